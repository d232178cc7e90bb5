"""A `runtime.schedule.Dispatch` in simulated time: the scheduler's own rules, no workers.

The live controller gives a schedule Ray calls and the wall clock; this gives it calls
that "finish" at times a cost model says, and a clock that jumps to the next finish
whenever the schedule waits. So `runtime/schedule_lanes.Lanes` runs unchanged in a what-if
replay (experiments/schedule_replay.py): which batch trains when, what runs ahead, what
is dropped as too stale, and what every update's wall and idle shares are, are decided
by the same code as in a real run.

A cost model (`SegmentCosts` in schedule_replay.py) answers two questions:
    generate(batch, start, version, trains_by, published) -> (end, oldest token's version)
    train(batch, start) -> (when it publishes the next policy version, when its lane ends)
`published(t)` is the newest version published by time t (what a streaming rollout pulls
between decode chunks). The model's seconds are a lane's alone; while both lanes run, each
runs slower: the generation lane `gen_contention` times, the training lane `train_contention`
times (the groups share the machine's cores). With `jitter` > 0 every call's seconds are the
model's times a log-normal factor of that spread (mean 1, drawn from `seed`): a real run's
calls vary around any cost model, and where generation just keeps up with training that
variation decides which batches train one version fresher, so a replay that samples it
predicts a mixture where one without it predicts all or nothing.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from distflow_lab.dataplane.interface import EndOfBatch
from distflow_lab.runtime.schedule import Dispatch

NEVER_S = 1e9  # a stage timeout in simulated time: nothing times out


class SegmentCostModel(Protocol):
    def generate(self, batch: int, start: float, version: int, trains_by: int,
                 published: Callable[[float], int]) -> tuple[float, int]: ...

    def train(self, batch: int, start: float) -> tuple[float, float]: ...


@dataclass(eq=False)
class SimCall:
    """A segment call in flight: its group's answer, and the seconds of work it has left (as if
    it ran alone); a training call also the work left until it publishes the next policy."""

    kind: str  # "generate" | "train"
    left: float
    answer: dict
    publish_left: float | None = None
    end: float | None = None  # when it finished


class SimDispatch:
    """`gen_contention`, `train_contention`: how much slower each lane runs while the other one runs
    too (the machine's cores are one resource; 1.0: independent groups). `jitter`: the spread
    (standard deviation of the log) of a call's seconds around the cost model; 0: none."""

    def __init__(self, costs: SegmentCostModel, gen_contention: float = 1.0, train_contention: float = 1.0,
                 jitter: float = 0.0, seed: int = 0) -> None:
        self.costs = costs
        self.jitter, self.rng = jitter, np.random.default_rng(seed)
        self.slowdown = {"generate": gen_contention, "train": train_contention}
        self.now = 0.0
        self.updates = 0  # training segments started: update t is the t-th
        self.publishes: list[float] = []  # when each policy version after 0 was published (sorted)
        self.active: list[SimCall] = []

    def dispatch(self) -> Dispatch:
        return Dispatch(call=self.call, gather=self.gather, wait=self.wait, failed=lambda done: False,
                        now=lambda: self.now, abort=lambda batch_id, reason: None,
                        end_batch=lambda batch_id: EndOfBatch(0.0, []), timeout=lambda stage: NEVER_S)

    # ---- the clock ----------------------------------------------------------------------
    def _rate(self, c: SimCall, both: bool) -> float:
        """Work seconds per second for call `c`, alone or beside the other lane."""
        return 1.0 / self.slowdown[c.kind] if both else 1.0

    def _both(self) -> bool:
        return len({c.kind for c in self.active}) > 1

    def _next_end(self) -> float:
        both = self._both()
        return self.now + min(c.left / self._rate(c, both) for c in self.active)

    def _advance(self, to: float) -> None:
        """Run the calls in flight until `to` (piecewise: the rates change when one ends)."""
        while self.active and self.now < to:
            both = self._both()
            t = min(to, self._next_end())
            for c in self.active:
                done = (t - self.now) * self._rate(c, both)
                if c.publish_left is not None and c.publish_left <= done:
                    bisect.insort(self.publishes, self.now + c.publish_left / self._rate(c, both))
                    c.publish_left = None
                elif c.publish_left is not None:
                    c.publish_left -= done
                c.left -= done
            self.now = t
            for c in [c for c in self.active if c.left <= 1e-12]:
                c.end = t
                self.active.remove(c)
        self.now = max(self.now, to)

    def published(self, t: float) -> int:
        """The newest version published by time t: the ones published, and the training calls in
        flight at the rate they run beside a generation."""
        due = [self.now + c.publish_left / self._rate(c, True) for c in self.active if c.publish_left is not None]
        return bisect.bisect_right(self.publishes, t) + sum(d <= t for d in due)

    # ---- the Dispatch -------------------------------------------------------------------
    def call(self, method: str, workers: list[int], args: tuple) -> list[SimCall]:
        """One call stands for the group's (its ranks finish together in the model)."""
        if method == "generate_segment":
            batch, _stages, trains_by, version, _replayed = args
            end, version_min = self.costs.generate(batch, self.now, version, trains_by,
                                                   lambda t: max(version, self.published(t)))
            c = SimCall("generate", end - self.now,
                        {"results": [], "version": version, "version_min": version_min, "checksum": 0.0})
        elif method == "train_segment":
            batch, _stages = args
            publish, end = self.costs.train(batch, self.now)
            update, self.updates = self.updates, self.updates + 1
            c = SimCall("train", end - self.now,
                        {"results": [], "version": update + 1, "version_before": update, "checksum": 0.0},
                        publish_left=publish - self.now)
        else:
            raise ValueError(f"a simulated dispatch runs generate_segment and train_segment, not {method!r}")
        if self.jitter > 0:  # mean 1: the expected seconds stay the model's
            f = math.exp(self.rng.normal(-self.jitter ** 2 / 2, self.jitter))
            c.left *= f
            c.publish_left = None if c.publish_left is None else c.publish_left * f
        if c.left <= 0:
            c.end = self.now
            if c.publish_left is not None:
                bisect.insort(self.publishes, self.now)
        else:
            self.active.append(c)
        return [c]

    def wait(self, calls: list[SimCall], num_returns: int, timeout_s: float) -> tuple[list, list]:
        """The clock runs until `num_returns` of `calls` ended (at most `timeout_s` on)."""
        deadline = self.now + timeout_s
        while sum(c.end is not None for c in calls) < num_returns and self.active:
            t = self._next_end()
            self._advance(min(t, deadline))
            if t > deadline:
                break
        return [c for c in calls if c.end is not None], [c for c in calls if c.end is None]

    def gather(self, calls: list[SimCall], batch_id: int, stage: Any, limit_s: float, workers: list[int]) -> list[dict]:
        self.wait(calls, len(calls), NEVER_S)
        return [c.answer for c in calls]
