"""Schedules on worker groups: generation on one group, training on the other, and
a rule for how far generation may run ahead.

A plan with groups is two segments: the generation segment (the stages on the
first group: data, rollout, reward, advantage, ...) and the training segment (the
stages on the second group). Each runs as one call per worker of its group (a
"lane"); the two lanes run at the same time on disjoint workers, and the data
plane carries each generated batch from one to the other, keyed by its batch
index r. The controller (`Lanes.step`) starts what may start, waits for what
finishes, and turns every finished training segment into one UpdateReport:

    a generation may start when at most k batches are ready or in training (at most 1
    with partial rollouts: see below)
    training update t takes the oldest ready batch r; if t - version_min(r) > k the batch
    is too stale: dropped, and counted (the hard guarantee: no sample older than k trains)
    after each update the training group publishes the policy; a generation pulls the
    version that was newest when it was launched (the pacing decides, not the moment the
    call starts on the worker; and between decode chunks the newest, with partial rollouts)

Without partial rollouts the pacing alone keeps every batch within k: a batch
generated from version v >= r - k is trained at update r. With partial rollouts a
sequence may carry tokens from older versions into a later batch. Batch r trains at
update r whatever the pacing, so every version generation runs ahead is one a carried
sequence cannot spend: generation runs at most one batch ahead (enough to keep the
trainer fed when generation is the faster side; when it is the slower side it never
gets ahead anyway), and a sequence may span up to k - 1 later batches. The rollout
stage is told the update its batch trains at (`ctx.trains_by`) and applies `on_stale`
to sequences that would be too old by then (drop them, or generate them again from
the start, counted in its metrics); the batch check above catches the rest.

k is the staleness bound: 0 = sync order (generation of r waits for update r-1: the
same steps, seeds and metrics as the synchronous schedule), 1 = one-step off-policy
(generation of r+1 beside training of r), k = bounded asynchrony.

Lanes is a `runtime.schedule.Schedule` and sees the cluster through `Dispatch` only
(start a segment call on workers, wait for calls, gather answers within a deadline,
abort a step, end a step on the data plane, read the clock): no Ray call and no clock
read of its own, so the same rules run live and in simulated time. It returns each
update's UpdateReport and keeps the ledger rows of the batches it ended (trained or
dropped) for the controller to take (`take_ledger`): the controller records both, in
one place. Its failure rule: any failure aborts everything in flight and the session
needs resume() (batches in flight on two groups cannot be rewound one by one).

Nothing waits or loops without a bound: a segment call's deadline is the sum of its
stages' timeouts (StageTimeout); a training update must leave the policy at the next
version, update t => version t + 1 (PolicyNotPublished, when the trainers have a
weights engine); and more than max(2, k + 1) batches in a row too stale to train,
with no update in between, is StaleBatches. Each aborts what is in flight.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from distflow_lab.core.errors import DAGError, PolicyNotPublished, SessionBroken, StageError, StaleBatches
from distflow_lab.graph.planner import Plan
from distflow_lab.runtime.results import StageReport, UpdateReport, ledger_row, stage_reports
from distflow_lab.runtime.schedule import ScheduleSetup, runs


@dataclass
class Lane:
    """One segment call in flight on one group."""

    kind: str  # "generate" | "train"
    batch_id: int  # r: the data-plane key
    update: int  # t: the training update (train lanes), or the updates done at launch (generation)
    refs: list
    workers: list[int]
    started: float
    deadline: float  # started + the sum of the segment's stage timeouts


@dataclass
class Ready:
    """A generated batch waiting to be trained on."""

    batch_id: int
    version: int  # the policy version the generation pulled
    version_min: int  # the oldest token's version (== version without partial rollouts)
    reports: list[StageReport]
    rows: int
    checksum: float  # of the weights the generation held (a sync test compares it with the published one)


@dataclass
class LaneStats:
    dropped: int = 0  # batches too stale, dropped
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"generate": [], "train": []})


def segments(plan: Plan, kind: str) -> tuple[list[int], list[int]]:
    """(generation stage indices, training stage indices) of a plan with two worker groups."""
    if len(plan.groups) != 2:
        raise DAGError(f"schedule {kind!r} needs a DAG on two worker groups (generation, then training), e.g. "
                       f"dag.with_groups(rollout=2, train=2); this DAG has {len(plan.groups) or 'no'} groups")
    gen, train = plan.groups[0][0], plan.groups[1][0]
    first = [s.index for s in plan.stages if s.group == gen]
    second = [s.index for s in plan.stages if s.group == train]
    if first != list(range(len(first))):
        late = [plan.stages[i].id for i in first if i >= len(first)]
        raise DAGError(f"schedule {kind!r}: the generation group's stages must come first in the chain; {late} come "
                       f"after a training stage")
    return first, second


def runs_ahead(k: int, partial_rollout: bool) -> int:
    """The pacing rule: how many batches generation may run ahead of training. With partial rollouts
    one is enough to keep the trainer fed, and the rest of k is slack for sequences that continue
    into later batches (see the module docstring)."""
    return min(k, 1) if partial_rollout else k


@dataclass(frozen=True)
class InFlight:
    """A batch generated but not yet trained when a checkpoint was taken: replayed after a
    resume at the policy version it came from (`how="replayed"`), or, with partial rollouts
    (whose sequences in flight die with the engine), generated again from the newest policy
    (`how="regenerated"`)."""

    batch_id: int
    version: int
    version_min: int
    how: str


_RENAMED = {"batch": "batch_id"}  # checkpoints written before the batch/update rename


@runs("one_step_off", "async")
class Lanes:
    position = 0  # it never stops between stages
    current: tuple[StageReport, ...] = ()  # the reports of an update in flight are not seen until it ends

    def __init__(self, setup: ScheduleSetup) -> None:
        """After `setup.updates` updates; `setup.state` (a checkpoint's `state()`): the first batch
        not yet trained (they differ once batches were dropped), the batches dropped, and the
        batches in flight, generated again at their recorded versions first."""
        plan, schedule, dispatch = setup.plan, setup.options, setup.dispatch
        saved = setup.state or {}
        start, first_batch = setup.updates, saved.get("next_batch")
        replay = [InFlight(**{_RENAMED.get(k, k): v for k, v in f.items()}) for f in saved.get("in_flight", ())]
        dropped = saved.get("dropped_batches", 0)
        self.plan, self.mode, self.schedule, self.d = plan, setup.mode, schedule, dispatch
        self.k = schedule.staleness
        self.ahead = runs_ahead(self.k, schedule.partial_rollout)
        # Batches dropped in a row beyond this, with no update in between: nothing would ever train.
        self.max_stale_run = max(2, self.k + 1)
        self.gen_stages, self.train_stages = segments(plan, schedule.kind)
        self.gen_workers = list(plan.stages[self.gen_stages[0]].ranks)
        self.train_workers = list(plan.stages[self.train_stages[0]].ranks)
        self.edge = plan.edge_into(self.train_stages[0]).name
        self.updates = start
        self.next_batch = start if first_batch is None else first_batch
        self.replay = {f.batch_id: f.version for f in replay if f.how == "replayed"}
        self.ready: deque[Ready] = deque()
        self.gen: Lane | None = None
        self.train: Lane | None = None
        self.stats = LaneStats(dropped=dropped)
        self.stale_run = 0  # batches dropped since the last update
        self.ledger: list[dict] = []  # rows of the batches ended (trained or dropped), not yet taken
        self._last_update_end = dispatch.now()
        self._training: Ready | None = None

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> UpdateReport:
        """Run until one more training update has finished; return its report. Raises a
        StageError (in-flight calls aborted) when a lane fails or cannot make progress."""
        report = None
        while report is None:
            self._launch()
            report = self._wait()
        return report

    def step_stage(self) -> tuple[StageReport, UpdateReport | None]:
        raise SessionBroken(f"step_stage() steps one stage of a colocated synchronous step; this session runs "
                            f"schedule {self.schedule.kind!r} on worker groups {self.plan.groups}: use step()")

    def failed(self, err: StageError) -> str | None:
        """Everything in flight was aborted when `err` was raised: the workers need resume()."""
        return (f"{type(err).__name__} in stage {err.stage!r} of schedule {self.schedule.kind!r}: "
                "call resume() to restart from the last checkpoint")

    def take_ledger(self) -> list[dict]:
        """The ledger rows of the batches ended since the last call (trained or dropped)."""
        rows, self.ledger = self.ledger, []
        return rows

    def state(self) -> dict:
        """Settles (see `settle`), then: the policy version, the batches generated but not yet trained
        (with the versions they came from, which the checkpoint keeps: `keep_versions`) and the batch
        to read next; a schedule built from this state replays them."""
        held = self.settle()
        return {"kind": self.schedule.kind, "max_staleness": self.schedule.staleness,
                "policy_version": self.updates, "next_batch": held[0].batch_id if held else self.next_batch,
                "dropped_batches": self.stats.dropped, "in_flight": [dataclasses.asdict(f) for f in held],
                "keep_versions": sorted({f.version for f in held if f.how == "replayed"})}

    def settle(self) -> list[InFlight]:
        """Between updates (a checkpoint): let a generation in flight finish, and return every
        batch generated but not yet trained, oldest first, with the versions it came from. The
        schedule goes on as before: nothing is dropped."""
        if self.gen is not None:
            self._finish(self.gen)  # bounded by its deadline; a failure aborts everything and raises
        how = "regenerated" if self.schedule.partial_rollout else "replayed"
        return [InFlight(r.batch_id, r.version, r.version_min, how) for r in self.ready]

    def discard(self) -> list[int]:
        """Give up every batch held (generating, ready, in training) untrained, e.g. before a
        checkpoint is loaded: waits for the calls in flight (bounded by their deadlines) and
        returns the batches, for the data plane to forget."""
        lanes = [lane for lane in (self.gen, self.train) if lane is not None]
        for lane in lanes:
            self.d.wait(lane.refs, len(lane.refs), max(0.0, lane.deadline - self.d.now()))
        held = [lane.batch_id for lane in lanes] + [r.batch_id for r in self.ready]
        self.gen = self.train = None
        self.ready.clear()
        return held

    def _launch(self) -> None:
        while self.train is None and self.ready:
            r = self.ready.popleft()
            if self.updates - r.version_min > self.k:  # too stale to train on
                self._drop(r)
            else:
                self._training = r
                self.train = self._start("train", r.batch_id, self.updates, self.train_stages, self.train_workers)
        # A generation starting now is trained after every batch ready or in training: it stays within k
        # of the trainer if there are at most k of those (a dropped batch no longer counts).
        ahead = len(self.ready) + (self.train is not None)
        if self.gen is None and ahead <= self.ahead:  # it trains at update `updates + ahead` at the latest
            self.gen = self._start("generate", self.next_batch, self.updates, self.gen_stages, self.gen_workers,
                                   trains_by=self.updates + ahead)
            self.next_batch += 1

    def _start(self, kind: str, batch_id: int, update: int, stages: list[int], workers: list[int],
               trains_by: int | None = None) -> Lane:
        limit = sum(self.d.timeout(self.plan.stages[i]) for i in stages)
        if kind == "generate":  # at the newest version now (a replayed batch: at the version it first came from)
            replayed = batch_id in self.replay
            version = self.replay.pop(batch_id) if replayed else self.updates
            refs = self.d.call("generate_segment", workers, (batch_id, stages, trains_by, version, replayed))
        else:
            refs = self.d.call("train_segment", workers, (batch_id, stages))
        now = self.d.now()
        return Lane(kind, batch_id, update, refs, workers, now, now + limit)

    def _wait(self) -> UpdateReport | None:
        """Wait until a lane finishes, fails or passes its deadline; finish it. Returns the
        report of an update that finished, if one did."""
        lanes = [lane for lane in (self.gen, self.train) if lane is not None]
        if not lanes:
            raise SessionBroken("nothing to run: no batch is generating and none is ready (this is a bug)")
        pending = [r for lane in lanes for r in lane.refs]
        timeout = max(0.0, min(lane.deadline for lane in lanes) - self.d.now())
        self.d.wait(pending, 1, timeout)
        report = None
        for lane in lanes:
            done, _ = self.d.wait(lane.refs, len(lane.refs), 0)
            if len(done) == len(lane.refs) or self.d.now() > lane.deadline or self.d.failed(done):
                report = self._finish(lane) or report  # a failed call ends its lane at once: others may wait on it
        return report

    # ---- a lane finished (or failed) -----------------------------------------------
    def _finish(self, lane: Lane) -> UpdateReport | None:
        answers = self._collect(lane)
        self.stats.busy[lane.kind].append((lane.started, self.d.now()))
        stages = [self.plan.stages[i] for i in (self.gen_stages if lane.kind == "generate" else self.train_stages)]
        reports = stage_reports(lane.batch_id, stages, self.mode, [a["results"] for a in answers])
        if lane.kind == "generate":
            self.gen = None
            rows = sum(r.items_out for r in reports[-1].results if r.group_rank == 0)
            self.ready.append(Ready(lane.batch_id, min(a["version"] for a in answers),
                                    min(a["version_min"] for a in answers), reports, rows, answers[0]["checksum"]))
            return None
        self.train = None
        self._check_published(lane, answers)
        return self._finish_update(lane, reports, answers)

    def _collect(self, lane: Lane) -> list[dict]:
        stage = "(generation)" if lane.kind == "generate" else "(training)"
        try:
            return self.d.gather(lane.refs, lane.batch_id, stage, max(0.0, lane.deadline - self.d.now()),
                                 lane.workers)
        except StageError as e:
            self._abort_all(e)
            raise

    def _finish_update(self, lane: Lane, reports: list[StageReport], answers: list[dict]) -> UpdateReport:
        r = self._training
        end = self.d.end_batch(lane.batch_id)
        self.ledger.extend(end.ledger)
        now = self.d.now()
        wall, self._last_update_end = now - self._last_update_end, now
        self.updates += 1
        self.stale_run = 0
        return UpdateReport(lane.update, self.mode, r.reports + reports, wall, end.seconds,
                          extra_metrics=self._schedule_metrics(lane, r, wall, answers))

    def _schedule_metrics(self, lane: Lane, r: Ready, wall: float, answers: list[dict]) -> dict:
        t1 = self.d.now()
        t0 = t1 - wall
        busy = {k: sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in v) for k, v in self.stats.busy.items()}
        versions = [a["version"] for a in answers if a["version"] is not None]  # None: no weights engine
        return {"schedule/batch": float(r.batch_id), "schedule/staleness": float(lane.update - r.version_min),
                "schedule/policy_version": float(max(versions, default=0)),
                "schedule/published_checksum": float(answers[0]["checksum"]),
                "schedule/rollout_version": float(r.version), "schedule/rollout_checksum": float(r.checksum),
                "schedule/trainer_idle": max(0.0, 1 - busy["train"] / wall) if wall > 0 else 0.0,
                "schedule/rollout_idle": max(0.0, 1 - busy["generate"] / wall) if wall > 0 else 0.0,
                "schedule/dropped_batches": float(self.stats.dropped),
                "schedule/queued_batches": float(len(self.ready))}

    # ---- the bounds: a policy that must advance, stale batches that must not go on --------
    def _check_published(self, lane: Lane, answers: list[dict]) -> None:
        """Update t must leave the trainers' policy at version t + 1 (versions start at 0 and
        a checkpoint restores them): otherwise generation never gets a newer policy and every
        batch goes stale. Checked on every trainer with a weights engine."""
        expected = lane.update + 1
        for w, a in zip(lane.workers, answers):
            v, before = a["version"], a["version_before"]
            if v is None or v == expected:
                continue
            last = self.plan.stages[self.train_stages[-1]].id
            was = f" (it was {before} before the segment)" if before not in (None, v) else ""
            self._raise(PolicyNotPublished(
                f"training update {lane.update} (batch {lane.batch_id}) left the policy at version {v} on worker {w}"
                f"{was}; update {lane.update} must leave it at version {expected}. The actor-update stage (the last "
                f"training stage that ran: {last!r}) must advance the policy version once per update (engines.weights:"
                f" e.g. bump(version + 1), as experiments/synthetic.py's actor_update does), or generation never gets "
                f"a newer policy and every batch goes stale", batch_id=lane.batch_id, stage=last, worker=w))

    def _drop(self, r: Ready) -> None:
        """A batch whose oldest token is more than k versions behind the trainer: dropped,
        its rows counted in the ledger (in, never out: never trained). More than
        `max_stale_run` in a row, with no update in between, is an error."""
        self.stats.dropped += 1
        self.stale_run += 1
        self.ledger.extend(self.d.end_batch(r.batch_id).ledger)
        self.ledger.append(ledger_row(r.batch_id, self.edge, items_dropped=r.rows))
        if self.stale_run > self.max_stale_run:
            self._raise(StaleBatches(
                f"schedule {self.schedule.kind!r} dropped {self.stale_run} batches in a row as too stale, with no "
                f"training update in between: the last, batch {r.batch_id}, came from policy version {r.version_min} "
                f"(its oldest token) while the trainer is at update {self.updates}: more than the staleness bound "
                f"k={self.k} behind. Every batch is too stale: the policy version is not advancing (the training "
                f"group must publish version t + 1 after update t: its actor-update stage bumps engines.weights), or "
                f"generation is too slow for k={self.k} (max_staleness)", batch_id=r.batch_id,
                stage=self.plan.stages[self.train_stages[0]].id, worker=None))

    # ---- failures ------------------------------------------------------------------
    def _raise(self, err: StageError) -> None:
        self._abort_all(err)
        raise err

    def _abort_all(self, err: StageError) -> None:
        """A failure in either lane: abort everything in flight (bounded wait); the session
        needs resume() (the controller marks it broken)."""
        lanes = [lane for lane in (self.gen, self.train) if lane is not None]
        for lane in lanes:
            self.d.abort(lane.batch_id, f"{err.stage!r} failed: {err.summary}")
        inflight = [r for lane in lanes for r in lane.refs]
        if inflight:
            self.d.wait(inflight, len(inflight), 5.0)
        self.gen = self.train = None
