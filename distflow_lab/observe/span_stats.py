"""Numbers derived from spans: the paper's Table 1 breakdown, the compute
critical path, data-plane time and bytes moved. Figures, benchmarks and
reports all read these, so they agree."""
from __future__ import annotations

import pandas as pd

from distflow_lab.core.spans import DRIVER, NESTED_PHASES


def _per_worker_phase(spans: pd.DataFrame) -> pd.DataFrame:
    """Seconds per (batch, stage, worker) x phase; nested phases taken out of compute."""
    per = spans.groupby(["batch_id", "stage", "worker", "phase"])["seconds"].sum().unstack(fill_value=0.0)
    for p in NESTED_PHASES:
        if p in per.columns and "compute" in per.columns:
            per["compute"] = per["compute"] - per[p]
    return per


def stage_breakdown(spans: pd.DataFrame, stage_order: list[str] | None = None) -> pd.DataFrame:
    """Paper Table 1: per stage, the critical-path seconds of each phase — the
    slowest worker's time in that phase (the driver's spans as they are) —
    averaged over the batches in `spans`. Adds a `total` column."""
    if not len(spans):
        return pd.DataFrame()
    per = _per_worker_phase(spans)
    crit = per.groupby(level=["batch_id", "stage"]).max().groupby(level="stage").mean()
    order = stage_order or list(dict.fromkeys(spans.sort_values("start")["stage"]))
    crit = crit.reindex([s for s in order if s in crit.index])
    crit = crit.loc[:, (crit != 0).any(axis=0)]
    crit["total"] = crit.sum(axis=1)
    return crit


def compute_critical_path(spans: pd.DataFrame) -> pd.Series:
    """Per batch: sum over stages of the slowest worker's compute."""
    if not len(spans):
        return pd.Series(dtype=float)
    per = _per_worker_phase(spans)
    if "compute" not in per.columns:
        return pd.Series(0.0, index=sorted(spans["batch_id"].unique()))
    return per["compute"].groupby(level=["batch_id", "stage"]).max().groupby(level="batch_id").sum()


def bytes_moved(spans: pd.DataFrame) -> pd.Series:
    """Per batch: payload bytes put into the object store (distributed: buffer puts;
    centralized: the driver's dispatches and the workers' returns)."""
    if not len(spans):
        return pd.Series(dtype=float)
    moved = spans[(spans.phase == "put") | ((spans.worker == DRIVER) & spans.phase.isin(["dispatch", "collect"]))]
    return moved.groupby("batch_id")["bytes"].sum().reindex(sorted(spans["batch_id"].unique()), fill_value=0)


def step_table(spans: pd.DataFrame, wall: pd.Series) -> pd.DataFrame:
    """Per batch: wall, compute critical path, data plane (= wall - compute), bytes moved."""
    compute = compute_critical_path(spans).reindex(wall.index, fill_value=0.0)
    out = pd.DataFrame({"wall_s": wall, "compute_s": compute})
    out["data_plane_s"] = (out["wall_s"] - out["compute_s"]).clip(lower=0.0)
    out["bytes_moved"] = bytes_moved(spans).reindex(wall.index, fill_value=0)
    return out
