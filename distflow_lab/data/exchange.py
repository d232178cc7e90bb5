"""The worker's side of the DataBuffer protocol (see buffer.py for the steps):
publish a stage's output for redistribution, fetch this rank's new shard.

A DataBuffer that dies mid-protocol surfaces as `BufferLost`, naming the step,
the edge and the buffer, so the driver can retry the step or report it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from ..errors import BufferLost
from ..planner import Edge, Stage
from ..telemetry import SpanRecorder
from .batch import Batch
from .buffer import BufferRestarted
from .routing import item_lengths


class BufferClient:
    def __init__(self, buffers: list, buffer_of_worker: list[int], rank: int, rec: SpanRecorder) -> None:
        self.buffers, self.buffer_of_worker, self.rank, self.rec = buffers, buffer_of_worker, rank, rec
        self.last_note = None  # the latest note_progress call, awaited before a planned exit

    def _buffer_of(self, worker: int):
        return self.buffers[self.buffer_of_worker[worker]]

    @contextmanager
    def _guard(self, step: int, edge: Edge, stage: Stage):
        try:
            yield
        except (RayActorError, RayTaskError) as e:  # died, restarting, or restarted without the step's data
            if isinstance(e, RayTaskError) and not isinstance(getattr(e, "cause", None), BufferRestarted):
                raise
            raise BufferLost(f"a DataBuffer died during step {step} on edge {edge.name} (stage {stage.id!r}, "
                             f"worker {self.rank}): {type(e).__name__}", step=step, stage=stage.id,
                             worker=self.rank) from None

    def note_progress(self, step: int, stage: str) -> None:
        if self.buffers:  # fire and forget: never on the critical path
            self.last_note = self._buffer_of(self.rank).note_progress.remote(self.rank, step, stage,
                                                                             time.monotonic_ns())

    def flush_progress(self) -> None:
        """Make sure the last progress note arrived (before a planned exit)."""
        if self.last_note is not None:
            ray.get(self.last_note, timeout=5)

    def publish(self, step: int, edge: Edge, st: Stage, consumer: Stage, out: Batch, policy: str) -> None:
        """Report lengths, get the routing plan, put one object per destination node."""
        me, mine = st.dp_rank(self.rank), self._buffer_of(self.rank)
        with self._guard(step, edge, st), self.rec.span(step, st.id, "plan", items=len(out)):
            lengths = item_lengths(out)
            calls = [b.report.remote(step, edge.name, me, lengths, st.dp, consumer.dp, policy, b is mine)
                     for b in self.buffers]
            pieces = ray.get(mine.plan.remote(step, edge.name, me))
            ray.get(calls)
        with self._guard(step, edge, st), self.rec.span(step, st.id, "put", items=len(out)) as sp:
            acks = []
            for b, consumers in self._consumers_by_buffer(consumer).items():
                rows = [pieces[c] for c in consumers]
                bounds = np.cumsum([0, *map(len, rows)])
                piece = out.select(np.concatenate(rows))  # one gather, one put per destination node
                sp.bytes += piece.nbytes
                slices = {c: (int(bounds[i]), int(bounds[i + 1])) for i, c in enumerate(consumers)}
                acks.append(self.buffers[b].add_piece.remote(step, edge.name, me, [ray.put(piece)], slices, st.dp))
            ray.get(acks)

    def _consumers_by_buffer(self, consumer: Stage) -> dict[int, list[int]]:
        """Consumer dp ranks grouped by the buffer of their node (group rank 0's worker)."""
        out: dict[int, list[int]] = {}
        for c in range(consumer.dp):
            out.setdefault(self.buffer_of_worker[c * consumer.group_size], []).append(c)
        return out

    def fetch(self, step: int, edge: Edge, producer: Stage, st: Stage) -> Batch:
        """This rank's rows from every producer, in global order."""
        me = st.dp_rank(self.rank)
        with self._guard(step, edge, st), self.rec.span(step, st.id, "wait"):
            pieces = ray.get(self._buffer_of(self.rank).get_pieces.remote(
                step, edge.name, me, producer.dp, st.group_rank(self.rank) == 0))
        with self.rec.span(step, st.id, "get", cache_hit=False) as sp:
            objs = ray.get([ref for ref, _, _ in pieces])
            batch = Batch.concat([o.select(slice(a, b)) for o, (_, a, b) in zip(objs, pieces)])
            sp.items, sp.bytes = len(batch), batch.nbytes
        return batch
