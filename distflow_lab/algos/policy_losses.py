"""The registry of policy-gradient losses: `@lab.register_policy_loss(name)` on
`fn(x: LossInputs) -> ([B, T] loss, metrics)`. The shared actor update (actor_update.py)
aggregates the loss, weighs it by the off-policy correction and adds the KL and entropy
terms, so a loss is only its own formula (PPO's clip, GSPO's sequence ratio, CISPO, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from distflow_lab.algos.losses import gspo_token_loss, ppo_token_loss
from distflow_lab.core.config import ActorOptions
from distflow_lab.core.registry import Registry, caller_module

POLICY_LOSSES: Registry["PolicyLoss"] = Registry("policy loss", "actor.policy_loss")


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees, all [B, T] over response tokens: the old policy's log-probs (no
    gradient), the current policy's (with gradient), the advantages, the loss tokens; the actor's
    options (clip ranges, ...) and the loss's own typed options (actor.policy_loss_options)."""

    old_log_probs: torch.Tensor
    log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    actor: ActorOptions
    options: Any = None


# loss(x) -> ([B, T] per-token loss, metrics); the update aggregates it (actor.loss_agg_mode) and adds the rest
PolicyLoss = Callable[[LossInputs], tuple[torch.Tensor, dict[str, float]]]


def register_policy_loss(name: str, *, options: type | None = None) -> Callable:
    """Decorator: `fn(x: LossInputs) -> (loss [B, T], metrics)` becomes the policy loss `name`
    (actor.policy_loss: name; an algorithm's declaration names its default). The shared update
    weighs it by the off-policy correction and adds the KL and entropy terms (module docstring)."""
    return POLICY_LOSSES.register(name, options=options, origin=caller_module())


@register_policy_loss("ppo_clip")
def ppo_clip(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's token-level clipped surrogate with dual clip (GRPO, PPO, DAPO)."""
    a = x.actor
    return ppo_token_loss(x.old_log_probs, x.log_probs, x.advantages, x.mask, a.clip_ratio_low, a.clip_ratio_high,
                          a.clip_ratio_c)


@register_policy_loss("gspo")
def gspo(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO's sequence-level clipped surrogate."""
    return gspo_token_loss(x.old_log_probs, x.log_probs, x.advantages, x.mask, x.actor.clip_ratio_low,
                           x.actor.clip_ratio_high)


def policy_loss(a: ActorOptions) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                             tuple[torch.Tensor, dict[str, float]]]:
    """The configured loss (actor.policy_loss with its options), as `fn(old, new, adv, mask)`."""
    fn = POLICY_LOSSES.get(a.policy_loss).obj
    opts = POLICY_LOSSES.options(a.policy_loss, a.policy_loss_options, "actor.policy_loss_options")
    return lambda old, new, adv, mask: fn(LossInputs(old, new, adv, mask, a, opts))
