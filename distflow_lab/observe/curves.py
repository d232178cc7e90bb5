"""Line and bar figures over steps or settings: training curves (paper Fig. 11
parity), the Fig. 10 ablation ladder and scaling plots."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.observe.style import empty_figure, series_color

DEFAULT_METRICS = ("reward/mean", "actor/entropy", "actor/kl", "actor/loss", "critic/loss", "response_length/mean")
THROUGHPUT = "tokens/s"  # derived: tokens / wall_s
_RUNG_COLORS = ("#BAB0AC", "#9ECAE9", "#4C78A8", "#54A24B", "#F58518")


def _with_throughput(df: pd.DataFrame) -> pd.DataFrame:
    if "tokens" in df.columns and "wall_s" in df.columns and THROUGHPUT not in df.columns:
        df = df.assign(**{THROUGHPUT: df["tokens"] / df["wall_s"].where(df["wall_s"] > 0)})
    return df


def metric_curves(metrics: pd.DataFrame | dict[str, pd.DataFrame], columns: list[str] | None = None,
                  smooth: int = 1) -> go.Figure:
    """One subplot per metric against step; a dict overlays runs (same colour
    per run in every panel). `smooth` > 1 draws a rolling mean over that many
    steps on top of the faint raw curve."""
    runs = {"": metrics} if isinstance(metrics, pd.DataFrame) else dict(metrics)
    runs = {name: _with_throughput(df) for name, df in runs.items() if df is not None and len(df)}
    if not runs:
        return empty_figure("no metrics yet", "metrics")
    present = {c for df in runs.values() for c in df.columns}
    if columns is None:
        columns = [c for c in (*DEFAULT_METRICS, THROUGHPUT) if c in present]
    elif missing := [c for c in columns if c not in present]:  # a typo should not just vanish
        raise KeyError(f"no run has metric(s) {missing}; recorded: {sorted(present)}")
    if not columns:
        return empty_figure("none of the requested metrics were recorded", "metrics")
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=columns, horizontal_spacing=0.08,
                        vertical_spacing=0.12 if nrows > 1 else 0.1)
    for i, (name, df) in enumerate(runs.items()):
        color = series_color(i, name)
        x = df["update"] if "update" in df.columns else df.index
        for j, col in enumerate(columns):
            if col not in df.columns:
                continue
            r, c = j // ncols + 1, j % ncols + 1
            label = name or col
            y = df[col]
            if smooth > 1:  # raw faintly, smoothed on top
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line=dict(color=color, width=1), opacity=0.3,
                                         name=f"{label} (raw)", legendgroup=name, showlegend=False,
                                         hoverinfo="skip"), row=r, col=c)
                y = y.rolling(smooth, min_periods=1).mean()
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines+markers" if len(df) <= 50 else "lines", marker=dict(size=4),
                line=dict(color=color, width=2), name=label, legendgroup=name,
                showlegend=bool(name) and j == 0, hovertemplate=f"{label}<br>update %{{x}}: %{{y:.4g}}<extra></extra>",
            ), row=r, col=c)
    fig.update_xaxes(title_text="update", row=nrows)
    fig.update_layout(template="plotly_white", height=260 * nrows + 60, title="training metrics",
                      margin=dict(l=50, r=20, t=70, b=40))
    return fig


def seed_curves(runs: dict[str, list[pd.DataFrame]], columns: list[str], smooth: int = 1) -> go.Figure:
    """One subplot per metric against step: per run name, the mean over its seeds (a line) and the
    seeds' min..max (a band). `runs` maps a name to one metrics frame per seed; `smooth` > 1 takes a
    rolling mean of each seed first."""
    runs = {name: [df for df in dfs if df is not None and len(df)] for name, dfs in runs.items()}
    runs = {name: dfs for name, dfs in runs.items() if dfs}
    if not runs:
        return empty_figure("no metrics yet", "metrics over seeds")
    present = {c for dfs in runs.values() for df in dfs for c in df.columns}
    if missing := [c for c in columns if c not in present]:
        raise KeyError(f"no run has metric(s) {missing}; recorded: {sorted(present)}")
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=columns, horizontal_spacing=0.08)
    for i, (name, dfs) in enumerate(runs.items()):
        color = series_color(i, name)
        for j, col in enumerate(columns):
            seeds = pd.DataFrame({k: df.set_index("update")[col].rolling(smooth, min_periods=1).mean()
                                  for k, df in enumerate(dfs) if col in df.columns})
            if seeds.empty:
                continue
            r, c, x = j // ncols + 1, j % ncols + 1, seeds.index
            band = dict(mode="lines", line=dict(width=0, color=color), hoverinfo="skip", showlegend=False,
                        legendgroup=name)
            fig.add_trace(go.Scatter(x=x, y=seeds.max(axis=1), **band), row=r, col=c)
            fig.add_trace(go.Scatter(x=x, y=seeds.min(axis=1), fill="tonexty", opacity=0.2, **band), row=r, col=c)
            fig.add_trace(go.Scatter(x=x, y=seeds.mean(axis=1), mode="lines", line=dict(color=color, width=2),
                                     name=f"{name} ({seeds.shape[1]} seeds)", legendgroup=name, showlegend=j == 0,
                                     hovertemplate=f"{name}<br>update %{{x}}: %{{y:.4g}} (mean)<extra></extra>"),
                          row=r, col=c)
    fig.update_xaxes(title_text="update", row=nrows)
    fig.update_layout(template="plotly_white", height=280 * nrows + 60, title="metrics over seeds (mean, min..max)",
                      margin=dict(l=50, r=20, t=70, b=40))
    return fig


def ablation_figure(df: pd.DataFrame, value: str = "median", lo: str | None = None, hi: str | None = None,
                    ylabel: str | None = None, title: str | None = None) -> go.Figure:
    """Paper Fig. 10: bars grouped by batch size, one per ablation rung (O1..O5),
    with asymmetric error bars from the `lo`/`hi` columns. Those must be in the
    units of `value`: by default "lo"/"hi" when value == "median", else
    f"{value}_lo"/f"{value}_hi" if present, else no error bars."""
    if not len(df):
        return empty_figure("no ablation rows", title or "ablation")
    if lo is None and hi is None:
        lo, hi = ("lo", "hi") if value == "median" else (f"{value}_lo", f"{value}_hi")
    errors = lo in df.columns and hi in df.columns
    batches = [f"batch {b}" for b in sorted(df["batch"].unique())]
    fig = go.Figure()
    for i, rung in enumerate(sorted(set(df["rung"]))):  # rungs are named "O1 ...", "O2 ...": the ladder order
        part = df[df["rung"] == rung].sort_values("batch")
        error = dict(type="data", symmetric=False, array=(part[hi] - part[value]).clip(lower=0).tolist(),
                     arrayminus=(part[value] - part[lo]).clip(lower=0).tolist(), thickness=1.2) if errors else None
        fig.add_trace(go.Bar(
            name=rung, x=[f"batch {b}" for b in part["batch"]], y=part[value], error_y=error,
            marker_color=_RUNG_COLORS[i] if i < len(_RUNG_COLORS) else series_color(i),
            text=[f"{v:.2f}" for v in part[value]], textposition="outside",
            hovertemplate=f"{rung}<br>%{{x}}: %{{y:.4g}}<extra></extra>",
        ))
    default_label = "step seconds (median, 95% CI)" if value == "median" else value
    fig.update_layout(barmode="group", template="plotly_white", height=420, legend_title="rung",
                      title=title or "ablation (paper Fig. 10)", yaxis_title=ylabel or default_label,
                      xaxis=dict(type="category", categoryorder="array", categoryarray=batches))
    return fig


def scaling_figure(df: pd.DataFrame, x: str = "workers", y: str = "throughput", by: str | None = "mode",
                   predicted: pd.DataFrame | None = None, lo: str | None = None, hi: str | None = None,
                   log_x: bool = False, title: str | None = None) -> go.Figure:
    """Measured points as lines with markers, one line per `by` group (error
    bars from `lo`/`hi` columns if given); `predicted` (same columns) dashed."""
    if not len(df):
        return empty_figure("no measurements", title)
    fig = go.Figure()
    groups = list(df.groupby(by, sort=False)) if by else [("", df)]
    colors = {str(name): series_color(i, str(name)) for i, (name, _) in enumerate(groups)}
    for name, part in groups:
        part = part.sort_values(x)
        err = (dict(type="data", symmetric=False, array=(part[hi] - part[y]).tolist(),
                    arrayminus=(part[y] - part[lo]).tolist()) if lo and hi else None)
        fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines+markers", name=str(name) or y, error_y=err,
                                 line=dict(color=colors[str(name)]), marker=dict(size=8),
                                 legendgroup=str(name)))
    if predicted is not None and len(predicted):
        pgroups = list(predicted.groupby(by, sort=False)) if by else [("", predicted)]
        for name, part in pgroups:
            part = part.sort_values(x)
            fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines", name=f"{name or y} (predicted)",
                                     line=dict(color=colors.get(str(name), "#666"), dash="dash"),
                                     legendgroup=str(name)))
    fig.update_layout(template="plotly_white", height=400, title=title or f"{y} vs {x}",
                      xaxis=dict(title=x, type="log" if log_x else "linear"), yaxis_title=y)
    return fig


def driver_memory_figure(df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """`experiments.bench.memory.sweep_batch` rows: MiB through the driver per step and the
    driver's peak RSS growth against tokens per step (batch x length), one line per data plane."""
    if df is None or not len(df):
        return empty_figure("no memory measurements", title or "driver memory")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("bytes through the driver per step", "driver RSS growth at peak"))
    for i, (mode, part) in enumerate(df.groupby("mode", sort=False)):
        part = part.sort_values("tokens_per_step")
        color = series_color(i, str(mode))
        for col, (y, label) in enumerate((("driver_bytes_per_step", "MiB/step"), ("driver_rss_growth", "MiB")), 1):
            fig.add_trace(go.Scatter(
                x=part["tokens_per_step"], y=part[y] / 2**20, mode="lines+markers", name=str(mode),
                legendgroup=str(mode), showlegend=col == 1, line=dict(color=color), marker=dict(size=8),
                customdata=part["batch"],
                hovertemplate=f"{mode}<br>batch %{{customdata}} (%{{x:,}} tokens): %{{y:.2f}} {label}<extra></extra>",
            ), row=1, col=col)
    fig.update_xaxes(title_text="tokens per step (batch x length)", type="log")
    fig.update_yaxes(title_text="MiB per step", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=2)
    fig.update_layout(template="plotly_white", height=400, title=title or "driver memory against batch size",
                      legend_title="data plane", margin=dict(l=60, r=20, t=70, b=50))
    return fig
