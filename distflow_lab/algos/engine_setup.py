"""What each DAG worker owns for the built-in RL algorithms: tokenizer, actor
(FSDP2 over its group), frozen reference, rollout engine, critic (PPO), the
reward function and the policy's version. Built once per worker by
`setup_engines` (the session's engine factory); stage functions reach them as
typed attributes: `ctx.engines.actor`, `ctx.engines.rollout`, ...

The policy version is one number with one owner, `Policy`. The one actor update
(`actor_update.py`) calls `Policy.updated()` after every optimizer step: the
version advances, a colocated rollout knows its weights lag, and on worker groups
the training group publishes that version (`runtime/weights.py`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from distflow_lab.algos.registry import algorithm
from distflow_lab.core.config import RewardOptions, RunConfig
from distflow_lab.datasets.rewards import reward_for
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.critic import build_critic_from
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.lora import LoraMerge, apply_lora
from distflow_lab.models.model_dir import load_model_dir
from distflow_lab.models.rollout import RolloutEngine, make_rollout
from distflow_lab.runtime.context import StageContext
from distflow_lab.runtime.engines import Checkpointable
from distflow_lab.runtime.weight_transport import Bucket, Manifest, check_loaded, patch_targets
from distflow_lab.runtime.weights import PolicyWeights, state_checksum

TRAIN_ROLES = {"actor", "reference", "critic"}


@dataclass
class Policy:
    """The policy's version on this worker, and whether a colocated rollout lags the actor.

    version: updates applied (trainers), or the published version pulled (rollout-only workers).
    shared:  the rollout generates with the actor's own module (one unsharded worker): never lags.
    """

    version: int = 0
    shared: bool = False
    stale: bool = False
    writer: bool = False  # saves the version in checkpoints (rank 0 of the trainers)

    def updated(self) -> None:
        """An optimizer step changed the actor: a new version, and the rollout here lags it."""
        self.version += 1
        self.stale = not self.shared

    def save(self, directory: Path) -> None:
        if self.writer:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".version.json.{os.getpid()}"
            tmp.write_text(json.dumps({"version": self.version}))
            os.replace(tmp, directory / "version.json")

    def load(self, directory: Path) -> None:
        self.version = int(json.loads((directory / "version.json").read_text())["version"])


@dataclass
class RLEngines:
    """One worker's engines (`runtime.engines.WorkerEngines`). A worker of a training group has
    no rollout; a worker of a generation group has no actor, reference or critic."""

    tokenizer: Any
    reward_fn: Callable[[str, str, str], float]
    policy: Policy = field(default_factory=Policy)
    actor: TrainEngine | None = None
    ref: TrainEngine | None = None
    critic: TrainEngine | None = None
    rollout: RolloutEngine | None = None
    weights: PolicyWeights | None = None  # worker groups: this worker's half of the weight sync
    stream: Any = None  # partial rollouts: the streaming decoder around the rollout's module (algos/streaming.py)
    multi_turn: Any = None  # multi-turn rollouts: the trajectories' engine and its environment pool (algos/multiturn.py)
    lora: LoraMerge | None = None  # a LoRA policy's rollout: adapters in, merged weights out (models/lora.py)

    def checkpointed(self) -> dict[str, Checkpointable]:
        """The trained engines and the version they are at (the rollout and reference are rebuilt)."""
        out: dict[str, Checkpointable] = {}
        if self.actor is not None:
            out.update(actor=self.actor, policy=self.policy)
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    def after_load(self) -> None:
        """The actor's weights were replaced: a colocated rollout lags until the next sync."""
        self.policy.stale = not self.policy.shared

    def close(self) -> None:
        self.stream = None  # its sequences in flight die with the session
        if self.multi_turn is not None:
            self.multi_turn.pool.shutdown()
            self.multi_turn = None
        if self.rollout is not None:
            self.rollout.close()


def setup_engines(ctx: StageContext, cfg: RunConfig) -> RLEngines:
    """The engines of the stages this worker runs (`ctx.roles`): all of them when every stage
    runs on every worker (colocated); only the training or the generation side on worker
    groups, each with its half of the weight sync (`weights`: export or import)."""
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.model.dtype)
    trains, generates = bool(ctx.roles & TRAIN_ROLES), "rollout" in ctx.roles
    model, tokenizer = load_model_dir(cfg.model.path, dtype=dtype)
    fresh = lambda: load_model_dir(cfg.model.path, dtype=dtype)[0]  # noqa: E731  another copy of the policy
    e = RLEngines(tokenizer, make_reward_fn(cfg.reward))
    budget, temp = cfg.actor.micro_token_budget, cfg.rollout.temperature
    compute = getattr(torch, cfg.model.compute_dtype) if cfg.model.compute_dtype else None  # FSDP2 mixed precision
    if trains:
        pg = ctx.groups.get("actor_update")  # the training layout's data-parallel group (FSDP2 shards over it)
        policy = apply_lora(model, cfg.actor.lora) if cfg.actor.lora else model
        e.actor = TrainEngine(policy, cfg.actor, process_group=pg, temperature=temp, micro_token_budget=budget,
                              mixed_precision=compute, gradient_checkpointing=cfg.actor.gradient_checkpointing)
        e.ref = TrainEngine(fresh(), None, process_group=pg, micro_token_budget=budget, temperature=temp,
                            mixed_precision=compute)
        e.policy.writer = e.actor.rank == 0
        if algorithm(cfg.algorithm.name).critic:  # its declaration: a critic trains beside the actor
            e.critic = TrainEngine(build_critic_from(cfg.model.path, dtype=dtype), cfg.critic,
                                   process_group=ctx.groups.get("critic_update"), mixed_precision=compute,
                                   micro_token_budget=cfg.critic.micro_token_budget, critic=True,
                                   gradient_checkpointing=cfg.actor.gradient_checkpointing)
    hf = cfg.rollout.engine == "hf"
    gen_dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    same = gen_dtype == cfg.model.dtype  # a rollout in another dtype needs its own copy of the weights
    e.policy.shared = generates and trains and hf and same and not e.actor.distributed  # the actor's own module
    if generates:
        gen_model = (e.actor.model if e.policy.shared else model if not trains else fresh()) if hf else None
        if gen_model is not None and not same:
            gen_model = gen_model.to(getattr(torch, gen_dtype))
        # vLLM: the rest comes from cfg.rollout; it sleeps at start only beside a trainer that needs the memory
        vllm_args = {} if hf else {"dtype": gen_dtype, "seed": cfg.seed, "sleep_at_start": trains}
        e.rollout = make_rollout(gen_model.eval() if gen_model is not None else None, tokenizer, cfg.rollout,
                                 cfg.data.max_prompt_len, model_path=cfg.model.path, **vllm_args)
        e.rollout.bucket_bytes = cfg.session.weight_sync.bucket_mib << 20  # one bucket size for every sync
        if e.rollout.sleeps:  # vLLM beside FSDP2: it sleeps whenever a trainer computes
            for trainer in (e.actor, e.ref, e.critic):
                if trainer is not None:
                    trainer.before_compute.append(e.rollout.sleep)
    if generates and cfg.actor.lora and not e.policy.shared:
        e.lora = LoraMerge(cfg.model.path, cfg.actor.lora)
    if trains and not generates:  # sent in the rollout's dtype: what it will hold anyway (bf16: half the bytes)
        e.weights = ActorWeights(e.actor, e.policy, None if same else getattr(torch, gen_dtype), cfg.actor.lora is not None)
    elif generates and not trains:
        ws, plain = cfg.session.weight_sync, hf and e.lora is None  # the config refuses the rest by name
        binds = ws.load != "copy" and ws.mode != "delta" and plain  # "auto": map where it can
        e.weights = RolloutWeights(e.rollout, e.policy, gen_model, e.lora, binds, ws.mode == "delta" and plain)
    return e


class ActorWeights:
    """The training side of the weight sync (`PolicyWeights`): the actor's full tensors (an FSDP
    gather, one tensor at a time) at the policy's version, cast to `dtype` (the rollout's) if given;
    a LoRA policy's adapters only (`lora`), in the trainer's dtype (the reader merges in float32)."""

    def __init__(self, actor: TrainEngine, policy: Policy, dtype: torch.dtype | None = None, lora: bool = False) -> None:
        self.actor, self.policy, self.dtype, self.lora = actor, policy, dtype, lora
        self.mode, self.binds = "lora" if lora else "full", False

    @property
    def version(self) -> int:
        return self.policy.version

    def export_buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        if self.lora:
            return self.actor.adapter_buckets(bucket_bytes, device="cpu")
        return self.actor.weight_buckets(bucket_bytes, device="cpu", dtype=self.dtype)

    def aliases(self) -> dict[str, str]:
        return {} if self.lora else self.actor.tied_aliases()

    def import_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        raise RuntimeError("the training group publishes weights; it never imports them")

    def import_delta(self, manifest: Manifest, patch: Callable[[dict[str, torch.Tensor]], set[str]]) -> bool:
        return False

    def checksum(self) -> float:
        """Collective under FSDP (a full gather): every training rank must call it."""
        if self.lora:
            return state_checksum({name: t for b in self.export_buckets(1 << 62) for name, t in b})
        return state_checksum(self.actor.full_state_dict())


class RolloutWeights:
    """The generation side (`PolicyWeights`): a published policy goes into the rollout engine
    (each checked view copied once, into the engine's own weights; or, `binds`, an HF rollout's
    parameters become the views: weight_sync.load "map") and becomes this worker's version."""

    def __init__(self, rollout: RolloutEngine, policy: Policy, model: torch.nn.Module | None,
                 lora: LoraMerge | None = None, binds: bool = False, patches: bool = False) -> None:
        self.rollout, self.policy, self.lora, self.binds = rollout, policy, lora, binds
        self.mode = "lora" if lora is not None else "full"
        self.patches = patches  # weight_sync.mode "delta": an HF rollout whose own weights a delta patches
        self._sum = state_checksum(model.state_dict()) if model is not None else 0.0

    @property
    def version(self) -> int:
        return self.policy.version

    def export_buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        return iter(())

    def aliases(self) -> dict[str, str]:
        return {}

    def import_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        loaded: set[str] = set()

        def noted() -> Iterator[tuple[str, torch.Tensor]]:  # each checked view is loaded before the next is read
            for name, t in tensors:
                loaded.add(name)
                yield name, t

        if self.binds:  # an HF rollout (the config allows nothing else): its parameters become the views
            self.rollout.load_weights(([nt] for nt in noted()), bind=True)  # type: ignore[call-arg]
        else:
            load_policy(self.rollout, noted(), self.lora)
        check_loaded(manifest, loaded)  # what the engine took is what the manifest lists
        self.policy.version, self._sum = manifest.version, manifest.checksum

    def import_delta(self, manifest: Manifest, patch: Callable[[dict[str, torch.Tensor]], set[str]]) -> bool:
        if not self.patches:
            return False
        check_loaded(manifest, patch(patch_targets(self.rollout.model)))  # type: ignore[attr-defined]
        self.policy.version, self._sum = manifest.version, manifest.checksum
        return True

    def checksum(self) -> float:
        return self._sum


def load_policy(rollout: RolloutEngine, tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraMerge | None) -> None:
    """Published tensors into the rollout engine, one at a time: the whole policy, or (`lora`) a LoRA
    policy's adapters merged into the layers they adapt (all of the checkpoint when the engine
    discarded its weights)."""
    if lora is None:
        rollout.load_weights([nt] for nt in tensors)
    else:
        everything = rollout.needs_weights
        rollout.load_weights(lora.merged(tensors, everything), partial=not everything)


def make_reward_fn(opts: RewardOptions) -> Callable[[str, str, str], float]:
    """(data_source, response, ground_truth) -> score: `opts.fn` for every source, or
    (fn "auto") by data source from `opts.by_source` over the built-in table."""
    if opts.fn != "auto":
        fn = resolve_function(opts.fn, node="reward")
        return lambda source, response, truth: fn(response, truth)
    by_source = {k: resolve_function(v, node="reward") for k, v in opts.by_source.items()}
    return lambda source, response, truth: reward_for(source, by_source)(response, truth)


def sync_weights(ctx: StageContext) -> None:
    """Colocated: push the actor's latest weights into the rollout engine if an update made them
    stale, or the engine discarded its own (vLLM's level-2 sleep). The "weight_sync" span records
    the seconds, the bytes gathered (each tensor once) and the tensors sent. Collective under
    FSDP: every worker runs the rollout stage. (On worker groups the rollout pulls instead.)"""
    e: RLEngines = ctx.engines
    if e.actor is None or e.rollout is None or e.policy.shared:
        return
    if not (e.policy.stale or e.rollout.needs_weights):
        return
    stats = {"bytes": 0, "tensors": 0}
    with ctx.span("weight_sync") as span:
        # bounded buckets straight from the actor's tensors into the engine's: the load is the only copy
        # (vLLM casts to its dtype on the way; HF's copy_ converts); a LoRA policy: its adapters, merged here
        if e.lora is not None:
            load_policy(e.rollout, (nt for b in e.actor.adapter_buckets(e.rollout.bucket_bytes, stats=stats)
                                    for nt in b), e.lora)
        else:
            e.rollout.load_weights(e.actor.weight_buckets(e.rollout.bucket_bytes, dtype=e.rollout.weight_dtype,
                                                          stats=stats))
        if span is not None:
            span.bytes, span.items = stats["bytes"], stats["tensors"]
    e.policy.stale = False
