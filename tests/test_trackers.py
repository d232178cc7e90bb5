"""Experiment trackers: every step's metrics go to TensorBoard, MLflow (local file
store) and W&B (offline), and come back through each tool's own reader. No network."""
from __future__ import annotations

import os

import pytest

from distflow_lab.core.errors import ConfigError
from distflow_lab.observe import trackers
from distflow_lab.runtime.results import StageReport, StageResult, UpdateReport

STEPS = 3


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:" + str(tmp_path / "never-used"))  # the logger passes its own


def _report(step: int) -> UpdateReport:
    def result(stage: int, sid: str, worker: int, tokens: int, reward: float | None = None) -> StageResult:
        return StageResult(step, stage, sid, worker, worker, 0, 4, 4, tokens, 0, 0, "cache", True,
                           metrics={"reward/mean": reward} if reward is not None else {}, rpcs=2)

    stages = [
        StageReport(step, 0, "rollout", "distributed", [result(0, "rollout", w, 100 + step) for w in range(2)],
                    wall_seconds=0.5 + step),
        StageReport(step, 1, "actor_update", "distributed",
                    [result(1, "actor_update", w, 100 + step, reward=0.25 * step) for w in range(2)],
                    wall_seconds=0.25),
    ]
    return UpdateReport(step, "distributed", stages, wall_seconds=2.0 + step, end_batch_seconds=0.01, driver_rpcs=5)


def test_step_metrics_derive_timing_and_throughput():
    m = trackers.step_metrics(_report(1))
    assert m["timing_s/step"] == 3.0 and m["timing_s/rollout"] == 1.5 and m["timing_s/actor_update"] == 0.25
    assert m["perf/total_tokens"] == 2 * 101 and m["perf/tokens_per_s"] == pytest.approx(202 / 3.0)
    assert m["perf/tokens_per_s_per_worker"] == pytest.approx(101 / 3.0)
    assert m["perf/rpcs"] == 5 + 4 * 2 and m["reward/mean"] == 0.25


def _expected() -> list[dict]:
    return [trackers.step_metrics(_report(s)) for s in range(STEPS)]


def _log(names: list[str], run_dir, capsys=None) -> list[dict]:
    loggers = trackers.make_loggers(names, run_dir, {"algo": {"name": "grpo", "lr": 1e-6}, "seed": 3})
    for s in range(STEPS):
        trackers.log_step(loggers, _report(s))
    trackers.close_all(loggers)
    return _expected()


def test_console_prints_a_line_per_step(tmp_path, capsys):
    _log(["console"], tmp_path)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert len(lines) == STEPS and "reward/mean=0.5" in lines[2] and "timing_s/step=4" in lines[2]


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = _log(["tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"timing_s/step", "timing_s/rollout", "perf/tokens_per_s", "reward/mean"} <= tags
    for key in ("timing_s/step", "perf/tokens_per_s", "reward/mean"):
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx({s: want[s][key] for s in range(STEPS)}, rel=1e-6), key


def test_mlflow_local_file_store_reads_back(tmp_path):
    from mlflow.tracking import MlflowClient

    want = _log(["mlflow"], tmp_path)
    client = MlflowClient(tracking_uri="file:" + str((tmp_path / "mlruns").resolve()))
    exp = client.get_experiment_by_name("distflow_lab")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["algo.name"] == "grpo"
    for key in ("timing_s/step", "timing_s/rollout", "perf/tokens_per_s", "reward/mean"):
        hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert hist == pytest.approx({s: want[s][key] for s in range(STEPS)}), key
    assert not (tmp_path / "never-used").exists()


def test_wandb_offline_run_file_reads_back(tmp_path):
    want = _log(["wandb"], tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # offline: written locally, nothing synced
    hist = trackers.read_wandb_offline(runs[0])
    assert list(hist["_step"]) == list(range(STEPS))
    for key in ("timing_s/step", "timing_s/rollout", "perf/tokens_per_s", "reward/mean"):
        assert hist[key].tolist() == pytest.approx([want[s][key] for s in range(STEPS)]), key


def test_unknown_logger_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown logger 'neptune'"):
        trackers.make_loggers(["console", "neptune"], tmp_path)
    assert os.environ["WANDB_MODE"] == "offline"
