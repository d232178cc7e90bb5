"""Load balance at a redistribution (paper §6.4): per-worker token load under
constrained LPT, Karmarkar-Karp and no balancing, against the lower bound.

With `cost` = (a, b) the policies balance the compute estimate a·L + b·L²
(`Balance.WORKLOAD`; `partition.workload_coeffs` gives a, b for a model) and the
figure gains a second panel: that cost per worker, in token-equivalents
(divided by a: a short sequence costs about its length), under the token counts.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.dataplane.partition import (
    Coeffs,
    LoadStats,
    constrained_lpt,
    contiguous_split,
    karmarkar_karp,
    load_stats,
    workload_cost,
)

Partitioner = Callable[[np.ndarray, int], list[list[int]]]

POLICIES: dict[str, Partitioner] = {
    "constrained LPT": constrained_lpt,
    "Karmarkar-Karp": karmarkar_karp,
    "no balancing": lambda lengths, k: contiguous_split(len(lengths), k),
}
POLICY_COLORS = {"constrained LPT": "#54A24B", "Karmarkar-Karp": "#4C78A8", "no balancing": "#BAB0AC"}


def workload_units(lengths: np.ndarray, cost: Coeffs) -> np.ndarray:
    """a·L + b·L² divided by a (token-equivalents), so it reads next to token counts."""
    a, b = (float(c) for c in cost)
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + b / a * lengths**2 if a > 0 else lengths**2


def policy_partitions(lengths: np.ndarray, k: int, cost: Coeffs | None = None) -> dict[str, list[list[int]]]:
    """Every policy's partition, balancing tokens or, with `cost`, a·L + b·L²."""
    lengths = np.asarray(lengths)
    weights = lengths if cost is None else workload_cost(lengths, cost)
    return {name: fn(weights, k) for name, fn in POLICIES.items()}


def policy_stats(lengths: np.ndarray, k: int, cost: Coeffs | None = None) -> dict[str, LoadStats]:
    """Token load_stats of every policy; pass it to both figure and table to partition once.
    With `cost` the policies balance a·L + b·L² (pass the same `cost` to figure and table)."""
    lengths = np.asarray(lengths)
    return {name: load_stats(lengths, p) for name, p in policy_partitions(lengths, k, cost).items()}


def _cost_stats(lengths: np.ndarray, k: int, cost: Coeffs) -> dict[str, LoadStats]:
    units = workload_units(lengths, cost)
    return {name: load_stats(units, p) for name, p in policy_partitions(lengths, k, cost).items()}


def load_balance_table(
    lengths: np.ndarray, k: int, stats: dict | None = None, cost: Coeffs | None = None
) -> pd.DataFrame:
    """One row per policy: max_load, mean, lower_bound (max(mean, longest item)),
    ratio (max / lower bound; 1.0 is optimal) and imbalance (max / mean), in tokens.
    With `cost`, policies balance a·L + b·L² and `workload_max` / `workload_ratio`
    give that cost (token-equivalents) per worker."""
    stats = stats or policy_stats(lengths, k, cost)
    df = pd.DataFrame([
        {"policy": name, "max_load": s.max_load, "mean": s.mean_load, "lower_bound": s.lower_bound,
         "ratio": s.ratio, "imbalance": s.imbalance}
        for name, s in stats.items()
    ])
    if cost is not None:
        by_cost = _cost_stats(np.asarray(lengths), k, cost)
        df["workload_max"] = [by_cost[name].max_load for name in df["policy"]]
        df["workload_ratio"] = [by_cost[name].ratio for name in df["policy"]]
    return df


def _lower_bound_line(fig: go.Figure, lb: float, label: str, row: int | None = None) -> None:
    where = {} if row is None else {"row": row, "col": 1}
    fig.add_hline(y=lb, name="lower bound", line=dict(color="#333", width=1.5, dash="dash"),
                  annotation_text=f"{label} {lb:,.0f}", annotation_position="top right",
                  annotation_font=dict(size=11, color="#333"), **where)


def _zoom(stats: dict[str, LoadStats]) -> list[float]:
    """Zoom on the interesting band: loads differ by a few percent above a big common base."""
    lb = next(iter(stats.values())).lower_bound
    lo = min(min(s.loads) for s in stats.values())
    return [max(0.0, 0.9 * lo), 1.05 * max(lb, max(s.max_load for s in stats.values()))]


def load_balance(
    lengths: np.ndarray, k: int, title: str | None = None, stats: dict | None = None, cost: Coeffs | None = None
) -> go.Figure:
    """Grouped bars: token load of each of the `k` workers under each policy,
    the lower bound as a dashed line, each policy's max / lower bound in the legend.

    With `cost` = (a, b) the policies balance a·L + b·L² and a second panel shows
    that cost per worker (token-equivalents) under the token panel."""
    lengths = np.asarray(lengths)
    stats = stats or policy_stats(lengths, k, cost)
    title = title or f"token load per worker: {len(lengths)} items over {k} workers"
    if cost is not None:
        return _two_panels(lengths, k, title, stats, cost)
    lb = next(iter(stats.values())).lower_bound
    workers = [f"w{i}" for i in range(k)]
    fig = go.Figure()
    for name, s in stats.items():
        fig.add_trace(go.Bar(
            name=f"{name} (max/LB {s.ratio:.3f})", x=workers, y=s.loads, marker_color=POLICY_COLORS[name],
            hovertemplate=f"{name}<br>%{{x}}: %{{y:,.0f}} tokens<extra></extra>",
        ))
    fig.add_shape(type="line", name="lower bound", xref="paper", x0=0, x1=1, y0=lb, y1=lb,
                  line=dict(color="#333", width=1.5, dash="dash"))
    fig.add_annotation(xref="paper", x=1, y=lb, text=f"lower bound {lb:,.0f}", showarrow=False,
                       xanchor="right", yanchor="bottom", font=dict(size=11, color="#333"))
    fig.update_layout(
        barmode="group", template="plotly_white", height=380, legend_title="policy", title=title,
        xaxis_title="worker (consumer dp rank)", yaxis_title="tokens", yaxis_range=_zoom(stats),
    )
    return fig


def _two_panels(lengths: np.ndarray, k: int, title: str, stats: dict[str, LoadStats], cost: Coeffs) -> go.Figure:
    """Tokens per worker on top, a·L + b·L² per worker below, same partitions (balancing the cost)."""
    by_cost = _cost_stats(lengths, k, cost)
    a, b = cost
    workers = [f"w{i}" for i in range(k)]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("tokens", f"workload {a:g}·L + {b:g}·L² (token-equivalents)"))
    for name, s in stats.items():
        c = by_cost[name]
        for row, panel, unit in ((1, s, "tokens"), (2, c, "token-equivalents")):
            fig.add_trace(go.Bar(
                name=f"{name} (max/LB tokens {s.ratio:.3f}, workload {c.ratio:.3f})", x=workers, y=panel.loads,
                marker_color=POLICY_COLORS[name], legendgroup=name, showlegend=row == 1,
                hovertemplate=f"{name}<br>%{{x}}: %{{y:,.0f}} {unit}<extra></extra>",
            ), row=row, col=1)
    _lower_bound_line(fig, next(iter(stats.values())).lower_bound, "lower bound", row=1)
    _lower_bound_line(fig, next(iter(by_cost.values())).lower_bound, "lower bound", row=2)
    fig.update_layout(barmode="group", template="plotly_white", height=560, legend_title="policy (balancing workload)",
                      title=title)
    fig.update_yaxes(title_text="tokens", range=_zoom(stats), row=1, col=1)
    fig.update_yaxes(title_text="token-equivalents", range=_zoom(by_cost), row=2, col=1)
    fig.update_xaxes(title_text="worker (consumer dp rank)", row=2, col=1)
    return fig
