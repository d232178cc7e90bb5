"""The schedule as a unit: what the controller holds beside its data plane.

The controller owns the cursor (updates done), records each finished update, and
turns failures into a session state; *how* batches and updates run, overlap and recover is the
schedule's. A schedule is a row of facts in `core.config.SCHEDULES` and a class (or
factory) registered under the same name with `@runs(name)`, built from a
`ScheduleSetup`. It reaches the workers, the data plane's batch ends and the clock only
through `Dispatch`: the live controller gives it Ray calls and the wall clock, the
what-if replay (experiments/sim_dispatch.py) simulated ones.

    sync          runtime/schedule_sync.py   one batch at a time on every worker (stage by stage, or whole)
    one_step_off  runtime/schedule_lanes.py  Lanes: generation and training on two worker groups, k = 1
    async         runtime/schedule_lanes.py  Lanes, k = max_staleness, partial rollouts optional

Adding a schedule: one row in SCHEDULES (`core.config.register_schedule` adds one at run
time, e.g. from a notebook) and one file with a class that has these methods, decorated
`@runs(name)` (tests/example_schedule.py: "sync with a delay").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from distflow_lab.core.config import SCHEDULES, ScheduleOptions
from distflow_lab.core.errors import ConfigError, StageError
from distflow_lab.dataplane.interface import DataPlane, EndOfBatch
from distflow_lab.graph.planner import Plan, Stage

if TYPE_CHECKING:
    from distflow_lab.runtime.gather import StageName
    from distflow_lab.runtime.results import StageReport, UpdateReport


@dataclass(frozen=True)
class Dispatch:
    """What a schedule may ask of the cluster, and nothing more (the controller builds it; a
    simulation builds another)."""

    call: Callable[[str, list[int], tuple], list]  # (method, workers, args): start it on each worker -> refs
    gather: Callable[["list", int, "StageName", float, list[int]], list]  # (refs, batch, stage, limit_s, workers)
    # -> answers; on a failure or past limit_s it aborts the batch and raises a named StageError (runtime/gather.py)
    wait: Callable[[list, int, float], tuple[list, list]]  # (refs, num_returns, timeout_s) -> (done, pending)
    failed: Callable[[list], bool]  # whether one of these finished calls raised (a dead worker, a stage error)
    now: Callable[[], float]  # seconds, monotonic: every deadline and wall time a schedule measures
    abort: Callable[[int, str], None]  # (batch, reason): fail the data plane's waiters of a batch
    end_batch: Callable[[int], EndOfBatch]  # release a batch in the data plane: its seconds, its ledger rows
    timeout: Callable[[Stage], float]  # a stage's timeout (its own, or the cluster's)
    rpcs: Callable[[], int] = lambda: 0  # Ray calls so far (the driver's and the data plane's), for UpdateReport.rpcs
    recover: Callable[[int, float | None], bool] = lambda batch_id, grace: False  # (batch, grace_s): the workers out of
    # a failed batch, the data plane's state of it reset, every loader rewound; False if not possible
    reached: Callable[[int], str | None] = lambda worker: None  # the stage a worker last reached (progress board)
    retried: Callable[[dict], None] = lambda row: None  # tell the controller a batch ran again (its `retries`)


@dataclass(frozen=True)
class ScheduleSetup:
    """Everything a schedule is built from."""

    plan: Plan
    mode: str  # the data plane's mode (for reports)
    options: ScheduleOptions
    dispatch: Dispatch
    plane: DataPlane  # a schedule that runs stage by stage drives it (begin_batch, stage_args, ...)
    updates: int  # training updates done so far (the controller's cursor)
    state: dict | None = None  # a checkpoint's `Schedule.state()`, to continue from


class Schedule(Protocol):
    """How updates run. Failures raise a named StageError out of `step`; `failed` then says
    whether the session can go on (the schedule's own rule, documented on its class)."""

    position: int  # the next stage of the current update (0 between updates; only sync stops in between)

    def step(self) -> "UpdateReport":
        """Run until one more training update has finished; its report."""

    def step_stage(self) -> "tuple[StageReport, UpdateReport | None]":
        """Run the next stage of the current update; its report, and the update's when that stage ended it
        (SessionBroken, naming the schedule, where it cannot stop between stages)."""

    def failed(self, err: StageError) -> str | None:
        """After `step` raised `err`: None if the same update can run again, else why the session is broken."""

    def take_ledger(self) -> list[dict]:
        """Ledger rows of the batches ended since the last call (trained, dropped or reset)."""

    def state(self) -> dict:
        """What a checkpoint stores, JSON-able: at least `next_batch` (the first batch not yet trained:
        where the loaders continue) and `keep_versions` (policy versions the checkpoint must keep)."""

    def discard(self) -> list[int]:
        """Give up every batch held untrained (before a checkpoint is loaded); the batches, for the data
        plane to forget."""


Runner = Callable[[ScheduleSetup], Schedule]
RUNNERS: dict[str, Runner] = {}  # schedule name -> what runs it (filled by @runs)


def runs(*names: str) -> Callable[[Any], Any]:
    """Register a class (or factory) taking a ScheduleSetup as what runs the schedules `names`
    (each must have its row of facts in SCHEDULES)."""
    def register(runner: Any) -> Any:
        for name in names:
            if name not in SCHEDULES:
                raise ConfigError(f"@runs({name!r}): no schedule {name!r} in SCHEDULES; add its facts first "
                                  f"(core.config.register_schedule); known: {list(SCHEDULES)}")
            if RUNNERS.get(name, runner) is not runner:
                raise ConfigError(f"@runs({name!r}): schedule {name!r} is already run by {RUNNERS[name]!r}")
            RUNNERS[name] = runner
        return runner
    return register


def open_schedule(setup: ScheduleSetup) -> Schedule:
    """The schedule named by `setup.options.kind`, built by what registered itself for it."""
    kind = setup.options.kind
    if kind not in RUNNERS:
        raise ConfigError(f"schedule {kind!r} has facts in SCHEDULES but nothing runs it: decorate its class "
                          f"with @runtime.schedule.runs({kind!r}) and import its module")
    return RUNNERS[kind](setup)
