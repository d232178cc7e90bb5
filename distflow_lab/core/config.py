"""Typed configuration (pydantic): every field documented, unknown keys are an
error (never silently dropped), YAML loads safely, CLI-style `a.b=value`
overrides are parsed as YAML scalars and an error names the override at fault.

One definition per concept: the session (mode, schedule, switches, cluster),
a DAG node's data source and contract, and the RL run (model, data, rollout,
actor, critic, algorithm, reward, trainer). Engines take these sections as
they are; nothing below re-declares them.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from distflow_lab.core.errors import ConfigError

__all__ = ["ConfigError"]  # re-exported: `from distflow_lab.core.config import ConfigError`


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# ---------------------------------------------------------------------------------
# The session: data plane, schedule, switches, placement.
# ---------------------------------------------------------------------------------

Mode = Literal["centralized", "coordinator", "distributed"]
MODES: tuple[str, ...] = ("centralized", "coordinator", "distributed")


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


class ScheduleOptions(Strict):
    """How steps overlap. sync: every stage of a step, then the next (DistFlow, the paper).
    one_step_off: generation of step t+1 runs beside training of step t on disjoint worker
    groups. async: generation runs ahead continuously, up to `max_staleness` policy versions."""

    kind: Literal["sync", "one_step_off", "async"] = "sync"
    """The schedule."""
    max_staleness: int = Field(default=1, ge=0)
    """async: no trained sample comes from a policy more than this many versions old (0: sync order)."""
    partial_rollout: bool = False
    """async: a generation in flight continues across a weight update (each token keeps its policy version)."""
    on_stale: Literal["drop", "regenerate"] = "drop"
    """async with partial rollouts: a sequence in flight whose oldest token is more than max_staleness versions old is dropped, or generated again from its start (counted). Without partial rollouts nothing is ever stale: generation is paced to stay within the bound."""

    @model_validator(mode="after")
    def _coherent(self) -> "ScheduleOptions":
        if self.kind != "async":
            extra = sorted(self.model_fields_set & {"max_staleness", "partial_rollout", "on_stale"})
            if extra:
                raise ValueError(f"{extra[0]} has no meaning for schedule {self.kind!r} (only for 'async')")
        return self

    @property
    def staleness(self) -> int:
        """The bound the schedule keeps: 0 for sync, 1 for one_step_off, max_staleness for async."""
        return {"sync": 0, "one_step_off": 1}.get(self.kind, self.max_staleness)


class ProfileOptions(Strict):
    """torch.profiler traces of chosen stages and steps (one file per rank per stage per step)."""

    stages: list[str] = Field(default_factory=list)
    """Stages to profile (empty: every stage)."""
    steps: list[int] | None = None
    """Steps to profile (None: every step)."""
    directory: str = "profiles"
    """Where the traces go (relative: under the working directory, or the run's folder for `distflow-lab run`)."""


def check_schedule(mode: str, schedule: ScheduleOptions) -> None:
    """The centralized plane moves every batch through the driver stage by stage: it cannot overlap steps."""
    if schedule.kind != "sync" and mode == "centralized":
        raise ConfigError(f"schedule {schedule.kind!r} needs the coordinator or distributed data plane; mode "
                          "'centralized' moves every batch through the driver, stage by stage, one step at a time")


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
    profile: ProfileOptions | None = None
    """torch.profiler traces of chosen stages and steps (None: no profiling)."""
    keep_outputs: bool = True
    """Keep each stage's latest output on the workers so `peek` can show samples."""
    history_steps: int = Field(default=1000, ge=1)
    """Step reports (spans) the driver keeps; older ones are dropped (metrics rows are all kept)."""
    algo: Any = None
    """Algorithm config visible to stage functions as `ctx.config` (a RunConfig for the built-in algorithms)."""


# ---------------------------------------------------------------------------------
# A DAG node's typed parts.
# ---------------------------------------------------------------------------------


class DataSpec(Strict):
    """What a data_load node reads: each worker loads its data-parallel shard."""

    source: str
    """A .parquet/.jsonl path, or "synthetic" (prompt lengths only, for data-plane benchmarks)."""
    batch_size: int = Field(ge=1)
    """Prompts per step over all data-parallel ranks (must divide by dp)."""
    shuffle: bool = True
    """Shuffle each rank's shard every epoch (seeded)."""
    num_rows: int | None = Field(default=None, ge=1)
    """Synthetic sources: rows in the dataset (default 4 x batch_size)."""
    mean_len: float = Field(default=200.0, gt=0)
    """Synthetic sources: median prompt length (lognormal)."""
    sigma: float = Field(default=0.5, ge=0)
    """Synthetic sources: lognormal sigma of prompt lengths."""
    max_len: int = Field(default=1024, ge=1)
    """Synthetic sources: longest prompt."""
    lengths_from: str | None = None
    """Synthetic sources: a jsonl whose `question` lengths give real prompt lengths (e.g. GSM8K)."""


class Contract(Strict):
    """What a stage promises; a stage that breaks it fails with StageContractError naming it."""

    outputs: list[str] = Field(default_factory=list)
    """Columns that must exist in the stage's output."""
    rows: Literal["same", "any"] = "any"
    """same: the stage keeps its input's row count."""


# ---------------------------------------------------------------------------------
# The RL run: model, data, rollout, actor/critic, algorithm, trainer.
# ---------------------------------------------------------------------------------


class TinySpec(Strict):
    """A random-init tiny Qwen2 (built offline when `model.path` holds no model); the vocabulary comes from the tokenizer."""

    hidden_size: int = 64
    """Residual width (and of the tied embedding)."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads per attention layer; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 256
    """Hidden width of the SwiGLU MLP."""
    max_position_embeddings: int = 64
    """Longest prompt + response the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""


class WarmStart(Strict):
    """Supervised warm-up (SFT) so RL starts from a policy with non-zero reward."""

    steps: int = Field(default=0, ge=0)
    """SFT optimizer steps before RL (0: none). The result is cached next to the model."""
    lr: float = 3e-3
    """SFT learning rate."""
    batch_size: int = 64
    """Examples per SFT step."""


class ModelOptions(Strict):
    path: str = "models/tiny-qwen2"
    """Local model directory (a Hugging Face checkpoint, e.g. Qwen2.5; never downloaded). Relative: under the cache dir."""
    tiny: TinySpec | None = Field(default_factory=TinySpec)
    """Build this tiny model at `path` if it holds none (None: `path` must hold a checkpoint)."""
    warm_start: WarmStart = Field(default_factory=WarmStart)
    """SFT warm-up before RL."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype (bfloat16 on GPU)."""


class DataOptions(Strict):
    train: str = "arithmetic"
    """verl-schema parquet/jsonl path, or "arithmetic" (generated) or "gsm8k" (converted from ../shared)."""
    prompts_per_step: int = Field(default=16, ge=1)
    """Prompts in the global batch of one step (each gets `rollout.n` responses)."""
    max_prompt_len: int = Field(default=16, ge=1)
    """P: prompts are left-padded to this many tokens; longer ones are truncated (counted and reported)."""
    shuffle: bool = True
    """Shuffle each rank's shard every epoch (seeded)."""
    arithmetic_rows: int = 4096
    """Rows generated for the arithmetic task."""
    arithmetic_max_operand: int = 9
    """Largest operand of the arithmetic task (difficulty)."""
    cache_dir: str = "data"
    """Where generated (arithmetic) and converted (GSM8K) parquet files go. Relative: under the cache dir."""


class VLLMOptions(Strict):
    """The vLLM engine (rollout.engine: vllm). vLLM runs inside every DAG worker, beside the FSDP2
    trainer on the same GPU, so its memory is a share of the GPU (README, "GPU")."""

    gpu_memory_utilization: float = Field(default=0.5, gt=0, lt=1)
    """Share of the GPU's total memory vLLM may take (weights, activations, KV cache); that much must be free when it starts."""
    kv_cache_gib: float | None = Field(default=None, gt=0)
    """KV cache per GPU in GiB (vLLM's kv_cache_memory_bytes); None: whatever gpu_memory_utilization leaves after weights and activations."""
    enable_sleep_mode: bool = True
    """Free vLLM's weights and KV cache while the trainer runs (sleep level 2); the next weight sync refills the weights."""
    enforce_eager: bool = False
    """No CUDA graphs: faster start-up and less memory, slower decoding."""
    weight_sync_bucket_mib: int = Field(default=512, ge=1)
    """Weight sync gathers and loads at most this many MiB of parameters at a time (a larger single tensor goes alone)."""


class RolloutOptions(Strict):
    """Sampling settings, shared by the HF and vLLM rollout engines."""

    engine: Literal["hf", "vllm"] = "hf"
    """transformers generate (CPU/GPU) or vLLM (GPU only, the [gpu] extra; untested here)."""
    n: int = Field(default=8, ge=1)
    """Responses per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, gt=0, le=2)
    """Sampling temperature (the trainer divides logits by it too); vLLM accepts at most 2."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """Top-k truncation (0: off)."""
    do_sample: bool = True
    """False: greedy decoding (validation); then n must be 1."""
    log_probs: bool = False
    """Also return `rollout_log_probs` (log p of each sampled token under logits / temperature)."""
    max_response_len: int = Field(default=8, ge=1)
    """R: new tokens at most; responses are right-padded to R."""
    micro_batch: int = Field(default=256, ge=1)
    """Sequences per generate() call (HF); vLLM: the most sequences it decodes at once (max_num_seqs)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size of the rollout layout (dp = world_size // tp); vLLM shards each engine over its tp consecutive workers."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    """vLLM engine settings (memory, sleep mode, weight-sync buckets); unused by the hf engine."""

    @model_validator(mode="after")
    def _greedy_single(self) -> "RolloutOptions":
        if not self.do_sample and self.n > 1:
            raise ValueError(f"n={self.n} with do_sample=false: greedy decoding gives {self.n} identical responses "
                             "(and vLLM rejects it); set n=1 or do_sample=true")
        return self


class Optim(Strict):
    """AdamW settings (the actor's and the critic's sections extend this one)."""

    lr: float = Field(default=1e-3, gt=0)
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    grad_clip: float = 1.0
    """Max global grad norm; <= 0 disables clipping (the norm is still reported)."""


LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k3", "low_var_kl", "abs", "mse"]


class ActorOptions(Optim):
    micro_token_budget: int = Field(default=4096, ge=1)
    """Real tokens per micro-batch (gradient accumulation is normalized: grouping does not change the update)."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    clip_ratio_low: float = Field(default=0.2, ge=0)
    """PPO clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(default=0.2, ge=0)
    """PPO clip: ratio <= 1 + clip_ratio_high."""
    clip_ratio_c: float = Field(default=3.0, gt=1)
    """Dual clip for negative advantages (> 1)."""
    loss_agg_mode: LossAgg = "token-mean"
    """How per-token losses become one number."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) loss term (GRPO style)."""
    kl_loss_coef: float = 0.01
    """Weight of the KL loss."""
    kl_loss_type: KLKind = "low_var_kl"
    """KL estimator for the loss (k3 = low_var_kl)."""
    off_policy: Literal["none", "decoupled", "tis"] = "none"
    """Correct for samples from an older policy (async schedules): decoupled PPO, or truncated IS (needs rollout.log_probs)."""
    is_cap: float = Field(default=2.0, gt=0)
    """Truncated IS: the cap on pi_prox / pi_behaviour."""


class CriticOptions(Optim):
    cliprange_value: float = 0.5
    """Value clipping range."""
    micro_token_budget: int = Field(default=4096, ge=1)
    """Real tokens per critic micro-batch."""


class DAPOOptions(Strict):
    """DAPO's four parts (Yu et al., 2025, arXiv:2503.14476), each a switch; they apply only when
    algorithm.name is dapo (setting one for another algorithm is an error naming it)."""

    clip_higher: bool = True
    """Decoupled clip: ratio in [1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high] (needs high >= low); off: [1 - low, 1 + low]."""
    dynamic_sampling: bool = True
    """Drop prompt groups whose accuracies are all equal (zero advantage) and sample again until the batch is full."""
    oversample: float = Field(default=1.5, ge=1)
    """Dynamic sampling: prompts generated in the first round = data.prompts_per_step x this (rounded up to the rollout's dp)."""
    max_rounds: int = Field(default=3, ge=1)
    """Dynamic sampling: generation rounds at most, the first included; a rank still short then trains on fewer groups."""
    token_level_loss: bool = True
    """Token-level loss (token-mean: every token weighs the same); off: seq-mean-token-mean (GRPO's per-sample mean)."""
    overlong_shaping: bool = True
    """Soft overlong penalty: 0 down to -overlong_penalty_factor over the last overlong_buffer_len tokens before rollout.max_response_len."""
    overlong_buffer_len: int | None = Field(default=None, ge=1)
    """Overlong shaping: the length window L_cache (None: a quarter of rollout.max_response_len, at least 1); must be < rollout.max_response_len."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0)
    """Overlong shaping: the penalty at (and past) rollout.max_response_len."""

    def buffer_len(self, max_response_len: int) -> int:
        """The overlong window L_cache in tokens."""
        return self.overlong_buffer_len if self.overlong_buffer_len is not None else max(1, max_response_len // 4)


class AlgorithmOptions(Strict):
    name: str = "grpo"
    """Which algorithm (its DAG and stages): one registered in `distflow_lab.algos.registry` (grpo, ppo, ...)."""
    adv_estimator: str | None = None
    """Advantage estimator; None: the algorithm's default. Each algorithm lists the estimators it supports."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(old || ref) from the token rewards (PPO style)."""
    kl_coef: float = 0.001
    """Weight of the KL reward penalty."""
    kl_penalty: KLKind = "k1"
    """KL estimator for the reward penalty."""
    dapo: DAPOOptions = Field(default_factory=DAPOOptions)
    """DAPO's switches (algorithm.name dapo only)."""


class RewardOptions(Strict):
    fn: str | Callable = "auto"
    """"auto" picks by data_source (GSM8K, arithmetic); or a "module:function" / a function taking (response, ground_truth)."""
    by_source: dict[str, str | Callable] = Field(default_factory=dict)
    """Reward functions by data_source, over the built-in ones; they travel to the workers with the config."""


class TrainerOptions(Strict):
    steps: int = Field(default=20, ge=1)
    """RL steps to run."""
    out_dir: str | None = None
    """Where metrics, spans, trace, report and checkpoints go: a new runs/<config name>/run-NNN under it (None: under runs/<config name>)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (0: only when asked)."""
    loggers: list[Literal["console", "tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """Experiment trackers that log every step's metrics (pip install 'distflow_lab[trackers]'; W&B runs offline)."""
    profile: ProfileOptions | None = None
    """torch.profiler traces of chosen stages and steps, under the run's folder (profiles/)."""


class RunConfig(Strict):
    """Everything one RL run needs. Load with `load_run_config(path, overrides)`."""

    name: str = "run"
    """A label for outputs (the preset or YAML file name by default)."""
    mode: Mode = "distributed"
    """Data plane: centralized, coordinator or distributed."""
    seed: int = 0
    """Seed for data order, sampling and initialization."""
    model: ModelOptions = Field(default_factory=ModelOptions)
    """The policy model."""
    data: DataOptions = Field(default_factory=DataOptions)
    """Training prompts."""
    rollout: RolloutOptions = Field(default_factory=RolloutOptions)
    """Generation."""
    actor: ActorOptions = Field(default_factory=ActorOptions)
    """Policy update."""
    critic: CriticOptions = Field(default_factory=CriticOptions)
    """Value model (PPO)."""
    algorithm: AlgorithmOptions = Field(default_factory=AlgorithmOptions)
    """Algorithm and advantage estimator."""
    reward: RewardOptions = Field(default_factory=RewardOptions)
    """Reward function."""
    trainer: TrainerOptions = Field(default_factory=TrainerOptions)
    """Steps, output, checkpoints."""
    cluster: ClusterOptions = Field(default_factory=lambda: ClusterOptions(world_size=2, torch_distributed=True))
    """Worker placement."""
    switches: Switches = Field(default_factory=Switches)
    """Data-plane switches (ablations)."""
    schedule: ScheduleOptions = Field(default_factory=ScheduleOptions)
    """sync, one_step_off or async (the last two need `groups`)."""
    groups: dict[str, int] | None = None
    """Worker groups, generation first then training (e.g. {rollout: 1, train: 1}); None: every stage on every worker."""

    def session_config(self) -> SessionConfig:
        return SessionConfig(mode=self.mode, seed=self.seed, cluster=self.cluster, switches=self.switches,
                             schedule=self.schedule, profile=self.trainer.profile, algo=self)

    def check_sizes(self) -> None:
        """Impossible sizes fail here, before any worker starts."""
        w, tp = self.cluster.world_size, self.rollout.tp
        if self.schedule.kind != "sync" and not self.groups:
            raise ConfigError(f"schedule.kind={self.schedule.kind} needs groups (e.g. groups: {{rollout: 1, train: 1}}): "
                              "generation and training on disjoint workers")
        if self.groups and len(self.groups) != 2:
            raise ConfigError(f"groups must name two worker groups (generation, training), got {self.groups}")
        if self.groups and sum(self.groups.values()) != w:
            raise ConfigError(f"groups {self.groups} hold {sum(self.groups.values())} workers but "
                              f"cluster.world_size={w}")
        gen, train = self.groups.values() if self.groups else (w, w)
        where = "the generation group's" if self.groups else "cluster.world_size"
        if gen % tp:
            raise ConfigError(f"rollout.tp={tp} does not divide {where} {gen} workers")
        dp = gen // tp
        if self.data.prompts_per_step % dp:
            raise ConfigError(f"data.prompts_per_step={self.data.prompts_per_step} is not divisible by the rollout's "
                              f"data-parallel size {dp} ({where} {gen} / rollout.tp {tp})")
        responses = self.data.prompts_per_step * self.rollout.n
        if responses % train:
            raise ConfigError(f"prompts_per_step x rollout.n = {responses} responses cannot be split evenly over "
                              f"{train} training workers")
        if self.actor.mini_batches > 1 and (responses // train) % self.actor.mini_batches:
            raise ConfigError(f"actor.mini_batches={self.actor.mini_batches} does not divide the "
                              f"{responses // train} responses per worker")
        if self.rollout.engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ConfigError("rollout.engine=vllm but vLLM is not installed: it needs the [gpu] extra "
                                  "(pip install -e '.[gpu]') and a CUDA GPU; use rollout.engine=hf on CPU")
        if self.cluster.world_size > 1 and not self.cluster.torch_distributed:
            raise ConfigError("cluster.torch_distributed must be true with more than one worker (FSDP2 training)")
        check_switches(self.mode, self.switches)
        check_schedule(self.mode, self.schedule)
        if self.actor.off_policy != "none" and not self.rollout.log_probs:
            raise ConfigError(f"actor.off_policy={self.actor.off_policy} needs the behaviour log-probs: set "
                              "rollout.log_probs=true")


# ---------------------------------------------------------------------------------
# Loading: YAML + overrides, errors that name the key and where it came from.
# ---------------------------------------------------------------------------------


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` strings -> {"a.b": value} (values parsed as YAML scalars: 3, true, [1,2], null)."""
    out: dict[str, Any] = {}
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like key.path=value")
        key, raw = o.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {o!r}: the value is not valid YAML ({e.problem})") from None
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for key, value in parse_overrides(overrides).items():
        set_dotted(data, key, value)
    return data


def load_model(cls: type[BaseModel], data: dict, source: str = "<config>", overrides: list[str] | None = None) -> Any:
    """Validate `data` as `cls`; errors name every bad key, what is wrong with it, and
    whether it came from an override (`--set`-style `a.b=value`) or from `source`."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        given = {k.split("=", 1)[0].strip(): k for k in overrides or []}
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(root)"
            what = "unknown key (not a field of this section)" if err["type"] == "extra_forbidden" else err["msg"]
            origin = next((f" (from the override {o!r})" for k, o in given.items()
                           if key == k or key.startswith(k + ".") or k.startswith(key + ".")), "")
            lines.append(f"  {key}: {what}{origin}")
        from_overrides = all("from the override" in line for line in lines)
        where = "command-line overrides" if from_overrides else source
        raise ConfigError(f"{where}: invalid configuration\n" + "\n".join(lines)) from None


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    return data


PRESETS = Path(__file__).resolve().parents[1] / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def parse_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML file or preset name (see `presets/`) plus `a.b=value`
    overrides: schema and sizes checked, nothing started, no heavy import."""
    data: dict = {}
    source = "<defaults>"
    name = "run"
    if path is not None:
        p = Path(path)
        if not p.exists() and (PRESETS / f"{path}.yaml").exists():
            p = PRESETS / f"{path}.yaml"
        elif not p.exists():
            raise ConfigError(f"config {str(path)!r} is neither a file nor a preset; presets: {preset_names()}")
        data, source, name = read_yaml(p), str(p), p.stem
    data.setdefault("name", name)
    overrides = list(overrides or [])
    cfg = load_model(RunConfig, apply_overrides(data, overrides), source, overrides)
    cfg.check_sizes()
    return resolve_paths(cfg)


def cache_root() -> Path:
    """Where built models, SFT warm starts and generated data are cached: $DISTFLOW_HOME,
    else ~/.cache/distflow_lab. One stable place, whatever the working directory."""
    import os

    home = os.environ.get("DISTFLOW_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "distflow_lab"


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """Relative `model.path` and `data.cache_dir` resolve under `cache_root()`."""
    root = cache_root()
    fix = lambda p: p if Path(p).is_absolute() else str(root / p)  # noqa: E731
    return cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": fix(cfg.model.path)}),
        "data": cfg.data.model_copy(update={"cache_dir": fix(cfg.data.cache_dir)}),
    })
