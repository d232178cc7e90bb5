"""What the driver receives: metadata only (timings, counts, metrics).

`StageResult` is one worker's account of one stage; `StageReport` gathers all
workers' results for a stage (plus the driver's own spans in centralized mode;
`stage_reports` groups a segment's results by stage); `UpdateReport` a whole training update.
All have rich notebook reprs. Ledger rows have one shape, `ledger_row`.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from distflow_lab.core.spans import DRIVER, Span, spans_to_frame
from distflow_lab.dataplane.interface import LEDGER_COLUMNS, ledger_row

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Stage

__all__ = ["LEDGER_COLUMNS", "ledger_row", "StageResult", "StageReport", "UpdateReport", "aggregate_metrics",
           "stage_reports"]


@dataclass
class StageResult:
    batch_id: int
    stage: int
    stage_id: str
    worker: int
    dp_rank: int
    group_rank: int
    items_in: int
    items_out: int
    tokens_out: int
    bytes_in: int
    bytes_out: int
    route_in: str  # "loader", "cache", "buffer", "coordinator", "driver", "none"
    cache_hit: bool | None
    metrics: dict[str, float] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    seconds: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    rpcs: int = 0  # Ray calls this worker's data-plane port made for this stage
    item_ids: np.ndarray | None = None  # the `item_id` of every output row (tensor-parallel rank 0 only)
    item_tokens: np.ndarray | None = None  # and its token length: per-item metadata for lineage and replay
    item_versions: np.ndarray | None = None  # and the policy version it came from (rows with a `version` column)
    item_turns: np.ndarray | None = None  # and its model turns (multi-turn rows, with a `turns` column)
    weight_syncs: list[dict] = field(default_factory=list)  # SyncReport rows of syncs this worker did (weight_transport.py)


def aggregate_metrics(results: list[StageResult]) -> dict[str, float]:
    """Over data-parallel ranks (group rank 0 of each group): `ctx.log` metrics are
    averaged weighted by each rank's output rows (a rank that produced nothing does
    not count; equal rows give the plain mean), except a metric whose key ends in
    `_max`, which is the max over those ranks (e.g. actor/is_ratio_max: a max of maxes,
    never a mean); `ctx.count` counts are summed."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for r in results:
        if r.group_rank != 0:
            continue
        for k, v in r.metrics.items():
            by_name.setdefault(k, []).append((float(v), float(r.items_out)))
        for k, v in r.counts.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = {}
    for k, pairs in by_name.items():
        values, weights = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
        if k.endswith("_max"):
            out[k] = float(values[weights > 0].max() if weights.sum() > 0 else values.max())
        else:
            out[k] = float(np.average(values, weights=weights)) if weights.sum() > 0 else float(values.mean())
    return {**out, **sums}


@dataclass
class StageReport:
    batch_id: int
    stage: int
    stage_id: str
    mode: str
    results: list[StageResult]
    driver_spans: list[Span] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def metrics(self) -> dict[str, float]:
        return aggregate_metrics(self.results)

    @property
    def spans(self) -> pd.DataFrame:
        return spans_to_frame([s for r in self.results for s in r.spans] + self.driver_spans)

    def per_worker(self) -> pd.DataFrame:
        """Seconds per phase for each worker (and the driver), with bytes, items, tokens."""
        df = self.spans
        if not len(df):
            return pd.DataFrame()
        t = df.pivot_table(index="worker", columns="phase", values="seconds", aggfunc="sum", fill_value=0.0)
        info = pd.DataFrame([{
            "worker": r.worker, "dp_rank": r.dp_rank, "route_in": r.route_in, "hit": r.cache_hit,
            "items_in": r.items_in, "items_out": r.items_out, "tokens_out": r.tokens_out,
            "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
        } for r in self.results]).set_index("worker")
        out = info.join(t, how="outer")
        out.index = ["driver" if i == DRIVER else f"w{i}" for i in out.index]
        return out

    def summary(self) -> dict[str, Any]:
        hits = [r.cache_hit for r in self.results if r.cache_hit is not None]
        return {
            "batch_id": self.batch_id, "stage": self.stage_id, "mode": self.mode, "wall_s": round(self.wall_seconds, 4),
            "items": sum(r.items_out for r in self.results if r.group_rank == 0),
            "tokens": sum(r.tokens_out for r in self.results if r.group_rank == 0),
            "bytes_moved": sum(r.bytes_in for r in self.results if r.route_in in ("buffer", "driver")),
            "cache_hits": sum(hits), "cache_misses": len(hits) - sum(hits),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (f"StageReport(batch={s['batch_id']}, stage={s['stage']!r}, mode={s['mode']}, wall={s['wall_s']}s, "
                f"items={s['items']}, bytes_moved={s['bytes_moved']}, hits={s['cache_hits']}, "
                f"misses={s['cache_misses']}, metrics={self.metrics})")

    def _repr_html_(self) -> str:
        s = self.summary()
        head = (f"<b>stage {html.escape(s['stage'])}</b> · batch {s['batch_id']} · {s['mode']} · "
                f"{s['wall_s']:.3f} s · {s['items']} items · {s['tokens']} tokens · "
                f"{s['bytes_moved'] / 2**20:.1f} MiB moved · cache {s['cache_hits']} hit / {s['cache_misses']} miss")
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        table = self.per_worker().round(4).to_html() if self.results else ""
        return head + (f"<br><small>{html.escape(metrics)}</small>" if metrics else "") + table


def stage_reports(batch_id: int, stages: "list[Stage]", mode: str, per_worker: list[list[StageResult]]
                  ) -> list[StageReport]:
    """Every worker's results of a run of `stages` (one list per worker, in any order),
    grouped into one StageReport per stage, in the order of `stages`; a stage's wall time
    runs from its first span's start to its last span's end, over every worker."""
    by_stage: dict[int, list[StageResult]] = {}
    for results in per_worker:
        for r in results:
            by_stage.setdefault(r.stage, []).append(r)
    out = []
    for st in stages:
        results = by_stage.get(st.index, [])
        spans = [s for r in results for s in r.spans]
        wall = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
        out.append(StageReport(batch_id, st.index, st.id, mode, results, wall_seconds=wall))
    return out


@dataclass
class UpdateReport:
    update: int  # the training update this report is of (metrics' `update` column)
    mode: str
    stages: list[StageReport]
    wall_seconds: float
    end_batch_seconds: float = 0.0
    driver_rpcs: int = 0  # Ray calls the driver made for this update (stage calls, data-plane calls)
    extra_metrics: dict[str, float] = field(default_factory=dict)  # the schedule's own (staleness, idle, ...)

    @property
    def rpcs(self) -> int:
        """Every Ray call of the update: the driver's and every worker's data-plane port's."""
        return self.driver_rpcs + sum(r.rpcs for s in self.stages for r in s.results)

    @property
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.stages:
            out.update(s.metrics)
        return {**out, **self.extra_metrics}

    @property
    def spans(self) -> pd.DataFrame:
        return pd.concat([s.spans for s in self.stages], ignore_index=True) if self.stages else spans_to_frame([])

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([s.summary() for s in self.stages])

    def __repr__(self) -> str:
        return f"UpdateReport(update={self.update}, mode={self.mode}, wall={self.wall_seconds:.3f}s, metrics={self.metrics})"

    def _repr_html_(self) -> str:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        return (f"<b>update {self.update}</b> · {self.mode} · {self.wall_seconds:.3f} s"
                f"<br><small>{html.escape(metrics)}</small>" + self.table().to_html(index=False))
