"""Training engine: a HF model, optionally FSDP2-sharded over a torch.distributed group.

One class serves the actor (causal LM: log-probs, entropy), the critic
(`*ForTokenClassification`, num_labels=1: values) and frozen models (optim=None:
the reference policy). With torch.distributed not initialised, or use_fsdp=False,
the module stays a plain local module and no collective runs.

Gradient normalisation. Invariant: the update does not depend on how rows are grouped
into micro-batches or spread over data-parallel ranks (up to float error). `loss_fn`
returns a per-token loss L and mask m; each micro-batch backpropagates a SUM divided
by a GLOBAL count, all-reduced once per step before the first forward:

  token-mean               sum_{b,t} L*m               / global number of tokens in batch[mask_key]
  seq-mean-token-mean      sum_b sum_t L*m / sum_t m   / global number of rows with a token
  seq-mean-token-sum       sum_{b,t} L*m               / global number of rows with a token
  seq-mean-token-sum-norm  sum_{b,t} L*m / T           / global number of rows with a token (T: padded width)

(= token_ops.aggregate_loss over the global batch: its loss_sum per micro-batch over one
global loss_count). FSDP2's reduce-scatter is switched
from AVERAGE to SUM (`set_gradient_divide_factor(1.0)` plus
`set_force_sum_reduction_for_comms(True)` on every FSDP unit: on torch 2.13 + gloo the
divide factor alone picks PREMUL_SUM, which gloo rejects), so summed per-rank
contributions are exactly the global loss' gradient. A torch without that setter keeps
averaging, and the engine multiplies each contribution by the dp world size instead.

Lock-step: every forward/backward of a sharded model runs collectives, so all ranks
must run the same number. The micro-batch count is all-reduced (MAX); ranks with fewer
run dummy micro-batches: one row (their first, or an all-pad row if they have none)
whose loss is multiplied by 0, adding nothing to the gradient.

Memory on a GPU. A sharded model is never whole on the device: `fully_shard` moves each
decoder block to the device as it shards it (then the root's embeddings/head), so the peak is
one full block beside the shards. The LM head's [tokens, vocab] logits are built
`logits_chunk` tokens at a time (`head_token_stats`; under grad each chunk is checkpointed and
recomputed in backward), never for a whole micro-batch: with a 152k vocabulary, 16k tokens
of fp32 logits are 10 GB. Weight sync streams bounded buckets (`weight_buckets`).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from distflow_lab.core.config import Optim
from distflow_lab.models.buckets import buckets_of
from distflow_lab.models.lora import adapter_name, is_lora
from distflow_lab.models.token_ops import (LOSS_AGG_MODES, entropy_from_logits, log_probs_from_logits, loss_count,
                                           loss_sum)

Tensor = torch.Tensor
# loss_fn(micro, log_probs or None (critic), entropy or values or None) -> (loss [b,R], mask [b,R], metrics)
LossFn = Callable[[dict[str, Tensor], Tensor | None, Tensor | None], tuple[Tensor, Tensor, dict[str, float]]]


def pack_rows(tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy, in row order: consecutive rows whose real-token total fits `budget`; a row
    longer than the budget is a micro-batch on its own. Every row lands in exactly one
    micro-batch. (The schedule replay packs recorded rows with it to predict another budget.)"""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(tokens):
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def micro_batches(attention_mask: Tensor, budget: int) -> list[Tensor]:
    """`pack_rows` of the rows' real tokens (attention_mask sum), as int64 index tensors."""
    return [torch.tensor(ix, dtype=torch.long) for ix in pack_rows(attention_mask.sum(-1).tolist(), budget)]


def forward_span(attention_mask: Tensor, prompt_len: int) -> tuple[int, int]:
    """Columns [lo, hi) a micro-batch's forward runs on: padding in every row (left of the
    prompts, right of the responses) is dropped; at least position P-1 and one response position."""
    used = (attention_mask.sum(0) > 0).nonzero().flatten()
    lo = min(int(used.min()), prompt_len - 1) if used.numel() else prompt_len - 1
    hi = max(int(used.max()) + 1, prompt_len + 1) if used.numel() else prompt_len + 1
    return lo, hi


def padding_tokens(attention_mask: Tensor, prompt_len: int, plan: list[Tensor | None]) -> tuple[float, float]:
    """(padded, real) tokens in the forwards of `plan`'s micro-batches (dummies left out): each one
    runs rows x `forward_span` positions. Padding waste = padded / real: micro-batches of rows of
    similar lengths shrink it."""
    padded = real = 0.0
    for idx in plan:
        if idx is not None:
            am = attention_mask[idx]
            lo, hi = forward_span(am, prompt_len)
            n = float(am.sum())
            padded, real = padded + am.shape[0] * (hi - lo) - n, real + n
    return padded, real


def sft_loss_fn(micro: dict[str, Tensor], log_probs: Tensor | None, _: Tensor | None) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Supervised next-token loss on response tokens: L = -log p(token), mask = the model's tokens
    (`loss_mask` for demonstrated trajectories, else response_mask)."""
    return -log_probs, micro.get("loss_mask", micro["response_mask"]), {}


def _chunk_stats(head: torch.nn.Module, temperature: float, with_entropy: bool, hidden: Tensor,
                 labels: Tensor) -> tuple[Tensor, Tensor | None]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return log_probs_from_logits(logits, labels), entropy_from_logits(logits) if with_entropy else None


def head_token_stats(head: torch.nn.Module, hidden: Tensor, labels: Tensor, temperature: float = 1.0,
                     chunk: int = 1024, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log p(labels) and optionally the entropy, [b, t] float32, from final hidden states [b, t, H]
    through the LM head, `chunk` tokens at a time: at most [chunk, vocab] logits exist at once.
    With grad enabled each chunk is checkpointed, so backward keeps only the hidden states and
    recomputes a chunk's logits when it gets there."""
    b, t, H = hidden.shape
    flat_h, flat_y = hidden.reshape(b * t, H), labels.reshape(b * t)
    fn = lambda h, y: _chunk_stats(head, temperature, with_entropy, h, y)  # noqa: E731
    lps, ents = [], []
    for s in range(0, b * t, chunk):
        h, y = flat_h[s : s + chunk], flat_y[s : s + chunk]
        lp, ent = checkpoint(fn, h, y, use_reentrant=False) if torch.is_grad_enabled() else fn(h, y)
        lps.append(lp)
        ents.append(ent)
    cat = lambda xs: torch.cat(xs).reshape(b, t) if xs else hidden.new_zeros((b, t), dtype=torch.float32)  # noqa: E731
    return cat(lps), cat(ents) if with_entropy else None


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class TrainEngine:
    """Forward (log-probs / values) and optimizer steps over a local batch, micro-batched.

    Args:
        model: HF causal LM (actor/ref) or `*ForTokenClassification` with num_labels=1 (critic).
        optim: None for a frozen model (eval mode, no grads, no optimizer).
        process_group: data-parallel group (default: the world group) when distributed.
        micro_token_budget: max real tokens per micro-batch (see `micro_batches`).
        use_fsdp: shard with FSDP2 when torch.distributed is initialised.
        device: default cuda:$LOCAL_RANK if CUDA is available, else cpu.
        temperature: logits are divided by it before log-probs/entropy (match the rollout's).
        critic: force actor/critic mode; None = critic iff the class is *ForTokenClassification.
        mixed_precision: FSDP2 param dtype (e.g. torch.bfloat16 on GPU); grads reduce in float32.
        gradient_checkpointing: recompute activations in backward (HF, non-reentrant).
        logits_chunk: tokens whose full-vocab logits exist at once in the log-prob forward.

    `before_compute`: callables run before every forward or backward pass (e.g. putting a
    colocated vLLM engine to sleep, so training gets its memory).
    """

    def __init__(self, model: torch.nn.Module, optim: Optim | None = None, process_group: dist.ProcessGroup | None = None,
                 micro_token_budget: int = 4096, use_fsdp: bool = True, device: torch.device | str | None = None,
                 temperature: float = 1.0, critic: bool | None = None, mixed_precision: torch.dtype | None = None,
                 gradient_checkpointing: bool = False, logits_chunk: int = 1024):
        self.device = torch.device(device) if device is not None else _default_device()
        self.distributed = use_fsdp and dist.is_available() and dist.is_initialized()
        self.group = (process_group or dist.group.WORLD) if self.distributed else None
        self.world = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.budget, self.temperature, self.optim_cfg = micro_token_budget, temperature, optim
        self.logits_chunk = logits_chunk
        self.before_compute: list[Callable[[], None]] = []
        self.padding_waste = 0.0  # padded / real tokens of the last forward pass (forward_log_probs / values)
        self.is_critic = type(model).__name__.endswith("ForTokenClassification") if critic is None else critic
        trainable = optim is not None
        if not (trainable and is_lora(model)):  # a LoRA policy: peft froze W0 and left the adapters trainable
            model.requires_grad_(trainable)
        model.train(trainable)
        if trainable and gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.grad_scale = 1.0  # multiplies each contribution; the world size if FSDP2 must average
        if self.distributed:
            self._shard(model, mixed_precision)  # moves to the device shard by shard, never whole
        else:
            model.to(self.device)
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay) if trainable else None

    # ---------------------------------------------------------------- setup
    def _shard(self, model: torch.nn.Module, mixed_precision: torch.dtype | None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # fully_shard moves each unit to the mesh's current device
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        mp = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32 if mixed_precision else None)
        # Decoder blocks are the HF "no split" classes; each becomes one all-gather unit.
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in block_names]
        if not blocks:
            raise ValueError(f"{type(model).__name__} lists no _no_split_modules: cannot find decoder blocks to shard")
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)  # root: embeddings, final norm, (tied) head
        fsdp_mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if all(hasattr(m, "set_force_sum_reduction_for_comms") for m in fsdp_mods):
            for m in fsdp_mods:  # per FSDP unit: each holds its own reduce settings
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        else:
            self.grad_scale = float(self.world)

    def _all_reduce(self, t: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        if not self.distributed:
            return t
        t = t.to(self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.cpu()

    def _plan(self, attention_mask: Tensor) -> list[Tensor | None]:
        """Local micro-batches, padded with None (dummy) to the max count over ranks."""
        mbs = micro_batches(attention_mask, self.budget) if attention_mask.shape[0] else []
        n = int(self._all_reduce(torch.tensor([len(mbs)], dtype=torch.long), dist.ReduceOp.MAX)[0])
        return mbs + [None] * (n - len(mbs))

    def _micro(self, batch: dict[str, Tensor], idx: Tensor | None) -> dict[str, Tensor]:
        """Rows `idx` of every tensor column on the device; None = a 1-row dummy."""
        cols = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
        if idx is None and cols["input_ids"].shape[0] == 0:  # no local rows: an all-pad row (finite, weight 0)
            mb = {k: v.new_zeros((1, *v.shape[1:])) for k, v in cols.items()}
            mb["attention_mask"] = torch.ones_like(mb["attention_mask"])
            return {k: v.to(self.device) for k, v in mb.items()}
        idx = torch.tensor([0]) if idx is None else idx
        return {k: v[idx].to(self.device) for k, v in cols.items()}

    # ---------------------------------------------------------------- forward
    def _forward_micro(self, mb: dict[str, Tensor], with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """(log_probs or values [b, R], entropy [b, R] | None), zero on response padding."""
        ids, am, pos = mb["input_ids"], mb["attention_mask"], mb["position_ids"]
        R = mb["responses"].shape[1]
        P = ids.shape[1] - R
        # Drop columns that are padding in every row (left of the prompts, right of the
        # responses): pure speed, the kept positions see the same keys and position ids.
        lo, hi = forward_span(am, P)
        k = hi - P  # response positions kept
        kw = dict(input_ids=ids[:, lo:hi], attention_mask=am[:, lo:hi], position_ids=pos[:, lo:hi], use_cache=False)
        rmask = am[:, P:hi].bool()
        if self.is_critic:
            v = self.model(**kw).logits[..., 0].float()[:, P - 1 - lo : hi - 1 - lo]  # value of the state before token t
            out, ent = torch.where(rmask, v, 0.0), None
        else:
            lp, ent = self._response_stats(kw, mb["responses"][:, :k], with_entropy)
            out = torch.where(rmask, lp, 0.0)
            ent = torch.where(rmask, ent, 0.0) if with_entropy else None
        pad = lambda x: F.pad(x, (0, R - k)) if x is not None else None  # noqa: E731
        return pad(out), pad(ent)

    def _response_stats(self, kw: dict[str, Tensor], labels: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropy) [b, k] of the k response tokens `labels`: position P+t-1 predicts
        token t, so the last k+1 hidden states but the very last reach the head, in chunks. They are
        taken from the decoder's output by a hook, inside the model's forward, where FSDP2 holds the
        root's (embedding / LM head) weights gathered; the model's own head sees one position only."""
        k, stats = labels.shape[1], {}

        def on_decoder_output(_module: torch.nn.Module, _args: tuple, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            stats["out"] = head_token_stats(self.model.get_output_embeddings(), hidden[:, -(k + 1) : -1], labels,
                                            self.temperature, self.logits_chunk, with_entropy)

        handle = self.model.get_decoder().register_forward_hook(on_decoder_output)
        try:
            self.model(**kw, logits_to_keep=1)
        finally:
            handle.remove()
        return stats["out"]

    @torch.no_grad()
    def _forward_all(self, batch: dict[str, Tensor], with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        for fn in self.before_compute:
            fn()
        out = torch.zeros(batch["responses"].shape)
        ent = torch.zeros(batch["responses"].shape) if with_entropy else None
        plan = self._plan(batch["attention_mask"])
        padded, real = padding_tokens(batch["attention_mask"], batch["input_ids"].shape[1] - out.shape[1], plan)
        self.padding_waste = padded / max(real, 1.0)
        for idx in plan:
            o, e = self._forward_micro(self._micro(batch, idx), with_entropy)
            if idx is None:
                continue  # dummy: ran only to keep the FSDP collectives in lock-step
            out[idx] = o.cpu()
            if ent is not None:
                ent[idx] = e.cpu()
        return out, ent

    def forward_log_probs(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, responses: Tensor,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs [B, R] float32 (CPU) of the response tokens, and optionally their entropy;
        0 on response padding. No grad. Collective under FSDP: every rank must call it."""
        cols = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, responses=responses)
        return self._forward_all(cols, with_entropy)

    def forward_values(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, responses: Tensor) -> Tensor:
        """Critic values [B, R] float32 (CPU): values[:, t] is read at input position P+t-1; 0 on padding."""
        if not self.is_critic:
            raise TypeError("forward_values needs a critic (*ForTokenClassification, num_labels=1)")
        cols = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, responses=responses)
        return self._forward_all(cols, False)[0]

    # ---------------------------------------------------------------- training
    def compute_grads(self, batch: dict[str, Tensor], loss_fn: LossFn, loss_agg_mode: str = "token-mean",
                      with_entropy: bool = False, mask_key: str = "response_mask") -> dict[str, float]:
        """Accumulate the global-batch loss gradient into .grad (no step, no zeroing).

        loss_fn gets (micro columns on device, log_probs [b,R] with grad or None (critic),
        entropy [b,R] / values [b,R] (critic) / None); its metric keys must not depend on the
        data. The token-mean normaliser counts batch[mask_key]: tokens the loss_fn masks out
        beyond it add 0 but still count. Returns all-reduced metrics: loss (the aggregated
        global loss), n_tokens, n_micro, padding_waste (`padding_tokens`: padded / real tokens
        of the forwards), and loss_fn metrics: a mean over micro-batches and ranks weighted by
        mask tokens, except a key ending in `_max`, the max over the micro-batches with a
        mask token on every rank (all_reduce MAX; 0.0 if there is none).
        """
        if loss_agg_mode not in LOSS_AGG_MODES or self.optimizer is None:
            raise ValueError(f"bad loss_agg_mode {loss_agg_mode!r} or frozen engine (optim=None)")
        local = torch.tensor([batch["input_ids"].shape[0], float(batch[mask_key].sum()),
                              loss_count(batch[mask_key], loss_agg_mode)], dtype=torch.float64)
        g_rows, g_tokens, g_count = self._all_reduce(local).tolist()
        if g_rows == 0:
            raise ValueError("empty global batch")
        denom = max(g_count, 1.0)
        for fn in self.before_compute:
            fn()
        plan = self._plan(batch["attention_mask"])
        waste = padding_tokens(batch["attention_mask"], batch["input_ids"].shape[1] - batch["responses"].shape[1], plan)
        total, weight_sum, metric_sums, metric_maxes = 0.0, 0.0, {}, {}
        for idx in plan:
            w = 0.0 if idx is None else 1.0
            mb = self._micro(batch, idx)
            out, ent = self._forward_micro(mb, with_entropy)
            lp, third = (None, out) if self.is_critic else (out, ent)
            loss_mat, mask, metrics = loss_fn(mb, lp, third)
            contrib = loss_sum(loss_mat, mask, loss_agg_mode) * (w / denom)
            (contrib * self.grad_scale).backward()
            total += float(contrib.detach())
            k = float(mask.sum()) * w
            weight_sum += k
            for key, v in metrics.items():
                if key.endswith("_max"):  # a max, not a mean: a micro-batch without tokens has none
                    m = metric_maxes.setdefault(key, -math.inf)
                    metric_maxes[key] = max(m, float(v)) if k > 0 else m
                else:
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(v) * k
        keys, max_keys = sorted(metric_sums), sorted(metric_maxes)
        packed = self._all_reduce(torch.tensor([total, weight_sum, *waste, *[metric_sums[k] for k in keys]],
                                               dtype=torch.float64))
        tot = max(float(packed[1]), 1e-12)
        result = {"loss": float(packed[0]), "n_tokens": g_tokens, "n_micro": float(len(plan)),
                  "padding_waste": float(packed[2]) / max(float(packed[3]), 1.0)}
        result.update({k: float(packed[4 + i]) / tot for i, k in enumerate(keys)})
        if max_keys:  # same keys on every rank (they do not depend on the data), so all call it
            maxes = self._all_reduce(torch.tensor([metric_maxes[k] for k in max_keys], dtype=torch.float64),
                                     dist.ReduceOp.MAX)
            result.update({k: float(v) if math.isfinite(v) else 0.0 for k, v in zip(max_keys, maxes.tolist())})
        return result

    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn, loss_agg_mode: str = "token-mean",
                   with_entropy: bool = False, mask_key: str = "response_mask") -> dict[str, float]:
        """One optimizer step over the local batch (collective under FSDP: all ranks call it).

        zero grads -> `compute_grads` -> clip the global grad norm -> AdamW step (skipped,
        with skipped=1, when the norm is not finite) -> zero grads. Metrics are python
        floats, identical on every rank (`*_max` keys reduced by max, see `compute_grads`).
        """
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.compute_grads(batch, loss_fn, loss_agg_mode, with_entropy, mask_key)
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        gn = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], clip)
        gn = float(gn.full_tensor() if isinstance(gn, DTensor) else gn)  # DTensor under FSDP2
        if finite := math.isfinite(gn):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(grad_norm=gn, skipped=float(not finite), lr=self.optimizer.param_groups[0]["lr"])
        return metrics

    # ---------------------------------------------------------------- state
    def gathered_grads(self) -> dict[str, Tensor]:
        """Full (unsharded) gradients on CPU by parameter name; for tests and debugging."""
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().clone()
                for n, p in self.model.named_parameters() if p.grad is not None}

    @torch.no_grad()
    def weight_buckets(self, bucket_bytes: int = 512 << 20, device: torch.device | str | None = None,
                       dtype: torch.dtype | None = None, copy: bool = False,
                       stats: dict[str, int] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
        """Full parameters/buffers (HF names, state-dict order) in buckets of at most `bucket_bytes`
        (a larger single tensor is a bucket alone), gathered one tensor at a time on EVERY rank:
        collective under FSDP, so every rank must consume every bucket. Tensors stay on the engine's
        device unless `device` is given, cast to `dtype` if given. Only the bucket being built is
        held (plus a tied weight until its last name), so no step holds the whole model twice.
        `stats`, if given, gets "bytes" (gathered, each tensor once) and "tensors" (names) added.
        The input of `VLLMRollout.load_weights`."""
        yield from buckets_of(self._full_tensors(device, dtype, copy, stats), bucket_bytes)

    def adapter_buckets(self, bucket_bytes: int = 512 << 20, device: torch.device | str | None = None,
                        stats: dict[str, int] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
        """A LoRA policy's adapters only (models/lora.py: "<module>.lora_A" / ".lora_B"), gathered
        like `weight_buckets` (collective under FSDP)."""
        yield from buckets_of(self._full_tensors(device, None, False, stats, rename=adapter_name), bucket_bytes)

    def _full_tensors(self, device: torch.device | str | None, dtype: torch.dtype | None, copy: bool,
                      stats: dict[str, int] | None, rename: Callable[[str], str | None] = lambda name: name,
                      ) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) one at a time; `rename`: the name it is sent under, None to skip it
        (the same names on every rank, so the gathers stay in lock-step)."""
        stats = stats if stats is not None else {}
        stats.setdefault("bytes", 0)
        stats.setdefault("tensors", 0)
        owner = self._owners()
        items = list(self.model.state_dict().items())
        names_left = Counter(owner.get(name, name) for name, _ in items if rename(name) is not None)
        tied: dict[str, Tensor] = {}  # gathered once, kept until its last name
        for name, t in items:
            if (sent := rename(name)) is None:
                continue
            key = owner.get(name, name)
            full = tied.get(key)
            if full is None:
                full = t.full_tensor() if isinstance(t, DTensor) else t
                full = full.detach().to(device=device or full.device, dtype=dtype or full.dtype, copy=copy)
                stats["bytes"] += full.numel() * full.element_size()
                if names_left[key] > 1:
                    tied[key] = full
            names_left[key] -= 1
            if names_left[key] == 0:
                tied.pop(key, None)
            stats["tensors"] += 1
            yield sent, full

    def _owners(self) -> dict[str, str]:
        """Every parameter/buffer name -> the first name of the tensor it is. Tied names
        (embed/lm_head) share one Parameter object: the module structure says so the same way on
        every rank, so every rank gathers the same tensors in the same order."""
        first: dict[int, str] = {}
        return {name: first.setdefault(id(t), name) for name, t in
                [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers(remove_duplicate=False)]}

    def tied_aliases(self) -> dict[str, str]:
        """Names that share a tensor with an earlier one (a tied lm_head -> embed_tokens): a
        weight sync sends the earlier name once and lists these as aliases."""
        return {name: owner for name, owner in self._owners().items() if owner != name}

    def full_state_dict(self, stats: dict[str, int] | None = None) -> dict[str, Tensor]:
        """Full parameters/buffers (HF names) as CPU copies on EVERY rank, gathered one tensor at a
        time (tied weights share one tensor); collective under FSDP. The input of
        `HFRollout.load_weights`; `stats` as in `weight_buckets`."""
        buckets = self.weight_buckets(bucket_bytes=math.inf, device="cpu", copy=True, stats=stats)
        return {name: t for bucket in buckets for name, t in bucket}

    def save(self, directory: str | os.PathLike) -> Path:
        """Write full (unsharded) state dicts `model.pt` (+ `optim.pt`) from rank 0 with torch.save.

        Gathered by torch.distributed.checkpoint.state_dict helpers (cpu_offload: only rank 0
        holds them); FQN keys, plain tensors: torch.load(weights_only=True) reads them, any
        world size can load them. Collective under FSDP.
        """
        directory = Path(directory)
        # cpu_offload gathers onto GLOBAL rank 0 only: a training group without it (worker groups) gathers
        # onto each of its ranks instead, and its rank 0 writes
        offload = self.distributed and dist.get_global_rank(self.group, 0) == 0
        opts = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        msd = get_model_state_dict(self.model, options=opts)
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts) if self.optimizer else None
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(msd, directory / "model.pt")
            if osd is not None:
                torch.save(osd, directory / "optim.pt")
        if self.distributed:
            dist.barrier(group=self.group)  # nobody reads the files before they exist
        return directory

    def load(self, directory: str | os.PathLike) -> None:
        """Load a `save` checkpoint; every rank reads the files (shared filesystem), FSDP re-shards."""
        directory, opts = Path(directory), StateDictOptions(full_state_dict=True)
        read = lambda name: torch.load(directory / name, map_location="cpu", weights_only=True)  # noqa: E731
        set_model_state_dict(self.model, read("model.pt"), options=opts)
        if self.optimizer is not None and (directory / "optim.pt").is_file():
            set_optimizer_state_dict(self.model, self.optimizer, read("optim.pt"), options=opts)

