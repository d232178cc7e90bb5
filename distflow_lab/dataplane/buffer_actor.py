"""DataBuffer (paper §6.2): one Ray actor per node, keyed by (batch, edge).

It redistributes a batch between stages whose data-parallel sizes differ, and
moves only metadata and object references itself — payloads go straight from
the producer's object store to the consumer:

1. every producer (tensor-parallel rank 0 of its group only) reports the
   token length of each of its items to every buffer (`report`; to its own
   buffer with `report_and_plan`, which also does batch 2 in the same call);
2. `plan` waits for all producers' lengths, balances items over the consumers
   (constrained LPT by default) and tells each producer which of its rows go
   to which consumer;
3. the producer `ray.put`s one object per destination node (the rows of all
   that node's consumers, grouped by consumer) and registers it with that
   node's buffer (`add_piece`) — so a node pulls exactly the rows its workers
   need, once, and a producer makes one put per node, not one per consumer;
4. the consumer gets its (reference, rows) from every producer (`get_pieces`),
   reads its rows of each object (a contiguous zero-copy view on its node)
   and concatenates them.

When every consumer of the edge sits on one node, there is nothing to split
by node: the producer skips batches 1–3 and puts its whole output at once
(`add_whole`, one call, no wait for the other producers); the buffer plans
when the last producer is in, and each consumer reads its rows (by index) of
every producer's object. Same rows, same order, one round trip less.

Every item is counted in (reported, pieces added) and out (pieces fetched by
group rank 0): `ledger()` shows nothing lost and nothing duplicated.
"""
from __future__ import annotations

import asyncio
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from distflow_lab.dataplane.routing import Routing, route
from distflow_lab.dataplane.batch_state import BatchState


class BufferError(RuntimeError):
    """A redistribution that cannot complete; names the batch, edge and missing parties."""


class BufferRestarted(BufferError):
    """This buffer was killed and restarted by Ray: the batch in flight lost its data here."""


@dataclass
class _Edge:
    lengths: dict[int, np.ndarray] = field(default_factory=dict)
    groups: dict[int, np.ndarray | None] = field(default_factory=dict)
    plan_ready: asyncio.Event = field(default_factory=asyncio.Event)
    pieces_for_producer: dict[int, list[np.ndarray]] = field(default_factory=dict)
    pieces: dict[int, dict[int, Any]] = field(default_factory=dict)  # consumer -> producer -> (ref, rows)
    wholes: dict[int, Any] = field(default_factory=dict)  # producer -> ref of its whole output (add_whole)
    piece_ready: dict[int, asyncio.Event] = field(default_factory=dict)


def _n_rows(rows: slice | np.ndarray) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


@ray.remote(num_cpus=0, max_concurrency=1000)
class DataBuffer:
    def __init__(self, index: int, double_buffer: bool = True, wait_timeout_s: float = 120.0) -> None:
        self.index = index
        self.wait_timeout_s = wait_timeout_s
        self.batches = BatchState(double_buffer, _Edge, f"buffer {index}", "data", BufferError, BufferRestarted)
        self.node_id = ray.get_runtime_context().get_node_id()
        gc.collect()
        gc.freeze()  # keep the event loop's GC pauses short (Ray's own objects are many)

    # ---- helpers --------------------------------------------------------------
    async def _wait(self, event: asyncio.Event, batch_id: int, what: str) -> None:
        try:
            await asyncio.wait_for(event.wait(), self.wait_timeout_s)
        except asyncio.TimeoutError:
            raise BufferError(f"buffer {self.index}: timed out after {self.wait_timeout_s:.0f}s waiting for {what}") from None
        if batch_id in self.batches.aborted:
            raise BufferError(f"batch {batch_id} was aborted while waiting for {what}: {self.batches.aborted[batch_id]}")

    # ---- protocol -------------------------------------------------------------
    async def report(self, batch_id: int, edge: str, producer: int, lengths: np.ndarray, n_producers: int,
                     n_consumers: int, routing: Routing, count: bool, groups: np.ndarray | None = None) -> None:
        """A producer's item lengths (sent to every buffer; counted only by the
        producer's own). When all producers reported, plan the routing."""
        e = self.batches.entry(batch_id, edge)
        if count:
            self.batches.count(batch_id, edge).items_reported += len(lengths)
        if producer in e.lengths:
            raise BufferError(f"batch {batch_id} edge {edge}: producer {producer} reported twice")
        e.lengths[producer], e.groups[producer] = np.asarray(lengths), groups
        if len(e.lengths) == n_producers:
            pieces = route([e.lengths[p] for p in range(n_producers)], n_consumers, routing.policy,
                           groups_by_producer=[e.groups[p] for p in range(n_producers)], **routing.kwargs())
            e.pieces_for_producer = dict(enumerate(pieces))
            e.plan_ready.set()

    async def report_and_plan(self, batch_id: int, edge: str, producer: int, lengths: np.ndarray, n_producers: int,
                              n_consumers: int, routing: Routing, groups: np.ndarray | None = None
                              ) -> list[np.ndarray]:
        """`report` to the producer's own buffer and `plan` in one round trip."""
        await self.report(batch_id, edge, producer, lengths, n_producers, n_consumers, routing, True, groups)
        return await self.plan(batch_id, edge, producer)

    async def plan(self, batch_id: int, edge: str, producer: int) -> list[np.ndarray]:
        """Rows of `producer` for each consumer (local indices, ascending). Waits for all producers."""
        e = self.batches.entry(batch_id, edge)
        await self._wait(e.plan_ready, batch_id, f"all producers' lengths on batch {batch_id} edge {edge} "
                                              f"(have producers {sorted(e.lengths)})")
        return e.pieces_for_producer[producer]

    async def add_piece(self, batch_id: int, edge: str, producer: int, ref: list, slices: dict[int, tuple[int, int]],
                        n_producers: int) -> None:
        """One object from `producer` holding the rows of every consumer on this
        node; consumer c's rows are the contiguous `slices[c]` = (start, stop)."""
        e = self.batches.entry(batch_id, edge)
        c = self.batches.count(batch_id, edge)
        c.pieces_in += 1
        for consumer, (start, stop) in slices.items():
            got = e.pieces.setdefault(consumer, {})
            if producer in got:
                raise BufferError(f"batch {batch_id} edge {edge}: producer {producer} sent consumer {consumer} rows twice")
            got[producer] = (ref[0], slice(start, stop))
            c.items_in += stop - start
            if len(got) == n_producers:
                e.piece_ready.setdefault(consumer, asyncio.Event()).set()

    async def add_whole(self, batch_id: int, edge: str, producer: int, lengths: np.ndarray, n_producers: int,
                        n_consumers: int, routing: Routing, ref: list, groups: np.ndarray | None = None) -> None:
        """Every consumer is on this node: `producer`'s whole output (`ref`) and its lengths,
        sent without waiting for a plan. The last producer in makes the plan and hands each
        consumer its rows (indices) of every producer's object."""
        await self.report(batch_id, edge, producer, lengths, n_producers, n_consumers, routing, True, groups)
        e, c = self.batches.entry(batch_id, edge), self.batches.count(batch_id, edge)
        e.wholes[producer] = ref[0]
        c.pieces_in += 1
        c.items_in += len(lengths)
        if len(e.wholes) < n_producers or not e.plan_ready.is_set():
            return
        for consumer in range(n_consumers):
            e.pieces[consumer] = {p: (e.wholes[p], e.pieces_for_producer[p][consumer]) for p in range(n_producers)}
            e.piece_ready.setdefault(consumer, asyncio.Event()).set()

    async def get_pieces(self, batch_id: int, edge: str, consumer: int, n_producers: int,
                         count_as_out: bool) -> list[tuple]:
        """(ref, rows) of the consumer's rows from each producer, in producer order; rows is a
        slice (`add_piece`) or an index array (`add_whole`)."""
        e = self.batches.entry(batch_id, edge)
        ready = e.piece_ready.setdefault(consumer, asyncio.Event())
        await self._wait(ready, batch_id, f"pieces for consumer {consumer} on batch {batch_id} edge {edge} "
                                      f"(have producers {sorted(e.pieces.get(consumer, {}))} of {n_producers})")
        got = [e.pieces[consumer][p] for p in range(n_producers)]
        if count_as_out:
            c = self.batches.count(batch_id, edge)
            c.pieces_out += len(got)
            c.items_out += sum(_n_rows(rows) for _, rows in got)
        return got

    # ---- batch lifecycle --------------------------------------------------------
    async def end_batch(self, batch_id: int) -> tuple[float, list[dict]]:
        """Release the batch's store (background with the double buffer). Returns the
        critical-path seconds and the batch's item counts (the driver keeps them: they
        survive this actor)."""
        return self.batches.end(batch_id)

    async def reset_batch(self, batch_id: int) -> list[dict]:
        """Forget an aborted attempt of `batch_id` so it can run again."""
        return self.batches.reset(batch_id)

    async def abort(self, batch_id: int, reason: str) -> None:
        """Fail every waiter of `batch_id` (a worker died or a stage raised) so nobody hangs."""
        for e in self.batches.abort(batch_id, reason):
            e.plan_ready.set()
            for ev in e.piece_ready.values():
                ev.set()

    async def ledger(self) -> list[dict]:
        return self.batches.ledger()

    async def stats(self) -> dict:
        store = self.batches.store
        return {"index": self.index, "node_id": self.node_id, "open_batches": store.batches(),
                "releases": store.releases, "double_buffer": store.enabled}

    async def drain(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.batches.store.drain)

    async def ping(self) -> str:
        return self.node_id

    async def pid(self) -> int:  # a restart answers from a new process (faults.kill_and_wait)
        return os.getpid()
