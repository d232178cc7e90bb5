"""Load balancing for the DataBuffer (paper §6.4, Algorithm 1).

The DataBuffer splits a batch of N sequences over K data-parallel workers.
Every worker must get exactly N/K items (collectives need equal counts), and
the slowest worker sets the step time, so we want the largest per-worker token
load to be small. The "load" of an item is its length in tokens.

Three partitioners, all returning K lists of item indices, each sorted
ascending (callers rely on that order to keep rows in their original order):

- `constrained_lpt`: Algorithm 1 of the paper (greedy, O(N log K)).
- `karmarkar_karp`: largest differencing method with equal sizes (as verl).
- `contiguous_split`: no balancing, the baseline.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Lengths = Sequence[float] | np.ndarray


def _as_array(lengths: Lengths) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind in "ub":  # unsigned/bool would wrap under negation
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "if":
        arr = arr.astype(np.float64)
    return arr


def _check_equal_split(n: int, k: int) -> int:
    if k < 1:
        raise ValueError(f"need at least one worker, got K={k}")
    if n % k != 0:
        raise ValueError(f"N={n} items cannot be split equally over K={k} workers (N % K = {n % k})")
    return n // k


def _rows_by_owner(owner: np.ndarray, order: np.ndarray, k: int, per: int) -> list[list[int]]:
    """Group item indices by owning worker; each row sorted ascending."""
    # owner[i] is the worker of item order[i]; every worker owns exactly `per` items.
    by_worker = order[np.argsort(owner, kind="stable")].reshape(k, per)
    return np.sort(by_worker, axis=1).tolist()


def _integral(arr: np.ndarray) -> bool:
    """True when float loads are exact integers, so integer heap keys are exact too."""
    if arr.dtype.kind == "i":
        return True
    return bool(np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr)) and np.abs(arr).max() < 2**53)


def constrained_lpt(lengths: Lengths, k: int) -> list[list[int]]:
    """Constrained LPT (paper Algorithm 1): K partitions of exactly N/K items.

    Items are visited longest first (stable sort: ties keep index order); each
    goes to the least-loaded worker that still has room, ties broken by the
    lower worker id (the heap orders (load, k) pairs).

    Algorithm 1 pops full workers, sets them aside and pushes them back. A full
    worker can never accept again, so we drop it from the heap for good: same
    result, and the loop is one C-implemented heap call per item.

    Returns K lists of item indices, each sorted ascending. N == 0 gives K
    empty lists. Raises ValueError unless N % K == 0.
    """
    arr = _as_array(lengths)
    n = len(arr)
    per = _check_equal_split(n, k)
    if n == 0:
        return [[] for _ in range(k)]
    order = np.argsort(-arr, kind="stable")
    owner = [0] * n
    counts = [0] * k
    if _integral(arr):
        # Key load*K + k orders exactly like the tuple (load, k), and int
        # comparisons are much cheaper than tuple ones in the heap.
        ordered = arr[order]
        if arr.dtype.kind == "i" and int(np.abs(ordered).max()) * k < 2**62:
            steps = (ordered.astype(np.int64) * k).tolist()
        else:  # Python ints: exact for floats and never overflow
            steps = [int(x) * k for x in ordered.tolist()]
        heap = list(range(k))  # loads 0: key == worker id; sorted, so a heap
        for i, step in enumerate(steps):
            key = heap[0]
            w = key % k
            owner[i] = w
            counts[w] += 1
            if counts[w] == per:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, key + step)
    else:
        heap_t = [(0.0, w) for w in range(k)]
        for i, s in enumerate(arr[order].tolist()):
            load, w = heap_t[0]
            owner[i] = w
            counts[w] += 1
            if counts[w] == per:
                heapq.heappop(heap_t)
            else:
                heapq.heapreplace(heap_t, (load + s, w))
    return _rows_by_owner(np.asarray(owner), order, k, per)


def karmarkar_karp(lengths: Lengths, k: int, equal_size: bool = True) -> list[list[int]]:
    """Largest differencing method (Karmarkar-Karp) for K-way partitioning.

    With equal_size, items are sorted ascending and cut into groups of K
    consecutive items; each group is a starting state with one item per set,
    so every final set has N/K items. Then the two states with the largest
    spread (max set sum - min set sum) are merged, pairing the largest set of
    one with the smallest set of the other, until one state is left.

    Returns K lists of item indices, each sorted ascending.
    """
    arr = _as_array(lengths)
    n = len(arr)
    if k < 1:
        raise ValueError(f"need at least one worker, got K={k}")
    if equal_size:
        _check_equal_split(n, k)
    if n == 0:
        return [[] for _ in range(k)]
    values = arr.tolist()
    order = np.argsort(arr, kind="stable").tolist()
    groups = [order[i:i + k] for i in range(0, n, k)] if equal_size else [[i] for i in order]

    tiebreak = itertools.count()
    heap: list = []

    def push(sums: list, sets: list[list[int]]) -> None:
        # Sets are kept sorted by sum, descending. Heap pops the largest
        # spread first, then the largest top set, then the oldest state.
        heapq.heappush(heap, (sums[-1] - sums[0], -sums[0], next(tiebreak), sums, sets))

    for group in groups:
        sets = [[i] for i in reversed(group)] + [[] for _ in range(k - len(group))]
        push([values[s[0]] if s else 0 for s in sets], sets)

    while len(heap) > 1:
        _, _, _, sums_a, sets_a = heapq.heappop(heap)
        _, _, _, sums_b, sets_b = heapq.heappop(heap)
        merged_sums, merged_sets = [], []
        for j in range(k):
            a, b = sets_a[j], sets_b[k - 1 - j]  # largest of a with smallest of b
            if len(a) < len(b):  # extend the longer list: O(N log N) copying overall
                a, b = b, a
            a.extend(b)
            merged_sets.append(a)
            merged_sums.append(sums_a[j] + sums_b[k - 1 - j])
        rank = sorted(range(k), key=merged_sums.__getitem__, reverse=True)
        push([merged_sums[j] for j in rank], [merged_sets[j] for j in rank])

    sets = heap[0][4]
    return [sorted(s) for s in sets]


def contiguous_split(n: int, k: int) -> list[list[int]]:
    """No balancing: chunk c gets rows [c*n/k, (c+1)*n/k). Requires n % k == 0."""
    per = _check_equal_split(n, k)
    return [list(range(c * per, (c + 1) * per)) for c in range(k)]


@dataclass
class LoadStats:
    """Per-worker token loads of one partition and how far from ideal it is.

    lower_bound = max(mean, longest item): no partition can beat it.
    ratio = max_load / lower_bound (1.0 is provably optimal);
    imbalance = max_load / mean (what the slowest worker costs vs. perfect).
    """

    loads: list[float]
    max_load: float
    mean_load: float
    lower_bound: float
    ratio: float
    imbalance: float
    counts: list[int]

    def __repr__(self) -> str:
        counts = f"{self.counts[0]} each" if len(set(self.counts)) == 1 else str(self.counts)
        return (f"LoadStats(k={len(self.loads)}, max={self.max_load:g}, mean={self.mean_load:g}, "
                f"lower_bound={self.lower_bound:g}, ratio={self.ratio:.4f}, "
                f"imbalance={self.imbalance:.4f}, counts={counts})")

    def _repr_html_(self) -> str:
        rows = [("workers", len(self.loads)), ("max load", f"{self.max_load:g}"),
                ("mean load", f"{self.mean_load:g}"), ("lower bound", f"{self.lower_bound:g}"),
                ("ratio (max / lower bound)", f"{self.ratio:.4f}"),
                ("imbalance (max / mean)", f"{self.imbalance:.4f}"),
                ("items per worker", f"{min(self.counts, default=0)}-{max(self.counts, default=0)}")]
        body = "".join(f"<tr><th style='text-align:left'>{name}</th><td>{value}</td></tr>" for name, value in rows)
        return f"<table><caption>LoadStats</caption>{body}</table>"


def load_stats(lengths: Lengths, partitions: Sequence[Sequence[int]]) -> LoadStats:
    """Token load per partition plus max, mean, lower bound and ratios."""
    arr = _as_array(lengths)
    loads = [arr[np.asarray(p, dtype=np.int64)].sum().item() if len(p) else 0 for p in partitions]
    k = len(partitions)
    max_load = max(loads, default=0)
    mean_load = float(arr.sum()) / k if k else 0.0
    lower_bound = max(mean_load, arr.max().item() if len(arr) else 0)
    return LoadStats(
        loads=loads,
        max_load=max_load,
        mean_load=mean_load,
        lower_bound=lower_bound,
        ratio=max_load / lower_bound if lower_bound else 1.0,
        imbalance=max_load / mean_load if mean_load else 1.0,
        counts=[len(p) for p in partitions],
    )


def validate_partition(partitions: Sequence[Sequence[int]], n: int, k: int) -> None:
    """Raise ValueError unless `partitions` splits range(n) into k equal-count parts."""
    if len(partitions) != k:
        raise ValueError(f"expected {k} partitions, got {len(partitions)}")
    parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in partitions]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    bad = flat[(flat < 0) | (flat >= n)]
    if len(bad):
        raise ValueError(f"index {bad[0].item()} out of range [0, {n})")
    seen = np.bincount(flat, minlength=n)
    if (seen > 1).any():
        raise ValueError(f"indices appear more than once: {np.flatnonzero(seen > 1)[:10].tolist()}")
    if (seen == 0).any():
        raise ValueError(f"indices missing: {np.flatnonzero(seen == 0)[:10].tolist()}")
    per = _check_equal_split(n, k)
    for w, part in enumerate(parts):
        if len(part) != per:
            raise ValueError(f"partition {w} has {len(part)} items, expected {per} (N={n}, K={k})")
