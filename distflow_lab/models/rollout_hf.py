"""Rollout with HF `generate`: prompts in, verl-layout response columns out
(the layout is described in `sequences.py`). The same HF model object serves
training and rollout, so the log-probs a trainer recomputes with
`TrainEngine.forward_log_probs` are those of the distribution sampled here
(with temperature 1 and no top-k/top-p truncation).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from distflow_lab.core.config import RolloutOptions
from distflow_lab.core.errors import WeightSyncMismatch
from distflow_lab.models.buckets import DEFAULT_BUCKET_BYTES
from distflow_lab.models.sequences import assemble_columns, response_mask_from_eos


class HFRollout:
    """Sampling with `model.generate`, in micro-batches, seeded per call.

    Weight sync: when the rollout holds the trainer's own (unsharded) module object
    (colocated, 1 rank) it always sees the latest weights and needs no copy. Otherwise
    push `TrainEngine.full_state_dict()` through `load_weights` after each step.
    """

    sleeps = needs_weights = False  # `rollout.RolloutEngine`: it keeps its weights in memory
    bucket_bytes = DEFAULT_BUCKET_BYTES  # a colocated sync's largest bucket; engine_setup sets weight_sync.bucket_mib
    weight_dtype = None  # copy_ converts

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions,
                 max_prompt_len: int):
        self.model, self.tokenizer, self.cfg, self.max_prompt_len = model, tokenizer, opts, max_prompt_len
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.foreign = False  # parameters are views of memory a weight sync lent (load_weights(bind=True))
        if self.eos_id is None or self.pad_id is None:
            raise ValueError("tokenizer needs both an eos and a pad token")
        c = self.cfg
        sampling: dict[str, Any] = (
            dict(do_sample=True, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k)
            if c.do_sample else dict(do_sample=False)
        )
        # A bare config replaces the checkpoint's generation_config during generate, so no
        # checkpoint default (repetition_penalty, min_p, top_k=20, ...) silently changes the
        # sampling distribution away from the policy the trainer differentiates.
        self.gen_config = GenerationConfig(
            max_new_tokens=c.max_response_len, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            bos_token_id=tokenizer.bos_token_id, repetition_penalty=1.0, use_cache=True,
            return_dict_in_generate=True, output_logits=c.log_probs, **sampling,
        )

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """Sample n responses per prompt; returns the verl columns (CPU tensors, see module doc).

        The output depends only on (inputs, seed, cfg): the torch RNG is seeded inside a
        forked RNG state, so the caller's global RNG is left untouched.
        """
        c, R = self.cfg, self.cfg.max_response_len
        device = next(self.model.parameters()).device
        prompts = prompt_ids.long().repeat_interleave(c.n, dim=0)
        pmask = prompt_mask.long().repeat_interleave(c.n, dim=0)
        responses = torch.full((prompts.shape[0], R), self.pad_id, dtype=torch.long)
        valid = torch.zeros((prompts.shape[0], R), dtype=torch.bool)
        logps = torch.zeros((prompts.shape[0], R), dtype=torch.float32) if c.log_probs else None
        was_training = self.model.training
        saved_cfg = self.model.generation_config
        self.model.eval()
        self.model.generation_config = self.gen_config
        cuda_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda_devices):
                torch.manual_seed(seed)
                for s in range(0, prompts.shape[0], c.micro_batch):
                    ids = prompts[s : s + c.micro_batch].to(device)
                    out = self.model.generate(
                        input_ids=ids, attention_mask=pmask[s : s + c.micro_batch].to(device),
                        generation_config=self.gen_config,
                    )
                    new = out.sequences[:, ids.shape[1]:].cpu()
                    L = new.shape[1]
                    responses[s : s + len(new), :L] = new
                    valid[s : s + len(new), :L] = True
                    if logps is not None:
                        logits = torch.stack(out.logits, dim=1).float().cpu()  # [b, L, V], raw
                        if c.do_sample and c.temperature != 1.0:
                            logits = logits / c.temperature
                        logps[s : s + len(new), :L] = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        finally:
            self.model.generation_config = saved_cfg
            self.model.train(was_training)
        response_mask = response_mask_from_eos(responses, self.eos_id, valid)
        responses = torch.where(response_mask.bool(), responses, self.pad_id)
        cols = assemble_columns(prompts, pmask, responses, response_mask)
        if logps is not None:
            cols["rollout_log_probs"] = logps * response_mask
        return cols

    def sleep(self) -> None:
        """Nothing to free: the module stays in memory (RolloutEngine)."""

    def close(self) -> None:
        """The module is the caller's (it may be the trainer's own)."""

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[list[tuple[str, torch.Tensor]]],
                     partial: bool = False, bind: bool = False) -> set[str]:
        """Copy HF-named weights into the rollout model's parameters in place: a state dict, or
        buckets of (name, tensor) pairs consumed one at a time (`TrainEngine.weight_buckets`, or a
        weight sync's received views), so the only copy is the one into the parameter. Returns the
        names loaded.

        Strict: an unknown name or shape is refused before it is copied; every name must arrive
        (a tied name sharing a parameter already written is not copied twice). A partial load is
        WeightSyncMismatch naming the missing tensors. dtype is converted. Not needed when the
        rollout shares the trainer's module object (colocated): it already holds the new weights.
        `partial`: only some layers (a LoRA policy's merged layers); the rest keep theirs.
        `bind`: no copy: each parameter becomes the tensor given (a weight sync's buffer that
        outlives the load: weight_sync.load "map"); a tensor of another dtype is converted into a
        new one, never written into the old (which may be a read-only mapping).
        """
        own = self.model.state_dict()  # the names a complete load covers (persistent buffers too)
        targets = {**dict(self.model.named_buffers(remove_duplicate=False)),
                   **dict(self.model.named_parameters(remove_duplicate=False))}
        buckets = [list(weights.items())] if isinstance(weights, Mapping) else weights
        seen: set[str] = set()
        written: set[int] = set()  # parameters already written (tied weights are one Parameter)
        for bucket in buckets:
            for name, src in bucket:
                t = targets.get(name)
                if t is None or name not in own:
                    raise _mismatch(f"{name!r} is not a weight of the rollout model")
                if src.shape != t.shape:
                    raise _mismatch(f"{name!r}: shape {tuple(src.shape)} != the rollout's {tuple(t.shape)}")
                seen.add(name)
                if id(t) in written:
                    continue
                written.add(id(t))
                if not bind and not self.foreign:
                    t.copy_(src)
                elif bind and src.dtype == t.dtype and src.is_contiguous():
                    t.data = src
                else:  # never into memory that is not ours (a sync's slot, a read-only object)
                    t.data = src.to(t.dtype, copy=True).contiguous()
        self.foreign = bind or (self.foreign and partial)  # a partial load leaves the others where they were
        missing = [] if partial else sorted(set(own) - seen)
        if missing:
            raise _mismatch(f"the sync covered {len(seen)} of the model's {len(own)} tensors; missing "
                            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return seen


def _mismatch(why: str) -> WeightSyncMismatch:
    return WeightSyncMismatch(f"HF rollout weight load: {why}", batch_id=-1, stage="weight_sync", worker=None)
