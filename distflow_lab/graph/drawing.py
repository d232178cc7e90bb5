"""Inline-SVG pictures of a DAG and its linearized plan, for their rich reprs:
pure strings, no JavaScript, so they render in any notebook viewer and in static
exports. (The interactive plotly figure is `observe.dag_figure`.)"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Iterable

from distflow_lab.graph.nodes import depths

if TYPE_CHECKING:
    from distflow_lab.graph.dag import DAG
    from distflow_lab.graph.planner import Plan

ROLE_COLORS: dict[str, str] = {
    "data": "#D9D9D9", "rollout": "#9ECAE9", "reward": "#FFBF79", "advantage": "#FDE9A9",
    "actor": "#88D27A", "reference": "#D6A5C9", "critic": "#F2B8B5", "custom": "#E6E6E6",
}

EDGE_COLORS: dict[str, str] = {"local": "#2A9D8F", "redistribute": "#E76F51", "dep": "#888888"}


# ---- layout shared by the figure and the SVG ----------------------------------------------------------

def grid(deps: dict[str, list[str]]) -> dict[str, tuple[int, float]]:
    """(column, row) per node: column = depth, rows centred within the tallest column."""
    dep = depths(deps)
    cols: dict[int, list[str]] = {}
    for u in deps:  # declaration order within a depth, as the planner
        cols.setdefault(dep[u], []).append(u)
    tallest = max((len(v) for v in cols.values()), default=1)
    return {u: (c, i + (tallest - len(ids)) / 2) for c, ids in cols.items() for i, u in enumerate(ids)}


# ---- inline SVG -----------------------------------------------------------------------------------

_BW, _BH, _SX, _SY, _PAD = 140, 46, 190, 62, 12  # box size, column/row stride, padding (px)


def _svg_box(x: float, y: float, nid: str, sub: str, fill: str) -> str:
    return (f"<g><title>{html.escape(nid)}</title>"
            f"<rect x='{x:.0f}' y='{y:.0f}' width='{_BW}' height='{_BH}' rx='6' fill='{fill}' stroke='#555'/>"
            f"<text x='{x + _BW / 2:.0f}' y='{y + 19:.0f}' text-anchor='middle' font-size='12' "
            f"font-weight='bold'>{html.escape(nid)}</text>"
            f"<text x='{x + _BW / 2:.0f}' y='{y + 35:.0f}' text-anchor='middle' font-size='10' "
            f"fill='#333'>{html.escape(sub)}</text></g>")


def _svg_edge(a: tuple[float, float], b: tuple[float, float], kind: str, label: str = "") -> str:
    """Curved arrow from box a's right edge to box b's left edge (top-left corners given)."""
    x1, y1, x2, y2 = a[0] + _BW, a[1] + _BH / 2, b[0], b[1] + _BH / 2
    bend = max(20.0, (x2 - x1) / 2)
    width = 1.2 if kind == "dep" else 2
    out = (f"<path d='M{x1:.0f},{y1:.0f} C{x1 + bend:.0f},{y1:.0f} {x2 - bend:.0f},{y2:.0f} {x2 - 2:.0f},{y2:.0f}' "
           f"fill='none' stroke='{EDGE_COLORS[kind]}' stroke-width='{width}' marker-end='url(#dfl-arrow-{kind})'/>")
    if label:
        out += (f"<text x='{(x1 + x2) / 2:.0f}' y='{min(y1, y2) - 5:.0f}' text-anchor='middle' font-size='10' "
                f"fill='{EDGE_COLORS[kind]}' font-weight='{'bold' if kind == 'redistribute' else 'normal'}'>"
                f"{html.escape(label)}</text>")
    return out


def _svg(parts: Iterable[str], width: float, height: float) -> str:
    defs = "".join(
        f"<marker id='dfl-arrow-{k}' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
        f"orient='auto'><path d='M0,0 L10,5 L0,10 z' fill='{c}'/></marker>" for k, c in EDGE_COLORS.items())
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}' "
            f"style='width:100%;max-width:{width:.0f}px;height:auto;font-family:sans-serif'>"
            f"<defs>{defs}</defs>{''.join(parts)}</svg>")


def _dag_parts(nodes: list[tuple[str, list[str], str, str]], y0: float) -> tuple[list[str], float, float]:
    """SVG of (id, deps, role, subtitle) nodes laid out by depth; returns (parts, width, bottom)."""
    pos = grid({nid: deps for nid, deps, _, _ in nodes})
    xy = {u: (_PAD + c * _SX, y0 + r * _SY) for u, (c, r) in pos.items()}
    parts = [_svg_edge(xy[d], xy[nid], "dep") for nid, deps, _, _ in nodes for d in deps if d in xy and d != nid]
    parts += [_svg_box(*xy[nid], nid, sub, ROLE_COLORS.get(role, ROLE_COLORS["custom"]))
              for nid, _, role, sub in nodes]
    width = _PAD * 2 + max((x for x, _ in xy.values()), default=_PAD) - _PAD + _BW
    bottom = max((y for _, y in xy.values()), default=y0) + _BH
    return parts, width, bottom


def dag_svg(dag: "DAG") -> str:
    """Inline SVG of a DAG (also of one that does not validate yet)."""
    nodes = [(n.id, list(n.deps), n.role, f"{n.role}/{n.type} · {n.layout}") for n in dag]
    parts, width, bottom = _dag_parts(nodes, _PAD)
    return _svg(parts, width, bottom + _PAD)


def plan_svg(plan: "Plan") -> str:
    """Inline SVG: the logical DAG on top, the linearized chain with local /
    redistribute edges below."""
    nodes = [(s.id, list(s.deps), s.role, f"{s.role} · dp={s.dp} tp={s.tp}") for s in plan.stages]
    parts, width, bottom = _dag_parts(nodes, _PAD + 14)
    parts.insert(0, f"<text x='{_PAD}' y='{_PAD + 6}' font-size='11' fill='#666'>logical DAG</text>")
    chain_y = bottom + 48
    parts.append(f"<text x='{_PAD}' y='{chain_y - 22}' font-size='11' fill='#666'>"
                 f"linearized chain on {plan.world_size} workers</text>")
    sx = _BW + 90  # room for the edge label between boxes
    xy = {s.index: (_PAD + s.index * sx, chain_y) for s in plan.stages}
    parts += [_svg_edge(xy[e.src], xy[e.dst], e.kind, e.kind) for e in plan.edges]
    parts += [_svg_box(*xy[s.index], s.id, f"[{s.index}] dp={s.dp} tp={s.tp}",
                       ROLE_COLORS.get(s.role, ROLE_COLORS["custom"])) for s in plan.stages]
    width = max(width, _PAD * 2 + (len(plan.stages) - 1) * sx + _BW)
    return _svg(parts, width, chain_y + _BH + _PAD)


# ---- rich reprs ----------------------------------------------------------------------------------

def dag_html(dag: "DAG") -> str:
    rows = "".join(
        f"<tr><td><b>{html.escape(n.id)}</b></td><td>{n.role}</td><td>{n.type}</td>"
        f"<td>{html.escape(', '.join(n.deps)) or '-'}</td><td>{n.layout}</td>"
        f"<td><code>{html.escape(n.fn_name())}</code></td></tr>"
        for n in dag
    )
    picture = dag_svg(dag) if len(dag) else ""
    return (f"<b>DAG {html.escape(dag.name)}</b> · {len(dag)} nodes<div>{picture}</div><table>"
            "<tr><th>id</th><th>role</th><th>type</th><th>deps</th><th>layout</th><th>fn</th></tr>"
            f"{rows}</table>")


def plan_html(plan: "Plan") -> str:
    table = plan.to_frame().to_html(index=False, escape=True)
    return f"<b>Plan {html.escape(plan.dag_name)}</b> on {plan.world_size} workers<div>{plan_svg(plan)}</div>{table}"
