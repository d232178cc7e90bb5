"""Connect to Ray: start an embedded local cluster (loopback only) or attach to
an existing one. Calling `connect` twice reuses the connection; `shutdown`
stops only what `connect` started.

The embedded cluster binds 127.0.0.1: Ray otherwise listens on the machine's
interface address, and a laptop default should not expose Ray's ports.
Attaching to a cluster keeps Ray's token authentication as that cluster has it.
"""
from __future__ import annotations

import html
import os
import sys
from dataclasses import dataclass, field
from typing import Any

_state: dict[str, Any] = {"cluster": None}


@dataclass
class ClusterInfo:
    address: str
    started_here: bool  # an embedded local cluster that connect() started
    connected_here: bool = True  # connect() called ray.init (else: an existing connection was reused)
    nodes: list[dict] = field(default_factory=list)

    @property
    def resources(self) -> dict[str, float]:
        import ray

        return ray.cluster_resources()

    def refresh(self) -> "ClusterInfo":
        import ray

        self.nodes = [
            {"node_id": n["NodeID"][:8], "address": n["NodeManagerAddress"], "alive": n["Alive"],
             "cpus": n["Resources"].get("CPU", 0), "gpus": n["Resources"].get("GPU", 0),
             "object_store_gib": round(n["Resources"].get("object_store_memory", 0) / 2**30, 2)}
            for n in ray.nodes() if n["Alive"]
        ]
        return self

    def __repr__(self) -> str:
        r = self.resources
        how = "started here (loopback only)" if self.started_here else "attached"
        return (f"Ray cluster at {self.address} ({how}): {len(self.nodes)} node(s), {r.get('CPU', 0):g} CPUs, "
                f"{r.get('GPU', 0):g} GPUs, {r.get('object_store_memory', 0) / 2**30:.2f} GiB object store")

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in n.values()) + "</tr>" for n in self.nodes
        )
        head = "".join(f"<th>{k}</th>" for k in (self.nodes[0] if self.nodes else {}))
        return f"<b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{rows}</table>"


def connect(address: str | None = None, **ray_options: Any) -> ClusterInfo:
    """Start a local Ray cluster (default) or attach to `address` / $RAY_ADDRESS."""
    if _state["cluster"] is not None:
        import ray

        if ray.is_initialized():
            return _state["cluster"].refresh()
        _state["cluster"] = None
    address = address or os.environ.get("RAY_ADDRESS") or None
    started_here = address is None
    if started_here:
        # Loopback only. Must be in the environment before Ray's processes start.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray_options.setdefault("include_dashboard", False)
        # logical CPUs: let a laptop run several one-CPU workers (oversubscribed, like real device slots)
        ray_options.setdefault("num_cpus", max(8, os.cpu_count() or 1))
        ray_options.setdefault("_node_ip_address", "127.0.0.1")
    else:  # an existing cluster has its own resources: Ray refuses them on attach
        for key in ("num_cpus", "num_gpus", "object_store_memory", "resources"):
            ray_options.pop(key, None)
    import ray

    ray_options.setdefault("log_to_driver", True)
    ray_options.setdefault("ignore_reinit_error", True)
    connected_here = not ray.is_initialized()
    if connected_here:
        # "local": always start a fresh cluster here, never silently attach to one a
        # `ray start` left on this machine (Ray's default for address=None).
        ray.init(address=address or "local", **ray_options)
    else:
        started_here = False
    info = ClusterInfo(ray.get_runtime_context().gcs_address, started_here, connected_here).refresh()
    _state["cluster"] = info
    return info


def shutdown() -> None:
    """End the cluster if `connect` started it; detach from one it attached to."""
    import ray

    info = _state["cluster"]
    _state["cluster"] = None
    pool = sys.modules.get("distflow_lab.runtime.worker_pool")  # loaded only if a session ever ran here
    if pool is not None and ray.is_initialized():
        pool.POOL.drain()  # parked workers belong to this driver: end them with the connection
    if info is not None and info.connected_here and ray.is_initialized():
        ray.shutdown()  # stops an embedded cluster; only disconnects from an attached one
