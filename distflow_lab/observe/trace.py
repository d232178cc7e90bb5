"""Chrome / Perfetto trace export of a session's spans."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import pandas as pd

from distflow_lab.core.spans import DRIVER, Span, spans_to_frame


def to_chrome_trace(spans: pd.DataFrame | Iterable[Span], path: str | Path | None = None) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process
    per node, one thread per worker (the driver is thread -1), one complete
    ("X") event per span with its counts in `args`."""
    df = spans if isinstance(spans, pd.DataFrame) else spans_to_frame(spans)
    t0 = float(df["start"].min()) if len(df) else 0.0
    nodes = {n: i for i, n in enumerate(sorted(df["node"].unique()))} if len(df) else {}
    events: list[dict] = []
    for node, pid in nodes.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"node {node}"}})
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
            "args": {"step": int(r.step), "stage": r.stage, "bytes": int(r.bytes), "items": int(r.items),
                     "tokens": int(r.tokens), "cache_hit": None if pd.isna(r.cache_hit) else bool(r.cache_hit),
                     "mode": r.mode},
        })
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace
