"""Spans: what every worker (and the driver, in centralized mode) did, and when.

A span is one phase of one stage on one worker: (batch, stage, worker, node,
phase, start, end, bytes, items, tokens, cache_hit). Workers keep them in
memory and ship them with each stage's metadata; the driver turns them into a
pandas DataFrame or a Chrome/Perfetto trace. Times are unix seconds (start)
plus a perf_counter duration, so spans from different processes line up.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Iterator

import pandas as pd

# Phases, in the order figures stack them. compute/put/get/cache_hit are the
# distributed data path; split/dispatch/collect/concat the centralized one.
PHASES = (
    "compute", "weight_sync", "env_wait", "load", "cache_hit", "put", "get", "plan", "wait",
    "split", "dispatch", "collect", "concat", "other",
)
# Phases a stage function records inside its own compute span (ctx.span): breakdowns
# subtract them from "compute" so nothing is counted twice. env_wait: a multi-turn rollout
# with no turn to decode, waiting for its environments' answers.
NESTED_PHASES = ("weight_sync", "env_wait")
DATA_PHASES = ("load", "cache_hit", "put", "get", "plan", "wait", "split", "dispatch", "collect", "concat")
DRIVER = -1  # worker id of the driver's own spans


@dataclass(slots=True)
class Span:
    batch_id: int
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
    def span(self, batch_id: int, stage: str, phase: str, **counts) -> Iterator[Span]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")
        s = Span(batch_id, stage, self.worker, self.node, phase, time.time(), 0.0, mode=self.mode, **counts)
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
