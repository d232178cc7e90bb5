"""Fault injection: kill a real DAG-worker process or a DataBuffer actor at a
chosen batch and stage, from a test or a notebook.

    from distflow_lab.runtime import faults
    faults.inject(session, "worker", 1, batch_id=3, stage="old_log_prob")  # worker 1 exits mid-stage
    faults.inject(session, "buffer", 0, batch_id=2, stage="old_log_prob")  # buffer 0 killed (Ray restarts it)
    faults.inject(session, "board", 1, batch_id=4, stage="actor_update")      # worker 1 kills the WeightBoard
    faults.inject(session, "checkpoint", 0, batch_id=5)                     # worker 0 dies halfway through a save
    faults.inject(session, "sync_corrupt", 1, batch_id=2, stage="actor_update")    # publisher 1 damages a bucket
    faults.inject(session, "sync_publisher", 1, batch_id=2, stage="actor_update")  # publisher 1 dies mid-sync
    faults.kill_worker(session, 2)                                      # right now

The worker process really dies (os._exit), and the buffer actor is really
killed (ray.kill): what the driver sees is what a crash on a cluster looks like.
"""
from __future__ import annotations

from typing import Any

import ray

from distflow_lab.runtime.controller import Controller

ACTOR_TARGETS = {"buffer": "distributed", "coordinator": "coordinator"}


def _controller(session: Any) -> Controller:
    """A Session holds its controller; a Controller is one."""
    return session if isinstance(session, Controller) else session.controller


def inject(session: Any, target: str, index: int, batch_id: int, stage: str = "save_checkpoint",
           by_worker: int | None = None, skip: int = 0, mark: str | None = None) -> None:
    """Plan a fault: when batch `batch_id` reaches stage `stage`, kill worker `index`
    (target="worker": it exits mid-stage), or DataBuffer `index` (target="buffer") or
    the coordinator (target="coordinator", index 0), killed by worker `by_worker`
    (default 0) as the stage starts; target="board": worker `index` kills the WeightBoard
    as the stage starts; target="checkpoint": worker `index` exits halfway through writing
    its part of the checkpoint saved after `batch_id` updates; on worker groups, target="sync_corrupt":
    worker `index` (the training group's first) damages the first bucket of the policy it publishes
    after stage `stage` (the training segment's last), and target="sync_publisher": it dies after
    writing its first bucket. `skip=n` lets the first n
    occurrences pass (e.g. strike again when the batch is retried). `mark`: a file the
    fault writes its wall-clock time to as it strikes."""
    c = _controller(session)
    if target != "checkpoint":
        c.plan.stage(stage)
    if target in ("worker", "checkpoint", "board", "sync_corrupt", "sync_publisher"):
        if not 0 <= index < len(c.workers):
            raise ValueError(f"no worker {index}; the session has {len(c.workers)}")
        if target in ("board", "sync_corrupt", "sync_publisher") and c.board is None:
            raise ValueError(f"a {target} fault needs worker groups (a WeightBoard); this session is colocated")
        action = {"worker": "exit", "checkpoint": "exit", "board": "kill_board", "sync_corrupt": "corrupt_weights",
                  "sync_publisher": "exit_mid_sync"}[target]
        fault = {"batch_id": batch_id, "stage": "save_checkpoint" if target == "checkpoint" else stage, "action": action,
                 "skip": skip}
        w = index
    elif target in ACTOR_TARGETS:
        actors = c.plane.actors()
        if c.mode != ACTOR_TARGETS[target]:
            raise ValueError(f"a {target} exists only in mode {ACTOR_TARGETS[target]!r}; this session is {c.mode!r}")
        if not 0 <= index < len(actors):
            raise ValueError(f"no {target} {index}; the session has {len(actors)}")
        fault = {"batch_id": batch_id, "stage": stage, "action": "kill_actor", "actor": index, "skip": skip}
        w = 0 if by_worker is None else by_worker
    else:
        raise ValueError(f"target must be 'worker', 'buffer', 'coordinator', 'board', 'checkpoint', 'sync_corrupt' or "
                         f"'sync_publisher', got {target!r}")
    if mark is not None:
        fault["mark"] = str(mark)
    ray.get(c.workers[w].add_faults.remote([fault]), timeout=30)


def kill_worker(session: Any, index: int) -> None:
    """Kill DAG worker `index` now (no restart)."""
    ray.kill(_controller(session).workers[index], no_restart=True)


def kill_plane_actor(session: Any, index: int = 0) -> None:
    """Kill data-plane actor `index` (a DataBuffer, or the coordinator) now; Ray restarts it, empty."""
    ray.kill(_controller(session).plane.actors()[index], no_restart=False)
