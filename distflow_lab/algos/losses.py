"""Policy, value, KL and entropy losses for RL post-training (PPO-style clipped objectives, GSPO).

Token tensors are [B, T] over response tokens with `response_mask` [B, T] (1 = real token).
In a multi-turn batch the environment's tokens sit in the response too: `loss_mask` (1 on the
model's own tokens only) is then the mask every loss, estimator and metric uses (`loss_mask_key`).
Loss functions return a scalar tensor (differentiable) and plain-python-float metrics.
"""
from __future__ import annotations

import torch

from distflow_lab.models.token_ops import (LOSS_AGG_MODES, aggregate_loss, entropy_from_logits,  # noqa: F401
                                           log_probs_from_logits, masked_mean)



def loss_mask_key(columns) -> str:
    """The column whose 1s carry loss: `loss_mask` when the batch has one (multi-turn: the model's
    tokens, not the environment's observations), else `response_mask`."""
    return "loss_mask" if "loss_mask" in columns else "response_mask"

def clipped_surrogate(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate PPO and GSPO share, per token:

        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))

    Metrics (means over valid tokens): clipfrac, where the clipped branch is strictly larger
    (was taken); approx_kl = mean(-log_ratio), the k1 estimate of KL(old || new).
    """
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((loss2 > loss1).float(), response_mask).item(),
                   "approx_kl": masked_mean(-log_ratio, response_mask).item()}
    return torch.maximum(loss1, loss2), metrics


def ppo_token_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO clipped surrogate with dual clip (arXiv:1707.06347, arXiv:1912.09729).

        r   = exp(log_prob - old_log_prob)
        L_1 = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L   = L_1                       if A >= 0
              min(L_1, -A * clip_ratio_c) if A < 0   (dual clip: caps the loss when r >> 1)

    Returns the [B, T] loss matrix (aggregate it with `aggregate_loss`) and metrics
    (python floats, means over valid tokens):
      clipfrac       fraction where the clipped branch is strictly larger (was taken)
      clipfrac_lower fraction with A < 0 where the dual clip bound -A*c engaged
      approx_kl      k1 estimate of KL(old || new): mean(old_log_prob - log_prob)
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # exp() overflow guard
    clipped, metrics = clipped_surrogate(torch.exp(log_ratio), log_ratio, advantages, response_mask,
                                         clip_ratio_low, clip_ratio_high)
    loss3 = -advantages * clip_ratio_c
    neg = advantages < 0
    loss_mat = torch.where(neg, torch.minimum(clipped, loss3), clipped)
    with torch.no_grad():
        metrics["clipfrac_lower"] = masked_mean(((clipped > loss3) & neg).float(), response_mask).item()
    return loss_mat, metrics


def gspo_token_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level importance ratio and clipping (Zheng et al., 2025, arXiv:2507.18071).

    Eq. (7), the ratio of a whole response, length-normalised:
        s_i = (pi(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|) = exp( (1/|y_i|) sum_t (log pi_t - log pi_old_t) )
    Eq. (5), the objective (A_i: the group-normalised advantage, constant over the response):
        J = (1/G) sum_i min( s_i A_i, clip(s_i, 1 - clip_ratio_low, 1 + clip_ratio_high) A_i )

    Returned per token, in the paper's GSPO-token form (Eq. 13): s_i,t = sg[s_i] * pi_t / sg[pi_t]
    has the value s_i on every token of response i and the gradient s_i * grad log pi_t, so
        L[i, t] = max(-A_i s_i,t, -A_i clip(s_i,t, 1 - low, 1 + high))
    aggregated with seq-mean-token-mean equals -J in value and in gradient (Eq. 10: a clipped
    response gives no gradient at all). log s_i is capped at 10 (exp overflow guard), as verl.

    Metrics (means over valid tokens, so each response weighs by its length):
      clipfrac   fraction of tokens in responses whose ratio was clipped
      ratio      s_i
      approx_kl  k1 estimate of KL(old || new): mean(old_log_prob - log_prob)
    """
    m = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # (1/|y_i|) sum_t, [B]
    log_s = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_s)  # value s_i on every token; gradient s_i * grad log pi_t
    loss_mat, metrics = clipped_surrogate(ratio, log_ratio, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    with torch.no_grad():
        metrics["ratio"] = masked_mean(ratio, response_mask).item()
    return loss_mat, metrics


def policy_loss_ppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                    clip_ratio_c: float = 3.0,
                    loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """`ppo_token_loss` aggregated to a scalar with `loss_agg_mode`."""
    loss_mat, metrics = ppo_token_loss(old_log_prob, log_prob, advantages, response_mask,
                                       clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return aggregate_loss(loss_mat, response_mask, loss_agg_mode), metrics


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) from sampled-token log-probs (Schulman, "Approximating KL").

    With d = log_prob - ref_log_prob:
      k1 / kl:          d                               (unbiased, high variance, can be < 0)
      abs:              |d|
      mse / k2:         0.5 * d^2
      k3 / low_var_kl:  exp(-d) + d - 1                  (unbiased, >= 0); -d clamped to [-20, 20]
                        and the result to [-10, 10] for stability, as verl does
    """
    d = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        x = (-d).clamp(-20.0, 20.0)  # x = ref - logp
        return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
) -> torch.Tensor:
    """KL to the reference as a loss term (GRPO style): aggregate_loss(kl_penalty(logp, ref), mask, agg)."""
    return aggregate_loss(kl_penalty(log_prob, ref_log_prob, kind), mask, agg)


@torch.no_grad()
def apply_kl_in_reward(
    token_rewards: torch.Tensor,
    log_prob_old: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, float]:
    """KL as a reward penalty (PPO/RLHF style): r'_t = r_t - coef * kl_t * m_t.

    kl_t = kl_penalty(log_prob_old, ref_log_prob, kind) uses the rollout policy's log-probs.
    mean_kl = mean over sequences of the per-sequence token-mean KL (what an adaptive KL
    controller consumes). Returns a new tensor; inputs are untouched.
    """
    kl = kl_penalty(log_prob_old, ref_log_prob, kind) * mask
    mean_kl = masked_mean(kl, mask, dim=-1).mean().item()
    return token_rewards - coef * kl, mean_kl


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Aggregated entropy (a scalar to MAXIMISE): total_loss = pg_loss - entropy_coef * entropy_bonus."""
    return aggregate_loss(entropy, mask, agg)


def value_loss_token(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped value loss (PPO's critic, as verl's `compute_value_loss`):

        v_clip = min(max(v, old - c), old + c)        (v itself inside the range, bit for bit)
        L_t    = 0.5 * max((v - R)^2, (v_clip - R)^2) (pessimistic: the clip can only raise it)

    Returns the [B, T] loss (aggregate it with `aggregate_loss`; the 0.5 is inside, so any
    aggregation equals verl's 0.5 * agg_loss) and {"vf_clipfrac": fraction of valid tokens
    where the clipped term is strictly larger}.
    """
    v_clip = torch.maximum(torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (v_clip - returns) ** 2
    with torch.no_grad():
        clipfrac = masked_mean((l2 > l1).float(), mask).item()
    return 0.5 * torch.maximum(l1, l2), {"vf_clipfrac": clipfrac}


def value_loss_clipped(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.5,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, float]:
    """`value_loss_token` aggregated: 0.5 * agg( max((v - R)^2, (v_clip - R)^2) ).

    Returns (loss, clipfrac) with clipfrac = fraction of valid tokens where the clipped term is larger.
    """
    loss_mat, metrics = value_loss_token(values, old_values, returns, mask, cliprange_value)
    return aggregate_loss(loss_mat, mask, agg), metrics["vf_clipfrac"]


def off_policy_weights(old_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       kind: str, cap: float = 2.0,
                       behav_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights that correct for samples generated by an older
    (behaviour) policy pi_b than the proximal policy pi_prox the trainer's `old_log_prob`
    pass evaluated (stale samples in the async schedules, rollout/trainer mismatch):

        w_t = pi_prox(y_t) / pi_b(y_t) = exp(old_log_prob_t - behaviour_log_prob_t)

    kind "decoupled": the decoupled PPO objective (Hilton et al., 2022, arXiv:2110.00641;
        as AReaL): L_t = w_t * PPO-clip(pi_theta / pi_prox) with w_t as is — the clip keeps
        the update near the proximal policy, the weight corrects the sampling. With
        `behav_cap` (AReaL's behav_imp_weight_cap): w_t = 0 where w_t > behav_cap, i.e. the
        token leaves the loss's numerator (it still counts in the normaliser, as in AReaL).
    kind "tis": truncated importance sampling (Yao et al., 2025, "Your efficient RL framework
        secretly brings you off-policy RL training"; verl's token-level rollout-IS weights):
        w_t = min(w_t, cap).
    kind "none": w_t = 1.
    `behav_cap` belongs to "decoupled" only; giving it with another kind is an error.
    The weights carry no gradient and are 0 on padding. Metrics, over valid tokens, of the
    weights as applied: is_ratio_mean, is_ratio_max (reduce by max: the `_max` suffix);
    is_capped_frac (tis: where the cap engaged) and behav_capped_frac (decoupled: tokens
    masked out by behav_cap), 0.0 for the other kind.
    """
    if behav_cap is not None and kind != "decoupled":
        raise ValueError(f"behav_cap (actor.behav_imp_weight_cap) applies to off_policy 'decoupled' only, got {kind!r}")
    if kind == "none":
        return torch.ones_like(old_log_prob), {}
    if kind not in ("decoupled", "tis"):
        raise ValueError(f"unknown off-policy correction {kind!r}; use 'none', 'decoupled' or 'tis'")
    with torch.no_grad():
        w = torch.exp((old_log_prob - behaviour_log_prob).clamp(-20.0, 20.0))
        valid = response_mask.bool()
        capped = (w > cap) if kind == "tis" else torch.zeros_like(valid)
        dropped = (w > behav_cap) if behav_cap is not None else torch.zeros_like(valid)
        w = torch.where(capped, torch.full_like(w, cap), w)
        w = torch.where(dropped, torch.zeros_like(w), w)
        metrics = {"is_ratio_mean": masked_mean(w, response_mask).item(),
                   "is_ratio_max": float(w[valid].max()) if valid.any() else 0.0,
                   "is_capped_frac": masked_mean(capped.float(), response_mask).item(),
                   "behav_capped_frac": masked_mean(dropped.float(), response_mask).item()}
    return w * response_mask, metrics
