"""Placement: one DAG-worker actor per device slot.

Workers are placed with a Ray placement group (one bundle per worker) and
ranked node by node, so data-parallel groups stay on a node. (A data plane
places its own actors: see dataplane/.)
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distflow_lab.core.errors import PlacementError
from distflow_lab.runtime.worker import DAGWorker


@dataclass
class Placement:
    workers: list  # actor handles, index = rank
    worker_nodes: list[str]  # full node id per rank
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
        raise PlacementError(
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def node_ip(node_id: str) -> str:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return n["NodeManagerAddress"]
    return "127.0.0.1"


def release(placement: Placement) -> None:
    """Kill the workers and free their placement group (a dead or hung worker is just killed)."""
    for a in placement.workers:
        try:
            ray.kill(a)
        except Exception:  # already gone
            pass
    try:
        remove_placement_group(placement.pg)
    except Exception:  # already removed
        pass
