"""Bytes between workers (observe/flows.py, `s.sankey`): on hand-made spans the split over
producers follows the items; on a real session, in each of the three data planes, the
Sankey's link values add up to the bytes the spans recorded for the edge."""
from __future__ import annotations

import pandas as pd
import pytest

import distflow_lab as lab
from distflow_lab.core.spans import DRIVER, Span, spans_to_frame
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.observe.flows import DRIVER_NODE, byte_flows, sankey_figure

EDGE = "advantage->old_log_prob"  # the redistribute edge of the synthetic GRPO plan at 4 workers, rollout tp 2


def _links(fig) -> pd.DataFrame:
    """The figure's links as (source label, target label, value)."""
    s = fig.data[0]
    label = list(s.node.label)
    return pd.DataFrame({"source": [label[i] for i in s.link.source], "target": [label[i] for i in s.link.target],
                         "value": list(s.link.value)})


def _worker_bytes(spans: pd.DataFrame, stage: str, phase: str) -> float:
    w = spans[(spans["stage"] == stage) & (spans["phase"] == phase) & (spans["worker"] != DRIVER)]
    return float(w["bytes"].sum())


def test_split_over_producers_follows_the_items():
    plan = synthetic_grpo(batch_size=4, n=2, max_prompt_len=8, max_response_len=8, rollout_tp=2).plan(world_size=4)
    # advantage (dp 2: workers 0, 2) -> old_log_prob (dp 4): worker 1 reads items 10, 11, 12 (two made on w0)
    spans = spans_to_frame([Span(0, "old_log_prob", 1, "n0", "get", 0.0, 1.0, bytes=300, items=3),
                            Span(0, "old_log_prob", 3, "n0", "get", 0.0, 1.0, bytes=100, items=1)])
    items = pd.DataFrame({"batch_id": 0, "stage": ["advantage"] * 4 + ["old_log_prob"] * 4,
                          "worker": [0, 0, 2, 2, 1, 1, 1, 3], "dp_rank": [0, 0, 1, 1, 1, 1, 1, 3],
                          "route_in": ["cache"] * 4 + ["buffer"] * 4, "item_id": [10, 11, 12, 13, 10, 11, 12, 13]})
    f = byte_flows(spans, items, plan).set_index(["source", "target"])["bytes"]
    assert f.to_dict() == {("advantage w0", "old_log_prob w1"): 200.0, ("advantage w2", "old_log_prob w1"): 100.0,
                           ("advantage w2", "old_log_prob w3"): 100.0}
    assert byte_flows(spans, items, plan, batches=1).empty
    with pytest.raises(KeyError, match="edges"):
        byte_flows(spans, items, plan, edge="nope")
    assert "no bytes moved" in sankey_figure(byte_flows(spans, items, plan, batches=1)).layout.annotations[0].text


def test_sankey_sums_to_the_recorded_bytes_in_every_mode(ray_cluster):
    d = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2, us_per_token=20)
    with lab.session(d, world_size=4, mode="distributed") as s:
        for mode in ("distributed", "coordinator", "centralized"):
            if mode != s.mode:
                s.reopen(mode=mode)
            s.run(2, progress=False)
            spans, ledger = s.spans, s.ledger()
            links = _links(s.sankey(EDGE))
            if mode == "centralized":  # producers -> driver -> consumers, every edge through the driver
                into, out = links[links.target == DRIVER_NODE], links[links.source == DRIVER_NODE]
                assert len(into) and len(out) and len(into) + len(out) == len(links)
                assert sum(into.value) == pytest.approx(_worker_bytes(spans, "advantage", "collect"))
                assert sum(out.value) == pytest.approx(_worker_bytes(spans, "old_log_prob", "dispatch"))
                every = sum(_worker_bytes(spans, e.split("->")[0], "collect")
                            + _worker_bytes(spans, e.split("->")[1], "dispatch") for e in ledger["edge"].unique())
            else:  # producers -> consumers through the object store; local edges are cache hits (no bytes)
                got = _worker_bytes(spans, "old_log_prob", "get")
                assert got > 0 and sum(links.value) == pytest.approx(got)
                assert got == pytest.approx(_worker_bytes(spans, "advantage", "put"))
                assert set(links.source) == {"advantage w0", "advantage w2"}
                assert set(links.target) == {f"old_log_prob w{w}" for w in range(4)}
                flows = byte_flows(spans, s.items(), s.plan, EDGE)
                assert flows["items"].sum() == pytest.approx(ledger.loc[ledger.edge == EDGE, "items_out"].sum())
                assert set(flows["hop"]) == {"DataBuffer" if mode == "distributed" else "coordinator"}
                every = got
            assert sum(_links(s.sankey()).value) == pytest.approx(every)  # every edge
            last = spans[spans.batch_id == 1]
            one = sum(_links(s.sankey(EDGE, batches=1)).value)
            expect = (_worker_bytes(last, "advantage", "collect") + _worker_bytes(last, "old_log_prob", "dispatch")
                      if mode == "centralized" else _worker_bytes(last, "old_log_prob", "get"))
            assert one == pytest.approx(expect) and 0 < one < sum(links.value)
