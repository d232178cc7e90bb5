"""Schedules on worker groups: generation on one group, training on the other, and
a rule for how far generation may run ahead.

A plan with groups is two segments: the generation segment (the stages on the
first group: data, rollout, reward, advantage, ...) and the training segment (the
stages on the second group). Each runs as one call per worker of its group (a
"lane"); the two lanes run at the same time on disjoint workers, and the data
plane carries each generated batch from one to the other, keyed by its batch
index r. The controller (`Lanes.step`) starts what may start, waits for what
finishes, and turns every finished training segment into one StepReport:

    a generation may start when at most k batches are ready or in training (at most 1
    with partial rollouts: see below)
    training update t takes the oldest ready batch r; if t - version_min(r) > k the batch
    is too stale: dropped, and counted (the hard guarantee: no sample older than k trains)
    after each update the training group publishes the policy; a generation pulls the
    newest one when it starts (and between decode chunks, with partial rollouts)

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
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayError

from distflow_lab.core.config import ScheduleOptions
from distflow_lab.core.errors import DAGError, SessionBroken, StageError
from distflow_lab.runtime.results import StageReport, StepReport

if TYPE_CHECKING:
    from distflow_lab.runtime.controller import Controller


@dataclass
class Lane:
    """One segment call in flight on one group."""

    kind: str  # "generate" | "train"
    batch: int  # r: the data-plane key
    update: int  # t: the training update (train lanes), or the updates done at launch (generation)
    refs: list
    workers: list[int]
    started: float
    deadline: float


@dataclass
class Ready:
    """A generated batch waiting to be trained on."""

    batch: int
    version: int  # the policy version the generation pulled
    version_min: int  # the oldest token's version (== version without partial rollouts)
    reports: list[StageReport]
    rows: int
    checksum: float  # of the weights the generation held (a sync test compares it with the published one)


@dataclass
class LaneStats:
    dropped: int = 0  # batches too stale, dropped
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"generate": [], "train": []})


def _failed(done: list) -> bool:
    """Whether one of these finished calls raised (a dead worker, a stage error)."""
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except RayError:
            return True
    return False


def segments(controller: "Controller") -> tuple[list[int], list[int]]:
    """(generation stage indices, training stage indices) of a plan with two worker groups."""
    plan = controller.plan
    kind = controller.config.schedule.kind
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


class Lanes:
    def __init__(self, controller: "Controller", schedule: ScheduleOptions) -> None:
        self.c, self.schedule = controller, schedule
        self.k = schedule.staleness
        # How many batches generation may run ahead. With partial rollouts one is enough to keep the trainer
        # fed, and the rest of k is slack for sequences that continue into later batches (see the docstring).
        self.ahead = min(self.k, 1) if schedule.partial_rollout else self.k
        self.gen_stages, self.train_stages = segments(controller)
        plan = controller.plan
        self.gen_workers = list(plan.stages[self.gen_stages[0]].ranks)
        self.train_workers = list(plan.stages[self.train_stages[0]].ranks)
        self.edge = plan.edge_into(self.train_stages[0]).name
        self.next_batch = self.updates = controller.step_index
        self.ready: deque[Ready] = deque()
        self.gen: Lane | None = None
        self.train: Lane | None = None
        self.stats = LaneStats()
        self._last_update_end = time.time()
        self._training: Ready | None = None

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> StepReport:
        """Run until one more training update has finished; return its report."""
        target = self.updates + 1
        while self.updates < target:
            self._launch()
            self._wait()
        return self.c.history[-1]

    def _launch(self) -> None:
        if self.train is None and self.ready:
            r = self.ready[0]
            if self.updates - r.version_min > self.k:  # too stale to train on
                self.ready.popleft()
                self._stale(r)
            else:
                self.ready.popleft()
                self._training = r
                self.train = self._start("train", r.batch, self.updates, self.train_stages, self.train_workers)
        # A generation starting now is trained after every batch ready or in training: it stays within k
        # of the trainer if there are at most k of those (a dropped batch no longer counts).
        ahead = len(self.ready) + (self.train is not None)
        if self.gen is None and ahead <= self.ahead:  # it trains at update `updates + ahead` at the latest
            self.gen = self._start("generate", self.next_batch, self.updates, self.gen_stages, self.gen_workers,
                                   trains_by=self.updates + ahead)
            self.next_batch += 1

    def _start(self, kind: str, batch: int, update: int, stages: list[int], workers: list[int],
               trains_by: int | None = None) -> Lane:
        limit = sum(self.c._timeout(self.c.plan.stages[i]) for i in stages)
        if kind == "generate":
            refs = [self.c.workers[w].generate_segment.remote(batch, stages, trains_by) for w in workers]
        else:
            refs = [self.c.workers[w].train_segment.remote(batch, stages) for w in workers]
        self.c.driver_calls += len(refs)
        now = time.monotonic()
        return Lane(kind, batch, update, refs, workers, now, now + limit)

    def _wait(self) -> None:
        lanes = [lane for lane in (self.gen, self.train) if lane is not None]
        if not lanes:
            raise SessionBroken("nothing to run: no batch is generating and none is ready (this is a bug)")
        pending = [r for lane in lanes for r in lane.refs]
        timeout = max(0.0, min(lane.deadline for lane in lanes) - time.monotonic())
        ray.wait(pending, num_returns=1, timeout=timeout)
        for lane in lanes:
            done, _ = ray.wait(lane.refs, num_returns=len(lane.refs), timeout=0)
            if len(done) == len(lane.refs) or time.monotonic() > lane.deadline or _failed(done):
                self._finish(lane)  # a failed call ends its lane at once: the others may wait on it

    # ---- a lane finished (or failed) -----------------------------------------------
    def _collect(self, lane: Lane) -> list[dict]:
        stage = "(generation)" if lane.kind == "generate" else "(training)"
        try:
            return self.c._gather(lane.refs, lane.batch, stage, max(0.0, lane.deadline - time.monotonic()),
                                  workers=lane.workers)
        except StageError as e:
            self._fail(e, lane)
            raise

    def _finish(self, lane: Lane) -> None:
        answers = self._collect(lane)
        self.stats.busy[lane.kind].append((lane.started, time.monotonic()))
        reports = self._stage_reports(lane, [a["results"] for a in answers])
        if lane.kind == "generate":
            self.gen = None
            rows = sum(r.items_out for r in reports[-1].results if r.group_rank == 0)
            self.ready.append(Ready(lane.batch, min(a["version"] for a in answers),
                                    min(a["version_min"] for a in answers), reports, rows, answers[0]["checksum"]))
        else:
            self.train = None
            self._finish_update(lane, reports, answers)

    def _finish_update(self, lane: Lane, reports: list[StageReport], answers: list[dict]) -> None:
        r = self._training
        end = self.c.plane.end_step(lane.batch)
        self.c.ledger_rows.extend(end.ledger)
        now = time.time()
        wall, self._last_update_end = now - self._last_update_end, now
        report = StepReport(lane.update, self.c.mode, r.reports + reports, wall, end.seconds,
                            extra_metrics=self._schedule_metrics(lane, r, wall, answers))
        self.c.history.append(report)
        self.updates += 1
        self.c.step_index = self.updates
        self.c.metric_rows.append({"step": lane.update, "wall_s": wall, **report.metrics})

    def _schedule_metrics(self, lane: Lane, r: Ready, wall: float, answers: list[dict]) -> dict:
        t1 = time.monotonic()
        t0 = t1 - wall
        busy = {k: sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in v) for k, v in self.stats.busy.items()}
        return {"schedule/batch": float(r.batch), "schedule/staleness": float(lane.update - r.version_min),
                "schedule/policy_version": float(max(a["version"] for a in answers)),
                "schedule/published_checksum": float(answers[0]["checksum"]),
                "schedule/rollout_version": float(r.version), "schedule/rollout_checksum": float(r.checksum),
                "schedule/trainer_idle": max(0.0, 1 - busy["train"] / wall) if wall > 0 else 0.0,
                "schedule/rollout_idle": max(0.0, 1 - busy["generate"] / wall) if wall > 0 else 0.0,
                "schedule/dropped_batches": float(self.stats.dropped),
                "schedule/queued_batches": float(len(self.ready))}

    def _stage_reports(self, lane: Lane, per_worker: list[list]) -> list[StageReport]:
        stages = self.gen_stages if lane.kind == "generate" else self.train_stages
        by_stage: dict[int, list] = {}
        for rs in per_worker:
            for res in rs:
                by_stage.setdefault(res.stage, []).append(res)
        out = []
        for i in stages:
            results = by_stage.get(i, [])
            spans = [s for res in results for s in res.spans]
            wall = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
            out.append(StageReport(lane.batch, i, self.c.plan.stages[i].id, self.c.mode, results, wall_seconds=wall))
        return out

    def _stale(self, r: Ready) -> None:
        """A batch whose oldest token is more than k versions behind the trainer: dropped,
        its rows counted in the ledger (in, never out: never trained)."""
        self.stats.dropped += 1
        end = self.c.plane.end_step(r.batch)
        self.c.ledger_rows.extend(end.ledger)
        self.c.ledger_rows.append({"step": r.batch, "edge": self.edge, "items_dropped": r.rows})

    def _fail(self, err: StageError, lane: Lane) -> None:
        """A failure in either lane: abort everything in flight; the session needs resume()."""
        for other in (self.gen, self.train):
            if other is not None:
                self.c._abort(other.batch, f"{err.stage!r} failed: {err.summary}")
        inflight = [r for other in (self.gen, self.train) if other is not None for r in other.refs]
        try:
            ray.wait(inflight, num_returns=len(inflight), timeout=5)
        except RayError:
            pass
        self.gen = self.train = None
        self.c.broken = (f"{type(err).__name__} in the {lane.kind} lane of schedule "
                         f"{self.schedule.kind!r}: call resume() to restart from the last checkpoint")
