"""Fault injection: kill a real DAG-worker process or a DataBuffer actor at a
chosen step and stage, from a test or a notebook.

    from distflow_lab import faults
    faults.inject(session, "worker", 1, step=3, stage="old_log_prob")  # worker 1 exits mid-stage
    faults.inject(session, "buffer", 0, step=2, stage="old_log_prob")  # buffer 0 killed (Ray restarts it)
    faults.kill_worker(session, 2)                                      # right now

The worker process really dies (os._exit), and the buffer actor is really
killed (ray.kill): what the driver sees is what a crash on a cluster looks like.
"""
from __future__ import annotations

from typing import Any

import ray


def _controller(session: Any):
    return getattr(session, "controller", session)


def inject(session: Any, target: str, index: int, step: int, stage: str, by_worker: int | None = None,
           skip: int = 0) -> None:
    """Plan a fault: when step `step` reaches stage `stage`, kill worker `index`
    (target="worker": that worker exits mid-stage) or DataBuffer `index`
    (target="buffer": killed by worker `by_worker`, default 0, as the stage starts).
    `skip=n` lets the first n occurrences pass (e.g. strike again when the step is retried)."""
    c = _controller(session)
    c.plan.stage(stage)
    if target == "worker":
        ray.get(c.workers[index].set_faults.remote([{"step": step, "stage": stage, "action": "exit", "skip": skip}]))
    elif target == "buffer":
        if not c.placement.buffers:
            raise ValueError("this session has no DataBuffers (centralized mode)")
        if not 0 <= index < len(c.placement.buffers):
            raise ValueError(f"no DataBuffer {index}; the session has {len(c.placement.buffers)}")
        w = 0 if by_worker is None else by_worker
        ray.get(c.workers[w].set_faults.remote([{"step": step, "stage": stage, "action": "kill_buffer",
                                                 "buffer": index, "skip": skip}]))
    else:
        raise ValueError(f"target must be 'worker' or 'buffer', got {target!r}")


def kill_worker(session: Any, index: int) -> None:
    """Kill DAG worker `index` now (no restart)."""
    ray.kill(_controller(session).workers[index], no_restart=True)


def kill_buffer(session: Any, index: int = 0) -> None:
    """Kill DataBuffer `index` now; Ray restarts it (empty)."""
    ray.kill(_controller(session).placement.buffers[index], no_restart=False)
