"""Placement: one DAG-worker actor per device slot, one DataBuffer per node.

Workers are placed with a Ray placement group (one bundle per worker) and
ranked node by node, so data-parallel groups stay on a node. Buffers are
pinned to their node with node-affinity scheduling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..data.buffer import DataBuffer
from ..worker import DAGWorker


@dataclass
class Placement:
    workers: list  # actor handles, index = rank
    worker_nodes: list[str]  # full node id per rank
    buffers: list  # DataBuffer handles
    buffer_nodes: list[str]
    buffer_of_worker: list[int]
    pg: object

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.worker_nodes), key=self.worker_nodes.index)


def place_workers(world_size: int, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                  strategy: str = "PACK", timeout_s: float = 60.0, env: dict | None = None):
    """Reserve one bundle per worker, then start the workers ranked node by node."""
    bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        total = ray.cluster_resources()
        raise RuntimeError(
            f"cannot place {world_size} workers with {bundle} each ({strategy}) within {timeout_s:.0f}s: "
            f"the cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all. "
            "Use fewer workers, fewer CPUs per worker, or start Ray with more logical CPUs (num_cpus).")
    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    order = sorted(range(world_size), key=lambda b: (bundle_nodes[b], b))  # node-contiguous ranks
    remote = ray.remote(DAGWorker)
    runtime_env = {"env_vars": env} if env else None
    workers = [
        remote.options(
            num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        ).remote(rank, world_size)
        for rank, b in enumerate(order)
    ]
    return workers, [bundle_nodes[b] for b in order], pg


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
    first_on = {}
    for i, node in enumerate(buffer_nodes):
        first_on.setdefault(node, i)
    buffer_of_worker = [first_on.get(node, nodes.index(node) % n) for node in worker_nodes]
    return buffers, buffer_nodes, buffer_of_worker


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)
