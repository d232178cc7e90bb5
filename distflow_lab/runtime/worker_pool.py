"""Idle DAG workers kept between sessions: closing a session and opening the next costs no process starts.

Starting a DAG worker means a new Ray actor process that imports torch and joins a torch.distributed
world: seconds each, on every `lab.session` / `rl_session`. A notebook closes and reopens sessions
all the time, so a session that closes healthy parks its workers here instead of killing them, and
the next session with the same shape takes them over, exactly as `Session.reopen` hands workers
over inside one session (the worker's `setup` resets everything of the last plan: engines,
loaders, data-plane ports, step state).

The key is what decides whether a process can serve the new session: the cluster, the placement
request (workers, CPUs and GPUs each, strategy) and the torch.distributed worlds. A session that
failed in a way the controller could not undo (`Controller.broken`), or whose workers do not
answer at close, never returns its workers. A parked placement is checked alive before it is
handed out (a worker killed while parked is not handed to anyone). `fresh_workers=True` on a
session opts out both ways.

Parked workers keep their placement group, so they keep their logical CPUs: a session that
cannot place its own workers first frees the pool. At most `DISTFLOW_WORKER_POOL` placements
(default 2) are kept; the oldest goes first.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass, field

import ray
from distflow_lab.runtime.placement import Placement, release

ALIVE_TIMEOUT_S = 10.0  # a parked worker that does not answer its liveness call within this is not reused


@dataclass(frozen=True)
class PoolKey:
    cluster: str  # the Ray cluster and this driver's job: a new cluster or driver has none of these processes
    world_size: int
    cpus_per_worker: float
    gpus_per_worker: float
    placement: str
    torch_distributed: bool
    worlds: tuple[tuple[int, int], ...]  # (first worker, workers) of each torch.distributed world


def current_cluster() -> str:
    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


@dataclass
class PoolStats:
    taken: int = 0  # sessions that started on parked workers
    started: int = 0  # sessions that started new workers (no match, pool off, or fresh_workers)
    parked: int = 0  # placements a closing session returned
    refused: int = 0  # placements not returned (broken session, a worker not answering) or found dead
    released: int = 0  # parked placements freed (capacity, room for another shape, drain)


@dataclass
class WorkerPool:
    capacity: int = field(default_factory=lambda: int(os.environ.get("DISTFLOW_WORKER_POOL", "2")))
    idle: list[tuple[PoolKey, Placement]] = field(default_factory=list)  # oldest first
    stats: PoolStats = field(default_factory=PoolStats)

    def take(self, key: PoolKey) -> Placement | None:
        """A parked placement for `key`, checked alive (the newest first), or None."""
        self._forget_other_clusters()
        for i in range(len(self.idle) - 1, -1, -1):
            k, placement = self.idle[i]
            if k != key:
                continue
            del self.idle[i]
            if _alive(placement):
                self.stats.taken += 1
                return placement
            self.stats.refused += 1
            release(placement)
        self.stats.started += 1
        return None

    def give(self, key: PoolKey, placement: Placement) -> bool:
        """Park a healthy session's placement (its workers already parked); False: not kept, released."""
        self._forget_other_clusters()
        if self.capacity < 1:
            release(placement)
            return False
        self.idle.append((key, placement))
        self.stats.parked += 1
        while len(self.idle) > self.capacity:
            release(self.idle.pop(0)[1])
            self.stats.released += 1
        return True

    def refuse(self, placement: Placement) -> None:
        """A placement that must not be reused (a broken session, a dead or hung worker)."""
        self.stats.refused += 1
        release(placement)

    def drain(self) -> int:
        """Free every parked placement (their processes end); how many there were."""
        n = len(self.idle)
        current = _cluster_or_none()
        for key, placement in self.idle:
            if key.cluster == current:
                release(placement)
        self.idle.clear()
        self.stats.released += n
        return n

    def idle_cpus(self) -> float:
        return sum(k.world_size * k.cpus_per_worker for k, _ in self.idle)

    def _forget_other_clusters(self) -> None:
        """Entries of a cluster that is gone (ray.shutdown, a new cluster): nothing to free."""
        current = _cluster_or_none()
        self.idle = [(k, p) for k, p in self.idle if k.cluster == current]

    def __repr__(self) -> str:
        s = self.stats
        shapes = ", ".join(f"{k.world_size}x{k.cpus_per_worker:g} CPU" for k, _ in self.idle) or "none"
        return (f"WorkerPool: {len(self.idle)} idle placement(s) of {self.capacity} ({shapes}); "
                f"sessions on parked workers {s.taken}, on new workers {s.started}; parked {s.parked}, "
                f"refused {s.refused}, released {s.released}")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def _cluster_or_none() -> str | None:
    return current_cluster() if ray.is_initialized() else None


def _alive(placement: Placement) -> bool:
    try:
        ray.get([w.alive.remote() for w in placement.workers], timeout=ALIVE_TIMEOUT_S)
        return True
    except Exception:  # dead (RayActorError), restarting (ActorUnavailableError) or hung (GetTimeoutError)
        return False


POOL = WorkerPool()  # one per driver process: its workers belong to this driver's Ray job


def worker_pool() -> WorkerPool:
    """This process's pool of parked DAG workers (`lab.worker_pool()`): what it holds, how often
    sessions reused it; `.drain()` frees the processes now."""
    return POOL
