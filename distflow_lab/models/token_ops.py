"""Token-level tensor ops shared by the training engine and the algorithms: masked
means, loss aggregation, log-probs and entropy from logits. One definition each.

Token tensors are [B, T] over response tokens; `mask` is 1 on real tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) / sum(m), over all elements or along `dim`; 0 where the mask is empty."""
    # where() first so NaN/inf in padding cannot leak in (NaN * 0 is NaN).
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1e-8)
    return x.sum(dim) / mask.sum(dim).clamp(min=1e-8)


def loss_sum(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """The numerator of `aggregate_loss`: a sum over the rows given, so micro-batches and
    ranks can each add theirs and divide by one global `loss_count` (the training engine).
    seq-mean-token-sum-norm divides by the padded width T = mask.shape[-1] here, not in the
    count: T is a per-row constant (verl's default `loss_scale_factor`), and a count of
    rows x T could not be summed over ranks padded to different widths."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    mask = mask.to(loss_mat.dtype)
    lm = torch.where(mask.bool(), loss_mat, 0.0) * mask  # where(): NaN/inf in padding cannot leak
    if mode == "seq-mean-token-mean":
        return (lm.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if mode == "seq-mean-token-sum-norm":
        return lm.sum() / mask.shape[-1]
    return lm.sum()


def loss_count(mask: torch.Tensor, mode: str = "token-mean") -> float:
    """The denominator of `aggregate_loss`: real tokens (token-mean), else rows with at
    least one real token (an all-padding row is not a sequence of the mean, as in verl)."""
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar (verl's `agg_loss`). With m = mask, n_b = sum_t m[b, t]
    and S = #{b : n_b > 0} the rows with a real token:

    token-mean:              sum_{b,t} L*m / sum_{b,t} m       (every token weighs the same; DAPO)
    seq-mean-token-mean:     (1/S) sum_b [ sum_t L*m / n_b ]   (every sequence weighs the same; GRPO paper)
    seq-mean-token-sum:      (1/S) sum_b sum_t L*m             (longer sequences weigh more)
    seq-mean-token-sum-norm: (1/(S*T)) sum_b sum_t L*m         (Dr. GRPO: a constant T, the padded
                                                                 width mask.shape[-1] = max response length)

    An all-padding row adds 0 and is left out of S. With S = 0 the loss is 0 (verl: NaN).
    """
    return loss_sum(loss_mat, mask, mode) / max(loss_count(mask, mode), 1e-8)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T]: H = logsumexp(z) - sum_v softmax(z)_v * z_v (= -sum p log p, no log(0)).

    Computed in float32 on max-shifted logits (H is shift-invariant; the shift keeps the two
    terms small so their difference does not cancel). Logits of -inf (masked vocab) are
    allowed: their p * z term is taken as 0, not NaN.
    """
    z = logits.float()
    z = z - z.amax(dim=-1, keepdim=True).detach()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * torch.where(p > 0, z, 0.0)).sum(-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T, V], [B, T] -> [B, T]: log softmax(logits)[labels], in float32.

    Caller aligns positions: logits at t must be the prediction FOR labels[:, t].
    """
    return F.log_softmax(logits.float(), dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
