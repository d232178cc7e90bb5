"""Bytes between workers, per edge of the plan: a table and a Sankey figure.

Where the bytes of an edge `S->D` are recorded depends on the data plane:

  * through the object store (`distributed`: per-node DataBuffers; `coordinator`: one
    metadata actor, the rows pulled from the producers): every consumer worker's `get`
    span of stage D counts the bytes it read. They are split over the producers of S by
    the items it received (`items()`: which worker made each item id), at the same
    bytes per item, so a link is  producer (S, p) -> consumer (D, c).  A tensor-parallel
    replica reads what its group's rank 0 reads. Local-cache hits move no bytes: no link.
  * through the driver (`centralized`): a worker's `collect` span of stage S counts what it
    sent back (the columns S changed), its `dispatch` span of stage D what it received
    (the whole input of D, every replica its own copy). Links: (S, p) -> driver -> (D, c);
    one driver node per edge, so the figure keeps flowing left to right.

The link values of an edge sum to exactly those spans' bytes (the test checks it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from distflow_lab.core.spans import DRIVER
from distflow_lab.observe.style import MODE_COLORS, SERIES_COLORS, empty_figure, worker_label

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Plan

FLOW_COLUMNS = ["edge", "source", "target", "source_worker", "target_worker", "hop", "bytes", "items"]
HOPS = {"buffer": "DataBuffer", "coordinator": "coordinator", "driver": "driver", "cache": "local cache"}
HOP_COLORS = {"DataBuffer": MODE_COLORS["distributed"], "coordinator": MODE_COLORS["coordinator"],
              "driver": MODE_COLORS["centralized"]}
DRIVER_NODE = "driver"


def _label(stage: str, worker: int) -> str:
    return f"{stage} {worker_label(worker)}"


def _worker_spans(spans: pd.DataFrame, stage: str, phase: str) -> pd.DataFrame:
    w = spans[(spans["stage"] == stage) & (spans["phase"] == phase) & (spans["worker"] != DRIVER)]
    return w.groupby(["batch_id", "worker"], as_index=False)[["bytes", "items"]].sum()


def _via_driver(spans: pd.DataFrame, name: str, src: str, dst: str) -> list[dict]:
    """Centralized: producers' collects into the driver, the driver's dispatches to consumers."""
    rows = []
    for r in _worker_spans(spans, src, "collect").itertuples(index=False):
        rows.append({"edge": name, "source": _label(src, r.worker), "target": DRIVER_NODE, "source_worker": r.worker,
                     "target_worker": DRIVER, "hop": "driver", "bytes": r.bytes, "items": r.items})
    for r in _worker_spans(spans, dst, "dispatch").itertuples(index=False):
        rows.append({"edge": name, "source": DRIVER_NODE, "target": _label(dst, r.worker), "source_worker": DRIVER,
                     "target_worker": r.worker, "hop": "driver", "bytes": r.bytes, "items": r.items})
    return rows


def _via_store(spans: pd.DataFrame, items: pd.DataFrame, plan: "Plan", name: str, src: str, dst: str) -> list[dict]:
    """Object store: each consumer's get bytes, split over producers by the items it received."""
    gets = _worker_spans(spans, dst, "get")
    if not len(gets):
        return []
    consumer = plan.stage(dst)
    made = items[items["stage"] == src].set_index(["batch_id", "item_id"])["worker"]
    made = made[~made.index.duplicated()]
    took = items[items["stage"] == dst]
    hop_of = took.groupby("batch_id")["route_in"].agg(lambda r: r.mode().iloc[0] if len(r) else "buffer")
    puts = _worker_spans(spans, src, "put").set_index(["batch_id", "worker"])["bytes"]
    rows = []
    for r in gets.itertuples(index=False):
        ids = took[(took["batch_id"] == r.batch_id) & (took["dp_rank"] == consumer.dp_rank(r.worker))]["item_id"]
        producers = made.reindex(list(zip([r.batch_id] * len(ids), ids))).dropna().astype(int)
        share = producers.value_counts()
        if not len(share):  # no lineage for this batch: split like the producers' puts
            share = puts.xs(r.batch_id, level="batch_id") if r.batch_id in puts.index.get_level_values(0) else pd.Series(dtype=float)
        if not len(share) or share.sum() <= 0:
            share = pd.Series({-2: 1.0})  # producers unknown: one "?" node keeps the sum
        frac = share / share.sum()
        hop = HOPS.get(hop_of.get(r.batch_id, "buffer"), "DataBuffer")
        for p, f in frac.items():
            rows.append({"edge": name, "source": _label(src, p) if p >= 0 else f"{src} ?", "target": _label(dst, r.worker),
                         "source_worker": int(p), "target_worker": int(r.worker), "hop": hop,
                         "bytes": float(r.bytes) * f, "items": float(r.items) * f})
    return rows


def byte_flows(spans: pd.DataFrame, items: pd.DataFrame, plan: "Plan", edge: str | None = None,
               batches: int | Iterable[int] | None = None) -> pd.DataFrame:
    """Bytes (and items) from worker to worker on each edge of `plan` (or only `edge`, a name
    like "advantage->old_log_prob"), summed over `batches` (an int, a list; None: every batch).
    Columns: FLOW_COLUMNS; the driver is worker -1 and node "driver" (centralized)."""
    names = {e.name: e for e in plan.edges}
    if edge is not None and edge not in names:
        raise KeyError(f"no edge {edge!r}; edges: {list(names)}")
    if batches is not None and len(spans):
        wanted = [batches] if isinstance(batches, (int, np.integer)) else list(batches)
        spans = spans[spans["batch_id"].isin(wanted)]
        items = items[items["batch_id"].isin(wanted)] if len(items) else items
    if not len(spans):
        return pd.DataFrame(columns=FLOW_COLUMNS)
    rows: list[dict] = []
    for name, e in names.items():
        if edge is not None and name != edge:
            continue
        src, dst = plan.stages[e.src].id, plan.stages[e.dst].id
        through_driver = ((spans["stage"] == dst) & (spans["phase"] == "dispatch") & (spans["worker"] != DRIVER)).any()
        rows += _via_driver(spans, name, src, dst) if through_driver else _via_store(spans, items, plan, name, src, dst)
    df = pd.DataFrame(rows, columns=FLOW_COLUMNS)
    if not len(df):
        return df
    keys = FLOW_COLUMNS[:6]
    return df.groupby(keys, as_index=False, sort=False)[["bytes", "items"]].sum()


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def sankey_figure(flows: pd.DataFrame, stage_order: list[str] | None = None, title: str | None = None) -> go.Figure:
    """A Sankey of `byte_flows` output: one node per (stage, worker), one driver node per
    edge that went through the driver; links coloured by hop, hover in bytes and items."""
    moved = flows[flows["bytes"] > 0] if len(flows) else flows
    if not len(moved):
        return empty_figure("no bytes moved between workers here (local-cache hits move none)",
                            title or "bytes between workers")
    def key(label: str, edge: str) -> tuple:
        return (label, edge) if label == DRIVER_NODE else (label, "")
    nodes: dict[tuple, int] = {}
    for r in moved.itertuples(index=False):
        for k in (key(r.source, r.edge), key(r.target, r.edge)):
            nodes.setdefault(k, len(nodes))
    order = {s: i for i, s in enumerate(stage_order or [])}
    colors = [("#7F7F7F" if lab == DRIVER_NODE else SERIES_COLORS[order.get(lab.rsplit(" ", 1)[0], 0) % len(SERIES_COLORS)])
              for lab, _ in nodes]
    hover = [f"{lab} ({edge})" if edge else lab for lab, edge in nodes]
    link_color = [_rgba(HOP_COLORS.get(h, "#7F7F7F"), 0.45) for h in moved["hop"]]
    custom = [[_size(b), int(round(i)), e, h] for b, i, e, h in zip(moved["bytes"], moved["items"], moved["edge"],
                                                                     moved["hop"])]
    fig = go.Figure(go.Sankey(
        arrangement="snap",
        node=dict(label=[lab for lab, _ in nodes], color=colors, pad=12, thickness=14, customdata=hover,
                  hovertemplate="%{customdata}<br>%{value:,.0f} B<extra></extra>"),
        link=dict(source=[nodes[key(s, e)] for s, e in zip(moved["source"], moved["edge"])],
                  target=[nodes[key(t, e)] for t, e in zip(moved["target"], moved["edge"])],
                  value=moved["bytes"].astype(float).tolist(), color=link_color, customdata=custom,
                  hovertemplate="%{source.label} → %{target.label}<br>%{customdata[0]} (%{value:,.0f} B), "
                                "%{customdata[1]} items<br>edge %{customdata[2]} via %{customdata[3]}<extra></extra>"),
    ))
    total = float(moved["bytes"].sum())
    fig.update_layout(title=title or f"bytes between workers: {_size(total)}", template="plotly_white",
                      height=max(320, 28 * len(nodes) // 2 + 160), margin=dict(l=20, r=20, t=60, b=20),
                      font=dict(size=11))
    return fig
