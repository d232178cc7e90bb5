"""Advantage estimators for RL post-training (GRPO, Dr. GRPO, RLOO, REINFORCE++, GAE).

Conventions: token tensors are [B, T] over the RESPONSE tokens only, `response_mask`
[B, T] is 1 on real response tokens and 0 on padding; sequence scores are [B];
`index` [B] holds group ids (the prompt uid), any hashable values.

Every estimator returns `(advantages, returns)`, both [B, T] and zero on padding.
They run under `torch.no_grad()`: advantages are fixed targets, never differentiated.
Inputs are never written in place (batches from the object store are read-only views).

Data parallelism: each rank holds a shard of the batch. Whole-batch statistics (the
whitening of REINFORCE++ and GAE) are all-reduced over the `group` given, so a sharded
run equals one process on the whole batch (as verl). Group-relative estimators (GRPO,
RLOO) need every response of a prompt on one rank, which the data plane keeps together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from distflow_lab.algos.losses import loss_mask_key
from distflow_lab.core.errors import ConfigError
from distflow_lab.core.registry import Registry, caller_module

if TYPE_CHECKING:
    from distflow_lab.core.batch import Batch
    from distflow_lab.core.config import AlgorithmOptions

GroupIndex = Sequence | np.ndarray


def _group_sum(t: torch.Tensor, group: "dist.ProcessGroup | None") -> torch.Tensor:
    """t summed over the ranks of `group` (a new tensor); t itself with no group or no torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return t
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else t.device
    out = t.to(dev, copy=True)  # nccl reduces only device tensors
    dist.all_reduce(out, group=group)
    return out.to(t.device)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
                   group: "dist.ProcessGroup | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) over the masked elements of x on every rank of `group`:

        n = sum m,  mean = sum(x m) / n,  var = sum((x - mean)^2 m) / n   (x n/(n-1) if unbiased)

    Two all-reduces of sums (sum, count; then squared deviations around the GLOBAL mean), so
    the result is whole-batch statistics to float precision, not a mean of per-rank ones.
    Raises (on every rank alike: n is global) when undefined: n == 0, or n == 1 with unbiased.
    """
    m = mask.to(x.dtype)
    keep = mask.bool()
    xm = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))  # NaN on padding cannot leak
    s, n = _group_sum(torch.stack([(xm * m).sum(), m.sum()]), group).unbind()
    if float(n) < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} masked elements, got {float(n):g}")
    mean = s / n
    sq = _group_sum(((xm - mean) ** 2 * m).sum(), group)
    var = sq / n
    return mean, var * (n / (n - 1)) if unbiased else var


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
               group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """Variance over all masked elements (of every rank of `group`): mean_m((x - mean_m(x))^2),
    times n / (n - 1) if unbiased. See `masked_moments`."""
    return masked_moments(x, mask, unbiased, group)[1]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """(x - mean_m) / sqrt(var_m + 1e-8) with batch-wide masked stats (unbiased var), over the
    rows of every rank of `group` (None: this process's rows); with shift_mean=False the mean
    is added back (only the scale changes). Padding positions are NOT zeroed here; callers
    multiply by the mask."""
    mean, var = masked_moments(x, mask, True, group)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


# ---------------------------------------------------------------- group helpers


def _group_ids(index: GroupIndex, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to 0..G-1 (order of first appearance)."""
    # tolist(): numpy/torch scalars -> python values (0-d tensors would hash by identity).
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    ids: dict = {}
    gid = [ids.setdefault(k, len(ids)) for k in keys]
    return torch.tensor(gid, dtype=torch.long, device=device), len(ids)


def _as_float(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.is_floating_point() else scores.float()


def _group_sum_count(
    scores: torch.Tensor, index: GroupIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-row group sum and group size, gathered back to [B]; plus group ids and G."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries, scores has {scores.shape[0]}")
    gid, g = _group_ids(index, scores.device)
    sums = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    counts = torch.bincount(gid, minlength=g).to(scores.dtype)
    return sums[gid], counts[gid], gid, g


# ---------------------------------------------------------------- outcome estimators


@torch.no_grad()
def grpo_outcome_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), broadcast to every response token.

    mean_g, std_g are over the responses sharing prompt id g; std is unbiased (as torch.std).
    A group of size 1 uses mean 0, std 1 (verl's convention), so its advantage is the raw score.
    norm_by_std=False is Dr. GRPO (arXiv:2503.20783): A_i = s_i - mean_g.
    Returns (advantages, returns), both [B, T] and equal, times the mask.
    """
    s = _as_float(scores)
    sums, n, gid, g = _group_sum_count(s, index)
    single = n == 1
    mean = torch.where(single, torch.zeros_like(s), sums / n)
    sq = torch.zeros(g, dtype=s.dtype, device=s.device).index_add_(0, gid, (s - mean) ** 2)[gid]
    std = torch.where(single, torch.ones_like(s), (sq / (n - 1).clamp(min=1)).sqrt())
    adv = (s - mean) / (std + eps) if norm_by_std else s - mean
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def dr_grpo_outcome_advantage(
    scores: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: A_i = s_i - mean_g (no std normalisation). See grpo_outcome_advantage."""
    return grpo_outcome_advantage(scores, response_mask, index, norm_by_std=False, eps=eps)


@torch.no_grad()
def rloo_advantage(
    scores: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): A_i = s_i - (sum_g - s_i) / (n_g - 1), the mean of the OTHER members.

    Equivalently n/(n-1) * (s_i - mean_g). A group of size 1 has no other member: following
    verl, its baseline is 0 and its advantage is the raw score s_i (not 0).
    Returns (advantages, returns), both [B, T] and equal, times the mask.
    """
    s = _as_float(scores)
    sums, n, _, _ = _group_sum_count(s, index)
    baseline = torch.where(n > 1, (sums - s) / (n - 1).clamp(min=1), torch.zeros_like(s))
    adv = (s - baseline).unsqueeze(-1) * response_mask
    return adv, adv


def outcome_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: r[b, t] = scores[b] on the last valid token of row b, 0 elsewhere.

    A row with no valid token gets no reward (all zeros).
    """
    t = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = ((response_mask > 0) * t).amax(dim=-1)  # last index with mask 1 (0 if none)
    out = torch.zeros(response_mask.shape, dtype=_as_float(scores).dtype, device=scores.device)
    out[torch.arange(out.shape[0], device=out.device), last] = _as_float(scores)
    return out * response_mask


# ---------------------------------------------------------------- token-level estimators


@torch.no_grad()
def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t+1} over valid tokens, 0 after the last one.

    Masked positions are skipped (G carries through unchanged, as verl's GAE does). For the
    usual right-padded mask this equals verl's REINFORCE++ loop, which resets G at padding.
    """
    m = response_mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    out = []
    for t in reversed(range(token_rewards.shape[1])):
        running = m[:, t] * (token_rewards[:, t] + gamma * running) + (1 - m[:, t]) * running
        out.append(running)
    return torch.stack(out[::-1], dim=1) * m


@torch.no_grad()
def reinforce_plus_plus_advantage(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
    group: "dist.ProcessGroup | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): returns G_t = discounted_returns(r, gamma);
    advantages = masked_whiten(G) over the whole batch (global, not per group; all ranks of
    `group`), times the mask."""
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, group=group) * response_mask, returns


@torch.no_grad()
def gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    group: "dist.ProcessGroup | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (arXiv:1506.02438), backward over response tokens.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V   (raw A, before whitening)

    V_{t+1} is the value of the next VALID token; after the last valid token it is 0
    (terminal), so values on padding never enter. Masked positions are skipped (A and V
    carry through). With whiten=True (verl's default) advantages = masked_whiten(A) over
    the whole batch (all ranks of `group`).
    Both outputs are zero on padding.
    """
    m = response_mask.to(values.dtype)
    next_v = torch.zeros_like(values[:, 0])
    last_a = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * last_a
        next_v = m[:, t] * values[:, t] + (1 - m[:, t]) * next_v
        last_a = m[:, t] * a + (1 - m[:, t]) * last_a
        out.append(last_a)
    adv = torch.stack(out[::-1], dim=1)
    returns = (adv + values) * m
    adv = masked_whiten(adv, m, group=group) if whiten else adv
    return adv * m, returns


# ---------------------------------------------------------------- the registry

ESTIMATORS: Registry["Estimator"] = Registry("estimator", "algorithm.adv_estimator")
KINDS = ("outcome", "token", "critic")  # what an estimator reads: see EstimatorInputs


@dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator sees: the batch, its own typed options (algorithm.estimator_options),
    the algorithm's (gamma, lam, ...) and the advantage stage's data-parallel group (whitening
    all-reduces over it; group-relative estimators ignore it: a prompt's responses share a rank)."""

    batch: "Batch"
    options: Any
    algorithm: "AlgorithmOptions"
    group: "dist.ProcessGroup | None" = None

    @property
    def mask(self) -> torch.Tensor:
        """[B, T] the loss tokens (multi-turn: the model's, not the environment's)."""
        return self.batch[loss_mask_key(self.batch)]

    @property
    def scores(self) -> torch.Tensor:
        """[B] each response's outcome (sum of the token rewards when a stage shaped them)."""
        return outcome_scores(self.batch)

    @property
    def token_rewards(self) -> torch.Tensor:
        """[B, T] per-token rewards (the outcome on the last token, unless a stage shaped them)."""
        return token_rewards(self.batch)

    @property
    def index(self):
        """[B] the prompt group of each response (its uid)."""
        return self.batch["uid"]


Estimator = Callable[[EstimatorInputs], tuple[torch.Tensor, torch.Tensor]]


def register_estimator(name: str, *, kind: str = "outcome", options: type | None = None) -> Callable:
    """Decorator: `fn(x: EstimatorInputs) -> (advantages [B, T], returns [B, T])` becomes the estimator
    `name` (algorithm.adv_estimator: name; its options from algorithm.estimator_options). `kind` says what
    it reads, and so which algorithms can run it (their `estimator_kinds`): "outcome" (one score per
    response, group-relative), "token" (per-token rewards, batch-wide) or "critic" (the critic's values)."""
    if kind not in KINDS:
        raise ConfigError(f"estimator {name!r}: kind {kind!r} is not one of {list(KINDS)}")
    return ESTIMATORS.register(name, options=options, kind=kind, origin=caller_module())


def token_rewards(batch: "Batch") -> torch.Tensor:
    """The batch's per-token rewards: a `token_rewards` column if a stage made one (e.g.
    KL in the reward), else the outcome score on each response's last token."""
    if "token_rewards" in batch:
        return batch["token_rewards"]
    return outcome_to_token_rewards(batch["scores"], batch[loss_mask_key(batch)])


def outcome_scores(batch: "Batch") -> torch.Tensor:
    """[B] score of each response for the outcome estimators: sum_t token_rewards when a
    stage made that column (verl's `token_level_rewards.sum(-1)`, so a KL-shaped reward
    reaches GRPO/RLOO too), else the `scores` column."""
    if "token_rewards" in batch:
        return batch["token_rewards"].sum(-1)
    return batch["scores"]


@register_estimator("grpo")
def _grpo(x: EstimatorInputs):
    return grpo_outcome_advantage(x.scores, x.mask, x.index)


@register_estimator("dr_grpo")
def _dr_grpo(x: EstimatorInputs):
    return dr_grpo_outcome_advantage(x.scores, x.mask, x.index)


@register_estimator("rloo")
def _rloo(x: EstimatorInputs):
    return rloo_advantage(x.scores, x.mask, x.index)


@register_estimator("reinforce_plus_plus", kind="token")
def _reinforce_plus_plus(x: EstimatorInputs):
    return reinforce_plus_plus_advantage(x.token_rewards, x.mask, x.algorithm.gamma, x.group)


@register_estimator("gae", kind="critic")
def _gae(x: EstimatorInputs):
    return gae_advantage(x.token_rewards, x.batch["values"], x.mask, x.algorithm.gamma, x.algorithm.lam, group=x.group)


def run_estimator(name: str, batch: "Batch", algorithm: "AlgorithmOptions",
                  group: "dist.ProcessGroup | None" = None, options: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered estimator `name` on `batch` (options: its typed options, or the config's dict)."""
    raw = algorithm.estimator_options if options is None else options
    opts = ESTIMATORS.options(name, raw, "algorithm.estimator_options")
    return ESTIMATORS.get(name).obj(EstimatorInputs(batch, opts, algorithm, group))
