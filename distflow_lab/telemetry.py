"""Spans: what every worker (and the driver, in centralized mode) did, and when.

A span is one phase of one stage on one worker: (step, stage, worker, node,
phase, start, end, bytes, items, tokens, cache_hit). Workers keep them in
memory and ship them with each stage's metadata; the driver turns them into a
pandas DataFrame or a Chrome/Perfetto trace. Times are unix seconds (start)
plus a perf_counter duration, so spans from different processes line up.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Iterator

import pandas as pd

# Phases, in the order figures stack them. compute/put/get/cache_hit are the
# distributed data path; split/dispatch/collect/concat the centralized one.
PHASES = (
    "compute", "weight_sync", "load", "cache_hit", "put", "get", "plan", "wait",
    "split", "dispatch", "collect", "concat", "other",
)
# Phases a stage function records inside its own compute span (ctx.span): breakdowns
# subtract them from "compute" so nothing is counted twice.
NESTED_PHASES = ("weight_sync",)
DATA_PHASES = ("load", "cache_hit", "put", "get", "plan", "wait", "split", "dispatch", "collect", "concat")
DRIVER = -1  # worker id of the driver's own spans


@dataclass(slots=True)
class Span:
    step: int
    stage: str
    worker: int
    node: str
    phase: str
    start: float
    end: float
    bytes: int = 0
    items: int = 0
    tokens: int = 0
    cache_hit: bool | None = None
    mode: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


SPAN_COLUMNS = [f.name for f in fields(Span)]


class SpanRecorder:
    """Collects spans for one worker. `take()` hands over what was recorded since the last call."""

    def __init__(self, worker: int, node: str, mode: str = "") -> None:
        self.worker, self.node, self.mode = worker, node, mode
        self._spans: list[Span] = []

    @contextmanager
    def span(self, step: int, stage: str, phase: str, **counts) -> Iterator[Span]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")
        s = Span(step, stage, self.worker, self.node, phase, time.time(), 0.0, mode=self.mode, **counts)
        t0 = time.perf_counter()
        try:
            yield s
        finally:
            s.end = s.start + (time.perf_counter() - t0)
            self._spans.append(s)

    def add(self, span: Span) -> None:
        self._spans.append(span)

    def take(self) -> list[Span]:
        out, self._spans = self._spans, []
        return out


def spans_to_frame(spans: Iterable[Span]) -> pd.DataFrame:
    df = pd.DataFrame([asdict(s) for s in spans], columns=SPAN_COLUMNS)
    if len(df):
        df["seconds"] = df["end"] - df["start"]
    else:
        df["seconds"] = pd.Series(dtype=float)
    return df


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
