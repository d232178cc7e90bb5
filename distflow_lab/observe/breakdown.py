"""Paper Appendix B Table 1 (per-stage phase seconds, modes side by side) and
the cache hit / miss picture of each stage transition."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.observe.span_stats import stage_breakdown
from distflow_lab.core.spans import DRIVER
from distflow_lab.observe.style import PHASE_COLORS, empty_figure, ordered_phases, phase_color

SpansByMode = dict[str, pd.DataFrame]


def _by_mode(spans: SpansByMode | pd.DataFrame) -> SpansByMode:
    """A dict passes through; one DataFrame is split by its `mode` column."""
    if isinstance(spans, pd.DataFrame):
        if not len(spans):
            return {}
        return {str(m) or "spans": g for m, g in spans.groupby("mode", sort=False)}
    return {m: df for m, df in spans.items() if df is not None and len(df)}


def _stage_order(spans_by_mode: SpansByMode, stage_order: list[str] | None) -> list[str]:
    """Given order first, then stages in the order they first ran (any mode)."""
    seen = list(stage_order or [])
    for df in spans_by_mode.values():
        seen += list(dict.fromkeys(df.sort_values("start")["stage"]))
    return list(dict.fromkeys(seen))


def breakdown_table(spans_by_mode: SpansByMode | pd.DataFrame, stage_order: list[str] | None = None) -> pd.DataFrame:
    """Table 1: rows = stages + "total", columns = (mode, phase) with a `total`
    phase per mode; seconds from `analysis.stage_breakdown` (0 where a mode
    has no such stage or phase, the paper's dashes)."""
    modes = _by_mode(spans_by_mode)
    if not modes:
        return pd.DataFrame()
    order = _stage_order(modes, stage_order)
    parts = {}
    for mode, df in modes.items():
        bd = stage_breakdown(df, order)
        cols = ordered_phases(c for c in bd.columns if c != "total")
        parts[mode] = bd.reindex(index=order, columns=[*cols, "total"]).fillna(0.0)
    table = pd.concat(parts, axis=1, names=["mode", "phase"])
    table = table.loc[[s for s in order if (table.loc[s] != 0).any()]]  # drop stages no mode ran
    table.index.name = "stage"
    table.loc["total"] = table.sum(axis=0)
    return table


def _cells(rows: list[str], modes: list[str]) -> list[list[str]]:
    """Two-level x (stage, mode): every mode side by side under each row."""
    return [[s for s in rows for _ in modes], [m for _ in rows for m in modes]]


@dataclass
class Breakdown:
    """The paper's Table 1 as a figure and a table. As a notebook cell's last line it
    shows both; `fig, table = breakdown(...)` still unpacks."""

    figure: go.Figure
    table: pd.DataFrame

    def __iter__(self) -> Iterator:
        return iter((self.figure, self.table))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.figure)
        display(self.table.round(4))

    def __repr__(self) -> str:
        return f"Breakdown (critical-path seconds per phase)\n{self.table.round(4).to_string()}"


def breakdown(spans_by_mode: SpansByMode | pd.DataFrame, stage_order: list[str] | None = None) -> Breakdown:
    """Stacked phase seconds per stage, modes side by side (x: stage / mode),
    with the batch total in a narrow second panel."""
    table = breakdown_table(spans_by_mode, stage_order)
    if not len(table):
        return Breakdown(empty_figure("no spans to break down", "stage breakdown"), table)
    modes = list(dict.fromkeys(table.columns.get_level_values("mode")))
    stages = [s for s in table.index if s != "total"]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.85, 0.15], horizontal_spacing=0.02)
    phases = ordered_phases(p for p in table.columns.get_level_values("phase") if p != "total")
    panels = ((1, stages), (2, ["total"]))  # stages, then the batch total in its own narrow panel
    for phase in phases:
        for col, rows in panels:
            ys = [float(table.at[s, (m, phase)]) if (m, phase) in table.columns else 0.0
                  for s in rows for m in modes]
            fig.add_trace(go.Bar(
                name=phase, legendgroup=phase, showlegend=col == 1, x=_cells(rows, modes), y=ys,
                marker_color=phase_color(phase), hovertemplate=f"{phase}: %{{y:.3f}} s<br>%{{x}}<extra></extra>",
            ), row=1, col=col)
    # Each stack's total printed above it, as the paper's Total column.
    for col, rows in panels:
        ys = [float(table.at[s, (m, "total")]) for s in rows for m in modes]
        fig.add_trace(go.Scatter(
            x=_cells(rows, modes), y=ys, mode="text", showlegend=False, hoverinfo="skip",
            text=[f"{v:.3g}" for v in ys], textposition="top center", name="total",
        ), row=1, col=col)
    fig.update_layout(barmode="stack", template="plotly_white", height=500, legend_title="phase",
                      legend_tracegroupgap=2,  # one legend group per phase: no gaps between them
                      title="stage breakdown: critical-path seconds per phase (paper Table 1)",
                      margin=dict(l=60, r=20, t=60, b=80))
    fig.update_yaxes(title="seconds (slowest worker, mean over batches)", row=1, col=1)
    return Breakdown(fig, table)


# ---- cache hits -------------------------------------------------------------------------------------

def cache_table(spans: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, stage), per batch on average: inputs served from the local
    cache (hits), inputs that crossed the object store (misses: a buffer `get`
    or a worker-side `dispatch` of a driver chunk) and the MiB those misses
    carried into the stage (receiver side, so tensor-parallel copies count)."""
    cols = ["mode", "stage", "hits", "misses", "mib_in"]
    if not len(spans):
        return pd.DataFrame(columns=cols)
    df = spans.assign(
        hit=spans["phase"] == "cache_hit",
        miss=(spans["phase"] == "get") | ((spans["phase"] == "dispatch") & (spans["worker"] != DRIVER)),
    )
    df = df.assign(mib=np.where(df["miss"], df["bytes"].astype(float) / 2**20, 0.0))
    order = list(dict.fromkeys(spans.sort_values("start")["stage"]))
    g = df.groupby(["mode", "stage"], sort=False)
    steps = g["batch_id"].nunique()
    out = pd.DataFrame({"hits": g["hit"].sum() / steps, "misses": g["miss"].sum() / steps,
                        "mib_in": g["mib"].sum() / steps}).reset_index()
    out["stage"] = pd.Categorical(out["stage"], categories=order, ordered=True)
    out["mode"] = pd.Categorical(out["mode"], categories=list(dict.fromkeys(spans["mode"])), ordered=True)
    return out.sort_values(["stage", "mode"]).reset_index(drop=True).astype({"stage": str, "mode": str})[cols]


NO_BYTES_ALL_HITS = "no bytes moved: every edge was a local-cache hit"
NO_BYTES = "no bytes moved into any stage"


def no_bytes_message(table: pd.DataFrame) -> str:
    """What the MiB panel says when nothing moved (a `cache_table` whose mib_in are all 0)."""
    return NO_BYTES_ALL_HITS if table["misses"].sum() == 0 and table["hits"].sum() > 0 else NO_BYTES


def cache_hits(spans: pd.DataFrame) -> go.Figure:
    """Two panels per stage: local-cache hits vs misses (per batch) and the MiB
    moved into the stage. Several modes in `spans` show side by side. When no
    bytes moved the second panel says so (`no_bytes_message`) instead of
    drawing an empty axis."""
    table = cache_table(spans)
    if not len(table):
        return empty_figure("no spans yet", "cache hits")
    multi = table["mode"].nunique() > 1
    x = [table["stage"].tolist(), table["mode"].tolist()] if multi else table["stage"].tolist()
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("stage inputs per batch: local cache hit vs moved (miss)",
                                        "MiB moved into stage"))
    fig.add_trace(go.Bar(name="cache hit", x=x, y=table["hits"], marker_color=PHASE_COLORS["cache_hit"],
                         hovertemplate="%{x}: %{y:.3g} hits/batch<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(name="miss (get / dispatch)", x=x, y=table["misses"], marker_color=PHASE_COLORS["get"],
                         hovertemplate="%{x}: %{y:.3g} misses/batch<extra></extra>"), row=1, col=1)
    if table["mib_in"].sum() > 0:
        fig.add_trace(go.Bar(name="MiB in", x=x, y=table["mib_in"], marker_color=PHASE_COLORS["put"],
                             hovertemplate="%{x}: %{y:.3f} MiB/batch<extra></extra>"), row=2, col=1)
    else:  # an empty panel would show a meaningless -1..1 axis: say what happened instead
        fig.add_annotation(text=no_bytes_message(table), showarrow=False, x=0.5, y=0.5, xref="x2 domain",
                           yref="y2 domain", font=dict(size=13, color="#666"), name="no-bytes")
        fig.update_yaxes(range=[0, 1], showticklabels=False, showgrid=False, row=2, col=1)
    # Stacked: the bar's height is the stage's inputs per batch, split into hits and misses.
    fig.update_layout(barmode="stack", template="plotly_white", height=480, title="local cache hits per stage",
                      legend_traceorder="normal",
                      margin=dict(l=60, r=20, t=70, b=60))
    fig.update_yaxes(title="inputs / batch", row=1, col=1)
    fig.update_yaxes(title="MiB / batch", row=2, col=1)
    return fig
