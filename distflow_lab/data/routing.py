"""Where each item goes when a batch changes data-parallel layout.

Both controllers use these functions, so distributed and centralized modes
route the same rows to the same ranks. The global order of items is producer
dp rank order (rank 0's rows, then rank 1's, ...); each consumer receives its
items in ascending global order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from .balance import constrained_lpt, karmarkar_karp

if TYPE_CHECKING:  # the DataBuffer imports this module and must stay free of torch
    from .batch import Batch

BalancePolicy = Literal["lpt", "kk", "none"]


def item_lengths(batch: "Batch") -> np.ndarray:
    """Tokens per item — the load the balancer equalizes. Uses `attention_mask`
    when present, then a `seq_len` tensor, then one per item."""
    if "attention_mask" in batch.tensors:
        return batch.tensors["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    if "seq_len" in batch.tensors:
        return batch.tensors["seq_len"].numpy().astype(np.int64)
    return np.ones(len(batch), dtype=np.int64)


def assign(lengths: np.ndarray, consumers: int, policy: BalancePolicy) -> list[np.ndarray]:
    """Partition item indices [0, N) over `consumers` ranks; each part sorted ascending.

    Equal counts per rank (Algorithm 1's constraint). When N is not a multiple of
    the rank count (a stage filtered rows), zero-length placeholders pad it to
    one and are dropped afterwards: counts then differ by at most one.
    """
    n = len(lengths)
    if policy == "none":  # contiguous chunks; sizes differ by at most one when n % consumers != 0
        return [p.astype(np.int64) for p in np.array_split(np.arange(n), consumers)]
    pad = (-n) % consumers
    if pad:
        padded = np.concatenate([np.asarray(lengths), np.zeros(pad, dtype=np.asarray(lengths).dtype)])
        return [p[p < n] for p in assign(padded, consumers, policy)]
    if policy == "lpt":
        parts = constrained_lpt(lengths, consumers)
    elif policy == "kk":
        parts = karmarkar_karp(lengths, consumers)
    else:
        raise ValueError(f"unknown balance policy {policy!r}; use 'lpt', 'kk' or 'none'")
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
