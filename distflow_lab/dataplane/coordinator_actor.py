"""The metadata coordinator (the siiRL `DataCoordinator` / verl TransferQueue
design): one Ray actor per session that holds, per (batch, edge), each
producer's item lengths and the object reference of its output, balances the
items over the consumers, and tells each consumer which rows of which
producer object are its own. Payloads never pass through it:

1. every producer (tensor-parallel rank 0 of its group) `ray.put`s its output
   once, in its own node's object store — one object per `rows_per_object`
   rows (1: per sample, as siiRL; 0: the whole output) — and `publish`es the
   item lengths with the references;
2. when all producers have published, the coordinator routes the items
   (`routing.route`: the same balancing as every other mode) — one
   computation in one place, instead of one per buffer;
3. each consumer asks `get_meta` for its (reference, row indices) list and
   reads the rows straight from the producers' objects (only the objects that
   hold its rows: a consumer on another node pulls no row it does not use
   when objects hold one row each).

Per batch: producers + consumers calls to one actor, against the DataBuffers'
producers x buffers reports + producers plans + producers x nodes pieces +
consumers fetches. Every item is counted in and out (`ledger`).
"""
from __future__ import annotations

import asyncio
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from distflow_lab.dataplane.routing import Routing, route
from distflow_lab.dataplane.batch_state import BatchState


class CoordinatorError(RuntimeError):
    """A routing that cannot complete; names the batch, edge and missing producers."""


class CoordinatorRestarted(CoordinatorError):
    """The coordinator was killed and restarted by Ray: the batch in flight lost its metadata."""


@dataclass
class _Edge:
    lengths: dict[int, np.ndarray] = field(default_factory=dict)
    groups: dict[int, np.ndarray | None] = field(default_factory=dict)
    refs: dict[int, list] = field(default_factory=dict)  # producer -> its objects, each `chunk` rows
    chunk: dict[int, int] = field(default_factory=dict)
    rows: dict[int, list[np.ndarray]] = field(default_factory=dict)  # producer -> rows per consumer
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@ray.remote(num_cpus=0, max_concurrency=1000)
class Coordinator:
    def __init__(self, double_buffer: bool = True, wait_timeout_s: float = 120.0) -> None:
        self.wait_timeout_s = wait_timeout_s
        self.batches = BatchState(double_buffer, _Edge, "the coordinator", "metadata", CoordinatorError,
                               CoordinatorRestarted)
        self.calls = 0  # metadata calls served (publish + get_meta), for the benchmarks
        self.meta_bytes = 0  # bytes of lengths and row indices in and out: metadata only, never a payload
        self.busy_s = 0.0  # seconds spent handling calls (routing included, waiting excluded)
        gc.collect()
        gc.freeze()  # short GC pauses on the event loop

    # ---- protocol -------------------------------------------------------------------
    async def publish(self, batch_id: int, edge: str, producer: int, lengths: np.ndarray, refs: list, chunk: int,
                      n_producers: int, n_consumers: int, routing: Routing, groups: np.ndarray | None = None) -> None:
        """A producer's item lengths and the references of its output: object i holds its
        rows [i*chunk, (i+1)*chunk) (refs stay refs: Ray does not resolve refs nested in a list)."""
        self.calls += 1
        t0 = time.perf_counter()
        e = self.batches.entry(batch_id, edge)
        if producer in e.lengths:
            raise CoordinatorError(f"batch {batch_id} edge {edge}: producer {producer} published twice")
        e.lengths[producer], e.refs[producer], e.groups[producer] = np.asarray(lengths), list(refs), groups
        e.chunk[producer] = max(1, chunk)
        self.meta_bytes += e.lengths[producer].nbytes
        c = self.batches.count(batch_id, edge)
        c.items_reported += len(lengths)
        c.items_in += len(lengths)
        c.pieces_in += 1
        if len(e.lengths) == n_producers:
            rows = route([e.lengths[p] for p in range(n_producers)], n_consumers, routing.policy,
                         groups_by_producer=[e.groups[p] for p in range(n_producers)], **routing.kwargs())
            e.rows = dict(enumerate(rows))
            e.ready.set()
        self.busy_s += time.perf_counter() - t0

    async def get_meta(self, batch_id: int, edge: str, consumer: int, count_as_out: bool) -> list[tuple[Any, np.ndarray]]:
        """(object ref, row indices in it) for every object holding rows of `consumer`, in
        producer then row order: reading them in this order gives its rows in global order."""
        self.calls += 1
        e = self.batches.entry(batch_id, edge)
        try:
            await asyncio.wait_for(e.ready.wait(), self.wait_timeout_s)
        except asyncio.TimeoutError:
            raise CoordinatorError(f"coordinator: timed out after {self.wait_timeout_s:.0f}s waiting for producers "
                                   f"on batch {batch_id} edge {edge} (have {sorted(e.lengths)})") from None
        if batch_id in self.batches.aborted:
            raise CoordinatorError(f"batch {batch_id} was aborted while waiting on edge {edge}: {self.batches.aborted[batch_id]}")
        t0 = time.perf_counter()
        got = [piece for p in sorted(e.rows) for piece in _by_object(e.refs[p], e.chunk[p], e.rows[p][consumer])]
        self.meta_bytes += sum(rows.nbytes for _, rows in got)
        if count_as_out:
            c = self.batches.count(batch_id, edge)
            c.pieces_out += len(got)
            c.items_out += sum(len(rows) for _, rows in got)
        self.busy_s += time.perf_counter() - t0
        return got

    # ---- batch lifecycle ---------------------------------------------------------------
    async def end_batch(self, batch_id: int) -> tuple[float, list[dict]]:
        return self.batches.end(batch_id)

    async def reset_batch(self, batch_id: int) -> list[dict]:
        return self.batches.reset(batch_id)

    async def abort(self, batch_id: int, reason: str) -> None:
        for e in self.batches.abort(batch_id, reason):
            e.ready.set()

    async def ledger(self) -> list[dict]:
        return self.batches.ledger()

    async def stats(self) -> dict:
        store = self.batches.store
        return {"open_batches": store.batches(), "releases": store.releases, "calls": self.calls,
                "meta_bytes": self.meta_bytes, "busy_s": self.busy_s, "double_buffer": store.enabled}

    async def drain(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.batches.store.drain)

    async def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def pid(self) -> int:  # a restart answers from a new process (faults.kill_and_wait)
        return os.getpid()


def _by_object(refs: list, chunk: int, rows: np.ndarray) -> list[tuple[Any, np.ndarray]]:
    """A producer's rows (ascending) split by the object holding them: (ref, rows in it)."""
    if not len(rows):
        return []
    obj = rows // chunk
    cut = np.flatnonzero(np.diff(obj)) + 1
    return [(refs[int(o[0])], r - int(o[0]) * chunk) for o, r in zip(np.split(obj, cut), np.split(rows, cut))]
