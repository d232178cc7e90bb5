"""The DAG and its linearized plan as an interactive plotly figure (the inline
SVG of the reprs is `graph.drawing`)."""
from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distflow_lab.graph.drawing import EDGE_COLORS, ROLE_COLORS, grid
from distflow_lab.graph.planner import Plan


# ---- plotly figure ---------------------------------------------------------------------------------

_HW, _HH = 0.38, 0.3  # box half-width / half-height in axis units


def _boxes(fig: go.Figure, nodes: list[tuple[str, float, float, str, str]], axis: str) -> None:
    """Rounded-ish role-coloured boxes with two-line labels; `axis` is "" or "2"."""
    for nid, x, y, role, sub in nodes:
        fig.add_shape(type="rect", x0=x - _HW, x1=x + _HW, y0=y - _HH, y1=y + _HH, xref=f"x{axis}", yref=f"y{axis}",
                      fillcolor=ROLE_COLORS.get(role, ROLE_COLORS["custom"]), line=dict(color="#555", width=1),
                      layer="below", name=f"box:{nid}")
        fig.add_annotation(x=x, y=y, xref=f"x{axis}", yref=f"y{axis}", showarrow=False, name=f"node:{nid}",
                           text=f"<b>{html.escape(nid)}</b><br><span style='font-size:10px'>{html.escape(sub)}</span>",
                           font=dict(size=11))


def _arrow(fig: go.Figure, a: tuple[float, float], b: tuple[float, float], axis: str, color: str, name: str) -> None:
    fig.add_annotation(x=b[0] - _HW, y=b[1], ax=a[0] + _HW, ay=a[1], xref=f"x{axis}", yref=f"y{axis}",
                       axref=f"x{axis}", ayref=f"y{axis}", showarrow=True, arrowhead=3, arrowsize=1.2,
                       arrowwidth=2 if color != EDGE_COLORS["dep"] else 1.3, arrowcolor=color, text="", name=name)


def dag_figure(plan: "Plan") -> go.Figure:
    """Top: the logical DAG (x = depth, y = order within the depth, one arrow
    per `plan.logical_edges`). Bottom: the linearized chain every worker runs,
    its edges green ("local": batch stays in the worker's cache) or orange
    ("redistribute": through the DataBuffer, with load balancing)."""
    deps = {s.id: list(s.deps) for s in plan.stages}
    pos = grid(deps)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.62, 0.38], vertical_spacing=0.1,
                        subplot_titles=(f"DAG {plan.dag_name}: logical dependencies",
                                        f"linearized chain on {plan.world_size} workers (data path)"))
    top = {u: (c, -r) for u, (c, r) in pos.items()}  # first node of a depth on top
    _boxes(fig, [(s.id, *top[s.id], s.role, f"{s.role} · dp={s.dp} tp={s.tp}") for s in plan.stages], "")
    for a, b in plan.logical_edges:
        _arrow(fig, top[a], top[b], "", EDGE_COLORS["dep"], f"dep:{a}->{b}")
    _boxes(fig, [(s.id, s.index, 0.0, s.role, f"[{s.index}] dp={s.dp} tp={s.tp}") for s in plan.stages], "2")
    for e in plan.edges:
        color = EDGE_COLORS[e.kind]
        _arrow(fig, (e.src, 0.0), (e.dst, 0.0), "2", color, f"chain:{e.name}")
        fig.add_annotation(x=(e.src + e.dst) / 2, y=_HH + 0.12, xref="x2", yref="y2", showarrow=False,
                           text=f"<b>{e.kind}</b>" if e.kind == "redistribute" else e.kind,
                           font=dict(size=10, color=color), name=f"chain-label:{e.name}")
    hover = [f"{s.id}<br>role {s.role} · type {s.type}<br>dp={s.dp} tp={s.tp} (group {s.group_size})"
             f"<br>depth {s.depth}<br>{html.escape(s.fn_name)}" for s in plan.stages]
    fig.add_trace(go.Scatter(x=[top[s.id][0] for s in plan.stages], y=[top[s.id][1] for s in plan.stages],
                             mode="markers", marker=dict(size=30, opacity=0), hovertext=hover, hoverinfo="text",
                             showlegend=False, name="dag"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[s.index for s in plan.stages], y=[0.0] * len(plan.stages), mode="markers",
                             marker=dict(size=30, opacity=0), hovertext=hover, hoverinfo="text",
                             showlegend=False, name="chain"), row=2, col=1)
    ncols = max(c for c, _ in pos.values()) + 1
    nrows = max(r for _, r in pos.values()) + 1
    axis = dict(visible=False, showgrid=False, zeroline=False, fixedrange=True)
    fig.update_xaxes(axis, range=[-0.55, ncols - 0.45], row=1, col=1)
    fig.update_yaxes(axis, range=[-nrows + 0.45, 0.55], row=1, col=1)
    fig.update_xaxes(axis, range=[-0.55, len(plan.stages) - 0.45], row=2, col=1)
    fig.update_yaxes(axis, range=[-0.55, 0.75], row=2, col=1)
    fig.update_layout(template="plotly_white", showlegend=False, height=220 + 90 * nrows,
                      width=max(720, 150 * max(ncols, len(plan.stages))), margin=dict(l=10, r=10, t=50, b=10))
    return fig
