"""The session's config: data plane (mode), seed, worker placement, the data-plane switches,
the schedule, profiling. Plus the checks that hold across these parts: a switch must mean
something in the mode, the centralized plane cannot overlap steps, worker groups add up.
A plain session (`lab.session`) takes a `SessionConfig`; an RL run's `RunConfig` holds one."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from pydantic import Field, field_validator, model_validator

from distflow_lab.core.config.base import Strict
from distflow_lab.core.errors import ConfigError

Mode = Literal["centralized", "coordinator", "distributed"]
"""The data planes: the one list of modes (`MODES` is the same, as a tuple)."""
MODES: tuple[str, ...] = get_args(Mode)


class Balance(str, enum.Enum):
    """How items are spread over consumer ranks where the layout changes (one list, used everywhere)."""

    LPT = "lpt"
    """Constrained LPT (paper Alg. 1) on token counts: equal item counts, longest first to the lightest
    rank; then swaps between the heaviest and light ranks (never worse than Alg. 1)."""
    KK = "kk"
    """Karmarkar-Karp largest differencing, equal item counts."""
    WORKLOAD = "workload"
    """Like lpt on each item's compute a·L + b·L² (a, b from the model config, else verl's constants)."""
    GROUP = "group"
    """Like workload, keeping the n responses of a prompt (same `uid`) on one rank."""
    MINIBATCH = "minibatch"
    """Like workload, balancing each optimizer mini-batch (consecutive slice of the batch) on its own."""
    NONE = "none"
    """Contiguous chunks in producer order (no balancing)."""
    IDENTITY = "identity"
    """Every rank gets its own rows back (same layout through the data plane: local cache off)."""

    def __str__(self) -> str:
        return self.value


class Switches(Strict):
    """The data-plane mechanisms of the paper's ablation (Fig. 10). Not every switch
    means something in every mode: setting one that does not is an error (`check_switches`)."""

    local_cache: bool = True
    """Keep a batch in the worker when the next stage has the same data-parallel layout (off: every edge goes through the data plane)."""
    double_buffer: bool = True
    """Release a step's buffer or coordinator state in the background (off: synchronously, on the actor's event loop)."""
    balance: Balance = Balance.LPT
    """Load balancing where the layout changes: lpt, kk, workload, group, minibatch or none (see `Balance`)."""
    num_buffers: int | Literal["per_node"] = "per_node"
    """DataBuffer actors (distributed mode): one per Ray node, or this many (1 = one central buffer)."""
    rows_per_object: int = Field(default=0, ge=0)
    """Coordinator mode: rows per object a producer puts. 0: its whole output in one object (fewest puts; a consumer on another node pulls it whole); 1: one object per sample, as siiRL (only used rows cross nodes, one put per sample)."""


# Which switches mean something in which mode (the others are errors when set explicitly).
SWITCHES_BY_MODE: dict[str, tuple[str, ...]] = {
    "centralized": ("balance",),
    "coordinator": ("local_cache", "double_buffer", "balance", "rows_per_object"),
    "distributed": ("local_cache", "double_buffer", "balance", "num_buffers"),
}
assert tuple(SWITCHES_BY_MODE) == MODES, "every mode says which switches it has"


def check_switches(mode: str, switches: Switches) -> None:
    """An explicitly set switch that has no meaning for `mode` is an error naming both."""
    if mode not in SWITCHES_BY_MODE:
        raise ConfigError(f"mode {mode!r} is not one of {list(MODES)}")
    bad = sorted(set(switches.model_fields_set) - set(SWITCHES_BY_MODE[mode]))
    if bad:
        raise ConfigError(f"switch {bad[0]!r} has no meaning in mode {mode!r} (it applies to "
                          f"{[m for m, s in SWITCHES_BY_MODE.items() if bad[0] in s]}); drop it or change the mode")
    if switches.balance == Balance.IDENTITY:
        raise ConfigError("switches.balance='identity' is internal (local cache off); use one of "
                          f"{[b.value for b in Balance if b != Balance.IDENTITY]}")


class ClusterOptions(Strict):
    """How the workers are placed."""

    world_size: int = Field(default=4, ge=1)
    """Number of DAG workers (one per device slot)."""
    cpus_per_worker: float = Field(default=1.0, ge=0)
    """Logical CPUs each worker reserves (Ray may oversubscribe physical cores)."""
    gpus_per_worker: float = Field(default=0.0, ge=0)
    """GPUs each worker reserves (0 on CPU machines)."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the workers."""
    threads_per_worker: int | None = None
    """torch threads per worker (None: cores // workers, at least 1)."""
    stage_timeout_s: float = Field(default=45.0, gt=0)
    """Longest a stage may run on any worker before the driver names the late workers (a node's `timeout_s` overrides it)."""
    buffer_wait_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a DataBuffer or the coordinator waits for producers before failing the step with a clear error."""
    torch_distributed: bool = False
    """Start a torch.distributed process group over the workers (gloo on CPU, nccl on GPU)."""
    fresh_workers: bool = False
    """Start new worker processes, and kill them at close, instead of taking parked ones from the worker pool and parking them again (runtime/worker_pool.py)."""


ScheduleName = str
"""A schedule's name: a key of `SCHEDULES` ("sync", "one_step_off", "async", or one registered)."""


@dataclass(frozen=True)
class ScheduleFacts:
    """A schedule's facts, read from here by config checks, the API, the CLI, the soak and the
    replay. What runs it registers itself under the same name in the runtime layer
    (`runtime.schedule.runs`)."""

    name: str
    staleness: int | None
    """The fixed staleness bound; None: the run's `max_staleness` (async)."""
    needs_groups: bool
    """Overlaps steps, so it needs two worker groups and a plane that runs them (not centralized)."""
    partial_rollout: bool
    """Takes `partial_rollout` (and the async-only options)."""

    def bound(self, max_staleness: int) -> int:
        """The staleness this schedule keeps, given the run's `max_staleness`."""
        return max_staleness if self.staleness is None else self.staleness


SCHEDULES: dict[str, ScheduleFacts] = {f.name: f for f in (
    ScheduleFacts("sync", 0, needs_groups=False, partial_rollout=False),
    ScheduleFacts("one_step_off", 1, needs_groups=True, partial_rollout=False),
    ScheduleFacts("async", None, needs_groups=True, partial_rollout=True))}


def register_schedule(facts: ScheduleFacts) -> ScheduleFacts:
    """Add a schedule's row: from then on `schedule.kind=<name>` is valid config, run by what
    `runtime.schedule.runs(<name>)` registered."""
    if facts.name in SCHEDULES and SCHEDULES[facts.name] != facts:
        raise ConfigError(f"schedule {facts.name!r} is already registered (as {SCHEDULES[facts.name]})")
    SCHEDULES[facts.name] = facts
    return facts


class ScheduleOptions(Strict):
    """How steps overlap. sync: every stage of a step, then the next (DistFlow, the paper).
    one_step_off: generation of step t+1 runs beside training of step t on disjoint worker
    groups. async: generation runs ahead continuously, up to `max_staleness` policy versions."""

    kind: ScheduleName = "sync"
    """The schedule: a name in `SCHEDULES`."""
    max_staleness: int = Field(default=1, ge=0)
    """async: no trained sample comes from a policy more than this many versions old (0: sync order)."""
    partial_rollout: bool = False
    """async: a generation in flight continues across a weight update (each token keeps its policy version)."""
    on_stale: Literal["drop", "regenerate"] = "drop"
    """async with partial rollouts: a sequence in flight whose oldest token is more than max_staleness versions old is dropped, or generated again from its start (counted). Without partial rollouts nothing is ever stale: generation is paced to stay within the bound."""

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in SCHEDULES:
            raise ValueError(f"schedule {kind!r} is not one of {list(SCHEDULES)}")
        return kind

    @model_validator(mode="after")
    def _coherent(self) -> "ScheduleOptions":
        if not SCHEDULES[self.kind].partial_rollout:
            extra = sorted(self.model_fields_set & {"max_staleness", "partial_rollout", "on_stale"})
            if extra:
                takes = [n for n, f in SCHEDULES.items() if f.partial_rollout]
                raise ValueError(f"{extra[0]} has no meaning for schedule {self.kind!r} (only for "
                                 f"{', '.join(map(repr, takes))})")
        return self

    @property
    def staleness(self) -> int:
        """The bound the schedule keeps: 0 for sync, 1 for one_step_off, max_staleness for async."""
        return SCHEDULES[self.kind].bound(self.max_staleness)


class WeightSyncOptions(Strict):
    """Weight sync. Between worker groups (runtime/weight_transport.py): the training group's rank 0
    writes the policy in buckets, each rollout worker reads and checks every tensor. Colocated
    (algos/engine_setup.py, sync_weights): the actor's gathered buckets go straight into the engine."""

    transport: Literal["auto", "shm", "object_store"] = "auto"
    """Where the buckets go: "shm", the publisher's own shared memory rewritten in place (one node;
    runtime/shm_slots.py), or "object_store", Ray's (any nodes). "auto": shm when every worker is on
    one node."""

    bucket_mib: int = Field(default=256, ge=1)
    """Largest bucket in MiB (between groups: one object-store object or one shared-memory segment;
    colocated: what the actor gathers and the engine loads at a time); a larger single tensor goes alone. Fewer, larger buckets write faster into the object store
    (benchmarks/probes/weight_sync_object_store.py: 256 MiB at 0.50x memcpy, 64 MiB at 0.08x)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """A sync (or a call to the WeightBoard) that takes longer is WeightSyncTimeout / WeightBoardLost, never a hang."""
    mode: Literal["full", "delta"] = "full"
    """What a version carries. "full": every tensor. "delta": also the elements that changed since the
    version before (positions and values; a tensor whose change is bigger than itself goes whole), as
    object-store objects: a reader holding that version reads and patches only those, every tensor then
    checked against its fingerprint; a reader further behind takes the full version. It pays between
    nodes, in a low-precision rollout: 2-5 % of SmolLM2-135M's bfloat16 elements change per update, and
    99.6 % of its float32 ones (benchmarks/results/probe_weight_delta.json). HF rollouts of the full
    policy, load "copy" (a delta patches the rollout's own weights)."""
    load: Literal["auto", "copy", "map"] = "auto"
    """How a rollout worker takes a policy from another group. "copy": into its own weights (every
    engine). "map": an HF rollout's parameters become the published buffers themselves (views of the
    publisher's shared-memory slot, which it holds until the next version; or of the object-store
    object): no copy on the reader, and the rollout workers of a node share one copy of the policy.
    HF rollouts of a full policy only (vLLM processes what it loads; a LoRA policy is merged into
    W0; a delta patches the rollout's own weights). "auto": "map" where it can, else "copy"."""


class ProfileOptions(Strict):
    """torch.profiler traces of chosen stages and steps (one file per rank per stage per step)."""

    stages: list[str] = Field(default_factory=list)
    """Stages to profile (empty: every stage)."""
    steps: list[int] | None = None
    """Steps to profile (None: every step)."""
    directory: str = "profiles"
    """Where the traces go (relative: under the working directory, or the run's folder for `distflow-lab run`)."""


def check_schedule(mode: str, schedule: ScheduleOptions, groups: Mapping[str, int] | None = None) -> None:
    """The centralized plane moves every batch through the driver stage by stage: it cannot overlap
    steps, nor run a worker group's stages back to back on its workers (what groups do)."""
    if SCHEDULES[schedule.kind].needs_groups and mode == "centralized":
        raise ConfigError(f"schedule {schedule.kind!r} needs the coordinator or distributed data plane; mode "
                          "'centralized' moves every batch through the driver, stage by stage, one step at a time")
    if groups and mode == "centralized":
        raise ConfigError(f"worker groups {dict(groups)} need the coordinator or distributed data plane; mode "
                          "'centralized' moves every batch through the driver, stage by stage, while a group runs "
                          "its stages back to back on its own workers")


def check_groups(groups: Mapping[str, int] | None, *, world_size: int | None = None, schedule: str = "sync",
                 pair: bool = False, where: str = "", world_size_key: str = "world_size",
                 error: type[Exception] = ConfigError) -> None:
    """The one check of worker groups, wherever they are named (`DAG.with_groups`, the planner, a
    run config's `groups`, a DAG shape, the schedules): positive integer sizes; exactly two,
    generation then training, when the schedule overlaps steps (not sync) or `pair` asks for them;
    together exactly `world_size` workers when that is known. `where` names what holds the groups,
    `world_size_key` the setting the user wrote for the worker count; `error` is the type raised."""
    at = f"{where}: " if where else ""
    overlaps = SCHEDULES[schedule].needs_groups
    if not groups:
        if overlaps:
            raise error(f"schedule {schedule!r} needs a DAG on two worker groups (generation, then training): "
                        "dag.with_groups(rollout=..., train=...), or in a run config `groups: {rollout: 1, train: 1}`"
                        + (f" ({where}: none)" if where else ""))
        return
    bad = {k: v for k, v in groups.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise error(f"{at}group sizes must be positive integers, got {bad}")
    if (pair or overlaps) and len(groups) != 2:
        why = f"schedule {schedule!r} needs" if overlaps else "the generation and training stages need"
        raise error(f"{at}{why} two worker groups (generation, then training), got {len(groups)}: {dict(groups)}")
    if world_size is not None and sum(groups.values()) != world_size:
        raise error(f"{at}worker groups {dict(groups)} hold {sum(groups.values())} workers but "
                    f"{world_size_key}={world_size}: make it their sum")


class SessionConfig(Strict):
    """A session: where it runs, how the data plane behaves, and the algorithm's own config."""

    mode: Mode = "distributed"
    """Data plane: centralized (verl-style driver dispatch), coordinator (one metadata-only actor) or distributed (DistFlow: per-node DataBuffers)."""
    seed: int = 0
    """Seed for data shuffling and every stage's random generator."""
    cluster: ClusterOptions = Field(default_factory=ClusterOptions)
    """Worker placement."""
    switches: Switches = Field(default_factory=Switches)
    """Data-plane switches (ablations)."""
    schedule: ScheduleOptions = Field(default_factory=ScheduleOptions)
    """sync, one_step_off or async (the last two need a DAG with worker groups)."""
    weight_sync: WeightSyncOptions = Field(default_factory=WeightSyncOptions)
    """Worker groups: the weight sync's bucket size and deadline."""
    profile: ProfileOptions | None = None
    """torch.profiler traces of chosen stages and steps (None: no profiling)."""
    keep_outputs: bool = True
    """Keep each stage's latest output on the workers so `peek` can show samples."""
    history_steps: int = Field(default=1000, ge=1)
    """Step reports (spans) the driver keeps; older ones are dropped (metrics rows are all kept)."""
    algo: Any = None
    """Algorithm config visible to stage functions as `ctx.config` (a RunConfig for the built-in algorithms)."""
