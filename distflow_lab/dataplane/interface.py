"""The contract between the controller and a data plane.

A data plane has two halves. The driver half (`DataPlane`) lives in the
controller: it places its actors, hands each worker its half, and takes part
in the batch's life cycle (begin, per-stage hooks, end, abort, reset). The
worker half (`WorkerPort`) lives in every DAG worker: it fetches a stage's
input and publishes its output.

    controller                         DAG worker
    ----------                         ----------
    plane.start(setup) -> spec  ---->  port = spec.bind(rank, recorder)
    args = plane.stage_args(...)  --->  batch = port.fetch(...); out = fn(batch)
    plane.stage_done(handoffs)  <----  handoff = port.publish(...)
    plane.end_batch(batch)

Three planes implement it: `centralized` (the driver moves every byte),
`coordinator` (one metadata-only actor) and `distributed` (a DataBuffer per
node). The controller never asks which one it holds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayError

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import Switches
from distflow_lab.core.spans import Span, SpanRecorder
# Light modules of their own: the DataBuffer and coordinator actors import them without torch or pandas
from distflow_lab.dataplane.ledger import LEDGER_COLUMNS, ledger_row  # noqa: F401 (re-exported)
from distflow_lab.dataplane.routing import Routing  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Plan, Stage


@dataclass
class PlaneSetup:
    """What the controller tells a data plane when the session starts."""

    plan: "Plan"
    switches: Switches
    seed: int
    worker_nodes: list[str]  # full Ray node id of every worker rank
    wait_timeout_s: float  # longest an actor waits for producers before failing the batch
    driver_context: Callable[..., Any] | None = None  # (batch, stage, dp_rank, loader) -> a stage context
    routing: Routing = field(default_factory=Routing)


@dataclass
class Fetched:
    """A stage's input on one worker, and how it got there."""

    batch: Batch
    route: str  # "loader" | "cache" | "buffer" | "coordinator" | "driver" | "none"
    cache_hit: bool | None = None


@dataclass
class EndOfBatch:
    """What a data plane reports when a batch ends."""

    seconds: float = 0.0  # on the critical path
    ledger: list[dict] = field(default_factory=list)  # items in/out per (batch, edge): `ledger_row`s


class WorkerPort(Protocol):
    """The worker half of a data plane (one per DAG worker). `rpcs` counts its Ray calls."""

    rpcs: int

    def begin_batch(self, batch_id: int) -> None: ...

    def fetch(self, batch_id: int, stage: "Stage", edge: "Edge | None", producer: "Stage | None", arg: Any) -> Fetched: ...

    def publish(self, batch_id: int, stage: "Stage", edge: "Edge | None", consumer: "Stage | None", out: Batch,
                batch_in: Batch) -> Any: ...

    def clear(self) -> None: ...

    def kill_actor(self, index: int) -> None: ...


class WorkerSpec(Protocol):
    """The picklable description of a worker half; the worker binds it to itself."""

    loads_data: bool  # workers run the data_load stage (centralized: the driver does)

    def bind(self, rank: int, recorder: SpanRecorder) -> WorkerPort: ...


class DataPlane(Protocol):
    """The driver half of a data plane (one per session)."""

    mode: str
    driver_moves_data: bool  # True: stages run one by one, the driver handling data between them
    bytes_to_driver: int  # payload bytes the driver itself received (centralized: every collect)
    rpcs: int  # Ray calls the driver half made (and ray.put calls of the driver), cumulative

    def start(self, setup: PlaneSetup) -> WorkerSpec: ...

    def ready(self) -> None: ...  # after the workers' setup: the plane's actors answer (they start meanwhile)

    def begin_batch(self, batch_id: int) -> None: ...

    def run_on_driver(self, batch_id: int, stage: "Stage") -> list[Span] | None: ...

    def stage_args(self, batch_id: int, stage: "Stage") -> list[Any]: ...  # one per worker of the stage

    def stage_done(self, batch_id: int, stage: "Stage", handoffs: list[Any]) -> list[Span]: ...  # stage.ranks order

    def end_batch(self, batch_id: int) -> EndOfBatch: ...

    def abort(self, batch_id: int, reason: str) -> None: ...

    def reset_batch(self, batch_id: int) -> list[dict]: ...

    def actors(self) -> list: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def close(self) -> None: ...


def wait_alive(actor, timeout_s: float) -> bool:
    """Ray restarts a killed actor; wait (bounded) until it answers. False if it does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=min(10.0, max(0.1, deadline - time.monotonic())))
            return True
        except (RayError, GetTimeoutError):
            time.sleep(0.2)
    return False


def kill_and_wait(actor: Any, what: str, timeout_s: float = 60.0) -> None:
    """Kill a restartable data-plane actor (a fault injection) and return once a restarted
    process answers: ray.kill is asynchronous, so without the wait the killer's next call
    could still be served by the old process and the fault would miss the batch."""
    before = ray.get(actor.pid.remote(), timeout=timeout_s)
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.pid.remote(), timeout=max(0.1, deadline - time.monotonic())) != before:
                return
        except (RayError, GetTimeoutError):  # dead, or restarting (ActorUnavailableError)
            time.sleep(0.05)
    raise TimeoutError(f"{what} was killed but did not come back within {timeout_s:.0f}s")
