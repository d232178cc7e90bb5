"""Every figure in one namespace. Plain functions of DataFrames or simple
values returning plotly `go.Figure`s; they never import `lab` or a controller.

    from distflow_lab.observe.figures import timeline, breakdown
    fig = timeline(session.spans, batches=[3, 4])
    w = go.FigureWidget(fig)  # live-updatable widget in a notebook

The code lives in timeline.py, breakdown.py, balance.py, curves.py and dag.py;
colours in style.py (`PHASE_COLORS`: one fixed colour per phase everywhere).
"""
from __future__ import annotations

from distflow_lab.observe.load_balance import POLICIES, load_balance, load_balance_table
from distflow_lab.observe.breakdown import breakdown, breakdown_table, cache_hits, cache_table
from distflow_lab.observe.curves import DEFAULT_METRICS, ablation_figure, metric_curves, scaling_figure
from distflow_lab.graph.drawing import dag_svg, plan_svg
from distflow_lab.observe.dag_figure import dag_figure
from distflow_lab.observe.style import PHASE_COLORS, ROLE_COLORS
from distflow_lab.observe.timeline import timeline

__all__ = [
    "PHASE_COLORS", "ROLE_COLORS", "POLICIES", "DEFAULT_METRICS",
    "timeline", "breakdown", "breakdown_table", "cache_hits", "cache_table", "load_balance",
    "load_balance_table", "dag_figure", "dag_svg", "plan_svg", "metric_curves", "ablation_figure",
    "scaling_figure",
]
