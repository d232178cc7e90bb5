"""GSPO (Zheng et al., 2025, arXiv:2507.18071) on distflow_lab, top to bottom.

GRPO's DAG, stages and group-relative advantage; only the policy loss differs:

    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update
    (no ref_log_prob without a KL term: actor.use_kl_loss=false, as in the paper's runs)

GRPO weighs every token by its own ratio pi_t / pi_old_t; GSPO gives a whole response one
importance ratio, the length-normalised sequence likelihood ratio
    s_i = exp( mean_t (log pi_t - log pi_old_t) ),
and clips that (`losses.gspo_token_loss`). The objective is a mean over responses
(seq-mean-token-mean), so `actor.loss_agg_mode` may only say so. The paper's clip ranges are
tiny (3e-4 / 4e-4: the registry's defaults for gspo): a sequence ratio moves far less than a
token's. Off-policy corrections (actor.off_policy) weigh the loss per token as for GRPO.
"""
from __future__ import annotations

from distflow_lab.algos.actor_update import gspo_policy, update_actor
from distflow_lab.algos.grpo import CONTRACTS, fit_kl
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.datasets.loader import load_batch
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape
from distflow_lab.runtime.context import StageContext

LOSS_AGG = "seq-mean-token-mean"  # Eq. (5): (1/G) sum_i over responses
SHARED = ("rollout", "reward", "advantage", "old_log_prob", "ref_log_prob")


def gspo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {"data": load_batch, **{n: f"distflow_lab.algos.grpo:{n}" for n in SHARED},
           "actor_update": f"{__name__}:actor_update"}
    dag = grpo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=CONTRACTS, name="gspo", groups=cfg.groups)
    return fit_kl(dag, cfg)


# ---- actor update: sequence-level clipped surrogate (+ KL to the reference - entropy bonus) ----
def actor_update(batch: Batch, ctx: StageContext) -> Batch:
    a = ctx.config.actor.model_copy(update={"loss_agg_mode": LOSS_AGG})
    return update_actor(batch, ctx, gspo_policy, actor=a)
