"""Where each item goes when a batch changes data-parallel layout.

Every data plane uses these functions, so all three modes route the same rows
to the same ranks (and a seed gives the same metrics in every mode). The global order of items is producer
dp rank order (rank 0's rows, then rank 1's, ...); each consumer receives its
items in ascending global order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distflow_lab.core.config import Balance
from distflow_lab.dataplane.partition import constrained_lpt, karmarkar_karp

if TYPE_CHECKING:  # the DataBuffer and the coordinator import this module and must stay free of torch
    from distflow_lab.core.batch import Batch


def item_lengths(batch: "Batch") -> np.ndarray:
    """Tokens per item — the load the balancer equalizes. Uses `attention_mask`
    when present, then a `seq_len` tensor, then one per item."""
    if "attention_mask" in batch.tensors:
        return batch.tensors["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    if "seq_len" in batch.tensors:
        return batch.tensors["seq_len"].numpy().astype(np.int64)
    return np.ones(len(batch), dtype=np.int64)


def assign(lengths: np.ndarray, consumers: int, policy: Balance | str) -> list[np.ndarray]:
    """Partition item indices [0, N) over `consumers` ranks; each part sorted ascending.

    Equal counts per rank (Algorithm 1's constraint). When N is not a multiple of
    the rank count (a stage filtered rows), zero-length placeholders pad it to
    one and are dropped afterwards: counts then differ by at most one.
    """
    policy = Balance(policy)
    n = len(lengths)
    if policy == Balance.IDENTITY:
        raise ValueError("identity routing needs the producers' row counts: use identity(counts)")
    if policy == Balance.NONE:  # contiguous chunks; sizes differ by at most one when n % consumers != 0
        return [p.astype(np.int64) for p in np.array_split(np.arange(n), consumers)]
    pad = (-n) % consumers
    if pad:
        padded = np.concatenate([np.asarray(lengths), np.zeros(pad, dtype=np.asarray(lengths).dtype)])
        return [p[p < n] for p in assign(padded, consumers, policy)]
    parts = constrained_lpt(lengths, consumers) if policy == Balance.LPT else karmarkar_karp(lengths, consumers)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


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


def route(lengths_by_producer: list[np.ndarray], consumers: int, policy: Balance | str) -> list[list[np.ndarray]]:
    """For every producer (in dp-rank order): the local row indices each consumer gets,
    ascending. `policy` identity sends every producer's rows back to the same rank."""
    counts = [len(x) for x in lengths_by_producer]
    if Balance(policy) == Balance.IDENTITY:
        assignment = identity(counts)
    else:
        assignment = assign(np.concatenate(lengths_by_producer) if counts else np.zeros(0, np.int64), consumers, policy)
    offsets = np.cumsum([0, *counts])
    return [pieces_for_producer(assignment, int(offsets[p]), counts[p]) for p in range(len(counts))]
