"""The train-inference mismatch: how far the rollout engine's log-probs of the tokens it
sampled are from the trainer's on the same tokens (vLLM's "training-inference consistency"
RFC, verl's log-prob monitoring). Per step from the metrics the old_log_prob stage logs,
and over the tokens of the latest step."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.observe.style import empty_figure, series_color

METRICS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/logprob_kl")


def token_diffs(rollout_lp: np.ndarray, trainer_lp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """|rollout - trainer| log-prob of every real response token (padding left out)."""
    return np.abs(np.asarray(rollout_lp) - np.asarray(trainer_lp))[np.asarray(mask).astype(bool)]


def mismatch_figure(metrics: pd.DataFrame, diffs: np.ndarray | None = None) -> go.Figure:
    """Left: the mismatch per step (mean and max |difference|, KL by k3; log scale). Right: the
    distribution of |difference| over the latest step's tokens, when given."""
    if not set(METRICS) <= set(metrics.columns):
        return empty_figure("no mismatch metrics: run with rollout.log_probs=true", "mismatch")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=("per step", "over the latest step's tokens"))
    for i, name in enumerate(METRICS):
        y = metrics[name].clip(lower=1e-12)  # log axis: an exact 0 would vanish
        fig.add_trace(go.Scatter(x=metrics["update"], y=y, mode="lines+markers", name=name.split("/")[1],
                                 line=dict(color=series_color(i))), row=1, col=1)
    if diffs is not None and len(diffs):
        fig.add_trace(go.Histogram(x=np.log10(np.maximum(diffs, 1e-12)), name="tokens", nbinsx=40,
                                   marker_color=series_color(3), showlegend=False), row=1, col=2)
        fig.update_xaxes(title_text="log10 |rollout - trainer| log-prob", row=1, col=2)
        fig.update_yaxes(title_text="tokens", row=1, col=2)
    fig.update_yaxes(type="log", title_text="log-prob difference", row=1, col=1)
    fig.update_xaxes(title_text="update", row=1, col=1)
    fig.update_layout(template="plotly_white", title="train-inference mismatch", height=380)
    return fig
