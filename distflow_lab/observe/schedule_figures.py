"""Pictures of the asynchronous schedules: how stale the trained samples were,
and how much each worker group waited."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.observe.style import empty_figure, series_color


def staleness_table(items: pd.DataFrame, train_stage: str) -> pd.DataFrame:
    """Per training update: how many trained samples were 0, 1, 2, ... versions old
    (`update - version` of each row entering the first training stage)."""
    rows = items[(items["stage"] == train_stage) & (items["version"] >= 0)]
    if not len(rows):
        return pd.DataFrame()
    age = (rows["update"] - rows["version"]).rename("staleness")
    return rows.assign(staleness=age).groupby(["update", "staleness"]).size().unstack(fill_value=0)


def staleness_figure(items: pd.DataFrame, train_stage: str, bound: int | None = None) -> go.Figure:
    """Stacked bars per training update: samples by staleness (versions behind the trainer)."""
    table = staleness_table(items, train_stage)
    if not len(table):
        return empty_figure("no policy versions recorded (the rows carry no `version` column)", "staleness")
    fig = go.Figure()
    for i, age in enumerate(table.columns):
        fig.add_trace(go.Bar(x=table.index, y=table[age], name=f"{age} behind", marker_color=series_color(i)))
    title = "staleness of the trained samples" + (f" (bound {bound})" if bound is not None else "")
    fig.update_layout(barmode="stack", template="plotly_white", title=title, xaxis_title="training update",
                      yaxis_title="samples", legend_title="versions behind", height=360)
    return fig


def idle_figure(metrics: pd.DataFrame) -> go.Figure:
    """Per training update: the share of the update's wall time the trainer and the rollout
    group spent idle, and the wall time itself."""
    cols = ["schedule/trainer_idle", "schedule/rollout_idle"]
    if not set(cols) <= set(metrics.columns):
        return empty_figure("no schedule metrics (a colocated synchronous session has no idle groups)", "idle")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.08)
    for i, c in enumerate(cols):
        fig.add_trace(go.Scatter(x=metrics["update"], y=metrics[c], mode="lines+markers", name=c.split("/")[1],
                                 line=dict(color=series_color(i))), row=1, col=1)
    fig.add_trace(go.Scatter(x=metrics["update"], y=metrics["wall_s"], mode="lines+markers", name="wall s",
                             line=dict(color="#666")), row=2, col=1)
    fig.update_yaxes(title_text="idle share", range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="seconds", row=2, col=1)
    fig.update_xaxes(title_text="training update", row=2, col=1)
    fig.update_layout(template="plotly_white", title="idle time per worker group", height=420)
    return fig
