"""The RL run's config: model, data, rollout, actor and critic, algorithm, reward, trainer,
worker groups, and the session it runs in (`RunConfig.session`, a `SessionConfig`: mode,
seed, cluster, switches, schedule). Engines take these sections as they are.

A run config is written flat, as users always have (`mode: coordinator`, `seed: 3`,
`cluster.world_size=2`, `switches.balance=kk`, `schedule.kind=one_step_off`): those keys are
the session's and move under `session` before validation; `session.mode` works as well,
and a key given both ways is an error. `cfg.mode`, `cfg.cluster`, ... read the session's."""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, ClassVar, Literal

from pydantic import Field, model_validator

from distflow_lab.core.config.base import Strict
from distflow_lab.core.config.session import (ClusterOptions, Mode, ProfileOptions, ScheduleOptions, SessionConfig,
                                              Switches, WeightSyncOptions, check_groups, check_schedule,
                                              check_switches)
from distflow_lab.core.errors import ConfigError


class TinySpec(Strict):
    """A random-init tiny Qwen2 (built offline when `model.path` holds no model); the vocabulary comes from the tokenizer."""

    hidden_size: int = 64
    """Residual width (and of the tied embedding)."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 2
    """Query heads per attention layer; must divide hidden_size."""
    num_kv_heads: int = 1
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
    tool_demos: float = Field(default=0.0, ge=0.0, le=1.0)
    """Multi-turn runs: the fraction of SFT examples shown as the environment's demonstration
    (its `demo(row)`, e.g. a calculator call, the tool's answer, the final answer), the rest as
    direct answers. The environment's tokens carry no loss."""


class ModelOptions(Strict):
    path: str = "models/tiny-qwen2-hd32"
    """Local model directory (a Hugging Face checkpoint, e.g. Qwen2.5; never downloaded). Relative: under the cache dir."""
    tiny: TinySpec | None = Field(default_factory=TinySpec)
    """Build this tiny model at `path` if it holds none (None: `path` must hold a checkpoint)."""
    warm_start: WarmStart = Field(default_factory=WarmStart)
    """SFT warm-up before RL."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype: the trainer's master weights (keep float32 to train: AdamW at lr 1e-6 loses most updates in bfloat16)."""
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    """The trainer's compute dtype under FSDP2 (its MixedPrecisionPolicy: parameters gathered in this dtype, gradients reduced in float32); None: dtype. bfloat16 with dtype float32 is the usual GPU setting."""


def check_partial_rollout(partial_rollout: bool, engine: str, tp: int = 1) -> None:
    """Partial rollouts decode across weight updates: the hf engine streams (models/rollout_stream.py),
    vLLM steps its engine (models/rollout_vllm_stream.py) on one rank per engine: the ranks of a
    tensor-parallel group would each pull weights on their own and could resume at different versions."""
    if partial_rollout and engine == "vllm" and tp > 1:
        raise ConfigError(f"schedule.partial_rollout on vLLM needs rollout.tp=1 (got {tp}): the ranks of a "
                          "tensor-parallel engine could resume at different policy versions")


# Keys of the data section before the dataset registry, by the dataset they belong to: saved configs stay readable
LEGACY_DATA_KEYS = {"arithmetic_rows": ("arithmetic", "rows"), "arithmetic_max_operand": ("arithmetic", "max_operand"),
                    "arithmetic_min_operand": ("arithmetic", "min_operand"), "arithmetic_ops": ("arithmetic", "ops"),
                    "arithmetic_style": ("arithmetic", "style"), "long_tail": ("long_tail", None),
                    "guess_number": ("guess_number", None)}


class DataOptions(Strict):
    train: str = "arithmetic"
    """A dataset registered with `lab.register_dataset` (arithmetic, long_tail, guess_number, gsm8k, or your
    own), generated under cache_dir; or a verl-schema parquet/jsonl path."""
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each dataset's own options, by dataset name, checked by its declared options model
    (data.options.arithmetic.max_operand=99); data.train's are used, the others only checked."""
    prompts_per_step: int = Field(default=16, ge=1)
    """Prompts in the global batch of one step (each gets `rollout.n` responses)."""
    max_prompt_len: int = Field(default=16, ge=1)
    """P: prompts are left-padded to this many tokens; longer ones are truncated (counted and reported)."""
    shuffle: bool = True
    """Shuffle each rank's shard every epoch (seeded)."""
    cache_dir: str = "data"
    """Where generated (arithmetic) and converted (GSM8K) parquet files go. Relative: under the cache dir."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """`data.arithmetic_max_operand: 99` and `data.long_tail: {...}` (before the registry) are
        data.options.arithmetic.max_operand and data.options.long_tail now: saved configs still read."""
        if not isinstance(data, dict) or not set(data) & set(LEGACY_DATA_KEYS):
            return data
        data = dict(data)
        options = {k: dict(v) for k, v in (data.get("options") or {}).items()}
        for key in [k for k in data if k in LEGACY_DATA_KEYS]:
            dataset, option = LEGACY_DATA_KEYS[key]
            value = data.pop(key)
            options.setdefault(dataset, {}).update(value if option is None else {option: value})
        data["options"] = options
        return data


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
    """No CUDA graphs (on CPU: no torch.compile): faster start-up and less memory, slower decoding. The tiny
    model on 2 cores builds in 4.9 s instead of 16 s and decodes 1.12x slower (benchmarks/probes/vllm_eager.py)."""
    block_size: int | None = Field(default=None, ge=1)
    """KV cache block in tokens; the prefix cache reuses whole blocks only (multi-turn contexts shorter
    than a block never hit). None: vLLM's default (128 on CPU, 16 on CUDA); CPU attention takes multiples of 32."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "weight_sync_bucket_mib" in data:
            raise ValueError("rollout.vllm.weight_sync_bucket_mib is now weight_sync.bucket_mib: one bucket size "
                             "for every weight sync, colocated or between worker groups")
        return data


class MultiTurnOptions(Strict):
    """Multi-turn rollouts: the model's turns interleaved with an environment (models/rollout_multiturn.py)."""

    env: str | type
    """A registered environment (calculator, guess_number, or one @register_env made), or the class itself
    (e.g. one defined in a notebook: it travels to the environment actors with the config)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The environment's own options (its Options class checks them)."""
    max_turns: int = Field(default=4, ge=1)
    """Model turns per trajectory at most."""
    max_turn_tokens: int = Field(default=16, ge=1)
    """Tokens per model turn at most (the trajectory's budget is rollout.max_response_len)."""
    pool_size: int = Field(default=2, ge=1)
    """Environment actors per rollout worker."""
    concurrency: int = Field(default=8, ge=1)
    """Calls each environment actor serves at once, on threads (tools that sleep or wait on I/O overlap)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """An environment call slower than this is an EnvError."""


class RolloutOptions(Strict):
    """Sampling settings, shared by the HF and vLLM rollout engines."""

    engine: Literal["hf", "vllm"] = "hf"
    """transformers generate, or vLLM (its CPU build, installed by scripts/setup.sh, runs here; GPU: the [gpu] extra, untested)."""
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
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The rollout engine's dtype; auto: model.dtype. bfloat16 against a float32 trainer gives a real train-inference mismatch (rollout/logprob_diff_*), what off-policy corrections exist for."""
    max_response_len: int = Field(default=8, ge=1)
    """R: new tokens at most; responses are right-padded to R."""
    micro_batch: int = Field(default=256, ge=1)
    """Sequences per generate() call (HF); vLLM: the most sequences it decodes at once (max_num_seqs)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size of the rollout layout (dp = world_size // tp); vLLM shards each engine over its tp consecutive workers."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    """vLLM engine settings (memory, sleep mode, weight-sync buckets); unused by the hf engine."""
    multi_turn: MultiTurnOptions | None = None
    """Trajectories of model turns and environment answers (hf engine); None: one response per sample."""

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


LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k3", "low_var_kl", "abs", "mse"]


class LoraOptions(Strict):
    """Train low-rank adapters instead of the whole policy (peft's LoRA, Hu et al. 2021): W = W0 + alpha/rank * B A
    on each target linear layer, W0 frozen. A weight sync then sends only A and B; the rollout merges them into
    its own copy of W0 (models/lora.py). "LoRA without regret" (Schulman et al., 2025) finds it matches full
    fine-tuning for RL, with every linear layer adapted and about 10x the full fine-tuning learning rate."""

    rank: int = Field(default=16, ge=1)
    """r: the adapters' inner width."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the update is alpha / rank * B A."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Linear layers to adapt, by module name (q_proj, v_proj, ...), or every linear layer but the LM head."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ActorOptions(Optim):
    lora: LoraOptions | None = None
    """LoRA adapters (None: full fine-tuning): `actor.lora={rank: 16, alpha: 32}`."""
    micro_token_budget: int = Field(default=4096, ge=1)
    """Real tokens per micro-batch (gradient accumulation is normalized: grouping does not change the update)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory for long padded micro-batches, ~1/3 more compute)."""
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
    behav_imp_weight_cap: float | None = Field(default=None, gt=1)
    """Decoupled PPO (off_policy=decoupled only): drop tokens whose pi_prox / pi_behaviour exceeds this from the loss (AReaL); None: keep all."""
    policy_loss: str = "ppo_clip"
    """The policy-gradient loss, one registered with `lab.register_policy_loss` (ppo_clip, gspo, or your own);
    unset: the algorithm's (its declaration)."""
    policy_loss_options: dict[str, Any] = Field(default_factory=dict)
    """The policy loss's own options, checked by its declared options model."""
    old_log_prob: Literal["recompute", "from_update"] = "recompute"
    """The PPO ratio's old policy: a forward pass over the batch before the update (recompute), or the update's own forward, detached (from_update: TRL's on-policy shortcut, one forward pass fewer; one mini-batch only, and no KL in the reward)."""

    @model_validator(mode="after")
    def _cap_needs_decoupled(self) -> "ActorOptions":
        if self.behav_imp_weight_cap is not None and self.off_policy != "decoupled":
            raise ValueError(f"behav_imp_weight_cap applies to off_policy='decoupled' only; off_policy is "
                             f"{self.off_policy!r} (truncated IS caps with is_cap)")
        return self


class CriticOptions(Optim):
    cliprange_value: float = 0.5
    """Value clipping range."""
    micro_token_budget: int = Field(default=4096, ge=1)
    """Real tokens per critic micro-batch."""


class AlgorithmOptions(Strict):
    name: str = "grpo"
    """Which algorithm: a declaration registered with `lab.register_algorithm` (grpo, ppo, dapo, gspo, or your own)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The algorithm's own options, checked by its declared options model (DAPO's switches: algorithm.options.max_rounds=2)."""
    adv_estimator: str | None = None
    """Advantage estimator, one registered with `lab.register_estimator`; None: the algorithm's default. The
    algorithm runs estimators of the kinds it declares (outcome, token, critic)."""
    estimator_options: dict[str, Any] = Field(default_factory=dict)
    """The estimator's own options, checked by its declared options model."""
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

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Saved configs from before the registries: `algorithm.dapo` is `algorithm.options` now."""
        if isinstance(data, dict) and "dapo" in data:
            data = dict(data)
            moved = data.pop("dapo")
            if data.get("options"):
                raise ValueError("algorithm.dapo is algorithm.options now; give DAPO's switches in one of them")
            data["options"] = moved
        return data


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


SESSION_KEYS: tuple[str, ...] = ("mode", "seed", "cluster", "switches", "schedule", "weight_sync")
"""The session's keys a run config takes at its top level (flat), as well as under `session`."""


def check_weight_sync(ws: WeightSyncOptions, engine: str, lora: bool) -> None:
    """A rollout that must copy (vLLM processes what it loads; a LoRA policy is merged into W0) cannot
    compute from a sync's buffers, nor be patched by a delta."""
    why = "a LoRA policy is merged into the rollout's W0" if lora else \
        f"rollout.engine={engine} processes the weights it loads" if engine != "hf" else None
    if ws.load == "map" and why:
        raise ConfigError(f"weight_sync.load=map needs an HF rollout of the full policy: {why}; use "
                          "weight_sync.load=copy (or auto)")
    if ws.mode == "delta" and why:
        raise ConfigError(f"weight_sync.mode=delta patches an HF rollout's own weights: {why}; use "
                          "weight_sync.mode=full")
    if ws.mode == "delta" and ws.load == "map":
        raise ConfigError("weight_sync.mode=delta patches the rollout's own weights, and load=map makes them "
                          "the publisher's buffers: use weight_sync.load=copy (or auto)")


def run_session() -> SessionConfig:
    """The session an RL run gets unless it says otherwise: two workers with torch.distributed (FSDP2
    trains over them), where a plain session has four and none. A key the run gives (flat or under
    `session`) replaces that key of this default as a whole, as a section of any config does."""
    return SessionConfig(cluster=ClusterOptions(world_size=2, torch_distributed=True))


class RunConfig(Strict):
    """Everything one RL run needs. Load with `load_run_config(path, overrides)`."""

    flat_keys: ClassVar[dict[str, tuple[str, ...]]] = {"session": SESSION_KEYS}
    """Sections whose keys are also written at the top level (see the module docstring)."""

    name: str = "run"
    """A label for outputs (the preset or YAML file name by default)."""
    session: SessionConfig = Field(default_factory=run_session)
    """Where and how the workers run: mode, seed, cluster, switches, schedule (usually written flat: `mode: coordinator`, `cluster.world_size=2`). Default: 2 workers with torch.distributed. Profiling is `trainer.profile`."""
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
    groups: dict[str, int] | None = None
    """Worker groups, generation first then training (e.g. {rollout: 1, train: 1}); None: every stage on every worker."""

    @model_validator(mode="before")
    @classmethod
    def _session_section(cls, data: Any) -> Any:
        """Flat session keys move under `session`, over the run's default session (`run_session`)."""
        if not isinstance(data, dict):
            return data
        given = data.get("session", {})
        if isinstance(given, SessionConfig):
            given = {k: getattr(given, k) for k in given.model_fields_set}
        if not isinstance(given, dict):
            return data  # pydantic names what is wrong with it
        flat = {k: data[k] for k in SESSION_KEYS if k in data}
        twice = sorted(set(flat) & set(given))
        if twice:
            raise ValueError(f"{twice[0]!r} is given twice, as `{twice[0]}` and as `session.{twice[0]}`: keep one")
        default = run_session()
        base = {k: getattr(default, k) for k in default.model_fields_set}
        rest = {k: v for k, v in data.items() if k not in SESSION_KEYS}
        return {**rest, "session": {**base, **given, **flat}}

    @model_validator(mode="after")
    def _run_owns(self) -> "RunConfig":
        if self.session.algo is not None:
            raise ValueError("session.algo is the run config itself (stages see it as ctx.config): leave it out")
        if self.session.profile is not None:
            raise ValueError("session.profile: a run profiles with trainer.profile (traces under the run's folder)")
        return self

    # The session's parts, read where they were before they moved into `session` (read-only).
    @property
    def mode(self) -> Mode:
        return self.session.mode

    @property
    def seed(self) -> int:
        return self.session.seed

    @property
    def cluster(self) -> ClusterOptions:
        return self.session.cluster

    @property
    def switches(self) -> Switches:
        return self.session.switches

    @property
    def schedule(self) -> ScheduleOptions:
        return self.session.schedule

    def session_config(self) -> SessionConfig:
        """The config the controller gets: this run's session, the trainer's profile, and the run config
        itself as `algo` (the stages' `ctx.config`)."""
        return self.session.model_copy(update={"profile": self.trainer.profile, "algo": self})

    def check_sizes(self) -> None:
        """Impossible sizes fail here, before any worker starts."""
        s = self.session
        w, tp = s.cluster.world_size, self.rollout.tp
        check_groups(self.groups, world_size=w, schedule=s.schedule.kind, pair=True, where="groups",
                     world_size_key="cluster.world_size")
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
        if self.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm but vLLM is not installed: `bash scripts/setup.sh` installs its CPU "
                              "build on a CPU machine, pip install -e '.[gpu]' on a CUDA one; or use rollout.engine=hf")
        check_partial_rollout(s.schedule.partial_rollout, self.rollout.engine, self.rollout.tp)
        if self.model.warm_start.tool_demos and self.rollout.multi_turn is None:
            raise ConfigError("model.warm_start.tool_demos shows an environment's demonstrations: it needs "
                              "rollout.multi_turn (or set tool_demos: 0)")
        if s.cluster.world_size > 1 and not s.cluster.torch_distributed:
            raise ConfigError("cluster.torch_distributed must be true with more than one worker (FSDP2 training)")
        check_weight_sync(s.weight_sync, self.rollout.engine, self.actor.lora is not None)
        check_switches(s.mode, s.switches)
        check_schedule(s.mode, s.schedule, self.groups)
        if self.actor.off_policy != "none" and not self.rollout.log_probs:
            raise ConfigError(f"actor.off_policy={self.actor.off_policy} needs the behaviour log-probs: set "
                              "rollout.log_probs=true")
