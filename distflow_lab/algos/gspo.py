"""GSPO (Zheng et al., 2025, arXiv:2507.18071) on distflow_lab, top to bottom.

GRPO's DAG, stages and group-relative advantage; only the actor update differs:

    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update
    (no ref_log_prob without a KL term: actor.use_kl_loss=false, as in the paper's runs)

GRPO weighs every token by its own ratio pi_t / pi_old_t; GSPO gives a whole response one
importance ratio, the length-normalised sequence likelihood ratio
    s_i = exp( mean_t (log pi_t - log pi_old_t) ),
and clips that (`losses.gspo_token_loss`). The objective is a mean over responses
(seq-mean-token-mean), so `actor.loss_agg_mode` may only say so. The paper's clip ranges are
tiny (3e-4 / 4e-4, `actor.clip_ratio_low/high`): a sequence ratio moves far less than a token's.
"""
from __future__ import annotations

import torch

from distflow_lab.algos.grpo import CONTRACTS, MODEL_INPUTS, _mini_batches
from distflow_lab.algos.losses import gspo_token_loss, kl_penalty, masked_mean
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape
from distflow_lab.runtime.context import StageContext

LOSS_AGG = "seq-mean-token-mean"  # Eq. (5): (1/G) sum_i over responses
SHARED = ("rollout", "reward", "advantage", "old_log_prob", "ref_log_prob")


def gspo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {**{n: f"distflow_lab.algos.grpo:{n}" for n in SHARED}, "actor_update": f"{__name__}:actor_update"}
    dag = grpo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=CONTRACTS, name="gspo", groups=cfg.groups)
    if not cfg.actor.use_kl_loss:  # no KL term: nothing reads the reference's log-probs
        dag.remove("ref_log_prob").replace("actor_update", deps=["old_log_prob"])
    return dag


# ---- actor update: sequence-level clipped surrogate (+ KL to the reference - entropy bonus) ----
def actor_loss(cfg: RunConfig):
    a = cfg.actor

    def loss_fn(mb: dict, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        mask = mb["response_mask"]
        loss, metrics = gspo_token_loss(mb["old_log_probs"], log_probs, mb["advantages"], mask,
                                        a.clip_ratio_low, a.clip_ratio_high)
        if a.use_kl_loss:
            kl = kl_penalty(log_probs, mb["ref_log_probs"], a.kl_loss_type)
            loss = loss + a.kl_loss_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        if a.entropy_coeff and entropy is not None:
            loss = loss - a.entropy_coeff * entropy
        return loss, mask, metrics

    return loss_fn


def actor_update(batch: Batch, ctx: StageContext) -> Batch:
    cfg, a, actor = ctx.config, ctx.config.actor, ctx.engines["actor"]
    need = [*MODEL_INPUTS, "response_mask", "old_log_probs", "advantages"]
    if a.use_kl_loss:
        need.append("ref_log_probs")
    metrics: dict[str, float] = {}
    for mini in _mini_batches({k: batch[k] for k in need}, a.mini_batches):
        metrics = actor.train_step(mini, actor_loss(cfg), LOSS_AGG, with_entropy=a.entropy_coeff > 0)
    ctx.engines["sync"].stale = True  # the rollout must pick up the new weights
    ctx.log(**{f"actor/{k}": v for k, v in metrics.items()})
    return batch
