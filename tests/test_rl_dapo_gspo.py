"""DAPO and GSPO learn the arithmetic task on Ray from the SFT warm start (the tiny presets),
as GRPO does in test_rl.py: the reward rises over 100 steps."""
from __future__ import annotations

import pytest

from distflow_lab.api.runner import load_run_config, train

pytestmark = pytest.mark.full  # learning curves: the full tier

STEPS = 100


@pytest.fixture(scope="module")
def base(tmp_path_factory, grpo_model):
    """Outputs inside the test's tmp dir; the model and its SFT warm start are the suite's (conftest)."""
    d = tmp_path_factory.mktemp("rl-dapo-gspo")
    return [f"trainer.out_dir={d}/out",
            f"trainer.steps={STEPS}"]


def rise(m) -> tuple[float, float]:
    reward = m["reward/mean"]
    return reward[:20].mean(), reward[-20:].mean()


def test_dapo_raises_reward(ray_cluster, base, tmp_path):
    m = train(load_run_config("tiny-cpu-dapo", base), out=tmp_path, progress=False, echo=False)
    first, last = rise(m)
    assert first > 0.05 and last >= first + 0.06, f"reward {first:.3f} -> {last:.3f}"
    # dynamic sampling: every step trains on its full 32 groups x 8 responses, no group all-equal
    assert (m["dynamic_sampling/rows_out"] == 256).all() and (m["dynamic_sampling/fallback"] == 0).all()
    assert (m["dynamic_sampling/groups_generated"] >= 48).all() and m["dynamic_sampling/groups_dropped"].sum() > 0
    assert "actor/kl" not in m.columns and (m["actor/skipped"] == 0).all()  # no KL term, no reference pass


def test_gspo_raises_reward(ray_cluster, base, tmp_path):
    m = train(load_run_config("tiny-cpu-gspo", base), out=tmp_path, progress=False, echo=False)
    first, last = rise(m)
    assert first > 0.05 and last >= first + 0.06, f"reward {first:.3f} -> {last:.3f}"
    # the second mini-batch is off-policy: its sequence ratios move and some leave [1 - 3e-4, 1 + 4e-4]
    assert m["actor/clipfrac"].mean() > 0 and abs(m["actor/ratio"].mean() - 1) < 0.05
    assert (m["actor/skipped"] == 0).all()
