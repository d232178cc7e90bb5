"""One item's path through a run: at each stage, the worker and node that held it, how it
arrived (local cache, DataBuffer, coordinator, driver, loader), the bytes it brought, its
token length and policy version, and, for a multi-turn trajectory, its model turns. DataFrames in, a DataFrame out:

    lineage(s.items(), s.spans, {17}, worker_nodes)       # what `s.lineage(17)` shows
    lineage(items, spans, uid_item_ids(batches, "p3"))    # every response of prompt uid "p3"

`items` is `Session.items()` (one row per batch, stage and item), `spans` is `Session.spans`.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd

HOPS = {"cache": "local cache", "buffer": "DataBuffer", "coordinator": "coordinator", "driver": "driver",
        "loader": "loader", "none": "-"}
"""How an item arrived at a stage (`items.route_in`), in words."""

COLUMNS = ["item_id", "batch_id", "update", "stage", "worker", "node", "hop", "bytes", "tokens", "version"]


def uid_item_ids(batches: Iterable[Any], uid: str) -> set[int]:
    """The item ids of every row whose `uid` (prompt group) is `uid`, over batches that carry both
    columns (a stage's kept outputs; the others are skipped)."""
    ids: set[int] = set()
    for b in batches:
        if "uid" in b and "item_id" in b:
            ids |= {int(i) for u, i in zip(b["uid"].tolist(), b["item_id"].tolist()) if str(u) == uid}
    return ids


def lineage(items: pd.DataFrame, spans: pd.DataFrame, item_ids: int | Iterable[int],
            worker_nodes: Mapping[int, Any] | None = None, label: Any = None) -> pd.DataFrame:
    """The rows of `items` for `item_ids`, sorted by item, batch and stage, with the node of each worker
    (its first 8 characters), the hop in words and the bytes moved per item where it arrived (the
    stage's get/dispatch/cache-hit bytes on that worker over its items). KeyError when none was
    recorded (`label` names what was asked for)."""
    ids = {item_ids} if isinstance(item_ids, int) else set(item_ids)
    rows = items[items["item_id"].isin(ids)]
    if not len(rows):
        asked = label if label is not None else (item_ids if isinstance(item_ids, int) else sorted(ids))
        raise KeyError(f"no recorded item {asked!r} (run a step first; a uid needs keep_outputs)")
    nodes = dict(worker_nodes or {})
    per_item = (spans[spans.phase.isin(["get", "dispatch", "cache_hit"])]
                .groupby(["batch_id", "stage", "worker"])[["bytes", "items"]].sum())
    out = rows.assign(node=rows["worker"].map(lambda w: str(nodes.get(w, "?"))[:8]),
                      hop=rows["route_in"].map(HOPS))
    moved = per_item.reindex(list(zip(out["batch_id"], out["stage"], out["worker"])))
    out = out.assign(bytes=(moved["bytes"] / moved["items"].clip(lower=1)).fillna(0).astype(int).to_numpy())
    cols = [*COLUMNS, "turns"] if "turns" in out and (out["turns"] >= 0).any() else COLUMNS  # multi-turn rows
    return out.sort_values(["item_id", "batch_id", "stage_index"])[cols].reset_index(drop=True)
