"""Typed configuration (pydantic): every field documented, unknown keys are an
error (never silently dropped), YAML loads safely, CLI-style `a.b=value`
overrides are parsed as YAML scalars.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import FriendlyError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ConfigError(FriendlyError, ValueError):
    """A configuration that cannot run; names the key at fault."""


class Switches(Strict):
    """The data-coordinator mechanisms of the paper's ablation (Fig. 10)."""

    local_cache: bool = True
    """Keep a batch in the worker when the next stage has the same data-parallel layout (off: every edge goes through a DataBuffer)."""
    double_buffer: bool = True
    """Release a step's buffer store in the background (off: synchronously, on the buffer's event loop)."""
    balance: Literal["lpt", "kk", "none"] = "lpt"
    """Load balancing at redistribution: constrained LPT (paper Alg. 1), Karmarkar-Karp, or a contiguous split."""
    num_buffers: int | Literal["per_node"] = "per_node"
    """DataBuffer actors: one per Ray node, or this many (1 = one central buffer)."""


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
    """Longest a stage may run on any worker before the driver reports which workers are late (raise it for big models)."""
    buffer_wait_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a DataBuffer waits for producers before failing the step with a clear error."""
    torch_distributed: bool = False
    """Start a torch.distributed process group over the workers (gloo on CPU, nccl on GPU)."""


class SessionConfig(Strict):
    """A session: where it runs, how the data plane behaves, and the algorithm's own config."""

    mode: Literal["distributed", "centralized"] = "distributed"
    """distributed: DistFlow's multi-controller data plane; centralized: verl-style driver dispatch."""
    seed: int = 0
    """Seed for data shuffling and every stage's random generator."""
    cluster: ClusterOptions = Field(default_factory=ClusterOptions)
    """Worker placement."""
    switches: Switches = Field(default_factory=Switches)
    """Data-coordinator switches (ablations)."""
    keep_outputs: bool = True
    """Keep each stage's latest output on the workers so `peek` can show samples."""
    history_steps: int = Field(default=1000, ge=1)
    """Step reports (spans) the driver keeps; older ones are dropped (metrics rows are all kept)."""
    algo: Any = None
    """Algorithm config visible to stage functions as `ctx.config` (a RunConfig for the built-in algorithms)."""


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (values parsed as YAML scalars: 3, true, [1,2], null)."""
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like key.path=value")
        key, raw = o.split("=", 1)
        set_dotted(data, key.strip(), yaml.safe_load(raw))
    return data


def load_model(cls: type[BaseModel], data: dict, source: str = "<config>") -> Any:
    """Validate `data` as `cls`; errors name every bad key and what is wrong with it."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = "\n".join(
            f"  {'.'.join(map(str, err['loc'])) or '(root)'}: "
            + ("unknown key (not a field of this section)" if err["type"] == "extra_forbidden" else err["msg"])
            for err in e.errors()
        )
        raise ConfigError(f"{source}: invalid configuration\n{problems}") from None


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------
# The RL run: model, data, rollout, actor/critic, algorithm, trainer.
# ---------------------------------------------------------------------------------


class TinySpec(Strict):
    """A random-init tiny Qwen2 (built offline when `model.path` holds no model)."""

    hidden_size: int = 64
    """Residual width."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 64
    """Longest prompt + response the model accepts."""


class WarmStart(Strict):
    """Supervised warm-up (SFT) so RL starts from a policy with non-zero reward."""

    steps: int = Field(default=0, ge=0)
    """SFT optimizer steps before RL (0: none). The result is cached next to the model."""
    lr: float = 3e-3
    """SFT learning rate."""
    batch_size: int = 64
    """Examples per SFT step."""


class ModelOptions(Strict):
    path: str = "runs/models/tiny-qwen2"
    """Local model directory (a Hugging Face checkpoint, e.g. Qwen2.5; never downloaded)."""
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
    cache_dir: str = "runs/data"
    """Where generated (arithmetic) and converted (GSM8K) parquet files are written."""


class RolloutOptions(Strict):
    engine: Literal["hf", "vllm"] = "hf"
    """transformers generate (CPU/GPU) or vLLM (GPU only, the [gpu] extra; untested here)."""
    n: int = Field(default=8, ge=1)
    """Responses per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the trainer divides logits by it too)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """Top-k truncation (0: off)."""
    max_response_len: int = Field(default=8, ge=1)
    """R: new tokens at most; responses are right-padded to R."""
    micro_batch: int = Field(default=256, ge=1)
    """Sequences per generate() call."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size of the rollout layout (dp = world_size // tp)."""


class ActorOptions(Strict):
    lr: float = 1e-3
    """AdamW learning rate."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    micro_token_budget: int = 4096
    """Real tokens per micro-batch (gradient accumulation is normalized: grouping does not change the update)."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio <= 1 + clip_ratio_high."""
    clip_ratio_c: float = 3.0
    """Dual clip for negative advantages (> 1)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) loss term (GRPO style)."""
    kl_loss_coef: float = 0.01
    """Weight of the KL loss."""
    kl_loss_type: Literal["k1", "k3", "low_var_kl", "abs", "mse"] = "low_var_kl"
    """KL estimator for the loss (k3 = low_var_kl)."""


class CriticOptions(Strict):
    lr: float = 1e-3
    """Critic AdamW learning rate (PPO)."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    micro_token_budget: int = 4096
    """Real tokens per critic micro-batch."""


class AlgorithmOptions(Strict):
    name: Literal["grpo", "ppo"] = "grpo"
    """Which DAG: GRPO (group-relative, no critic) or PPO (GAE with a critic)."""
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"] = "grpo"
    """Advantage estimator (gae needs the PPO DAG)."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(old || ref) from the token rewards (PPO style)."""
    kl_coef: float = 0.001
    """Weight of the KL reward penalty."""
    kl_penalty: Literal["k1", "k3", "low_var_kl", "abs", "mse"] = "k1"
    """KL estimator for the reward penalty."""


class RewardOptions(Strict):
    fn: str = "auto"
    """"auto" picks by data_source (GSM8K, arithmetic); or "module:function" taking (response, ground_truth)."""


class TrainerOptions(Strict):
    steps: int = Field(default=20, ge=0)
    """RL steps to run."""
    out_dir: str = "runs/latest"
    """Where metrics, spans, trace, report and checkpoints go."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (0: only when asked)."""


class RunConfig(Strict):
    """Everything one RL run needs. Load with `load_run_config(path, overrides)`."""

    mode: Literal["distributed", "centralized"] = "distributed"
    """Data plane: DistFlow multi-controller or verl-style centralized."""
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
    """Data-coordinator switches (ablations)."""

    def session_config(self) -> SessionConfig:
        return SessionConfig(mode=self.mode, seed=self.seed, cluster=self.cluster, switches=self.switches, algo=self)

    def check_sizes(self) -> None:
        """Impossible sizes fail here, before any worker starts."""
        w, tp = self.cluster.world_size, self.rollout.tp
        if w % tp:
            raise ConfigError(f"rollout.tp={tp} does not divide cluster.world_size={w}")
        dp = w // tp
        if self.data.prompts_per_step % dp:
            raise ConfigError(f"data.prompts_per_step={self.data.prompts_per_step} is not divisible by the rollout's "
                              f"data-parallel size {dp} (world_size {w} / rollout.tp {tp})")
        if (self.data.prompts_per_step * self.rollout.n) % w:
            raise ConfigError(f"prompts_per_step x rollout.n = {self.data.prompts_per_step * self.rollout.n} responses "
                              f"cannot be split evenly over {w} training workers")
        if self.actor.mini_batches > 1 and (self.data.prompts_per_step * self.rollout.n // w) % self.actor.mini_batches:
            raise ConfigError(f"actor.mini_batches={self.actor.mini_batches} does not divide the "
                              f"{self.data.prompts_per_step * self.rollout.n // w} responses per worker")
        if self.algorithm.adv_estimator == "gae" and self.algorithm.name != "ppo":
            raise ConfigError("algorithm.adv_estimator=gae needs algorithm.name=ppo (a critic)")
        if self.rollout.engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ConfigError("rollout.engine=vllm but vLLM is not installed: it needs the [gpu] extra "
                                  "(pip install -e '.[gpu]') and a CUDA GPU; use rollout.engine=hf on CPU")
        if self.cluster.world_size > 1 and not self.cluster.torch_distributed:
            raise ConfigError("cluster.torch_distributed must be true with more than one worker (FSDP2 training)")


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML file or preset name (see `presets/`) plus `a.b=value` overrides.
    Relative model/data/output paths resolve under $DISTFLOW_HOME when it is set."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.exists() and (PRESETS / f"{path}.yaml").exists():
            p = PRESETS / f"{path}.yaml"
        data, source = read_yaml(p), str(p)
    cfg = load_model(RunConfig, apply_overrides(data, list(overrides or [])), source)
    cfg.check_sizes()
    return resolve_paths(cfg)


def resolve_paths(cfg: RunConfig) -> RunConfig:
    import os

    home = os.environ.get("DISTFLOW_HOME")
    if not home:
        return cfg
    fix = lambda p: p if Path(p).is_absolute() else str(Path(home) / p)  # noqa: E731
    return cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": fix(cfg.model.path)}),
        "data": cfg.data.model_copy(update={"cache_dir": fix(cfg.data.cache_dir)}),
        "trainer": cfg.trainer.model_copy(update={"out_dir": fix(cfg.trainer.out_dir)}),
    })


PRESETS = Path(__file__).parent / "presets"
