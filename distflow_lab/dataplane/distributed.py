"""The `distributed` data plane (DistFlow, paper §6): a local cache where the
layout stays, one DataBuffer per node where it changes, constrained-LPT
balancing by metadata, payloads straight from producer to consumer, a double
buffer for each step's state.

Driver half: places the buffers (node affinity), ends steps, collects the
ledger, resets a failed attempt. Worker half (`BufferPort`): the protocol in
buffer_actor.py, seen from a producer (`publish`) and a consumer (`fetch`).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import Balance
from distflow_lab.core.errors import BufferLost, StageError
from distflow_lab.core.spans import Span, SpanRecorder
from distflow_lab.dataplane.buffer_actor import BufferRestarted, DataBuffer
from distflow_lab.dataplane.cache import LocalCache
from distflow_lab.dataplane.interface import EndOfStep, Fetched, PlaneSetup, Routing, kill_and_wait, wait_alive
from distflow_lab.dataplane.routing import item_groups, item_lengths

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Stage


def place_buffers(worker_nodes: list[str], num_buffers: int | str, double_buffer: bool,
                  wait_timeout_s: float) -> tuple[list, list[str], list[int]]:
    """One buffer per node ("per_node"), or `num_buffers` spread over the workers'
    nodes (1 = one central buffer on the first node). Each worker uses the buffer
    on its own node when there is one."""
    nodes = sorted(set(worker_nodes), key=worker_nodes.index)
    n = len(nodes) if num_buffers == "per_node" else int(num_buffers)
    if n < 1:
        raise ValueError(f"num_buffers must be >= 1 or 'per_node', got {num_buffers!r}")
    buffer_nodes = [nodes[i % len(nodes)] for i in range(n)]
    buffers = [
        DataBuffer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                           max_restarts=3)  # a killed buffer comes back empty; the step is retried
        .remote(i, double_buffer, wait_timeout_s)
        for i, node in enumerate(buffer_nodes)
    ]
    first_on: dict[str, int] = {}
    for i, node in enumerate(buffer_nodes):
        first_on.setdefault(node, i)
    buffer_of_worker = [first_on.get(node, nodes.index(node) % n) for node in worker_nodes]
    return buffers, buffer_nodes, buffer_of_worker


# ---- driver half ---------------------------------------------------------------------------


class DistributedPlane:
    mode = "distributed"
    driver_moves_data = False
    bytes_to_driver = 0  # never a payload

    def __init__(self) -> None:
        self.rpcs = 0
        self.buffers: list = []
        self.buffer_of_worker: list[int] = []
        self.wait_s = 60.0

    def start(self, setup: PlaneSetup) -> "BufferSpec":
        sw = setup.switches
        self.wait_s = min(60.0, setup.wait_timeout_s)
        self.buffers, _, self.buffer_of_worker = place_buffers(setup.worker_nodes, sw.num_buffers,
                                                               sw.double_buffer, setup.wait_timeout_s)
        ray.get([b.ping.remote() for b in self.buffers], timeout=120)
        return BufferSpec(self.buffers, self.buffer_of_worker, sw.local_cache, setup.routing)

    def begin_step(self, step: int) -> None:
        pass

    def run_on_driver(self, step: int, stage: "Stage") -> list[Span] | None:
        return None

    def stage_args(self, step: int, stage: "Stage") -> list[Any]:
        return [None] * stage.workers

    def stage_done(self, step: int, stage: "Stage", handoffs: list[Any]) -> list[Span]:
        return []

    def end_step(self, step: int) -> EndOfStep:
        t0, rows = time.perf_counter(), []
        self.rpcs += len(self.buffers)
        for b, ref in [(b, b.end_step.remote(step)) for b in self.buffers]:
            try:
                rows.extend(ray.get(ref, timeout=self.wait_s)[1])
            except RayError:  # restarted after this step's data was delivered: let it serve the next step
                if wait_alive(b, self.wait_s):
                    ray.get(b.reset_step.remote(step), timeout=self.wait_s)
        return EndOfStep(time.perf_counter() - t0, rows)

    def abort(self, step: int, reason: str) -> None:
        for b in self.buffers:
            b.abort.remote(step, reason)  # fire and forget: a dead buffer has no waiters to free

    def reset_step(self, step: int) -> list[dict]:
        """Forget the failed attempt in every buffer (after the workers left it). Waits, bounded,
        for a restarting buffer; raises BufferLost if one does not come back."""
        rows: list[dict] = []
        for i, b in enumerate(self.buffers):
            if not wait_alive(b, self.wait_s):
                raise BufferLost(f"DataBuffer {i} did not come back within {self.wait_s:.0f}s after step {step} "
                                 "failed", step=step, stage="(reset)", worker=None)
            try:
                rows.extend(ray.get(b.reset_step.remote(step), timeout=self.wait_s))
            except RayError as e:
                raise BufferLost(f"DataBuffer {i} failed while resetting step {step}: {type(e).__name__}",
                                 step=step, stage="(reset)", worker=None) from None
        return rows

    def actors(self) -> list:
        return list(self.buffers)

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        for b in self.buffers:
            try:
                ray.kill(b)
            except Exception:  # already gone
                pass
        self.buffers = []


# ---- worker half ---------------------------------------------------------------------------


@dataclass
class BufferSpec:
    buffers: list
    buffer_of_worker: list[int]
    local_cache: bool
    routing: Routing
    loads_data: bool = True

    def bind(self, rank: int, recorder: SpanRecorder) -> "BufferPort":
        return BufferPort(self, rank, recorder)


class BufferPort:
    """A worker's side of the DataBuffer protocol (see buffer_actor.py for the steps)."""

    def __init__(self, spec: BufferSpec, rank: int, rec: SpanRecorder) -> None:
        self.spec, self.rank, self.rec = spec, rank, rec
        self.buffers, self.buffer_of_worker = spec.buffers, spec.buffer_of_worker
        self.cache = LocalCache()
        self.rpcs = 0

    def _buffer_of(self, worker: int):
        return self.buffers[self.buffer_of_worker[worker]]

    @contextmanager
    def _guard(self, step: int, edge: "Edge", stage: "Stage"):
        try:
            yield
        except RayError as e:  # died, restarting, restarted without the data, or failed the step
            cause = getattr(e, "cause", None)
            if isinstance(e, RayTaskError) and not isinstance(cause, BufferRestarted):
                raise StageError(f"stage {stage.id!r} (worker {self.rank}, step {step}): {cause or e}", step=step,
                                 stage=stage.id, worker=self.rank) from None
            raise BufferLost(f"a DataBuffer died during step {step} on edge {edge.name} (stage {stage.id!r}, "
                             f"worker {self.rank}): {type(e).__name__}", step=step, stage=stage.id,
                             worker=self.rank) from None

    def begin_step(self, step: int) -> None:
        self.cache.clear()

    def clear(self) -> None:
        self.cache.clear()

    def kill_actor(self, index: int) -> None:
        kill_and_wait(self.buffers[index], f"DataBuffer {index}")

    def _local(self, edge: "Edge") -> bool:
        return edge.kind == "local" and self.spec.local_cache

    def fetch(self, step: int, stage: "Stage", edge: "Edge | None", producer: "Stage | None", arg: Any) -> Fetched:
        if edge is None:
            return Fetched(Batch.empty(), "loader" if stage.type == "data_load" else "none")
        if self._local(edge):
            with self.rec.span(step, stage.id, "cache_hit", cache_hit=True) as sp:
                batch = self.cache.take(edge.name)
                sp.items = len(batch)
            return Fetched(batch, "cache", True)
        me = stage.dp_rank(self.rank)
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "wait"):
            pieces = ray.get(self._buffer_of(self.rank).get_pieces.remote(
                step, edge.name, me, producer.dp, stage.group_rank(self.rank) == 0))
            self.rpcs += 1
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "get", cache_hit=False) as sp:
            objs = ray.get([ref for ref, _ in pieces])
            batch = Batch.gather([(o, rows) for o, (_, rows) in zip(objs, pieces)])  # one copy per column
            sp.items, sp.bytes = len(batch), batch.nbytes
        return Fetched(batch, "buffer", False)

    def publish(self, step: int, stage: "Stage", edge: "Edge | None", consumer: "Stage | None", out: Batch,
                batch_in: Batch) -> None:
        if edge is None:
            return None
        if self._local(edge):
            self.cache.put(edge.name, out)
            return None
        if stage.group_rank(self.rank) != 0:  # only tensor-parallel rank 0 writes: no duplicates
            return None
        routing = self.spec.routing if edge.kind == "redistribute" else Routing(Balance.IDENTITY)
        me, mine = stage.dp_rank(self.rank), self._buffer_of(self.rank)
        nodes = self._consumers_by_buffer(consumer)
        if len(nodes) == 1:  # every consumer on one node: nothing to split by node, so no plan to wait for
            (b,) = nodes
            with self._guard(step, edge, stage), self.rec.span(step, stage.id, "put", items=len(out)) as sp:
                sp.bytes = out.nbytes
                ray.get(self.buffers[b].add_whole.remote(step, edge.name, me, item_lengths(out), stage.dp, consumer.dp,
                                                         routing, [ray.put(out)], item_groups(out)))
                self.rpcs += 2  # the put and the call
            return None
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "plan", items=len(out)):
            lengths, groups = item_lengths(out), item_groups(out)
            reports = [b.report.remote(step, edge.name, me, lengths, stage.dp, consumer.dp, routing, False, groups)
                       for b in self.buffers if b is not mine]  # awaited with the pieces below
            pieces = ray.get(mine.report_and_plan.remote(step, edge.name, me, lengths, stage.dp, consumer.dp, routing,
                                                         groups))
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "put", items=len(out)) as sp:
            acks = []
            for b, consumers in nodes.items():
                rows = [pieces[c] for c in consumers]
                bounds = np.cumsum([0, *map(len, rows)])
                piece = out.select(np.concatenate(rows))  # one gather, one put per destination node
                sp.bytes += piece.nbytes
                slices = {c: (int(bounds[i]), int(bounds[i + 1])) for i, c in enumerate(consumers)}
                acks.append(self.buffers[b].add_piece.remote(step, edge.name, me, [ray.put(piece)], slices, stage.dp))
            ray.get(acks + reports)
            self.rpcs += 1 + len(reports) + 2 * len(acks)  # plan, reports, and a put and a call per destination node
        return None

    def _consumers_by_buffer(self, consumer: "Stage") -> dict[int, list[int]]:
        """Consumer dp ranks grouped by the buffer of their node (group rank 0's worker)."""
        out: dict[int, list[int]] = {}
        for c in range(consumer.dp):
            out.setdefault(self.buffer_of_worker[consumer.worker_of(c)], []).append(c)
        return out
