"""The synchronous schedule (DistFlow's): every stage of update t, then update t+1.

On one set of workers (no groups) a batch runs on every worker at once, as one call
each (the driver moves no data), or stage by stage when the data plane moves data
through the driver (centralized) or the user steps it (`step_stage`):

    plane.begin_batch -> for each stage: args = plane.stage_args -> workers run it -> plane.stage_done
                     -> plane.end_batch -> UpdateReport (recorded by the controller)

Its failure rule: a failed batch is rewound (every worker out of it, the data plane's
state of it reset, loaders back at its start) so the same batch can run again; a batch
that lost a data-plane actor before any training stage ran is retried once at once. A
batch that cannot be rewound (a worker dead or stuck) leaves the session broken.

On worker groups "sync" is Lanes with k = 0 (runtime/schedule_lanes.py): the generation
group's segment, then the training group's, in sync order (`open_sync` picks).
"""
from __future__ import annotations

import time

from distflow_lab.core.errors import PlaneLost, StageError, StageTimeout
from distflow_lab.runtime.results import StageReport, UpdateReport, stage_reports
from distflow_lab.runtime.schedule import Schedule, ScheduleSetup, runs


@runs("sync")
def open_sync(setup: ScheduleSetup) -> Schedule:
    """Sync on worker groups is Lanes in sync order; on one set of workers, SyncSchedule."""
    if setup.plan.groups:
        from distflow_lab.runtime.schedule_lanes import Lanes

        return Lanes(setup)
    return SyncSchedule(setup)


class SyncSchedule:
    def __init__(self, setup: ScheduleSetup) -> None:
        self.plan, self.mode, self.plane, self.d = setup.plan, setup.mode, setup.plane, setup.dispatch
        self.kind = setup.options.kind
        self.updates = setup.updates
        self.position = 0  # the next stage of the current batch
        self.current: list[StageReport] = []  # the stages of the current batch run so far
        self.retried: set[int] = set()  # batches retried once already
        self._ledger: list[dict] = []
        self._t0, self._rpcs0 = 0.0, 0

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> UpdateReport:
        if self.position:  # finish what step_stage calls left
            while True:
                _, done = self.step_stage()
                if done is not None:
                    return done
        self._begin()
        self.current = self._run_batch_or_retry(self.updates)
        self.position = len(self.plan.stages)
        return self._finish()

    def step_stage(self) -> tuple[StageReport, UpdateReport | None]:
        """The next stage; and the batch's report when that stage ended it."""
        if self.position == 0:
            self._begin()
        report = self._run_stage(self.updates, self.position)
        self.current.append(report)
        self.position += 1
        return report, (self._finish() if self.position == len(self.plan.stages) else None)

    def _begin(self) -> None:
        self.current, self._t0, self._rpcs0 = [], self.d.now(), self.d.rpcs()
        self.plane.begin_batch(self.updates)

    def _finish(self) -> UpdateReport:
        end = self.d.end_batch(self.updates)
        self._ledger.extend(end.ledger)
        report = UpdateReport(self.updates, self.mode, self.current, self.d.now() - self._t0, end.seconds,
                            self.d.rpcs() - self._rpcs0)
        self.updates, self.position, self.current = self.updates + 1, 0, []
        return report

    def _run_stage(self, batch_id: int, index: int) -> StageReport:
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        driver_spans = self.plane.run_on_driver(batch_id, st)
        if driver_spans is not None:  # the driver ran it (centralized data loading)
            return StageReport(batch_id, index, st.id, self.mode, [], driver_spans, time.perf_counter() - t0)
        args = self.plane.stage_args(batch_id, st)  # one per worker of the stage, in rank order
        refs = [r for w, a in zip(st.ranks, args) for r in self.d.call("run_stage", [w], (batch_id, index, a))]
        answers = self.d.gather(refs, batch_id, st.id, self.d.timeout(st), list(st.ranks))
        driver_spans = self.plane.stage_done(batch_id, st, [h for _, h in answers])
        return StageReport(batch_id, index, st.id, self.mode, [r for r, _ in answers], driver_spans,
                           time.perf_counter() - t0)

    def _run_batch(self, batch_id: int) -> list[StageReport]:
        if self.plane.driver_moves_data:
            return [self._run_stage(batch_id, i) for i in range(len(self.plan.stages))]
        workers = list(range(self.plan.world_size))
        limit = sum(self.d.timeout(st) for st in self.plan.stages)
        reached = self.d.reached  # one call runs every stage: an error names the stage its worker had reached
        per_worker = self.d.gather(self.d.call("run_batch", workers, (batch_id,)), batch_id,
                                   lambda w: reached(w) or "(whole batch)", limit, workers)
        return stage_reports(batch_id, self.plan.stages, self.mode, per_worker)

    def _run_batch_or_retry(self, batch_id: int) -> list[StageReport]:
        """A data-plane actor lost mid-batch: the batch runs again once, from its start,
        if no training stage could have changed a model yet."""
        try:
            return self._run_batch(batch_id)
        except PlaneLost as e:
            detected = time.time()
            if not self._retryable(batch_id, e) or not self.d.recover(batch_id, None):
                raise
            self.retried.add(batch_id)
            self.d.retried({"batch_id": batch_id, "stage": e.stage, "worker": e.worker, "reason": e.summary,
                            "detected_at": detected})
            self._begin()
            return self._run_batch(batch_id)

    def _retryable(self, batch_id: int, err: PlaneLost) -> bool:
        train = [s.index for s in self.plan.stages if s.type == "train"]
        try:
            failed = self.plan.stage(err.stage).index
        except KeyError:
            return False
        return batch_id not in self.retried and (not train or failed < min(train))

    # ---- failures and checkpoints ----------------------------------------------------------
    def failed(self, err: StageError) -> str | None:
        """The same batch runs again on the next call, or (if the workers cannot) the session is broken."""
        batch_id = self.updates
        self.current, self.position = [], 0
        # a stage that timed out is hung: waiting longer for it only delays the error
        if self.d.recover(batch_id, 1.0 if isinstance(err, StageTimeout) else None):
            return None
        return (f"batch {batch_id} failed ({type(err).__name__}) and some workers or data-plane actors are "
                "dead or still busy in it: call resume() to restart them from the last checkpoint")

    def take_ledger(self) -> list[dict]:
        rows, self._ledger = self._ledger, []
        return rows

    def state(self) -> dict:
        return {"kind": self.kind, "next_batch": self.updates, "keep_versions": []}

    def discard(self) -> list[int]:
        return []  # nothing is held between batches
