"""An example schedule, written as a user would add one (in a file or a notebook cell): its
row of facts and a class registered under its name. "sync with a delay": the synchronous
schedule, each update starting at least DELAY_S after the last one ended (a rate-limited
reward service, say). It composes SyncSchedule and changes only `step`."""
from __future__ import annotations

import time

from distflow_lab.core.config import ScheduleFacts, register_schedule
from distflow_lab.runtime.results import UpdateReport
from distflow_lab.runtime.schedule import ScheduleSetup, runs
from distflow_lab.runtime.schedule_sync import SyncSchedule

DELAY_S = 0.3

register_schedule(ScheduleFacts("sync_delayed", 0, needs_groups=False, partial_rollout=False))


@runs("sync_delayed")
class DelayedSync:
    def __init__(self, setup: ScheduleSetup) -> None:
        self.inner, self.now = SyncSchedule(setup), setup.dispatch.now
        self.last_end: float | None = None

    def __getattr__(self, name: str):  # position, current, step_stage, failed, take_ledger, state, discard
        return getattr(self.inner, name)

    def step(self) -> UpdateReport:
        waited = max(0.0, self.last_end + DELAY_S - self.now()) if self.last_end is not None else 0.0
        time.sleep(waited)
        report = self.inner.step()
        self.last_end = self.now()
        report.extra_metrics["schedule/waited_s"] = waited
        return report
