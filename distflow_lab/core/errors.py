"""Errors a user sees. Each names what is at fault (stage, worker, batch, node,
file, key). Every user-facing failure of distflow_lab is one of these: raw Ray
or torch exceptions are turned into them where they cross into the driver."""
from __future__ import annotations


class FriendlyError(Exception):
    """Shown in a notebook as its message only (IPython's `_render_traceback_` hook),
    and by the CLI as `error: <message>`: a traceback into distflow_lab or Ray
    internals helps nobody fix a bad input."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ConfigError(FriendlyError, ValueError):
    """A configuration that cannot run; names the key (or override) at fault."""


class DatasetError(FriendlyError, ValueError):
    """A dataset that cannot be read or does not follow the schema; names the file (and row or line)."""


class DAGError(FriendlyError, ValueError):
    """A DAG that cannot run. The message names the node at fault."""


class StageError(FriendlyError, RuntimeError):
    """A stage function raised, returned the wrong thing, or its worker died."""

    def __init__(self, message: str, *, batch_id: int, stage: str, worker: int | None, remote_traceback: str = "") -> None:
        super().__init__(message + (f"\n\n--- traceback on the worker ---\n{remote_traceback}" if remote_traceback else ""))
        self.batch_id, self.stage, self.worker = batch_id, stage, worker
        self.remote_traceback = remote_traceback
        self.summary = message

    def __reduce__(self):  # keyword-only fields: rebuild explicitly when crossing processes
        return (_rebuild, (type(self), self.summary, self.batch_id, self.stage, self.worker, self.remote_traceback))

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self.summary}"]

    def _repr_html_(self) -> str:  # readable in a notebook, not a wall of Ray internals
        import html

        return (f"<div style='border-left:4px solid #c0392b;padding:4px 8px'><b>{html.escape(self.summary)}</b>"
                f"<details><summary>traceback on the worker</summary><pre>{html.escape(self.remote_traceback)}</pre>"
                "</details></div>")


def _rebuild(cls, summary, batch_id, stage, worker, tb):
    return cls(summary, batch_id=batch_id, stage=stage, worker=worker, remote_traceback=tb)


class WorkerLost(StageError):
    """A DAG worker process died or stopped answering."""


class StageTimeout(StageError):
    """A stage ran past its timeout on some workers."""


class StageContractError(StageError):
    """A stage returned the wrong columns or row count for what its node declares."""


class PlaneLost(StageError):
    """A data-plane actor (a DataBuffer or the coordinator) died during a batch.
    The controller retries the batch once when no training stage has run yet."""


class BufferLost(PlaneLost):
    """A DataBuffer actor died during a redistribution."""


class CoordinatorLost(PlaneLost):
    """The metadata coordinator actor died during a batch."""


class WeightBoardLost(StageError):
    """On worker groups: the WeightBoard actor died, or a policy it pointed to was lost with
    the worker that published it. The run needs resume() (a checkpoint restores the board)."""


class WeightSyncMismatch(StageError):
    """A weight sync delivered something other than what was published: a tensor whose
    fingerprint differs (damaged, zeroed, another version), or one that never reached the
    engine. Names the policy version and the tensor. The rollout keeps no mix of old and new
    weights silently: the batch fails, and resume() reloads a whole policy."""


class WeightSyncTimeout(StageError):
    """A weight sync did not finish within its deadline (`weight_sync.timeout_s`), or the
    policy it was reading was lost with the worker that published it. Never a silent hang."""


class PolicyNotPublished(StageError):
    """On worker groups: a training segment ended without leaving the policy at the next
    version (update t must leave version t + 1): the actor-update stage must advance it,
    or generation never sees a newer policy and every batch goes stale."""


class StaleBatches(StageError):
    """On worker groups: batch after batch came out too stale to train on (older than
    max_staleness), with no update in between: the policy version is not advancing, or
    generation is too slow for max_staleness."""


class SessionBroken(FriendlyError, RuntimeError):
    """The workers cannot run another batch (some are dead or stuck) until `resume()`."""


class PlacementError(FriendlyError, RuntimeError):
    """The cluster cannot hold what was asked for (workers, CPUs, GPUs)."""


class CheckpointError(FriendlyError, ValueError):
    """A checkpoint that is missing, incomplete, corrupt or from another configuration."""


class EnvError(FriendlyError, RuntimeError):
    """An environment of a multi-turn rollout raised, timed out, or answered malformed data.
    Names the environment, the turn and, where known, the trajectory (its prompt's row)."""

    def __init__(self, message: str, *, env: str, turn: int, trajectory: str | None = None) -> None:
        where = f"environment {env!r}, turn {turn}" + (f", trajectory {trajectory}" if trajectory else "")
        super().__init__(f"{where}: {message}")
        self.env, self.turn, self.trajectory, self.reason = env, turn, trajectory, message

    def __reduce__(self):  # keyword-only fields: rebuild explicitly when crossing processes
        return (_rebuild_env_error, (type(self), self.reason, self.env, self.turn, self.trajectory))


def _rebuild_env_error(cls, reason, env, turn, trajectory):
    return cls(reason, env=env, turn=turn, trajectory=trajectory)
