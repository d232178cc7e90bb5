"""What each DAG worker owns for the built-in RL algorithms: tokenizer, actor
(FSDP2 over all workers), frozen reference, rollout engine, critic (PPO) and
the reward function. Built once per worker by `setup_engines` (the session's
engine factory); stage functions reach them through `ctx.engines`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from distflow_lab.core.config import RewardOptions, RunConfig
from distflow_lab.datasets.rewards import reward_for
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.critic import build_critic_from
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import load_model_dir
from distflow_lab.models.rollout import make_rollout
from distflow_lab.runtime.context import StageContext
from distflow_lab.runtime.weights import state_checksum


@dataclass
class WeightSync:
    """The rollout's weights lag the actor's after an update until synced."""

    shared: bool  # the rollout uses the actor's own module (1 worker): always in sync
    stale: bool = False

    def after_load(self) -> None:  # a checkpoint replaced the actor's weights
        self.stale = not self.shared


TRAIN_ROLES = {"actor", "reference", "critic"}


def setup_engines(ctx: StageContext, cfg: RunConfig) -> dict[str, Any]:
    """The engines of the stages this worker runs (`ctx.roles`): all of them when every stage
    runs on every worker (colocated); only the training or the generation side on worker
    groups, each with its half of the weight sync ("weights": export or import)."""
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.model.dtype)
    trains, generates = bool(ctx.roles & TRAIN_ROLES), "rollout" in ctx.roles
    model, tokenizer = load_model_dir(cfg.model.path, dtype=dtype)
    temp = cfg.rollout.temperature
    hf = cfg.rollout.engine == "hf"
    engines: dict[str, Any] = {"tokenizer": tokenizer, "reward_fn": make_reward_fn(cfg.reward)}
    actor = None
    if trains:
        pg = ctx.groups.get("actor_update")  # the training layout's data-parallel group (FSDP2 shards over it)
        actor = engines["actor"] = TrainEngine(model, cfg.actor, process_group=pg, temperature=temp,
                                               micro_token_budget=cfg.actor.micro_token_budget)
        engines["ref"] = TrainEngine(load_model_dir(cfg.model.path, dtype=dtype)[0], None, process_group=pg,
                                     micro_token_budget=cfg.actor.micro_token_budget, temperature=temp)
    shared = generates and actor is not None and hf and not actor.distributed  # generate with the actor's module
    if generates:
        gen_model = actor.model if shared else ((model if actor is None else load_model_dir(cfg.model.path,
                                                                                           dtype=dtype)[0]) if hf
                                                else None)
        vllm_args = {} if hf else {"dtype": cfg.model.dtype, "seed": cfg.seed}  # the rest comes from cfg.rollout
        engines["rollout"] = make_rollout(gen_model.eval() if gen_model is not None else None, tokenizer, cfg.rollout,
                                          cfg.data.max_prompt_len, model_path=cfg.model.path, **vllm_args)
    engines["sync"] = WeightSync(shared=shared)
    if trains and not generates:
        engines["weights"] = ActorWeights(actor)
    elif generates and not trains:
        engines["weights"] = RolloutWeights(engines["rollout"], gen_model)
    if trains and cfg.algorithm.name == "ppo":
        critic = build_critic_from(cfg.model.path, dtype=dtype)
        engines["critic"] = TrainEngine(critic, cfg.critic,
                                        process_group=ctx.groups.get("critic_update"),
                                        micro_token_budget=cfg.critic.micro_token_budget, critic=True)
    if generates and hasattr(engines["rollout"], "sleep"):  # vLLM beside FSDP2: it sleeps whenever a trainer computes
        for name in ("actor", "ref", "critic"):
            if name in engines:
                engines[name].before_compute.append(engines["rollout"].sleep)
    return engines


class ActorWeights:
    """The training side of the weight sync: the actor's full state (an FSDP gather)."""

    def __init__(self, actor: TrainEngine) -> None:
        self.actor, self.version = actor, 0

    def export_state(self) -> dict[str, torch.Tensor]:
        return self.actor.full_state_dict()

    def import_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("the training group publishes weights; it never imports them")

    def checksum(self) -> float:
        """Collective under FSDP (a full gather): every training rank must call it."""
        return state_checksum(self.actor.full_state_dict())


class RolloutWeights:
    """The generation side: published weights go into the rollout engine."""

    def __init__(self, rollout: Any, model: Any) -> None:
        self.rollout, self.model, self.version = rollout, model, 0
        self._sum = state_checksum(model.state_dict()) if model is not None else 0.0

    def export_state(self) -> None:
        return None

    def import_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.rollout.load_weights(state)
        self.version, self._sum = version, state_checksum(state)

    def checksum(self) -> float:
        return self._sum


def policy_version(ctx: StageContext) -> int:
    """The version of the policy this worker generates with (0 when nothing is published)."""
    w = ctx.engines.get("weights")
    return w.version if w is not None else 0


def mark_updated(ctx: StageContext) -> None:
    """After an optimizer step: a new policy version, published to a separate rollout group."""
    w = ctx.engines.get("weights")
    if w is not None:
        w.version += 1


def make_reward_fn(opts: RewardOptions) -> Callable[[str, str, str], float]:
    """(data_source, response, ground_truth) -> score: `opts.fn` for every source, or
    (fn "auto") by data source from `opts.by_source` over the built-in table."""
    if opts.fn != "auto":
        fn = resolve_function(opts.fn, node="reward")
        return lambda source, response, truth: fn(response, truth)
    by_source = {k: resolve_function(v, node="reward") for k, v in opts.by_source.items()}
    return lambda source, response, truth: reward_for(source, by_source)(response, truth)


def sync_weights(ctx: StageContext) -> None:
    """Push the actor's latest weights into the rollout engine if an update made them stale, or the
    engine discarded its own (vLLM's level-2 sleep). The "weight_sync" span records the seconds,
    the bytes gathered (each tensor once) and the tensors sent. Collective under FSDP: every
    worker runs the rollout stage."""
    sync: WeightSync = ctx.engines["sync"]
    if "actor" not in ctx.engines:  # worker groups: the training group publishes, the worker pulls (weights.py)
        return
    rollout, actor = ctx.engines["rollout"], ctx.engines["actor"]
    if sync.shared or not (sync.stale or getattr(rollout, "needs_weights", False)):
        return
    stats = {"bytes": 0, "tensors": 0}
    with ctx.span("weight_sync") as span:
        if getattr(rollout, "streams_weights", False):  # vLLM: bounded buckets, on the GPU, no host copy
            rollout.load_weights(actor.weight_buckets(rollout.bucket_bytes, dtype=rollout.weight_dtype, stats=stats))
        else:  # HF: its own module copy takes a full (CPU) state dict
            rollout.load_weights(actor.full_state_dict(stats=stats))
        if span is not None:
            span.bytes, span.items = stats["bytes"], stats["tensors"]
    sync.stale = False
