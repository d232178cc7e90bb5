"""Load balance at a redistribution (paper §6.4): per-worker token load under
constrained LPT, Karmarkar-Karp and no balancing, against the lower bound."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from distflow_lab.dataplane.partition import constrained_lpt, contiguous_split, karmarkar_karp, load_stats

Partitioner = Callable[[np.ndarray, int], list[list[int]]]

POLICIES: dict[str, Partitioner] = {
    "constrained LPT": constrained_lpt,
    "Karmarkar-Karp": karmarkar_karp,
    "no balancing": lambda lengths, k: contiguous_split(len(lengths), k),
}
POLICY_COLORS = {"constrained LPT": "#54A24B", "Karmarkar-Karp": "#4C78A8", "no balancing": "#BAB0AC"}


def policy_stats(lengths: np.ndarray, k: int) -> dict[str, object]:
    """load_stats of every policy; pass it to both figure and table to partition once."""
    lengths = np.asarray(lengths)
    return {name: load_stats(lengths, fn(lengths, k)) for name, fn in POLICIES.items()}


def load_balance_table(lengths: np.ndarray, k: int, stats: dict | None = None) -> pd.DataFrame:
    """One row per policy: max_load, mean, lower_bound (max(mean, longest item)),
    ratio (max / lower bound; 1.0 is optimal) and imbalance (max / mean)."""
    return pd.DataFrame([
        {"policy": name, "max_load": s.max_load, "mean": s.mean_load, "lower_bound": s.lower_bound,
         "ratio": s.ratio, "imbalance": s.imbalance}
        for name, s in (stats or policy_stats(lengths, k)).items()
    ])


def load_balance(lengths: np.ndarray, k: int, title: str | None = None, stats: dict | None = None) -> go.Figure:
    """Grouped bars: token load of each of the `k` workers under each policy,
    the lower bound as a dashed line, each policy's max / lower bound in the legend."""
    lengths = np.asarray(lengths)
    stats = stats or policy_stats(lengths, k)
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
    lo = min(min(s.loads) for s in stats.values())
    fig.update_layout(
        barmode="group", template="plotly_white", height=380, legend_title="policy",
        title=title or f"token load per worker: {len(lengths)} items over {k} workers",
        xaxis_title="worker (consumer dp rank)", yaxis_title="tokens",
        # Zoom on the interesting band: loads differ by a few percent above a big common base.
        yaxis_range=[max(0.0, 0.9 * lo), 1.05 * max(lb, max(s.max_load for s in stats.values()))],
    )
    return fig
