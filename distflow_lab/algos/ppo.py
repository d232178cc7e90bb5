"""PPO with GAE and a critic (Schulman et al., 2017) on distflow_lab.

    data -> rollout -> reward -> old_log_prob -> ref_log_prob -> values -> advantage
         -> critic_update -> actor_update

Rollout, reward, the log-prob stages and the actor update are GRPO's (grpo.py);
PPO adds the critic's values, a GAE advantage (with the KL penalty optionally in
the reward, PPO/RLHF style) and a clipped value-loss update of the critic.
"""
from __future__ import annotations

from typing import Any

import torch

from distflow_lab.algos.estimators import ESTIMATORS, outcome_to_token_rewards
from distflow_lab.algos.grpo import CONTRACTS, MODEL_INPUTS, _mini_batches
from distflow_lab.algos.losses import apply_kl_in_reward, masked_mean
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import ppo_shape
from distflow_lab.runtime.context import StageContext

SHARED = ("rollout", "reward", "old_log_prob", "ref_log_prob", "actor_update")


def ppo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {**{n: f"distflow_lab.algos.grpo:{n}" for n in SHARED},
           **{n: f"{__name__}:{n}" for n in ("values", "advantage", "critic_update")}}
    contracts = {**CONTRACTS, "values": {"contract": {"outputs": ["values"], "rows": "same"}},
                 "critic_update": {"contract": {"rows": "same"}}}
    return ppo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=contracts, name="ppo", groups=cfg.groups)


def values(batch: Batch, ctx: StageContext) -> Batch:
    v = ctx.engines["critic"].forward_values(*(batch[k] for k in MODEL_INPUTS))
    return batch.with_columns(values=v)


def advantage(batch: Batch, ctx: StageContext) -> Batch:
    alg, mask = ctx.config.algorithm, batch["response_mask"]
    if alg.use_kl_in_reward:
        rewards, kl = apply_kl_in_reward(outcome_to_token_rewards(batch["scores"], mask), batch["old_log_probs"],
                                         batch["ref_log_probs"], mask, alg.kl_coef, alg.kl_penalty)
        ctx.log(**{"critic/kl_in_reward": float(kl)})
        batch = batch.with_columns(token_rewards=rewards)
    adv, ret = ESTIMATORS[alg.adv_estimator or "gae"](batch, alg)
    return batch.with_columns(advantages=adv.float(), returns=ret.float())


def critic_loss(cfg: RunConfig):
    c = cfg.critic.cliprange_value

    def loss_fn(mb: dict, _: Any, values: torch.Tensor):
        mask, old, ret = mb["response_mask"], mb["values"], mb["returns"]
        clipped = old + (values - old).clamp(-c, c)
        loss = 0.5 * torch.maximum((values - ret) ** 2, (clipped - ret) ** 2)
        with torch.no_grad():
            frac = masked_mean(((clipped - ret) ** 2 > (values - ret) ** 2).float(), mask).item()
        return loss, mask, {"vf_clipfrac": frac}

    return loss_fn


def critic_update(batch: Batch, ctx: StageContext) -> Batch:
    cfg, critic = ctx.config, ctx.engines["critic"]
    cols = {k: batch[k] for k in (*MODEL_INPUTS, "response_mask", "values", "returns")}
    metrics: dict[str, float] = {}
    for mini in _mini_batches(cols, cfg.actor.mini_batches):
        metrics = critic.train_step(mini, critic_loss(cfg), cfg.actor.loss_agg_mode)
    ctx.log(**{f"critic/{k}": v for k, v in metrics.items()})
    return batch
