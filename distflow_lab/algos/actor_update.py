"""The one actor update, shared by every algorithm. An algorithm's declaration names
only its policy-gradient loss (policy_losses.py) (and, for DAPO, how its
switches set the actor options); everything else is here, written once:

    for each mini-batch:  loss = policy_loss(pi_old, pi, A)          (actor.policy_loss: ppo_clip, gspo, ...)
                                 x off-policy weight w_t              (actor.off_policy: decoupled | tis)
                                 + kl_loss_coef * KL(pi || pi_ref)    (actor.use_kl_loss)
                                 - entropy_coeff * H(pi)              (actor.entropy_coeff > 0)
                          one optimizer step (FSDP2, token-budget micro-batches)
    policy.updated()      the policy version advances; a colocated rollout knows it lags, and on
                          worker groups the training group publishes the new version

So no algorithm can forget to publish its weights, read a column another forgot to
send, or ignore an off-policy correction.
"""
from __future__ import annotations

import torch

from distflow_lab.algos.losses import kl_penalty, loss_mask_key, masked_mean, off_policy_weights
from distflow_lab.algos.policy_losses import policy_loss
from distflow_lab.algos.registry import effective_actor
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ActorOptions
from distflow_lab.runtime.context import StageContext

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def needed_columns(a: ActorOptions, has_rollout_log_probs: bool = False) -> list[str]:
    """The columns the update reads: the model inputs, and what each enabled term needs."""
    cols = [*MODEL_INPUTS, "response_mask", "advantages"]
    if a.old_log_prob == "recompute":
        cols.append("old_log_probs")
    if a.off_policy != "none" or (a.old_log_prob == "from_update" and has_rollout_log_probs):
        cols.append("rollout_log_probs")  # the correction's behaviour policy, or the mismatch measured here
    if a.use_kl_loss:
        cols.append("ref_log_probs")
    return cols


def actor_loss(a: ActorOptions):
    """The per-token loss the training engine aggregates: `loss_fn(mb, log_probs, entropy)
    -> (loss [B, T], mask, metrics)`, composed as in the module docstring."""
    pg = policy_loss(a)

    def loss_fn(mb: dict, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        mask = mb[loss_mask_key(mb)]
        # from_update: these weights are the ones the batch is scored under (one mini-batch, checked
        # in registry.check_old_log_prob), so the old policy is this forward without its gradient
        old = log_probs.detach() if a.old_log_prob == "from_update" else mb["old_log_probs"]
        loss, metrics = pg(old, log_probs, mb["advantages"], mask)
        if a.old_log_prob == "from_update" and "rollout_log_probs" in mb:  # no old_log_prob stage to log it
            metrics.update(mismatch(mb["rollout_log_probs"], old, mask))
        if a.off_policy != "none":  # samples from an older policy: weigh by pi_prox / pi_behaviour
            w, more = off_policy_weights(old, mb["rollout_log_probs"], mask, a.off_policy, a.is_cap,
                                         behav_cap=a.behav_imp_weight_cap)
            loss, metrics = loss * w, {**metrics, **more}
        if a.use_kl_loss:
            kl = kl_penalty(log_probs, mb["ref_log_probs"], a.kl_loss_type)
            loss = loss + a.kl_loss_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        if a.entropy_coeff and entropy is not None:
            loss = loss - a.entropy_coeff * entropy
        return loss, mask, metrics

    return loss_fn


def update_actor(batch: Batch, ctx: StageContext) -> Batch:
    """The actor-update stage of every algorithm: `actor.mini_batches` optimizer steps over the batch
    with the configured policy loss, then a new policy version. The actor options are the ones the
    algorithm's declaration derives from the config (DAPO's switches), else the run's."""
    a, e = effective_actor(ctx.config), ctx.engines
    key = loss_mask_key(batch)  # multi-turn: the environment's tokens carry no loss
    cols = {k: batch[k] for k in {*needed_columns(a, "rollout_log_probs" in batch), key}}
    per_step = [e.actor.train_step(mini, actor_loss(a), a.loss_agg_mode,
                                   with_entropy=a.entropy_coeff > 0, mask_key=key)
                for mini in mini_batches(cols, a.mini_batches)]
    lag = policy_lag(batch, key, e.policy.version)  # before the update: the version being trained
    e.policy.updated()
    metrics = {**over_steps(per_step), **lag}
    ctx.log(**{k if k.startswith("rollout/") else f"actor/{k}": v for k, v in metrics.items()})
    return batch


def mismatch(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's log-probs are from the trainer's on the sampled tokens: mean and max
    |difference|, and KL(rollout || trainer) by the k3 estimator (samples come from the rollout)."""
    valid = mask.bool()
    diff = (rollout_lp - trainer_lp).abs()
    return {"rollout/logprob_diff_mean": masked_mean(diff, mask).item(),
            "rollout/logprob_diff_max": float(diff[valid].max()) if valid.any() else 0.0,
            "rollout/logprob_kl": masked_mean(kl_penalty(rollout_lp, trainer_lp, "k3"), mask).item()}


def policy_lag(batch: Batch, mask_key: str, current: int) -> dict[str, float]:
    """How off-policy the trained batch is: the share of its loss tokens sampled by a policy older
    than the one this update starts from (stale_token_frac), and the share of responses whose
    tokens come from two or more versions (mixed_version_frac: partial rollouts resumed across an
    update). From the rollout's per-token versions, else its per-response version."""
    mask = batch[mask_key].bool()
    if "token_versions" in batch:
        v = batch["token_versions"]
    elif "version" in batch:
        v = batch["version"][:, None].expand_as(mask)
    else:
        return {}
    lo = torch.where(mask, v, torch.iinfo(v.dtype).max).min(1).values
    hi = torch.where(mask, v, torch.iinfo(v.dtype).min).max(1).values
    rows = mask.any(1)
    return {"stale_token_frac": float(((v < current) & mask).sum() / mask.sum().clamp(min=1)),
            "mixed_version_frac": float(((hi > lo) & rows).sum() / rows.sum().clamp(min=1))}


def over_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimizer steps: the mean, except `*_max` (the max) and `lr` (the last)."""
    out = {}
    for k in per_step[-1]:
        values = [m[k] for m in per_step if k in m]
        out[k] = max(values) if k.endswith("_max") else values[-1] if k == "lr" else sum(values) / len(values)
    return out


def mini_batches(cols: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """k consecutive slices of the batch (one optimizer step each)."""
    n = len(cols["input_ids"])
    return [{name: t[i * n // k:(i + 1) * n // k] for name, t in cols.items()} for i in range(k)]
