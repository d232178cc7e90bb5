"""Counter tracks and lineage flows in the Chrome/Perfetto trace: exact values on
hand-made spans, the trace-event schema on a real session's trace, and a merge with
ray.timeline() on one time axis without process-id collisions."""
from __future__ import annotations

import json

import jsonschema
import pandas as pd
import pytest

import distflow_lab as lab
from distflow_lab.core.spans import DRIVER, Span, spans_to_frame
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.observe.trace import (BYTES_HELD, COUNTER_PID, ITEMS_HELD, PID_BASE, data_plane_counters,
                                        merge_with_ray_timeline, to_chrome_trace)

EVENT_SCHEMA = {"oneOf": [
    {"type": "object", "required": ["ph", "name", "ts", "dur", "pid", "tid"],
     "properties": {"ph": {"const": "X"}, "name": {"type": "string"}, "ts": {"type": "number", "minimum": 0},
                    "dur": {"type": "number", "minimum": 0}, "pid": {"type": "integer"},
                    "tid": {"type": "integer"}, "args": {"type": "object"}}},
    {"type": "object", "required": ["ph", "name", "pid", "args"],
     "properties": {"ph": {"const": "M"}, "name": {"enum": ["process_name", "thread_name"]},
                    "args": {"type": "object", "required": ["name"]}}},
    {"type": "object", "required": ["ph", "name", "ts", "pid", "args"],
     "properties": {"ph": {"const": "C"}, "name": {"type": "string"}, "ts": {"type": "number", "minimum": 0},
                    "pid": {"type": "integer"}, "tid": {"type": "integer"},
                    "args": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "number"}}}},
    {"type": "object", "required": ["ph", "name", "id", "ts", "pid", "tid"],
     "properties": {"ph": {"enum": ["s", "f"]}, "name": {"type": "string"}, "id": {"type": ["integer", "string"]},
                    "ts": {"type": "number", "minimum": 0}, "pid": {"type": "integer"}, "tid": {"type": "integer"},
                    "cat": {"type": "string"}, "bp": {"const": "e"}}},
]}
SCHEMA = {"type": "object", "required": ["traceEvents"],
          "properties": {"traceEvents": {"type": "array", "items": EVENT_SCHEMA}}}


def _handmade() -> pd.DataFrame:
    """Two producers put 4 items (100 B each) at t=1 and t=2; two consumers get 3 and 5 items at t=3 and t=4."""
    S = lambda stage, w, phase, a, b, items=0, nbytes=0: Span(0, stage, w, "n0", phase, a, b, nbytes, items)  # noqa
    return spans_to_frame([
        S("advantage", 0, "compute", 0.0, 0.5), S("advantage", 1, "compute", 0.0, 1.5),
        S("advantage", 0, "put", 0.5, 1.0, 4, 400), S("advantage", 1, "put", 1.5, 2.0, 4, 400),
        S("old_log_prob", 0, "wait", 1.0, 2.0), S("old_log_prob", 0, "get", 2.5, 3.0, 3, 300),
        S("old_log_prob", 1, "get", 3.5, 4.0, 5, 500),
        S("old_log_prob", 0, "compute", 3.0, 5.0), S("old_log_prob", 1, "compute", 4.0, 5.0),
    ])


def test_counters_on_handmade_spans():
    c = data_plane_counters(_handmade())
    items = c[c["name"] == ITEMS_HELD]
    assert list(zip(items["time"], items["value"])) == [(0.5, 4), (1.5, 8), (3.0, 5), (4.0, 0)]  # puts from their start
    edge = c[c["name"] == "in flight advantage->old_log_prob"]
    assert edge["value"].tolist() == [4, 8, 5, 0]
    assert c[c["name"] == BYTES_HELD]["value"].tolist() == [400, 800, 500, 0]

    trace = to_chrome_trace(_handmade())
    jsonschema.validate(trace, SCHEMA)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {COUNTER_PID}
    assert [e["args"]["items"] for e in counters if e["name"] == ITEMS_HELD] == [4, 8, 5, 0]
    assert [e["ts"] for e in counters if e["name"] == ITEMS_HELD] == [0.5e6, 1.5e6, 3e6, 4e6]  # relative clock, us
    unix = to_chrome_trace(_handmade(), clock="unix", counters=False)
    assert not any(e["ph"] == "C" for e in unix["traceEvents"]) and unix["otherData"]["t0_unix_s"] == 0.0


def test_counters_when_a_read_ends_before_the_put_span_does():
    """Producer 1's put span stays open until its acks return (t=4.5, on a loaded machine),
    after the consumers have already read its items (t=3, t=4): nothing is left held."""
    spans = _handmade()
    late = (spans["worker"] == 1) & (spans["phase"] == "put")
    spans.loc[late, "end"] = 4.5
    items = data_plane_counters(spans).query("name == @ITEMS_HELD")
    assert items["value"].tolist() == [4, 8, 5, 0] and items["value"].iloc[-1] == 0


def test_sampled_series_and_flows_from_items():
    spans = _handmade()
    samples = pd.DataFrame({"time": [0.5, 1.5], "name": ["ray plasma bytes"] * 2, "value": [10.0, 20.0]})
    # item 7 made on worker 1 (advantage) and consumed on worker 0 (old_log_prob): one hop, one arrow
    items = pd.DataFrame({"batch_id": [0, 0, 0, 0], "stage": ["advantage", "old_log_prob"] * 2,
                          "stage_index": [3, 4, 3, 4], "worker": [1, 0, 0, 0], "dp_rank": [1, 0, 0, 0],
                          "route_in": ["cache", "buffer", "cache", "buffer"], "item_id": [7, 7, 8, 8],
                          "tokens": [10, 10, 5, 5]})
    trace = to_chrome_trace(spans, samples=samples, items=items)
    jsonschema.validate(trace, SCHEMA)
    sampled = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "ray plasma bytes"]
    assert [e["args"]["bytes"] for e in sampled] == [10.0, 20.0]
    s, f = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert (s["ph"], s["tid"], f["ph"], f["tid"], s["id"]) == ("s", 1, "f", 0, f["id"])
    assert s["name"] == "1 items advantage->old_log_prob"
    assert 1.5e6 <= s["ts"] <= 2.0e6  # inside worker 1's last advantage span (its put)
    assert f["ts"] == 1.0e6  # the consumer's first old_log_prob span (its wait)


@pytest.mark.full
@pytest.mark.parametrize("mode", ["distributed"])
def test_real_trace_has_counters_flows_and_merges_with_ray_timeline(ray_cluster, tmp_path, mode):
    d = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2)
    with lab.session(d, world_size=4, mode=mode) as s:
        s.run(2, progress=False)
        spans, items = s.spans, s.items()
    trace = to_chrome_trace(spans, tmp_path / "trace.json", items=items)
    jsonschema.validate(json.loads((tmp_path / "trace.json").read_text()), SCHEMA)
    events = trace["traceEvents"]
    held = [e["args"]["items"] for e in events if e["ph"] == "C" and e["name"] == ITEMS_HELD]
    assert max(held) >= 32 and held[-1] == 0  # a whole batch was held at once, and all of it was read
    edges = {e["name"] for e in events if e["ph"] == "C" and e["name"].startswith("in flight")}
    assert "in flight advantage->old_log_prob" in edges
    flows = [e for e in events if e["ph"] in "sf"]
    assert flows and len(flows) % 2 == 0 and all(e["pid"] > PID_BASE for e in flows)
    assert {e["pid"] for e in events} >= {COUNTER_PID, PID_BASE + 1}

    ray_events = ray_cluster.timeline()  # Ray's own task events: pid = node IP, tid = worker id (strings)
    ray_events = ray_events + [{"ph": "X", "name": "a ray task", "cat": "task", "pid": "127.0.0.1",
                                "tid": "worker:abc", "ts": spans["start"].min() * 1e6, "dur": 1.0}]
    merged = merge_with_ray_timeline(tmp_path / "trace.json", ray_events, tmp_path / "merged.json")
    jsonschema.validate(json.loads((tmp_path / "merged.json").read_text()), SCHEMA)  # integer pids/tids only
    ours = [e for e in merged["traceEvents"] if e["pid"] >= PID_BASE and e["ph"] == "X"]
    theirs = [e for e in merged["traceEvents"] if e["pid"] < PID_BASE and e["ph"] == "X"]
    assert len(ours) == len(spans) and len(theirs) == len(ray_events)
    assert min(e["ts"] for e in ours) == pytest.approx(spans["start"].min() * 1e6, abs=1.0)  # absolute us, as Ray
    assert {"Node 127.0.0.1", f"distflow node {spans['node'].iloc[0]}"} <= {
        e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    with pytest.raises(ValueError, match="appear in both"):
        merge_with_ray_timeline(trace, [{"ph": "X", "pid": PID_BASE + 1, "ts": 0, "dur": 1, "name": "x"}])
    assert DRIVER in set(spans["worker"]) or mode == "distributed"
