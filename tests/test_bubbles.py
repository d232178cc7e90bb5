"""Idle time by cause: exact seconds on hand-made spans (every cause), and on a real
session's spans the parts add up to each step's wall time within 1 %."""
from __future__ import annotations

import pandas as pd
import pytest

import distflow_lab as lab
from distflow_lab.core.spans import DRIVER, Span, spans_to_frame
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.observe.bubbles import CAUSES, COLUMNS, Bubbles, bubble_table, bubbles

TYPES = {"gen": "generate", "train": "train"}


def _spans(step: int = 0) -> pd.DataFrame:
    S = lambda stage, w, phase, a, b: Span(step, stage, w, "n0", phase, a, b)  # noqa: E731
    return spans_to_frame([
        S("train", DRIVER, "dispatch", 4.0, 4.5),
        # w0: short generation, waits for w1's long one, then trains and syncs weights
        S("gen", 0, "compute", 1.0, 2.0), S("train", 0, "get", 4.5, 5.0), S("train", 0, "compute", 5.0, 7.0),
        S("train", 0, "weight_sync", 7.0, 7.5),
        # w1: the straggler of both stages; its multi-turn generation waits 1 s for its environments
        S("gen", 1, "compute", 1.0, 4.0), S("gen", 1, "env_wait", 2.0, 3.0), S("train", 1, "get", 4.5, 5.0),
        S("train", 1, "compute", 5.0, 8.0),
        # w2: a trainer only: idle while generation runs elsewhere, then gated by staleness
        S("train", 2, "get", 4.5, 5.0), S("train", 2, "compute", 5.0, 6.0), S("train", 2, "stale_wait", 6.0, 6.5),
    ])


EXPECTED = {  # wall 10 s; the spans cover 1..8, so 3 s of control (driver round trips) for everyone;
    # w1's environment wait (2..3) is the environment's for all three, not imbalance or the rollout tail
    0: dict(compute=3.0, imbalance=1.5, rollout_tail=0.0, data_plane=1.0, control=3.0, weight_sync=0.5, staleness=0,
            environment=1.0),
    1: dict(compute=5.0, imbalance=0.0, rollout_tail=0.0, data_plane=1.0, control=3.0, weight_sync=0.0, staleness=0,
            environment=1.0),
    2: dict(compute=1.0, imbalance=1.5, rollout_tail=2.0, data_plane=1.0, control=3.0, weight_sync=0.0,
            staleness=0.5, environment=1.0),
}


def test_every_cause_on_handmade_spans():
    t = bubble_table(_spans(), TYPES, pd.Series({0: 10.0})).set_index("worker")
    for w, want in EXPECTED.items():
        assert t.loc[w, list(COLUMNS)].to_dict() == pytest.approx(want), w
        assert t.loc[w, "idle"] == pytest.approx(10.0 - want["compute"])
    assert t[list(COLUMNS)].sum(axis=1).tolist() == pytest.approx([10.0] * 3)


def test_clock_skew_scales_and_a_missing_wall_uses_the_extent():
    both = pd.concat([_spans(0), _spans(1)], ignore_index=True)
    t = bubble_table(both, TYPES, {0: 3.5})  # wall shorter than the 7 s span extent: everything halves
    s0, s1 = t[t.batch_id == 0].set_index("worker"), t[t.batch_id == 1].set_index("worker")
    assert s0[list(COLUMNS)].sum(axis=1).tolist() == pytest.approx([3.5] * 3)
    assert s0.loc[1, "compute"] == pytest.approx(2.5) and s0.loc[0, "control"] == 0.0
    assert s1[list(COLUMNS)].sum(axis=1).tolist() == pytest.approx([7.0] * 3)  # step 1: no wall given
    assert bubble_table(_spans().iloc[:0], TYPES).empty


def test_real_session_parts_add_up_to_the_wall(ray_cluster):
    d = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2, us_per_token=20)
    out = {}
    with lab.session(d, world_size=4, mode="centralized") as s:
        for mode in ("centralized", "distributed"):
            if mode != s.mode:
                s.reopen(mode=mode)
            s.run(3, progress=False)
            walls = s.metrics.set_index("update")["wall_s"]
            b = bubbles(s.spans, {st.id: st.type for st in s.plan.stages}, walls)
            out[mode] = b
            t = b.table
            assert len(t) == 3 * 4 and isinstance(b, Bubbles)
            total = t[list(COLUMNS)].sum(axis=1)
            assert ((total - t["wall_s"]).abs() <= 0.01 * t["wall_s"]).all(), t
            assert (t["wall_s"] == t["batch_id"].map(walls)).all()
            assert (t["compute"] > 0).all() and (t[list(CAUSES)] >= 0).all().all()
            table, fig = b
            assert {tr.name for tr in fig.data} >= {"compute", "data_plane"} and "w3" in repr(b)
    # the centralized driver moves every stage's data: its workers wait on the data plane far longer
    assert out["centralized"].summary.loc["all", "data_plane"] > 2 * out["distributed"].summary.loc["all", "data_plane"]
