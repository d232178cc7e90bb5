"""What-if replay: exact on a hand-made recording, identical from a Session and from its
run directory, and checked against real runs of the same choices (record balance=none,
replay lpt/kk, run them for real)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from distflow_lab.core.spans import Span, spans_to_frame
from distflow_lab.experiments.replay import Recording, fit_costs, rank_tokens, replay, replay_accuracy

LENGTHS = [90, 10, 10, 10, 50, 50, 40, 40]  # items of the producer, in global order (rank 0: first four)


def _recording() -> Recording:
    """2 workers; 'gen' (2 ranks, 4 items each) -> redistribute -> 'train' (2 ranks, contiguous split = none).
    Costs: gen 1 ms + 1 ms/token... exactly: gen a=0.01 b=0.001, train a=0.0 b=0.002."""
    items, spans = [], []
    for step in range(2):
        for i, n in enumerate(LENGTHS):
            items.append({"batch_id": step, "stage": "gen", "stage_index": 0, "worker": i // 4, "dp_rank": i // 4,
                          "route_in": "loader", "item_id": 100 + i, "tokens": n})
            items.append({"batch_id": step, "stage": "train", "stage_index": 1, "worker": i // 4, "dp_rank": i // 4,
                          "route_in": "buffer", "item_id": 100 + i, "tokens": n})
        t = 10.0 * step
        for w in range(2):
            tok = sum(LENGTHS[4 * w:4 * w + 4])
            spans.append(Span(step, "gen", w, "n0", "compute", t, t + 0.01 + 0.001 * tok, tokens=tok, mode="distributed"))
            spans.append(Span(step, "train", w, "n0", "compute", t + 1, t + 1 + 0.002 * tok, tokens=tok,
                              mode="distributed"))
    # rank 0 holds 120 tokens, rank 1 180: train 0.36 s on the slowest; wall = 0.19 + 0.36 + 0.05 rest
    walls = pd.Series({0: 0.6, 1: 0.6})
    return Recording(pd.DataFrame(items), spans_to_frame(spans), {"distributed": walls}, "distributed", 2,
                     ["gen", "train"], {"gen": 2, "train": 2}, {"train": "gen"}, "none")


def test_replay_is_exact_on_a_handmade_recording():
    rec = _recording()
    costs = fit_costs(rec.spans)
    assert costs.loc["gen", ["a_s", "b_s_per_token"]].tolist() == pytest.approx([0.01, 0.001])
    assert costs.loc["train", ["a_s", "b_s_per_token"]].tolist() == pytest.approx([0.0, 0.002], abs=1e-12)
    tok = rank_tokens(rec, rec.items[rec.items.batch_id == 0], "lpt", 2)
    assert sorted(tok["train"].tolist()) == [150, 150] and tok["gen"].tolist() == [120, 180]
    r = replay(rec, balance=["none", "lpt"], world_size=[2, 4])
    t = r.table.set_index(["balance", "world_size", "batch_id"])
    assert t.loc[("none", 2, 0), "predicted_s"] == pytest.approx(0.6)  # recorded choice: the recorded wall
    # lpt: train 0.30 s instead of 0.36 s on the slowest rank; the rest (0.05 s) stays
    assert t.loc[("lpt", 2, 0), "predicted_s"] == pytest.approx(0.6 - 0.06)
    assert t.loc[("lpt", 2, 0), "compute_s"] == pytest.approx(0.19 + 0.30)
    # 4 workers: gen re-split contiguously (2 items a rank), train routed by lpt over 4 ranks
    four = rank_tokens(rec, rec.items[rec.items.batch_id == 0], "lpt", 4)
    assert four["gen"].tolist() == [100, 20, 100, 80]
    assert max(four["train"]) == 100  # equal counts (2 a rank): 90 must share with a 10
    assert t.loc[("lpt", 4, 0), "compute_s"] == pytest.approx(0.01 + 0.001 * 100 + 0.002 * 100)
    assert "lpt" in repr(r) and set(r.summary["balance"]) == {"none", "lpt"}


@pytest.mark.full
def test_replay_matches_real_runs(ray_cluster, tmp_path):
    """Record balance=none, replay lpt and kk, run both for real: the median error is measured."""
    acc = replay_accuracy(policies=("lpt", "kk"), base="none", steps=4, skip=1)
    t = acc.table
    assert len(t) == 2 * 3 and (t["measured_s"] > 0).all()
    rec = acc.recording
    same = replay(rec, balance="none")  # the recorded choice gives back the recorded walls
    assert np.allclose(same.table["predicted_s"], same.table["recorded_s"])
    # a run directory (spans, metrics, items parquet) replays the same as the session did; this one is
    # written as runs were before the batch/update rename (every table says "step"): still readable
    old = {"batch_id": "step"}
    spans = rec.spans.rename(columns=old)
    spans.assign(cache_hit=spans["cache_hit"].astype("boolean")).to_parquet(tmp_path / "spans.parquet")
    rec.walls["distributed"].rename("wall_s").rename_axis("step").reset_index().to_parquet(tmp_path / "metrics.parquet")
    rec.items.rename(columns=old).to_parquet(tmp_path / "items.parquet")
    from_dir = replay(tmp_path, balance=["lpt", "kk"], recorded_balance="none", steps=sorted(set(t["batch_id"])))
    assert np.allclose(from_dir.table["predicted_s"], acc.replayed.table["predicted_s"])
    # the model says balancing helps this long-tailed workload
    assert (t["predicted_s"] < t["recorded_s"]).mean() >= 0.5
    assert acc.median_abs_error < 0.25, acc  # the target is 15 % (README); a loaded 2-core box gets slack
    print(acc)
