"""The `distributed` data plane (DistFlow, paper §6): a local cache where the
layout stays, one DataBuffer per node where it changes, constrained-LPT
balancing by metadata, payloads straight from producer to consumer, a double
buffer for each batch's state.

Driver half: places the buffers (node affinity), ends batches, collects the
ledger, resets a failed attempt. Worker half (`BufferPort`): the protocol in
buffer_actor.py, seen from a producer (`publish`) and a consumer (`fetch`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distflow_lab.core.batch import Batch
from distflow_lab.core.errors import BufferLost
from distflow_lab.core.spans import SpanRecorder
from distflow_lab.dataplane.actor_plane import ActorPlane, ActorPort
from distflow_lab.dataplane.buffer_actor import BufferRestarted, DataBuffer
from distflow_lab.dataplane.interface import PlaneSetup, Routing, kill_and_wait
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
                           max_restarts=3)  # a killed buffer comes back empty; the batch is retried
        .remote(i, double_buffer, wait_timeout_s)
        for i, node in enumerate(buffer_nodes)
    ]
    first_on: dict[str, int] = {}
    for i, node in enumerate(buffer_nodes):
        first_on.setdefault(node, i)
    buffer_of_worker = [first_on.get(node, nodes.index(node) % n) for node in worker_nodes]
    return buffers, buffer_nodes, buffer_of_worker


# ---- driver half (the batch hooks: actor_plane.ActorPlane) ------------------------------------


class DistributedPlane(ActorPlane):
    mode = "distributed"
    lost = BufferLost

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list = []
        self.buffer_of_worker: list[int] = []

    def start(self, setup: PlaneSetup) -> "BufferSpec":
        sw = setup.switches
        self.wait_s = min(60.0, setup.wait_timeout_s)
        self.buffers, _, self.buffer_of_worker = place_buffers(setup.worker_nodes, sw.num_buffers,
                                                               sw.double_buffer, setup.wait_timeout_s)
        self._started([b.ping.remote() for b in self.buffers])
        return BufferSpec(self.buffers, self.buffer_of_worker, sw.local_cache, setup.routing,
                          wait_timeout_s=setup.wait_timeout_s)

    def actors(self) -> list:
        return list(self.buffers)

    def actor_name(self, index: int) -> str:
        return f"DataBuffer {index}"

    def close(self) -> None:
        self._kill_actors()
        self.buffers = []


# ---- worker half (the local cache, the guard: actor_plane.ActorPort) -------------------------


@dataclass
class BufferSpec:
    buffers: list
    buffer_of_worker: list[int]
    local_cache: bool
    routing: Routing
    loads_data: bool = True
    wait_timeout_s: float = 120.0  # a DataBuffer's own wait; a call to it is bounded a little above

    def bind(self, rank: int, recorder: SpanRecorder) -> "BufferPort":
        return BufferPort(self, rank, recorder)


class BufferPort(ActorPort):
    """A worker's side of the DataBuffer protocol (see buffer_actor.py for the batches)."""

    route, who = "buffer", "a DataBuffer"
    restarted, lost = BufferRestarted, BufferLost

    def __init__(self, spec: BufferSpec, rank: int, rec: SpanRecorder) -> None:
        super().__init__(spec, rank, rec)
        self.buffers, self.buffer_of_worker = spec.buffers, spec.buffer_of_worker

    def _buffer_of(self, worker: int):
        return self.buffers[self.buffer_of_worker[worker]]

    def kill_actor(self, index: int) -> None:
        kill_and_wait(self.buffers[index], f"DataBuffer {index}")

    def _locate(self, batch_id: int, stage: "Stage", edge: "Edge", producer: "Stage") -> list[tuple[Any, Any]]:
        pieces = ray.get(self._buffer_of(self.rank).get_pieces.remote(
            batch_id, edge.name, stage.dp_rank(self.rank), producer.dp, stage.group_rank(self.rank) == 0),
            timeout=self.call_timeout_s)
        self.rpcs += 1
        return pieces

    def _publish_remote(self, batch_id: int, stage: "Stage", edge: "Edge", consumer: "Stage", out: Batch,
                        routing: Routing) -> None:
        me, mine = stage.dp_rank(self.rank), self._buffer_of(self.rank)
        nodes = self._consumers_by_buffer(consumer)
        if len(nodes) == 1:  # every consumer on one node: nothing to split by node, so no plan to wait for
            (b,) = nodes
            with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "put", items=len(out)) as sp:
                sp.bytes = out.nbytes
                ray.get(self.buffers[b].add_whole.remote(batch_id, edge.name, me, item_lengths(out), stage.dp, consumer.dp,
                                                         routing, [ray.put(out)], item_groups(out)),
                        timeout=self.call_timeout_s)
                self.rpcs += 2  # the put and the call
            return
        with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "plan", items=len(out)):
            lengths, groups = item_lengths(out), item_groups(out)
            reports = [b.report.remote(batch_id, edge.name, me, lengths, stage.dp, consumer.dp, routing, False, groups)
                       for b in self.buffers if b is not mine]  # awaited with the pieces below
            pieces = ray.get(mine.report_and_plan.remote(batch_id, edge.name, me, lengths, stage.dp, consumer.dp, routing,
                                                         groups), timeout=self.call_timeout_s)
        with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "put", items=len(out)) as sp:
            acks = []
            for b, consumers in nodes.items():
                rows = [pieces[c] for c in consumers]
                bounds = np.cumsum([0, *map(len, rows)])
                piece = out.select(np.concatenate(rows))  # one gather, one put per destination node
                sp.bytes += piece.nbytes
                slices = {c: (int(bounds[i]), int(bounds[i + 1])) for i, c in enumerate(consumers)}
                acks.append(self.buffers[b].add_piece.remote(batch_id, edge.name, me, [ray.put(piece)], slices, stage.dp))
            ray.get(acks + reports, timeout=self.call_timeout_s)
            self.rpcs += 1 + len(reports) + 2 * len(acks)  # plan, reports, and a put and a call per destination node

    def _consumers_by_buffer(self, consumer: "Stage") -> dict[int, list[int]]:
        """Consumer dp ranks grouped by the buffer of their node (group rank 0's worker)."""
        out: dict[int, list[int]] = {}
        for c in range(consumer.dp):
            out.setdefault(self.buffer_of_worker[consumer.worker_of(c)], []).append(c)
        return out
