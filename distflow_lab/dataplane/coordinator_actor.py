"""The metadata coordinator (the siiRL `DataCoordinator` / verl TransferQueue
design): one Ray actor per session that holds, per (step, edge), each
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

Per step: producers + consumers calls to one actor, against the DataBuffers'
producers x buffers reports + producers plans + producers x nodes pieces +
consumers fetches. Every item is counted in and out (`ledger`).
"""
from __future__ import annotations

import asyncio
import gc
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from distflow_lab.dataplane.double_buffer import DoubleBuffer
from distflow_lab.dataplane.interface import Routing
from distflow_lab.dataplane.routing import route


class CoordinatorError(RuntimeError):
    """A routing that cannot complete; names the step, edge and missing producers."""


class CoordinatorRestarted(CoordinatorError):
    """The coordinator was killed and restarted by Ray: the step in flight lost its metadata."""


@dataclass
class _Edge:
    lengths: dict[int, np.ndarray] = field(default_factory=dict)
    groups: dict[int, np.ndarray | None] = field(default_factory=dict)
    refs: dict[int, list] = field(default_factory=dict)  # producer -> its objects, each `chunk` rows
    chunk: dict[int, int] = field(default_factory=dict)
    rows: dict[int, list[np.ndarray]] = field(default_factory=dict)  # producer -> rows per consumer
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Count:
    step: int
    edge: str
    items_reported: int = 0
    items_in: int = 0
    items_out: int = 0
    pieces_in: int = 0
    pieces_out: int = 0


@ray.remote(num_cpus=0, max_concurrency=1000)
class Coordinator:
    def __init__(self, double_buffer: bool = True, wait_timeout_s: float = 120.0) -> None:
        self.wait_timeout_s = wait_timeout_s
        self._store = DoubleBuffer(double_buffer)
        self._counts: dict[tuple[int, str], _Count] = {}
        self._done: deque[_Count] = deque(maxlen=10_000)
        self._aborted: dict[int, str] = {}
        self.calls = 0  # metadata calls served (publish + get_meta), for the benchmarks
        self.meta_bytes = 0  # bytes of lengths and row indices in and out: metadata only, never a payload
        self.busy_s = 0.0  # seconds spent handling calls (routing included, waiting excluded)
        with warnings.catch_warnings():  # Ray 2.60 warns about an attribute it uses inside this property
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        # A restarted coordinator lost its state: refuse the steps in flight until the driver resets them.
        self._accept_from = float("inf") if restarted else float("-inf")
        gc.collect()
        gc.freeze()  # short GC pauses on the event loop

    def _edge(self, step: int, edge: str) -> _Edge:
        if step < self._accept_from:
            raise CoordinatorRestarted(f"the coordinator was restarted: the metadata of step {step} edge {edge} is lost")
        if step in self._aborted:
            raise CoordinatorError(f"step {step} was aborted: {self._aborted[step]}")
        store = self._store.store(step)
        e = store.get(edge)
        if e is None:
            e = store[edge] = _Edge()
        return e

    def _count(self, step: int, edge: str) -> _Count:
        c = self._counts.get((step, edge))
        if c is None:
            c = self._counts[(step, edge)] = _Count(step, edge)
        return c

    def _pop_counts(self, closed: Callable[[int], bool], suffix: str = "") -> list[dict]:
        rows = []
        for key in [k for k in self._counts if closed(k[0])]:
            c = self._counts.pop(key)
            c.edge += suffix
            self._done.append(c)
            rows.append({**c.__dict__, "buffer": -1})
        return rows

    # ---- protocol -------------------------------------------------------------------
    async def publish(self, step: int, edge: str, producer: int, lengths: np.ndarray, refs: list, chunk: int,
                      n_producers: int, n_consumers: int, routing: Routing, groups: np.ndarray | None = None) -> None:
        """A producer's item lengths and the references of its output: object i holds its
        rows [i*chunk, (i+1)*chunk) (refs stay refs: Ray does not resolve refs nested in a list)."""
        self.calls += 1
        t0 = time.perf_counter()
        e = self._edge(step, edge)
        if producer in e.lengths:
            raise CoordinatorError(f"step {step} edge {edge}: producer {producer} published twice")
        e.lengths[producer], e.refs[producer], e.groups[producer] = np.asarray(lengths), list(refs), groups
        e.chunk[producer] = max(1, chunk)
        self.meta_bytes += e.lengths[producer].nbytes
        c = self._count(step, edge)
        c.items_reported += len(lengths)
        c.items_in += len(lengths)
        c.pieces_in += 1
        if len(e.lengths) == n_producers:
            rows = route([e.lengths[p] for p in range(n_producers)], n_consumers, routing.policy,
                         groups_by_producer=[e.groups[p] for p in range(n_producers)], **routing.kwargs())
            e.rows = dict(enumerate(rows))
            e.ready.set()
        self.busy_s += time.perf_counter() - t0

    async def get_meta(self, step: int, edge: str, consumer: int, count_as_out: bool) -> list[tuple[Any, np.ndarray]]:
        """(object ref, row indices in it) for every object holding rows of `consumer`, in
        producer then row order: reading them in this order gives its rows in global order."""
        self.calls += 1
        e = self._edge(step, edge)
        try:
            await asyncio.wait_for(e.ready.wait(), self.wait_timeout_s)
        except asyncio.TimeoutError:
            raise CoordinatorError(f"coordinator: timed out after {self.wait_timeout_s:.0f}s waiting for producers "
                                   f"on step {step} edge {edge} (have {sorted(e.lengths)})") from None
        if step in self._aborted:
            raise CoordinatorError(f"step {step} was aborted while waiting on edge {edge}: {self._aborted[step]}")
        t0 = time.perf_counter()
        got = [piece for p in sorted(e.rows) for piece in _by_object(e.refs[p], e.chunk[p], e.rows[p][consumer])]
        self.meta_bytes += sum(rows.nbytes for _, rows in got)
        if count_as_out:
            c = self._count(step, edge)
            c.pieces_out += len(got)
            c.items_out += sum(len(rows) for _, rows in got)
        self.busy_s += time.perf_counter() - t0
        return got

    # ---- step lifecycle ---------------------------------------------------------------
    async def end_step(self, step: int) -> tuple[float, list[dict]]:
        counts = self._pop_counts(lambda s: s <= step)
        return self._store.release(step), counts

    async def reset_step(self, step: int) -> list[dict]:
        aborted = self._pop_counts(lambda s: s == step, " (aborted attempt)")
        self._aborted.pop(step, None)
        self._accept_from = min(self._accept_from, step)
        self._store.release(step)
        return aborted

    async def abort(self, step: int, reason: str) -> None:
        self._aborted[step] = reason
        for e in self._store.store(step).values():
            e.ready.set()

    async def stats(self) -> dict:
        return {"open_steps": self._store.steps(), "releases": self._store.releases, "calls": self.calls,
                "meta_bytes": self.meta_bytes, "busy_s": self.busy_s, "double_buffer": self._store.enabled}

    async def drain(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._store.drain)

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
