"""Idle time by cause ("bubbles"): per worker and batch, the batch's wall time split
into compute and idle, and the idle part split by why the worker was not computing.

A worker is, at every instant of a batch, in exactly one state, so the parts add
up to the batch's wall time (the driver's `wall_s`). The states, by priority when
several of a worker's own spans overlap (a stage records `weight_sync` inside its
compute span):

    weight_sync   its own `weight_sync` span (a weight broadcast / reload)
    environment   its own `env_wait` span (a multi-turn rollout with no turn to decode,
                  waiting for its environments' answers)
    staleness     its own `stale_wait` span (an async schedule's staleness gate)
    compute       its own `compute` span, minus the two above
    data_plane    its own data-plane span: put, get, plan, cache_hit, dispatch, collect,
                  split, concat, load (moving data, not waiting for it)

Time with no own span, and time blocked in its own `wait` span (a consumer waiting
for producers), is idle for a reason found in what the others do at that instant
(first match):

    environment   someone else's rollout waits for its environments
    imbalance     another worker computes the stage this worker just ran or is about to
                  run (a straggler in the same stage)
    rollout_tail  a `generate`-type stage computes elsewhere (the rollout long tail)
    weight_sync   someone else syncs weights;  staleness: someone else waits at the gate
    data_plane    someone else (a worker or the driver) moves data; in a `wait` span,
                  also the default (the data plane had not delivered yet)
    control       nobody relevant is busy: driver round trips, stage calls, the batch's
                  start and end (centralized mode's gaps between stage calls)

The driver's wall time of a batch usually exceeds the span extent (first span start
to last span end) by the call and gather latency; that remainder is `control` for
every worker. If clocks make the extent exceed the wall (nodes with skewed
clocks), every part is scaled by wall / extent so the sum still equals the wall.

    b = bubbles(s.spans, {st.id: st.type for st in s.plan.stages}, s.metrics.set_index("update")["wall_s"])
    b.table; b.summary; b.figure      # also: table, fig = bubbles(...)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from distflow_lab.core.spans import DRIVER
from distflow_lab.observe.style import empty_figure, worker_label

CAUSES = ("imbalance", "rollout_tail", "data_plane", "control", "weight_sync", "staleness", "environment")
COLUMNS = ("compute", *CAUSES)
CAUSE_COLORS = {
    "compute": "#4C78A8", "imbalance": "#E45756", "rollout_tail": "#F58518", "data_plane": "#54A24B",
    "control": "#BAB0AC", "weight_sync": "#1B2A49", "staleness": "#B279A2",
    "environment": "#9D755D",
}
CAUSE_DOCS = {
    "compute": "own compute span (nested weight_sync taken out)",
    "imbalance": "idle while another worker computes the same stage (a straggler)",
    "rollout_tail": "idle while a generate-type stage computes elsewhere (rollout long tail)",
    "data_plane": "own put/get/plan/cache_hit/dispatch/collect/split/concat/load, or idle while data moves",
    "control": "idle while nobody relevant is busy: driver round trips, stage calls, batch start/end",
    "weight_sync": "own weight_sync span (or idle while another worker syncs weights)",
    "staleness": "own stale_wait span (async staleness gate), or idle while another worker waits there",
    "environment": "own env_wait span (multi-turn: no turn to decode, tools running), or idle while another "
                   "worker's rollout waits for its environments",
}
MOVING = ("put", "get", "plan", "cache_hit", "dispatch", "collect", "split", "concat", "load")
# own-state codes, higher wins where a worker's own spans overlap
_IDLE, _WAIT, _OTHER, _DATA, _COMPUTE, _STALE, _ENV, _SYNC = range(8)
_OWN_CODE = {"wait": _WAIT, "other": _OTHER, "compute": _COMPUTE, "stale_wait": _STALE, "env_wait": _ENV,
             "weight_sync": _SYNC, **{p: _DATA for p in MOVING}}
_OWN_CAUSE = {_DATA: "data_plane", _COMPUTE: "compute", _STALE: "staleness", _ENV: "environment",
              _SYNC: "weight_sync", _OTHER: "control"}


def _cover(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Bool per elementary interval [bounds[k], bounds[k+1]): covered by one of the spans."""
    k = len(bounds) - 1
    if k <= 0 or not len(starts):
        return np.zeros(max(k, 0), bool)
    diff = np.zeros(k + 1, np.int64)
    np.add.at(diff, np.searchsorted(bounds, starts), 1)
    np.add.at(diff, np.searchsorted(bounds, ends), -1)
    return np.cumsum(diff)[:k] > 0


def _step_parts(df: pd.DataFrame, types: dict[str, str], wall: float | None) -> list[dict]:
    """Rows (one per worker) of one batch's split."""
    df = df[df["end"] > df["start"]]
    workers = sorted(int(w) for w in df.loc[df["worker"] != DRIVER, "worker"].unique())
    if not workers:
        return []
    bounds = np.unique(np.r_[df["start"].to_numpy(float), df["end"].to_numpy(float)])
    dur = np.diff(bounds)
    extent = float(bounds[-1] - bounds[0])
    wall = extent if wall is None or not np.isfinite(wall) else float(wall)
    scale = min(1.0, wall / extent) if extent > 0 else 1.0
    extra = max(wall - extent, 0.0)
    phase, stage, worker = df["phase"].to_numpy(), df["stage"].to_numpy(), df["worker"].to_numpy()
    start, end = df["start"].to_numpy(float), df["end"].to_numpy(float)

    def cover(mask: np.ndarray) -> np.ndarray:
        return _cover(bounds, start[mask], end[mask])

    on_workers = worker != DRIVER
    computing = {st: cover((phase == "compute") & (stage == st) & on_workers) for st in np.unique(stage)}
    generate = np.zeros(len(dur), bool)
    for st, c in computing.items():
        if types.get(st) == "generate":
            generate |= c
    syncing = {w: cover((phase == "weight_sync") & (worker == w)) for w in workers}
    gated = {w: cover((phase == "stale_wait") & (worker == w)) for w in workers}
    tooling = {w: cover((phase == "env_wait") & (worker == w)) for w in workers}
    moving = {w: cover(np.isin(phase, MOVING) & (worker == w)) for w in [*workers, DRIVER]}
    any_sync = np.logical_or.reduce(list(syncing.values()))
    any_gate = np.logical_or.reduce(list(gated.values()))
    any_env = np.logical_or.reduce(list(tooling.values()))
    any_move = np.logical_or.reduce(list(moving.values()))
    mids = (bounds[:-1] + bounds[1:]) / 2
    rows = []
    for w in workers:
        mine = (worker == w)
        own = np.full(len(dur), _IDLE)
        for p in np.unique(phase[mine]):
            code = _OWN_CODE.get(p, _OTHER)
            own = np.where(cover(mine & (phase == p)), np.maximum(own, code), own)
        # the stage this worker just ran (last own span ended) and the one it runs or waits in next
        order = np.argsort(end[mine], kind="stable")
        ends_w, stages_by_end = end[mine][order], stage[mine][order]
        order_s = np.argsort(start[mine], kind="stable")
        starts_w, stages_by_start = start[mine][order_s], stage[mine][order_s]
        i_prev = np.searchsorted(ends_w, mids, side="right") - 1
        i_next = np.searchsorted(starts_w, mids, side="left")
        prev = np.where(i_prev >= 0, stages_by_end[np.clip(i_prev, 0, None)], None)
        # a wait span is "in" its stage: the next stage is the one of the latest span started before mid
        i_cur = np.searchsorted(starts_w, mids, side="right") - 1
        cur = np.where((own == _WAIT) & (i_cur >= 0), stages_by_start[np.clip(i_cur, 0, None)], None)
        nxt = np.where(i_next < len(starts_w), stages_by_start[np.clip(i_next, None, len(starts_w) - 1)], None)
        same = np.zeros(len(dur), bool)
        for st, c in computing.items():
            same |= c & ((prev == st) | (nxt == st) | (cur == st))
        others_sync = any_sync & ~syncing[w]
        others_gate = any_gate & ~gated[w]
        others_env = any_env & ~tooling[w]
        others_move = any_move & ~moving[w]
        idle = (own == _IDLE) | (own == _WAIT)
        cause = np.select(
            [~idle, others_env, same, generate, others_sync, others_gate, others_move | (own == _WAIT)],
            ["own", "environment", "imbalance", "rollout_tail", "weight_sync", "staleness", "data_plane"], "control")
        row = {c: 0.0 for c in COLUMNS}
        for code, name in _OWN_CAUSE.items():
            row[name] += float(dur[(own == code)].sum())
        for name in ("imbalance", "environment", "rollout_tail", "weight_sync", "staleness", "data_plane", "control"):
            row[name] += float(dur[idle & (cause == name)].sum())
        row = {k: v * scale for k, v in row.items()}
        row["control"] += extra
        rows.append({"worker": w, "wall_s": wall, **row})
    return rows


def bubble_table(spans: pd.DataFrame, plan_stage_types: dict[str, str] | None = None,
                 wall_by_batch: pd.Series | dict | None = None) -> pd.DataFrame:
    """One row per (batch, worker): wall_s, compute, the six idle causes (seconds), idle
    (their sum) and idle_frac. `wall_by_batch`: the driver's batch wall (index: batch);
    batches missing from it use the span extent."""
    cols = ["batch_id", "worker", "wall_s", *COLUMNS, "idle", "idle_frac"]
    if spans is None or not len(spans):
        return pd.DataFrame(columns=cols)
    types = dict(plan_stage_types or {})
    walls = pd.Series(wall_by_batch if wall_by_batch is not None else {}, dtype=float)
    rows = []
    for batch_id, df in spans.groupby("batch_id", sort=True):
        for r in _step_parts(df, types, walls.get(batch_id)):
            rows.append({"batch_id": int(batch_id), **r})
    out = pd.DataFrame(rows)
    if not len(out):
        return pd.DataFrame(columns=cols)
    out["idle"] = out[list(CAUSES)].sum(axis=1)
    out["idle_frac"] = out["idle"] / out["wall_s"].where(out["wall_s"] > 0)
    return out[cols]


def bubble_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per batch for each worker (rows), plus an `all` row (mean over workers)."""
    if not len(table):
        return pd.DataFrame(columns=["wall_s", *COLUMNS, "idle", "idle_frac"])
    per = table.groupby("worker")[["wall_s", *COLUMNS, "idle"]].mean()
    per.loc["all"] = per.mean()
    per["idle_frac"] = per["idle"] / per["wall_s"].where(per["wall_s"] > 0)
    per.index = [i if i == "all" else worker_label(i) for i in per.index]
    per.index.name = "worker"
    return per


def bubble_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Stacked bars per worker: compute and the idle causes, mean seconds per batch."""
    if not len(table):
        return empty_figure("no spans yet", title or "idle time by cause")
    summary = bubble_summary(table).drop(index="all")
    fig = go.Figure()
    for c in COLUMNS:
        if not (summary[c] > 0).any():
            continue
        frac = summary[c] / summary["wall_s"].where(summary["wall_s"] > 0)
        fig.add_trace(go.Bar(
            name=c, x=list(summary.index), y=summary[c], marker_color=CAUSE_COLORS[c], customdata=frac,
            hovertemplate=f"{c}: %{{y:.4f}} s/batch (%{{customdata:.1%}} of wall)<br>%{{x}}<extra>{CAUSE_DOCS[c]}</extra>"))
    steps = table["batch_id"].nunique()
    fig.update_layout(barmode="stack", template="plotly_white", height=420, legend_title="state",
                      title=title or f"idle time by cause: mean seconds per batch over {steps} batch(es)",
                      yaxis_title="seconds per batch (sums to the batch's wall)", xaxis_title="worker",
                      margin=dict(l=60, r=20, t=60, b=50))
    return fig


@dataclass
class Bubbles:
    """Idle time by cause. `table`: per (batch, worker); `summary`: mean per worker;
    `figure`: stacked bars. `table, fig = bubbles(...)` unpacks."""

    table: pd.DataFrame
    figure: go.Figure

    @property
    def summary(self) -> pd.DataFrame:
        return bubble_summary(self.table)

    def __iter__(self) -> Iterator:
        return iter((self.table, self.figure))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.figure)
        display(self.summary.round(4))

    def __repr__(self) -> str:
        return f"Bubbles (mean seconds per batch; idle causes sum to wall - compute)\n{self.summary.round(4).to_string()}"


def bubbles(spans: pd.DataFrame, plan_stage_types: dict[str, str] | None = None,
            wall_by_batch: pd.Series | dict | None = None, title: str | None = None) -> Bubbles:
    """Idle time by cause per worker and batch (see the module docstring), with a
    stacked bar figure per worker. `plan_stage_types`: stage id -> node type (which
    stages are `generate`); `wall_by_batch`: the driver's wall seconds per batch."""
    table = bubble_table(spans, plan_stage_types, wall_by_batch)
    return Bubbles(table, bubble_figure(table, title))
