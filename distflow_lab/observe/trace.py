"""Chrome / Perfetto trace export of a session's spans, with counter tracks of the
data plane and (given the items' lineage) flow arrows from producer to consumer.

Layout (chosen so the file merges with `ray.timeline()` output without collisions):
  * Ray's timeline numbers its processes 0, 1, ... (one per node, "Node <ip>") and uses
    absolute microseconds since the epoch. Ours start at PID_BASE (100000): pid 100000
    is the counter process "distflow data plane", pids 100001+ one process per node
    ("distflow node <id>"), one thread per worker in it (the driver is thread -1).
  * Timestamps: `clock="relative"` (default) counts from the first span; "unix" gives
    absolute microseconds like Ray's. `merge_with_ray_timeline` shifts a relative trace
    (its `otherData.t0_unix_s`) and concatenates both, so one Perfetto window shows Ray's
    task events and our stage phases on the same time axis.

Counter tracks ("ph": "C", on the counter process), derived from the spans:
  * "data plane: items held"      items put into the data plane (a `put`, or a worker's
    `collect` back to the driver; counted from the span's start) and not yet taken out
    (a `get`, or a worker's `dispatch` chunk; counted at its end): the DataBuffers' /
    coordinator's / driver's depth, summed over edges.
  * "in flight <src>-><dst>"       the same per edge (an out-span of stage dst takes from the
    latest stage that put in before it; tensor-parallel replicas reading one piece twice
    are clamped at 0).
  * "object store: bytes held"     bytes put and not yet read, the same way (the driver's own
    dispatch puts and collect reads included); or, given `samples` (columns time [unix s],
    name, value), those sampled series instead of / beside it (e.g. Ray's plasma usage).
Flow events ("ph": "s" / "f", binding to the enclosing slices): with `items`
(`Session.items()`), one arrow per (batch, producer worker, consumer worker, edge) whose
items crossed workers, from the producer's last span of its stage to the consumer's first
span of the next stage, with the item count in its name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Literal

import numpy as np
import pandas as pd

from distflow_lab.core.spans import DRIVER, Span, spans_to_frame

PID_BASE = 100_000  # above ray.timeline()'s pids (0..nodes-1)
COUNTER_PID = PID_BASE
IN_PHASES, OUT_PHASES = ("put", "collect"), ("get", "dispatch")
ITEMS_HELD, BYTES_HELD, IN_FLIGHT = "data plane: items held", "object store: bytes held", "in flight"


def _is_in(phase: str, worker: int) -> bool:
    return phase == "put" or (phase == "collect" and worker != DRIVER) or (phase == "dispatch" and worker == DRIVER)


def _is_out(phase: str, worker: int) -> bool:
    return phase == "get" or (phase == "dispatch" and worker != DRIVER) or (phase == "collect" and worker == DRIVER)


def data_plane_counters(spans: pd.DataFrame) -> pd.DataFrame:
    """Counter samples (time [unix s], name, value) from put/get/dispatch/collect spans:
    items held (total and per edge) and object-store bytes held. See the module docstring."""
    cols = ["time", "name", "value"]
    if spans is None or not len(spans):
        return pd.DataFrame(columns=cols)
    pw = list(zip(spans["phase"], spans["worker"]))
    incoming = np.array([_is_in(p, w) for p, w in pw], dtype=bool)
    moving = spans.assign(incoming=incoming)[incoming | np.array([_is_out(p, w) for p, w in pw], dtype=bool)]
    steps: list[tuple[pd.DataFrame, dict]] = []
    consumers: dict[str, set] = {}
    # An in-span counts from its start and an out-span at its end: a consumer's read can end
    # before the producer's put span does (the producer still awaits its acks), never before it began.
    moving = moving.assign(t=np.where(moving["incoming"], moving["start"], moving["end"]))
    for _, df in moving.sort_values("t", kind="stable").groupby("batch_id", sort=True):
        firsts: dict[str, float] = {}
        for r in df.itertuples(index=False):
            if r.worker != DRIVER and r.incoming:
                firsts[r.stage] = min(firsts.get(r.stage, np.inf), r.start)
        src_of = {}
        for r in df.itertuples(index=False):  # an out-span takes from the latest stage that put in before it
            if r.worker != DRIVER and not r.incoming:
                before = [(t, s) for s, t in firsts.items() if t <= r.start and s != r.stage]
                if before:
                    src_of[r.stage] = max(before)[1]
                    consumers.setdefault(src_of[r.stage], set()).add(r.stage)
        steps.append((df, src_of))
    name = {src: f"{IN_FLIGHT} {src}->{'|'.join(sorted(dst))}" for src, dst in consumers.items()}
    rows: list[tuple[float, str, float]] = []
    held: dict[str, float] = {}
    total_bytes = 0.0
    for df, src_of in steps:
        for r in df.itertuples(index=False):
            total_bytes = max(0.0, total_bytes + (r.bytes if r.incoming else -r.bytes))
            rows.append((r.t, BYTES_HELD, total_bytes))
            if r.worker == DRIVER:
                continue
            edge = r.stage if r.incoming else src_of.get(r.stage)
            if edge is None:
                continue
            held[edge] = max(0.0, held.get(edge, 0.0) + (r.items if r.incoming else -r.items))
            rows.append((r.t, name.get(edge, f"{IN_FLIGHT} {edge}->?"), held[edge]))
            rows.append((r.t, ITEMS_HELD, sum(held.values())))
    return pd.DataFrame(rows, columns=cols)


def _flows(df: pd.DataFrame, items: pd.DataFrame, t0: float, pid_of, scale: float) -> list[dict]:
    """Flow arrows for items that changed worker between a stage and the next one they reached."""
    if items is None or not len(items) or not len(df):
        return []
    it = items.sort_values(["item_id", "batch_id", "stage_index"])
    same = (it["item_id"].to_numpy()[1:] == it["item_id"].to_numpy()[:-1]) & \
           (it["batch_id"].to_numpy()[1:] == it["batch_id"].to_numpy()[:-1])
    a, b = it.iloc[:-1][same], it.iloc[1:][same]
    hops = pd.DataFrame({"batch_id": a["batch_id"].to_numpy(), "src_stage": a["stage"].to_numpy(),
                         "src_worker": a["worker"].to_numpy(), "dst_stage": b["stage"].to_numpy(),
                         "dst_worker": b["worker"].to_numpy()})
    hops = hops[hops["src_worker"] != hops["dst_worker"]]
    if not len(hops):
        return []
    hops = hops.groupby(list(hops.columns)).size().reset_index(name="items")
    w = df[df["worker"] != DRIVER]
    last = w.groupby(["batch_id", "stage", "worker"]).agg(node=("node", "first"), end=("end", "max"))
    first = w.groupby(["batch_id", "stage", "worker"]).agg(node=("node", "first"), start=("start", "min"))
    events, fid = [], 0
    for h in hops.itertuples(index=False):
        src, dst = (h.batch_id, h.src_stage, h.src_worker), (h.batch_id, h.dst_stage, h.dst_worker)
        if src not in last.index or dst not in first.index:
            continue
        s, f = last.loc[src], first.loc[dst]
        fid += 1
        name = f"{h.items} items {h.src_stage}->{h.dst_stage}"
        common = {"name": name, "cat": "lineage", "id": fid}
        # "s" inside the producer's last span (1 us before its end), "f" at the consumer's first span
        events.append({**common, "ph": "s", "ts": max((s["end"] - t0) * scale - 1.0, 0.0), "pid": pid_of(s["node"]),
                       "tid": int(h.src_worker)})
        events.append({**common, "ph": "f", "bp": "e", "ts": (f["start"] - t0) * scale, "pid": pid_of(f["node"]),
                       "tid": int(h.dst_worker)})
    return events


def to_chrome_trace(spans: pd.DataFrame | Iterable[Span], path: str | Path | None = None, *,
                    counters: bool = True, items: pd.DataFrame | None = None,
                    samples: pd.DataFrame | None = None, clock: Literal["relative", "unix"] = "relative") -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process
    per node, one thread per worker (the driver is thread -1), one complete
    ("X") event per span with its counts in `args`; counter tracks of the data plane
    (`counters`), sampled series (`samples`: time, name, value) and lineage flows
    (`items`: `Session.items()`). See the module docstring for names and pids."""
    df = spans if isinstance(spans, pd.DataFrame) else spans_to_frame(spans)
    first = float(df["start"].min()) if len(df) else 0.0
    t0 = 0.0 if clock == "unix" else first
    nodes = {n: PID_BASE + 1 + i for i, n in enumerate(sorted(df["node"].unique()))} if len(df) else {}
    events: list[dict] = []
    for node, pid in nodes.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"distflow node {node}"}})
    for (node, worker), _ in df.groupby(["node", "worker"]) if len(df) else []:
        name = "driver" if worker == DRIVER else f"worker {worker}"
        events.append({"ph": "M", "name": "thread_name", "pid": nodes[node], "tid": int(worker), "args": {"name": name}})
    for r in df.itertuples(index=False):
        events.append({
            "name": f"{r.stage}:{r.phase}",
            "cat": r.phase,
            "ph": "X",
            "ts": (r.start - t0) * 1e6,
            "dur": max((r.end - r.start) * 1e6, 0.0),
            "pid": nodes[r.node],
            "tid": int(r.worker),
            "args": {"batch_id": int(r.batch_id), "stage": r.stage, "bytes": int(r.bytes), "items": int(r.items),
                     "tokens": int(r.tokens), "cache_hit": None if pd.isna(r.cache_hit) else bool(r.cache_hit),
                     "mode": r.mode},
        })
    series = [data_plane_counters(df)] if counters and len(df) else []
    if samples is not None and len(samples):
        series.append(samples[["time", "name", "value"]])
    series = [s for s in series if len(s)]
    if series:
        events.append({"ph": "M", "name": "process_name", "pid": COUNTER_PID, "tid": 0,
                       "args": {"name": "distflow data plane"}})
        for r in pd.concat(series, ignore_index=True).itertuples(index=False):
            unit = "bytes" if "bytes" in r.name else "items" if (r.name.startswith((ITEMS_HELD, IN_FLIGHT))) else "value"
            events.append({"ph": "C", "name": r.name, "ts": max((r.time - t0) * 1e6, 0.0), "pid": COUNTER_PID,
                           "tid": 0, "args": {unit: float(r.value)}})
    events += _flows(df, items, t0, lambda n: nodes[n], 1e6)
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"t0_unix_s": t0, "clock": clock, "pid_base": PID_BASE}}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def _integer_ids(events: list[dict]) -> list[dict]:
    """`ray.timeline()` read from GCS names processes by node IP and threads by worker id
    (strings, which Perfetto's JSON importer refuses): number them 0, 1, ... and name
    them with metadata events, as Ray's dashboard export does."""
    pids: dict = {}
    tids: dict = {}
    out = []
    for e in events:
        e = dict(e)
        pid, tid = e.get("pid"), e.get("tid")
        if isinstance(pid, str):
            e["pid"] = pids.setdefault(pid, len(pids))
        if isinstance(tid, str):
            e["tid"] = tids.setdefault((e.get("pid"), tid), len(tids))
        out.append(e)
    meta = [{"ph": "M", "name": "process_name", "pid": i, "tid": 0, "args": {"name": f"Node {p}"}}
            for p, i in pids.items()]
    meta += [{"ph": "M", "name": "thread_name", "pid": p, "tid": i, "args": {"name": t}} for (p, t), i in tids.items()]
    return meta + out


def merge_with_ray_timeline(trace: dict | str | Path, ray_events: list[dict] | str | Path,
                            path: str | Path | None = None) -> dict:
    """One trace of ours (a dict or a trace.json) and `ray.timeline()` output (its event
    list, or the file `ray.timeline(filename=...)` wrote) on one time axis: our events are
    shifted to absolute microseconds; pids never collide (ours start at PID_BASE)."""
    ours = json.loads(Path(trace).read_text()) if isinstance(trace, (str, Path)) else trace
    theirs = json.loads(Path(ray_events).read_text()) if isinstance(ray_events, (str, Path)) else ray_events
    if isinstance(theirs, dict):
        theirs = theirs.get("traceEvents", [])
    shift = float(ours.get("otherData", {}).get("t0_unix_s", 0.0)) * 1e6
    events = [dict(e, ts=e["ts"] + shift) if "ts" in e else dict(e) for e in ours["traceEvents"]]
    theirs = _integer_ids(theirs)
    clash = {e.get("pid") for e in theirs} & {e.get("pid") for e in events}
    if clash:
        raise ValueError(f"process ids {sorted(clash, key=str)[:5]} appear in both traces")
    merged = {"traceEvents": events + list(theirs), "displayTimeUnit": "ms",
              "otherData": {**ours.get("otherData", {}), "t0_unix_s": 0.0, "clock": "unix", "merged": "ray.timeline"}}
    if path is not None:
        Path(path).write_text(json.dumps(merged))
    return merged
