"""PPO with GAE and a critic (Schulman et al., 2017) on distflow_lab.

    data -> rollout -> reward -> old_log_prob -> ref_log_prob -> values -> advantage
         -> critic_update -> actor_update

Rollout, reward, the log-prob stages, the advantage stage and the actor update are
GRPO's (grpo.py and the one actor update); PPO adds the critic's values, GAE as its
estimator (with the KL penalty optionally in the reward, PPO/RLHF style: grpo.advantage
does it for every estimator) and a clipped value-loss update of the critic.
"""
from __future__ import annotations

from typing import Any

import torch

from distflow_lab.algos.actor_update import MODEL_INPUTS, mini_batches, over_steps
from distflow_lab.algos.grpo import CONTRACTS
from distflow_lab.algos.losses import loss_mask_key, value_loss_token
from distflow_lab.algos.registry import register_algorithm
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.datasets.loader import load_batch
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import ppo_shape
from distflow_lab.runtime.context import StageContext

SHARED = ("rollout", "reward", "old_log_prob", "ref_log_prob", "advantage", "actor_update")


def ppo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {"data": load_batch, **{n: f"distflow_lab.algos.grpo:{n}" for n in SHARED},
           **{n: f"{__name__}:{n}" for n in ("values", "critic_update")}}
    contracts = {**CONTRACTS, "values": {"contract": {"outputs": ["values"], "rows": "same"}},
                 "critic_update": {"contract": {"rows": "same"}}}
    return ppo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=contracts, name=cfg.algorithm.name,
                     groups=cfg.groups)


def values(batch: Batch, ctx: StageContext) -> Batch:
    v = ctx.engines.critic.forward_values(*(batch[k] for k in MODEL_INPUTS))
    return batch.with_columns(values=v)


def critic_loss(cfg: RunConfig):
    c = cfg.critic.cliprange_value

    def loss_fn(mb: dict, _: Any, values: torch.Tensor):
        mask = mb[loss_mask_key(mb)]
        loss, metrics = value_loss_token(values, mb["values"], mb["returns"], mask, c)
        return loss, mask, metrics

    return loss_fn


def critic_update(batch: Batch, ctx: StageContext) -> Batch:
    cfg, critic = ctx.config, ctx.engines.critic
    key = loss_mask_key(batch)
    cols = {k: batch[k] for k in {*MODEL_INPUTS, "response_mask", key, "values", "returns"}}
    per_step = [critic.train_step(mini, critic_loss(cfg), cfg.actor.loss_agg_mode, mask_key=key)
                for mini in mini_batches(cols, cfg.actor.mini_batches)]
    ctx.log(**{f"critic/{k}": v for k, v in over_steps(per_step).items()})
    return batch


# ---- the declaration: its own DAG, a critic, GAE by default, PPO's clipped loss ---------
register_algorithm("ppo", dag=ppo_dag, estimator="gae", estimator_kinds=("critic",), policy_loss="ppo_clip",
                   critic=True)
