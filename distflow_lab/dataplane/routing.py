"""Where each item goes when a batch changes data-parallel layout.

Every data plane uses these functions, so all three modes route the same rows
to the same ranks (and a seed gives the same metrics in every mode). The global order of items is producer
dp rank order (rank 0's rows, then rank 1's, ...); each consumer receives its
items in ascending global order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from distflow_lab.core.config import Balance
from distflow_lab.dataplane.partition import (
    DEFAULT_WORKLOAD,
    Coeffs,
    balanced_lpt,
    group_partition,
    karmarkar_karp,
    workload_cost,
)

if TYPE_CHECKING:  # the DataBuffer and the coordinator import this module and must stay free of torch
    from distflow_lab.core.batch import Batch


@dataclass(frozen=True)
class Routing:
    """How items are balanced where the layout changes: the policy, the workload
    cost (a, b) of the model when known, and the optimizer's mini-batch count."""

    policy: Balance = Balance.LPT
    cost: tuple[float, float] | None = None
    minibatches: int = 1

    def kwargs(self) -> dict:
        return {"cost": self.cost, "minibatches": self.minibatches}


def item_lengths(batch: "Batch") -> np.ndarray:
    """Tokens per item — the load the balancer equalizes. Uses `attention_mask`
    when present, then a `seq_len` tensor, then one per item."""
    if "attention_mask" in batch.tensors:
        return batch.tensors["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    if "seq_len" in batch.tensors:
        return batch.tensors["seq_len"].numpy().astype(np.int64)
    return np.ones(len(batch), dtype=np.int64)


def item_groups(batch: "Batch") -> np.ndarray | None:
    """Group id per item for `Balance.GROUP`: the `uid` column (the prompt each
    response came from), or None when the batch has none (every row its own group)."""
    if "uid" in batch.objects:
        return np.asarray(batch.objects["uid"])
    if "uid" in batch.tensors:
        return batch.tensors["uid"].numpy()
    return None


def assign(
    lengths: np.ndarray,
    consumers: int,
    policy: Balance | str,
    *,
    groups: Sequence[Any] | np.ndarray | None = None,
    cost: Coeffs | None = None,
    minibatches: int = 1,
) -> list[np.ndarray]:
    """Partition item indices [0, N) over `consumers` ranks; each part sorted ascending.

    lpt and kk balance tokens; workload, group and minibatch balance the compute
    estimate a·L + b·L² with `cost` = (a, b) (`partition.workload_coeffs` of the
    model config; None: verl's constants). `groups` (one id per item) is used by
    group, `minibatches` by minibatch; a policy ignores the arguments it does
    not use, so a data plane may always pass all of them.

    Equal counts per rank (Algorithm 1's constraint) when the rank count divides
    N; otherwise (a stage filtered rows) counts differ by at most one. `group`
    keeps whole groups instead: equal counts need equal group sizes and a group
    count the ranks divide.
    """
    policy = Balance(policy)
    n = len(lengths)
    if minibatches < 1:
        raise ValueError(f"minibatches must be >= 1, got {minibatches}")
    if policy == Balance.IDENTITY:
        raise ValueError("identity routing needs the producers' row counts: use identity(counts)")
    if policy == Balance.NONE:  # contiguous chunks; sizes differ by at most one when n % consumers != 0
        return [p.astype(np.int64) for p in np.array_split(np.arange(n), consumers)]
    if policy == Balance.KK:
        return _kk(np.asarray(lengths), consumers)
    if policy == Balance.LPT:
        return balanced_lpt(lengths, consumers)
    costs = workload_cost(lengths, DEFAULT_WORKLOAD if cost is None else cost)
    if policy == Balance.GROUP:
        return group_partition(costs, np.arange(n) if groups is None else groups, consumers)
    if policy == Balance.MINIBATCH:
        return _per_minibatch(costs, consumers, minibatches)
    return balanced_lpt(costs, consumers)  # WORKLOAD


def _kk(lengths: np.ndarray, consumers: int) -> list[np.ndarray]:
    """Karmarkar-Karp needs N % K == 0: zero-length placeholders pad N, then are
    dropped. They share the lowest band of K items, one per rank, so counts
    differ by at most one."""
    n, pad = len(lengths), (-len(lengths)) % consumers
    padded = np.concatenate([lengths, np.zeros(pad, dtype=lengths.dtype)]) if pad else lengths
    parts = [np.asarray(p, dtype=np.int64) for p in karmarkar_karp(padded, consumers)]
    return [np.sort(p[p < n]) for p in parts]


def _per_minibatch(costs: np.ndarray, consumers: int, minibatches: int) -> list[np.ndarray]:
    """Mini-batch c is the c-th of `minibatches` consecutive slices of the global
    order (the optimizer's mini-batches); each is balanced over the ranks on its
    own, so every rank holds one balanced part per mini-batch, in order. When a
    slice does not divide by the ranks, the ranks taking an extra item rotate,
    keeping the totals within one."""
    parts: list[list[np.ndarray]] = [[] for _ in range(consumers)]
    cursor = 0  # next rank due an extra item
    for chunk in np.array_split(np.arange(len(costs)), minibatches):
        extra = len(chunk) % consumers  # balanced_lpt gives them to its last ranks: rotate onto the cursor
        shift = (cursor + extra) % consumers
        for r, local in enumerate(balanced_lpt(costs[chunk], consumers)):
            parts[(r + shift) % consumers].append(chunk[local])
        cursor = (cursor + extra) % consumers
    # slices ascend and each piece ascends: every part is in ascending global order
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]


def identity(counts: list[int]) -> list[np.ndarray]:
    """Same layout through the buffer (local cache off): every rank gets its own rows back."""
    offsets = np.cumsum([0, *counts])
    return [np.arange(offsets[i], offsets[i + 1], dtype=np.int64) for i in range(len(counts))]


def pieces_for_producer(assignment: list[np.ndarray], offset: int, count: int) -> list[np.ndarray]:
    """For the producer owning global items [offset, offset+count): the local row
    indices destined to each consumer, in ascending order."""
    out = []
    for idx in assignment:
        lo, hi = np.searchsorted(idx, [offset, offset + count])
        out.append(idx[lo:hi] - offset)
    return out


def route(
    lengths_by_producer: list[np.ndarray],
    consumers: int,
    policy: Balance | str,
    *,
    groups_by_producer: Sequence[np.ndarray | None] | None = None,
    cost: Coeffs | None = None,
    minibatches: int = 1,
) -> list[list[np.ndarray]]:
    """For every producer (in dp-rank order): the local row indices each consumer gets,
    ascending. `policy` identity sends every producer's rows back to the same rank.

    `groups_by_producer` holds each producer's `item_groups` (None: its rows are
    groups of one); `cost` and `minibatches` are passed to `assign`.
    """
    counts = [len(x) for x in lengths_by_producer]
    if Balance(policy) == Balance.IDENTITY:
        assignment = identity(counts)
    else:
        lengths = np.concatenate(lengths_by_producer) if counts else np.zeros(0, np.int64)
        assignment = assign(lengths, consumers, policy, groups=_global_groups(groups_by_producer, counts),
                            cost=cost, minibatches=minibatches)
    offsets = np.cumsum([0, *counts])
    return [pieces_for_producer(assignment, int(offsets[p]), counts[p]) for p in range(len(counts))]


def _global_groups(groups_by_producer: Sequence[np.ndarray | None] | None, counts: list[int]) -> np.ndarray | None:
    """One group id per global item; a producer without ids gives each row its own
    ("row", global index), which no uid can equal."""
    if groups_by_producer is None or all(g is None for g in groups_by_producer):
        return None
    if len(groups_by_producer) != len(counts):
        raise ValueError(f"{len(groups_by_producer)} group arrays for {len(counts)} producers")
    out = np.empty(sum(counts), dtype=object)
    offset = 0
    for g, c in zip(groups_by_producer, counts):
        if g is None:
            out[offset:offset + c] = [("row", offset + i) for i in range(c)]
        elif len(g) != c:
            raise ValueError(f"a producer sent {len(g)} group ids for {c} rows")
        else:
            out[offset:offset + c] = np.asarray(g, dtype=object)
        offset += c
    return out
