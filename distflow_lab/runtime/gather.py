"""The one gather: wait for calls to workers within a deadline, or raise the named error.

Every path that waits on workers (set-up, a stage, a whole batch, a segment of a
schedule on worker groups, checkpoints) goes through `gather`, so a failure reads
the same wherever it happens:

    a stage raised on a worker       -> its StageError (kept subclass: BufferLost, ...)
                                        or StageError("stage 's' failed on worker w (batch t): ...")
    a worker died (or is unreachable) -> WorkerLost("worker w died during stage 's' of batch t")
    a collective broke because a peer died -> WorkerLost naming the dead peer, not the survivor
    past the deadline                -> StageTimeout naming the late workers

Before raising, `abort(batch, reason)` releases whatever waits on the batch in the data plane.
`stage` is the stage's id, or a function of the worker that names the stage it reached (a
whole batch or a segment runs several stages in one call).

Workers report the size of their own answers: a worker method decorated `@sized` returns an
`Answer` (the value and its pickled bytes, measured on the worker), which `gather` unwraps and
counts (`received`), so the driver never pickles an answer to count what it received.
"""
from __future__ import annotations

import functools
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from distflow_lab.core.errors import StageError, StageTimeout, WorkerLost

# A collective's error on a surviving rank when a peer process died (gloo, NCCL): the peer's death is the cause.
PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|NCCL communicator was aborted")
PEER_GRACE_S = 3.0  # how long Ray may take to report the dead peer's actor

StageName = str | Callable[[int], str]  # a stage id, or the stage a given worker reached


@dataclass
class Answer:
    """A worker's answer and its size, pickled, as the worker measured it."""

    value: Any
    nbytes: int


def sized(method: Callable) -> Callable:
    """A worker method whose answer reports its own size (`Answer`). Of a (result, handoff) pair only
    the result counts: a data plane's handoff is object refs, and pickling a ref out of band would
    pin its object for good."""
    @functools.wraps(method)
    def answer(self, *args: Any, **kwargs: Any) -> Answer:
        out = method(self, *args, **kwargs)
        return Answer(out, len(pickle.dumps(out[0] if isinstance(out, tuple) else out)))
    return answer


def gather(refs: list, workers: list[int], batch_id: int, stage: StageName, limit_s: float,
           abort: Callable[[int, str], None], received: Callable[[int], None] = lambda nbytes: None) -> list:
    """Every answer of `refs` (the calls to `workers`, in that order) within `limit_s`, unwrapped
    (`received` is told their bytes); on the first failure or past the deadline: `abort` the batch,
    then raise the named StageError."""
    index = dict(zip(refs, workers))
    pending, deadline = list(refs), time.monotonic() + limit_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted(index[r] for r in pending)
            name = _name(stage, late[0])
            abort(batch_id, f"stage {name!r} timed out on workers {late}")
            raise StageTimeout(f"stage {name!r} of batch {batch_id} did not finish within {limit_s:.0f}s on workers "
                               f"{late} (the node's timeout_s, or cluster.stage_timeout_s)", batch_id=batch_id,
                               stage=name, worker=late[0])
        _check(ready[0], batch_id, stage, index[ready[0]], pending, index, abort)
    out = ray.get(refs, timeout=60)
    received(sum(a.nbytes for a in out if isinstance(a, Answer)))
    return [a.value if isinstance(a, Answer) else a for a in out]


def _name(stage: StageName, worker: int) -> str:
    return stage if isinstance(stage, str) else stage(worker)


def _check(ref, batch_id: int, stage: StageName, worker: int, pending: list, index: dict,
           abort: Callable[[int, str], None]) -> None:
    """Raise the named error if this finished call failed."""
    try:
        ray.get(ref, timeout=0)
    except GetTimeoutError:
        return
    except RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
        if PEER_LOST.search(str(cause or e)) and (dead := _dead_peer(pending, index)) is not None:
            worker, e = dead  # a collective broke because a peer died: the death is the error to name
            raise _lost(batch_id, stage, worker, e, abort) from None
        name = _name(stage, worker)
        abort(batch_id, f"stage {name!r} failed on worker {worker}")
        if isinstance(cause, StageError):  # keep the subclass (BufferLost, StageContractError, ...)
            raise type(cause)(cause.summary, batch_id=cause.batch_id, stage=cause.stage, worker=cause.worker,
                              remote_traceback=cause.remote_traceback) from None
        raise StageError(f"stage {name!r} failed on worker {worker} (batch {batch_id}): "
                         f"{type(cause or e).__name__}: {cause or e}", batch_id=batch_id, stage=name, worker=worker,
                         remote_traceback=str(e)) from None
    except RayError as e:  # the actor died (RayActorError) or is unreachable (ActorUnavailableError)
        raise _lost(batch_id, stage, worker, e, abort) from None


def _lost(batch_id: int, stage: StageName, worker: int, e: Exception, abort: Callable[[int, str], None]) -> WorkerLost:
    name = _name(stage, worker)
    abort(batch_id, f"worker {worker} died during stage {name!r}")
    return WorkerLost(f"worker {worker} died during stage {name!r} of batch {batch_id}: {type(e).__name__}",
                      batch_id=batch_id, stage=name, worker=worker, remote_traceback=str(e))


def _dead_peer(pending: list, index: dict) -> tuple[int, Exception] | None:
    """(worker, error) of a pending call whose actor died, within PEER_GRACE_S; else None."""
    if not pending:
        return None
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_GRACE_S)
    for r in done:
        try:
            ray.get(r, timeout=0)
        except RayTaskError:
            continue  # another rank's own error, not a death
        except RayError as e:
            return index.get(r, -1), e
    return None


def settle(refs: list, grace_s: float) -> bool:
    """After a failure: wait (at most `grace_s`) until every call has returned; False if some
    are stuck (a hung stage, a collective with a failed peer) or their worker died."""
    if not refs:
        return True
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    dead = False
    for r in done:
        try:
            ray.get(r, timeout=0)
        except ray.exceptions.RayActorError:
            dead = True
        except RayError:  # the failure itself, already reported
            pass
    return not pending and not dead


def wait(refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]:
    """ray.wait, bounded: (done, pending)."""
    try:
        return ray.wait(list(refs), num_returns=num_returns, timeout=timeout_s)
    except RayError:
        return [], list(refs)


def any_failed(done: list) -> bool:
    """Whether one of these finished calls raised (a dead worker, a stage error)."""
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except RayError:
            return True
    return False
