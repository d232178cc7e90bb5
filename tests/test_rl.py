"""End-to-end RL on Ray with real models: GRPO learns the arithmetic task from
an SFT warm start, PPO's critic learns, both modes give identical metrics,
and a checkpoint resumes to the same metrics as an uninterrupted run."""
from __future__ import annotations

import math

import pytest

from distflow_lab.core.errors import CheckpointError, ConfigError
from distflow_lab.api.runner import load_run_config, open_session, train


@pytest.fixture(scope="module")
def base(tmp_path_factory, grpo_model):
    """Outputs inside the test's tmp dir; the model and its SFT warm start are the suite's (conftest)."""
    d = tmp_path_factory.mktemp("rl")
    return [f"trainer.out_dir={d}/out"]


@pytest.mark.full
def test_ppo_runs_and_value_loss_falls(ray_cluster, base, tmp_path):
    # a frozen, low-temperature policy gives the critic a stationary target to learn
    cfg = load_run_config("tiny-cpu-ppo", base + ["trainer.steps=60", "actor.lr=1e-30", "rollout.temperature=0.3"])
    m = train(cfg, out=tmp_path, progress=False, echo=False)
    loss = m["critic/loss"]
    assert loss[:5].mean() > 1.15 * loss[-10:].mean(), loss.round(4).tolist()
    assert {"critic/vf_clipfrac", "actor/clipfrac"} <= set(m.columns)


@pytest.mark.full  # the planes give identical outputs: tests/test_dataplane.py (default tier, synthetic)
@pytest.mark.parametrize("preset", ["tiny-cpu-grpo"])
def test_every_mode_gives_identical_metrics(ray_cluster, base, preset):
    """The same seed on the same worker processes (reopen): the data plane changes nothing but the data path."""
    runs = {}
    cfg = load_run_config(preset, base + ["cluster.world_size=2", "data.prompts_per_step=8"])
    with open_session(cfg, progress=False) as s:
        for mode in ("distributed", "coordinator", "centralized"):
            if mode != s.mode:
                s.reopen(mode=mode)
            runs[mode] = [s.step().metrics for _ in range(2)]
    for other in ("coordinator", "centralized"):
        for d, c in zip(runs["distributed"], runs[other]):
            assert d.keys() == c.keys()
            for k in d:
                assert math.isclose(d[k], c[k], rel_tol=1e-6, abs_tol=1e-9), (other, k, d[k], c[k])


def test_checkpoint_resume_matches_uninterrupted_run(ray_cluster, base, tmp_path):
    cfg = load_run_config("tiny-cpu-grpo", base + ["data.prompts_per_step=16"])
    with open_session(cfg, progress=False) as s:
        s.step(), s.step()
        ckpt = s.save_checkpoint(tmp_path / "ckpt")
        straight = [s.step().metrics for _ in range(2)]
    assert (ckpt / "actor" / "model.pt").exists() and (ckpt / "actor" / "optim.pt").exists()
    with open_session(cfg, progress=False) as s:
        assert s.load_checkpoint(ckpt) == 2
        resumed = [s.step().metrics for _ in range(2)]
    assert resumed == straight
    other = load_run_config("tiny-cpu-grpo", base + ["data.prompts_per_step=16", "seed=1"])
    with open_session(other, progress=False) as s:
        with pytest.raises(ValueError, match="another configuration: .*seed"):
            s.load_checkpoint(ckpt)
        with pytest.raises(CheckpointError, match=r"nowhere is not a distflow_lab checkpoint"):
            s.load_checkpoint(tmp_path / "nowhere")


def test_bad_configs_fail_before_workers_start(base):
    with pytest.raises(ConfigError, match=r"actor\.lrr: unknown key"):
        load_run_config("tiny-cpu-grpo", ["actor.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"rollout\.n: Input should be a valid integer"):
        load_run_config("tiny-cpu-grpo", ["rollout.n=many"])
    with pytest.raises(ConfigError, match="prompts_per_step=15 is not divisible"):
        load_run_config("tiny-cpu-grpo", ["data.prompts_per_step=15"])
    import importlib.util

    find = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as mp:  # a machine without vLLM (setup.sh installs its CPU build here)
        mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a))
        with pytest.raises(ConfigError, match="vLLM is not installed: `bash scripts/setup.sh` installs"):
            load_run_config("tiny-cpu-grpo", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="'no-such-preset' is neither a file nor a preset"):
        load_run_config("no-such-preset")
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator: ppo does not support 'rloo'"):
        load_run_config("tiny-cpu-ppo", ["algorithm.adv_estimator=rloo"])  # it used to run GAE silently
    with pytest.raises(ConfigError, match=r"algorithm.name: 'sac' is not a registered algorithm"):
        load_run_config("tiny-cpu-grpo", ["algorithm.name=sac"])
    with pytest.raises(ConfigError, match=r"command-line overrides: invalid configuration\n  actor.lrr: unknown key "
                                          r"\(not a field of this section\) \(from the override 'actor.lrr=1'\)"):
        load_run_config("tiny-cpu-grpo", ["actor.lrr=1"])  # the override is named, not the preset file
    cfg = load_run_config("tiny-cpu-grpo", base + ["rollout.max_response_len=80"])
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        open_session(cfg, progress=False)


def test_missing_column_names_the_file(tmp_path, base):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1="}]] * 4}), bad)
    cfg = load_run_config("tiny-cpu-grpo", base + [f"data.train={bad}", "data.prompts_per_step=2"])
    with pytest.raises(ValueError, match=r"bad.parquet: missing required column\(s\) \['data_source'"):
        open_session(cfg, progress=False)


def test_e2e_benchmark_configs_are_valid():
    """`bench e2e` builds its run configs from overrides: they must stay valid as the config evolves."""
    from distflow_lab.experiments.bench.e2e import overrides_for

    for context, source in ((32, "arithmetic"), (1024, "gsm8k")):
        cfg = load_run_config("tiny-cpu-grpo", overrides_for(context, workers=2, prompts=16, n=4))
        cfg.check_sizes()
        assert cfg.data.max_prompt_len + cfg.rollout.max_response_len == context
        assert cfg.model.tiny.max_position_embeddings >= context and cfg.data.train == source
