"""Shared look of every figure: one fixed colour per phase, role and policy,
so a timeline, a breakdown and a report agree on what orange means."""
from __future__ import annotations

from typing import Iterable

import plotly.graph_objects as go

from distflow_lab.core.spans import DRIVER, PHASES
from distflow_lab.graph.drawing import EDGE_COLORS, ROLE_COLORS  # noqa: F401  (one palette)

# Distributed data path in greens/oranges/reds, centralized in teals/pinks, so
# side-by-side breakdowns of the two modes never reuse a colour.
PHASE_COLORS: dict[str, str] = {
    "compute": "#4C78A8",
    "weight_sync": "#1B2A49",
    "env_wait": "#9D755D",
    "load": "#8C564B",
    "cache_hit": "#54A24B",
    "put": "#F58518",
    "get": "#E45756",
    "plan": "#EECA3B",
    "wait": "#BAB0AC",
    "split": "#72B7B2",
    "dispatch": "#B279A2",
    "collect": "#FF9DA6",
    "concat": "#17BECF",
    "other": "#7F7F7F",
}


# Fixed colours for runs/modes/series beyond phases (metric curves, scaling lines).
SERIES_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")

MODE_COLORS: dict[str, str] = {"distributed": "#4C78A8", "centralized": "#F58518", "coordinator": "#54A24B",
                               "verl": "#9D755D"}


def phase_color(phase: str) -> str:
    return PHASE_COLORS.get(phase, PHASE_COLORS["other"])


def label_color(background: str) -> str:
    """Dark text on a light colour, white on a dark one (WCAG relative luminance of "#RRGGBB")."""
    rgb = [int(background.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    luminance = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "#222222" if luminance > 0.35 else "white"


def ordered_phases(phases: Iterable[str]) -> list[str]:
    """Known phases in PHASES order (stacking order), unknown ones after, alphabetically."""
    present = set(phases)
    return [p for p in PHASES if p in present] + sorted(present - set(PHASES))


def worker_label(worker: int) -> str:
    return "driver" if int(worker) == DRIVER else f"w{int(worker)}"


def series_color(i: int, name: str | None = None) -> str:
    """Colour of the i-th series; modes keep their own colour everywhere."""
    if name in MODE_COLORS:
        return MODE_COLORS[name]
    return SERIES_COLORS[i % len(SERIES_COLORS)]


def empty_figure(message: str, title: str | None = None) -> go.Figure:
    """A blank figure that says why it is blank (no spans yet, no metrics...)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="#666"))
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=240, template="plotly_white")
    return fig
