"""A `runtime.schedule.Dispatch` in simulated time: the scheduler's own rules, no workers.

The live controller gives a schedule Ray calls and the wall clock; this gives it calls
that "finish" at times a cost model says, and a clock that jumps to the next finish
whenever the schedule waits. So `runtime/schedules.Lanes` runs unchanged in a what-if
replay (experiments/schedule_replay.py): which batch trains when, what runs ahead, what
is dropped as too stale, and what every update's wall and idle shares are, are decided
by the same code as in a real run.

A cost model (`SegmentCosts` in schedule_replay.py) answers two questions:
    generate(batch, start, version, trains_by, published) -> (end, oldest token's version)
    train(batch, start) -> (when it publishes the next policy version, when its lane ends)
`published(t)` is the newest version published by time t (what a streaming rollout pulls
between decode chunks).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from distflow_lab.dataplane.interface import EndOfStep
from distflow_lab.runtime.schedule import Dispatch

NEVER_S = 1e9  # a stage timeout in simulated time: nothing times out


class SegmentCostModel(Protocol):
    def generate(self, batch: int, start: float, version: int, trains_by: int,
                 published: Callable[[float], int]) -> tuple[float, int]: ...

    def train(self, batch: int, start: float) -> tuple[float, float]: ...


@dataclass(eq=False)
class SimCall:
    """A segment call in flight: its group's answer, ready at `end`."""

    end: float
    answer: dict


class SimDispatch:
    def __init__(self, costs: SegmentCostModel) -> None:
        self.costs = costs
        self.now = 0.0
        self.updates = 0  # training segments started: update t is the t-th
        self.publishes: list[float] = []  # when each policy version after 0 was published (sorted)

    def dispatch(self) -> Dispatch:
        return Dispatch(call=self.call, gather=self.gather, wait=self.wait, failed=lambda done: False,
                        now=lambda: self.now, abort=lambda step, reason: None,
                        end_step=lambda step: EndOfStep(0.0, []), timeout=lambda stage: NEVER_S)

    def published(self, t: float) -> int:
        return bisect.bisect_right(self.publishes, t)

    def call(self, method: str, workers: list[int], args: tuple) -> list[SimCall]:
        """One call stands for the group's (its ranks finish together in the model)."""
        if method == "generate_segment":
            batch, _stages, trains_by, version, _replayed = args
            end, version_min = self.costs.generate(batch, self.now, version, trains_by,
                                                   lambda t: max(version, self.published(t)))
            return [SimCall(end, {"results": [], "version": version, "version_min": version_min, "checksum": 0.0})]
        if method == "train_segment":
            batch, _stages = args
            publish, end = self.costs.train(batch, self.now)
            bisect.insort(self.publishes, publish)
            update, self.updates = self.updates, self.updates + 1
            return [SimCall(end, {"results": [], "version": update + 1, "version_before": update, "checksum": 0.0})]
        raise ValueError(f"a simulated dispatch runs generate_segment and train_segment, not {method!r}")

    def wait(self, calls: list[SimCall], num_returns: int, timeout_s: float) -> tuple[list, list]:
        """The clock moves to the `num_returns`-th finish (at most `timeout_s` on)."""
        ends = sorted(c.end for c in calls)
        if 0 < num_returns <= len(ends) and ends[num_returns - 1] > self.now:
            self.now = min(ends[num_returns - 1], self.now + timeout_s)
        done = [c for c in calls if c.end <= self.now]
        return done, [c for c in calls if c.end > self.now]

    def gather(self, calls: list[SimCall], step: int, stage: Any, limit_s: float, workers: list[int]) -> list[dict]:
        self.now = max([self.now, *(c.end for c in calls)])
        return [c.answer for c in calls]
