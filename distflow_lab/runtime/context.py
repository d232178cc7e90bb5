"""What a stage function sees besides its batch: `fn(batch, ctx: StageContext)`."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from distflow_lab.core.config import ScheduleOptions
from distflow_lab.core.spans import PHASES, Span, SpanRecorder
from distflow_lab.runtime.engines import StageState

if TYPE_CHECKING:
    from distflow_lab.datasets.loader import ShardedLoader
    from distflow_lab.graph.planner import Plan, Stage


@dataclass(kw_only=True)
class StageContext:
    """One stage on one worker in one batch. Built in one place (keyword-only)."""

    batch_id: int
    stage: "Stage"
    worker: int
    world_size: int
    seed: int
    node: str = "local"
    config: Any = None
    engines: Any = field(default_factory=StageState)  # the worker's engines (runtime.engines.WorkerEngines)
    loader: "ShardedLoader | None" = None
    recorder: SpanRecorder | None = None
    groups: dict[str, Any] = field(default_factory=dict)  # stage id -> this worker's dp process group
    dp_rank: int | None = None  # default: from the stage's layout and `worker`
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)  # sync, one_step_off or async
    refresh_policy: Callable[[], int] | None = None  # partial rollouts: load the newest policy, return its version
    trains_by: int | None = None  # async generation: the latest update this batch trains at (tokens older than
    # trains_by - max_staleness can never train; None: synchronous)
    roles: frozenset[str] = frozenset()  # the roles of the stages this worker runs (engine set-up builds theirs)
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    _rng: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.dp_rank is None:
            self.dp_rank = self.stage.dp_rank(self.worker)

    @property
    def dp_size(self) -> int:
        return self.stage.dp

    @property
    def group_rank(self) -> int:
        return self.stage.group_rank(self.worker)

    @property
    def params(self) -> Mapping[str, Any]:
        """The node's `params` (read-only): the stage function's own knobs."""
        return MappingProxyType(self.stage.params)

    @property
    def process_group(self) -> Any:
        """The torch.distributed group of this stage's layout that holds this worker:
        the ranks with the same tensor-parallel rank (None without torch.distributed)."""
        return self.groups.get(self.stage.id)

    def span(self, phase: str, **counts):
        """Time a part of this stage as its own span (e.g. "weight_sync")."""
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(self.batch_id, self.stage.id, phase, **counts)

    def record(self, phase: str, start: float, end: float) -> None:
        """A span of this stage that was timed apart (wall-clock `time.time()` seconds), e.g. a multi-turn
        rollout's waits for its environments, collected as they happened and recorded after."""
        if self.recorder is not None and end > start:
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")
            self.recorder.add(Span(self.batch_id, self.stage.id, self.recorder.worker, self.recorder.node, phase,
                                   start, end, mode=self.recorder.mode))

    @property
    def rng(self) -> torch.Generator:
        """Seeded by (seed, batch, stage, dp rank): the same rows see the same randomness in every mode."""
        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        return self._rng

    def log(self, **metrics: float) -> None:
        """Record metrics; the driver averages them over data-parallel ranks (weighted by rows),
        except keys ending in `_max`, which take the max over ranks."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def count(self, **counts: float) -> None:
        """Record counts (rows kept, items dropped, ...); the driver sums them over data-parallel ranks."""
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + float(v)


def stage_seed(seed: int, batch_id: int, stage: int, dp_rank: int) -> int:
    return int(np.random.SeedSequence([seed, batch_id, stage, dp_rank]).generate_state(1)[0])


def stage_context(stage: "Stage", *, batch_id: int, worker: int, world_size: int, session_seed: int,
                  dp_rank: int | None = None, **fields: Any) -> StageContext:
    """The context of `stage` on `worker` in `batch_id`, its seed derived from the session's."""
    dp = stage.dp_rank(worker) if dp_rank is None else dp_rank
    return StageContext(batch_id=batch_id, stage=stage, worker=worker, world_size=world_size, dp_rank=dp,
                        seed=stage_seed(session_seed, batch_id, stage.index, dp), **fields)


def local_context(plan: "Plan", stage: str, batch_id: int = 0, dp_rank: int = 0, seed: int = 0, config: Any = None,
                  engines: Any = None) -> StageContext:
    """A context for calling a stage function by hand, outside Ray (tests, notebooks):
    `fn(batch, local_context(dag.plan(4), "advantage"))`."""
    st = plan.stage(stage)
    return stage_context(st, batch_id=batch_id, worker=st.worker_of(dp_rank), world_size=plan.world_size,
                         session_seed=seed, dp_rank=dp_rank, config=config, engines=engines if engines is not None else StageState(),
                         roles=frozenset(s.role for s in plan.stages))  # by hand: every role's engines
