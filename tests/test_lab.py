"""The notebook API end to end: connect/attach/shutdown, stepping a stage,
decoded peeks, the Chrome trace against the trace-event schema, the HTML
report with every figure, and the CLI on the tiny preset."""
from __future__ import annotations

import json
import subprocess

import jsonschema
import pytest

import distflow_lab as lab
from distflow_lab.experiments.synthetic import synthetic_grpo

from .conftest import CLI, run_python, suite_env
from .test_trace import SCHEMA


def _run(code: str, timeout: int = 120, env: dict | None = None) -> str:
    out = run_python(code, timeout, env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.full
def test_connect_twice_reuses_and_attach_does_not_stop_the_cluster():
    """In fresh processes: connect() starts a loopback cluster and reuses it; attaching
    to a running cluster and calling shutdown() leaves it running: every notebook kernel the suite runs
    attaches to the suite's cluster and calls lab.shutdown() (tests/test_notebooks.py checks after)."""
    out = _run("""
        from distflow_lab.runtime import cluster
        a = cluster.connect(num_cpus=1, log_to_driver=False)
        b = cluster.connect()
        print(a.started_here, b is a, a.address.startswith("127.0.0.1"), "CPUs" in repr(a), "<table>" in a._repr_html_())
        cluster.shutdown()
        import ray; print(ray.is_initialized())
    """)
    assert out.split() == ["True", "True", "True", "True", "True", "False"]


@pytest.fixture(scope="module")
def synth(ray_cluster):
    s = lab.session(synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2),
                    world_size=4)
    yield s
    s.close()


def test_step_stage_reports_real_numbers(synth):
    rep = synth.step_stage()
    assert rep.stage_id == "data" and synth.cursor == (0, "rollout")
    rep = synth.step_stage()
    s = rep.summary()
    assert s["items"] == 32 and s["tokens"] > 0 and rep.wall_seconds > 0
    assert (rep.per_worker()["compute"] > 0).all()
    rest = synth.step()
    assert len(rest.stages) == 7 and synth.cursor == (1, "data")
    assert "Session" in repr(synth) and "<svg" in synth._repr_html_()


def test_trace_matches_the_chrome_trace_event_schema(synth, tmp_path):
    synth.run(2, progress=False)
    path = synth.trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    jsonschema.validate(trace, SCHEMA)  # the Chrome trace-event schema tests/test_trace.py defines
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(x) == len(synth.spans)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {f"worker {i}" for i in range(4)}


def test_report_contains_every_figure(synth, tmp_path):
    synth.run(1, progress=False)
    fig, table = synth.breakdown()
    assert "total" in table.index
    assert synth.load_balance().layout.shapes  # the lower-bound line
    path = synth.report(tmp_path / "report.html")
    html = path.read_text()
    for fid in ("fig-dag", "fig-timeline", "fig-breakdown", "fig-cache", "fig-balance", "fig-metrics", "config"):
        assert f'id="{fid}"' in html or f"id='{fid}'" in html, fid
    assert html.count("plotly.js v") == 1 and "<script src=\"http" not in html


@pytest.fixture(scope="module")
def rl_base(tmp_path_factory, grpo_model):
    d = tmp_path_factory.mktemp("lab-rl")
    return [f"trainer.out_dir={d}/out"]  # the model and its warm start: the suite's (conftest)


def test_peek_returns_decoded_samples(ray_cluster, rl_base):
    with lab.rl_session("tiny-cpu-grpo", rl_base + ["data.prompts_per_step=8"], progress=False) as s:
        s.step()
        df = s.peek("advantage", worker=1, n=3)
        assert len(df) == 3 and (df["worker"] == 1).all()
        assert {"prompt", "response", "scores", "advantages(mean)", "ground_truth"} <= set(df.columns)
        assert df["prompt"].str.fullmatch(r"\d\+\d=").all()  # the arithmetic prompts, decoded
        with pytest.raises(KeyError, match="no stage"):
            s.peek("nope")


@pytest.mark.budget(45, reason="README's main job end to end: a CLI process that imports torch and runs 3 GRPO steps")
def test_cli_run_writes_everything(ray_cluster, rl_base, tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([CLI, "run", "tiny-cpu-grpo", "--steps", "3", "--out", str(out), *rl_base,
                          "data.prompts_per_step=8"],
                         capture_output=True, text=True, timeout=600, env=suite_env())  # attached: no cluster start
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("reward") == 3
    for f in ("metrics.parquet", "spans.parquet", "trace.json", "report.html"):
        assert (out / f).stat().st_size > 0, f
    bad = subprocess.run([CLI, "run", "tiny-cpu-grpo", "actor.nope=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "actor.nope: unknown key" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.full
def test_reopen_reuses_the_worker_processes(ray_cluster):
    import ray

    d = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2)
    with lab.session(d, world_size=4) as s:
        first = [s.step().metrics for _ in range(2)]
        pids = ray.get([w.memory.remote() for w in s.controller.workers])
        s.reopen(mode="centralized", balance="lpt")
        assert s.mode == "centralized" and s.cursor[0] == 0
        assert [p["pid"] for p in ray.get([w.memory.remote() for w in s.controller.workers])] == \
            [p["pid"] for p in pids]  # the very same processes
        again = [s.step().metrics for _ in range(2)]
        assert again == first  # same workers, fresh state: the same steps again
        assert [p["rank"] for p in pids] == [0, 1, 2, 3]
        assert {"distributed"} == set(s.previous) and len(s.previous_metrics["distributed"]) == 2
        s.reopen(mode="distributed", num_buffers=1)
        assert len(s.controller.plane.actors()) == 1 and s.step().metrics == first[0]
