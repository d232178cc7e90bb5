"""HTML views of a DAG and its linearized plan (rich reprs in notebooks)."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..dag import DAG
    from ..planner import Plan

_EDGE_STYLE = {"local": "color:#2a9d8f", "redistribute": "color:#e76f51;font-weight:bold"}


def dag_html(dag: "DAG") -> str:
    rows = "".join(
        f"<tr><td><b>{html.escape(n.id)}</b></td><td>{n.role}</td><td>{n.type}</td>"
        f"<td>{html.escape(', '.join(n.deps)) or '-'}</td><td>{n.layout}</td>"
        f"<td><code>{html.escape(n.fn_name())}</code></td></tr>"
        for n in dag
    )
    return (f"<b>DAG {html.escape(dag.name)}</b> · {len(dag)} nodes<table>"
            "<tr><th>id</th><th>role</th><th>type</th><th>deps</th><th>layout</th><th>fn</th></tr>"
            f"{rows}</table>")


def plan_html(plan: "Plan") -> str:
    parts = []
    for s in plan.stages:
        e = plan.edge_into(s.index)
        if e:
            parts.append(f"<span style='{_EDGE_STYLE[e.kind]}'>&nbsp;—{e.kind}→&nbsp;</span>")
        parts.append(f"<span style='border:1px solid #999;border-radius:4px;padding:2px 4px'>"
                     f"{html.escape(s.id)} <small>dp={s.dp} tp={s.tp}</small></span>")
    return (f"<b>Plan {html.escape(plan.dag_name)}</b> on {plan.world_size} workers<br>"
            f"<div style='line-height:2.2'>{''.join(parts)}</div>")
