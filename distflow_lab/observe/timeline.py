"""The timeline: a Gantt chart of spans, one row per worker (and the
driver in centralized mode), one bar per span coloured by phase and labelled
with its stage (a label shows where it fits; the hover names everything)."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from distflow_lab.core.spans import DRIVER, NESTED_PHASES
from distflow_lab.observe.style import empty_figure, label_color, ordered_phases, phase_color, worker_label

BAR_WIDTH = 0.8
NESTED_WIDTH = 0.35  # nested spans (weight_sync) are thinner so the compute bar around them stays visible
OUTLINE = dict(color="rgba(0,0,0,0.45)", width=0.6)  # a dark hairline: back-to-back stages of one phase stay
# apart, and a sliver of a bar stays visible (a light outline would cover it)
LABEL_MIN_PX = 9  # stage labels smaller than this would not be readable: plotly hides them (uniformtext)

_HOVER = ("<b>%{customdata[2]}</b> · %{customdata[1]} · batch %{customdata[0]}<br>"
          "%{y} on %{customdata[8]}<br>%{customdata[3]:.2f} ms<br>"
          "%{customdata[4]:.3f} MiB · %{customdata[5]} items · %{customdata[6]} tokens<br>"
          "cache hit: %{customdata[7]}<extra></extra>")


def select_batches(spans: pd.DataFrame, batches: int | Iterable[int] | None) -> pd.DataFrame:
    """Rows of `spans` whose batch is in `batches` (an int, an iterable, or None for all)."""
    if batches is None or not len(spans):
        return spans
    wanted = [int(batches)] if isinstance(batches, (int, np.integer)) else [int(s) for s in batches]
    return spans[spans["batch_id"].isin(wanted)]


def last_batches(spans: pd.DataFrame, n: int) -> list[int] | None:
    """The latest `n` batches in `spans`, ascending; None (all) when there are no spans."""
    if not len(spans):
        return None
    return [int(x) for x in sorted(spans["batch_id"].unique())[-n:]]


def worker_rows(spans: pd.DataFrame) -> list[str]:
    """Row labels, top to bottom: the driver, then workers ordered by node then id."""
    pairs = spans[["node", "worker"]].drop_duplicates()
    pairs = pairs.assign(is_driver=pairs["worker"] != DRIVER).sort_values(["is_driver", "node", "worker"])
    return list(dict.fromkeys(worker_label(w) for w in pairs["worker"]))


def _hit_text(v: object) -> str:
    if v is None or pd.isna(v):
        return "-"
    return "yes" if bool(v) else "no"


def timeline(spans: pd.DataFrame, batches: int | Iterable[int] | None = None,
             title: str | None = None) -> go.Figure:
    """Gantt chart of `spans` (x: seconds since the first shown span).

    One `go.Bar` trace per phase (bars placed with `base` = start offset and
    `x` = duration), so thousands of spans stay fast; nested phases are drawn
    after compute and thinner. Colour = phase; each bar carries its stage's
    name inside it (shown where it fits at a readable size) and a hairline
    outline, so consecutive stages on a worker are told apart without hovering.
    Dotted lines mark where each batch starts.
    Wrap in `go.FigureWidget(...)` for in-place updates in a notebook.
    """
    df = select_batches(spans, batches)
    if not len(df):
        return empty_figure("no spans to show (run a stage first)", title)
    t0 = float(df["start"].min())
    rows = worker_rows(df)
    # Nested phases last: plotly draws later traces on top in overlay mode.
    phases = ordered_phases(df["phase"].unique())
    phases = [p for p in phases if p not in NESTED_PHASES] + [p for p in phases if p in NESTED_PHASES]
    fig = go.Figure()
    for phase in phases:
        part = df[df["phase"] == phase]
        seconds = (part["end"] - part["start"]).to_numpy(dtype=float)
        custom = np.empty((len(part), 9), dtype=object)
        custom[:, 0] = part["batch_id"].astype(int).to_numpy()
        custom[:, 1] = part["stage"].astype(str).to_numpy()
        custom[:, 2] = phase
        custom[:, 3] = seconds * 1e3
        custom[:, 4] = part["bytes"].to_numpy(dtype=float) / 2**20
        custom[:, 5] = part["items"].astype(int).to_numpy()
        custom[:, 6] = part["tokens"].astype(int).to_numpy()
        custom[:, 7] = [_hit_text(v) for v in part["cache_hit"]]
        custom[:, 8] = part["node"].astype(str).to_numpy()
        fig.add_trace(go.Bar(
            name=phase, orientation="h", y=[worker_label(w) for w in part["worker"]],
            x=seconds, base=part["start"].to_numpy(dtype=float) - t0,
            width=NESTED_WIDTH if phase in NESTED_PHASES else BAR_WIDTH,
            marker=dict(color=phase_color(phase), line=OUTLINE),
            text=custom[:, 1], textposition="inside", insidetextanchor="middle", textangle=0,
            textfont=dict(color=label_color(phase_color(phase))), constraintext="inside",
            customdata=custom, hovertemplate=_HOVER,
        ))
    _batch_marks(fig, df, t0)
    fig.update_layout(
        title=title or f"timeline ({df['mode'].iloc[0] or 'spans'}, batches {_batch_list(df)})",
        barmode="overlay", bargap=0.15, template="plotly_white", hovermode="closest",
        uniformtext=dict(minsize=LABEL_MIN_PX, mode="hide"),
        height=max(360, 90 + 34 * len(rows)), legend=dict(traceorder="normal", title="phase"),
        xaxis=dict(title="seconds since first span", rangemode="tozero", showgrid=True),
        yaxis=dict(title=None, type="category", categoryorder="array", categoryarray=rows,
                   autorange="reversed"),
        margin=dict(l=60, r=20, t=60, b=40),
    )
    return fig


def _batch_list(df: pd.DataFrame) -> str:
    steps = sorted(int(s) for s in df["batch_id"].unique())
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]}"


def _batch_marks(fig: go.Figure, df: pd.DataFrame, t0: float) -> None:
    """A faint dotted line and a label where each batch's first span starts."""
    starts = df.groupby("batch_id")["start"].min().sort_index() - t0
    label = len(starts) <= 40  # labels would overlap beyond that
    shapes, notes = [], []
    for batch_id, x in starts.items():
        shapes.append(dict(type="line", name="batch-boundary", x0=x, x1=x, y0=0, y1=1, xref="x", yref="paper",
                           line=dict(color="#999", width=1, dash="dot"), layer="below"))
        if label:
            notes.append(dict(text=f"batch {int(batch_id)}", x=x, y=1.0, xref="x", yref="paper", showarrow=False,
                              xanchor="left", yanchor="bottom", font=dict(size=10, color="#666")))
    fig.update_layout(shapes=shapes, annotations=notes)
