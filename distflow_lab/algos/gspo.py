"""GSPO (Zheng et al., 2025, arXiv:2507.18071) on distflow_lab, top to bottom.

GRPO's DAG, stages and group-relative advantage; only the policy loss differs:

    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update
    (no ref_log_prob without a KL term: actor.use_kl_loss=false, as in the paper's runs)

GRPO weighs every token by its own ratio pi_t / pi_old_t; GSPO gives a whole response one
importance ratio, the length-normalised sequence likelihood ratio
    s_i = exp( mean_t (log pi_t - log pi_old_t) ),
and clips that (`losses.gspo_token_loss`). The objective is a mean over responses
(seq-mean-token-mean), so `actor.loss_agg_mode` may only say so. The paper's clip ranges are
tiny (3e-4 / 4e-4: the declaration's defaults): a sequence ratio moves far less than a
token's. Off-policy corrections (actor.off_policy) weigh the loss per token as for GRPO.
"""
from __future__ import annotations

from distflow_lab.algos.grpo import grpo_dag
from distflow_lab.algos.registry import loss_agg_is, register_algorithm
from distflow_lab.core.config import RunConfig

LOSS_AGG = "seq-mean-token-mean"  # Eq. (5): (1/G) sum_i over responses


def check(cfg: RunConfig) -> None:
    loss_agg_is(cfg, LOSS_AGG, "GSPO's sequence-level objective")


# the paper's sequence-ratio clip range; PPO's 0.2 would be close to no clipping at all
register_algorithm("gspo", dag=grpo_dag, estimator="grpo", estimator_kinds=("outcome",), policy_loss="gspo",
                   actor={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": LOSS_AGG}, check=check)
