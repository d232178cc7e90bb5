"""Rollout with HF `generate`: prompts in, verl-layout response columns out.

Layout (verl's): prompts LEFT-padded to P = max_prompt_len, responses RIGHT-padded
to R = max_response_len. `generate` returns CPU tensors

    prompts [B*n, P]        responses [B*n, R]        input_ids = cat(prompts, responses)
    attention_mask [B*n, P+R]  (1 on real prompt tokens and real response tokens)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask [B*n, R]  (1 up to and INCLUDING the first eos, 0 after)

with the n responses of prompt i in rows i*n .. i*n+n-1. The same HF model object
serves training and rollout, so the log-probs a trainer recomputes with
`TrainEngine.forward_log_probs` are those of the distribution sampled here
(with temperature 1 and no top-k/top-p truncation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class RolloutConfig:
    """Sampling settings shared by the HF and vLLM rollouts."""

    n: int = 4
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; the trainer must divide logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Top-k truncation; 0 disables it."""
    max_prompt_len: int = 64
    """P: prompts are left-padded (and tail-truncated) to exactly this many tokens."""
    max_response_len: int = 32
    """R: at most this many new tokens; responses are right-padded to exactly R."""
    micro_batch: int = 64
    """Sequences (prompt x n rows) per `generate()` call; bounds KV-cache memory."""
    do_sample: bool = True
    """False = greedy decoding (validation); temperature/top_p/top_k are then ignored."""
    return_log_probs: bool = False
    """Also return `rollout_log_probs` [B*n, R]: log p(token) under logits/temperature,
    before top-k/top-p (0 on padding). Lets a trainer check rollout/train consistency."""


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    messages_list: Sequence[Sequence[dict]] | Sequence[str],
    max_prompt_len: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize prompts into LEFT-padded `(prompt_ids [B, P], prompt_mask [B, P], n_truncated)`.

    Chat prompts (lists of {"role", "content"} dicts) go through the chat template with
    add_generation_prompt=True; plain strings are encoded as is. No special tokens are
    added beyond what the template writes. A prompt longer than P keeps its LAST P tokens
    (the question usually sits at the end); `n_truncated` counts them so the caller can
    report it. Empty prompts raise ValueError (there is nothing to condition on).
    """
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("tokenizer has no pad token; set tokenizer.pad_token first")
    ids_list: list[list[int]] = []
    for i, item in enumerate(messages_list):
        if isinstance(item, str):
            text = item
        else:
            text = tokenizer.apply_chat_template(list(item), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        ids_list.append(ids)
    B, P = len(ids_list), max_prompt_len
    prompt_ids = torch.full((B, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    n_truncated = 0
    for i, ids in enumerate(ids_list):
        if len(ids) > P:
            ids, n_truncated = ids[-P:], n_truncated + 1
        prompt_ids[i, P - len(ids):] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, P - len(ids):] = 1
    return prompt_ids, prompt_mask, n_truncated


def response_mask_from_eos(responses: torch.Tensor, eos_token_id: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, R] int64 mask: 1 up to and including the first eos, 0 after it.

    `valid` (optional [B, R] bool) marks positions that were generated at all; positions
    past a row's generated length are 0 regardless (vLLM rows may stop without eos).
    """
    is_eos = (responses == eos_token_id).long()
    # eos strictly before t  <=>  cumsum up to t-1 > 0
    eos_before = (is_eos.cumsum(-1) - is_eos) > 0
    mask = ~eos_before
    if valid is not None:
        mask &= valid
    return mask.long()


def assemble_columns(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Build the verl column set from left-padded prompts and right-padded responses."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1).long()
    return {
        "prompts": prompts.long(),
        "responses": responses.long(),
        "input_ids": torch.cat([prompts, responses], dim=-1).long(),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask.long(),
    }


def decode_responses(tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> list[str]:
    """Decode each row's masked tokens to text, skipping special tokens (eos, pad)."""
    return [
        tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
        for row, m in zip(responses.cpu(), response_mask.cpu())
    ]


def build_sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[dict]] | Sequence[str],
    targets: Sequence[str],
    max_prompt_len: int,
    max_response_len: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """Supervised batch in the rollout layout: target text + eos as the "response".

    Returns (columns, n_truncated) where n_truncated counts prompts cut to P plus
    targets cut to R (a cut target loses its eos). Train it with `fsdp.sft_loss_fn`.
    """
    prompt_ids, prompt_mask, n_trunc = tokenize_prompts(tokenizer, prompts, max_prompt_len)
    R, eos, pad = max_response_len, tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.full((len(targets), R), pad, dtype=torch.long)
    response_mask = torch.zeros((len(targets), R), dtype=torch.long)
    for i, text in enumerate(targets):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) > R:
            ids, n_trunc = ids[:R], n_trunc + 1
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1
    return assemble_columns(prompt_ids, prompt_mask, responses, response_mask), n_trunc


class HFRollout:
    """Sampling with `model.generate`, in micro-batches, seeded per call.

    Weight sync: when the rollout holds the trainer's own (unsharded) module object
    (colocated, 1 rank) it always sees the latest weights and needs no copy. Otherwise
    push `TrainEngine.full_state_dict()` through `load_weights` after each step.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: RolloutConfig | None = None):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg or RolloutConfig()
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
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
            return_dict_in_generate=True, output_logits=c.return_log_probs, **sampling,
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
        logps = torch.zeros((prompts.shape[0], R), dtype=torch.float32) if c.return_log_probs else None
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

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy `state_dict` into the rollout model's parameters in place.

        Strict: every name must match (missing or unexpected keys raise), shapes must
        match; dtype/device are converted. Not needed when the rollout shares the
        trainer's module object (colocated): it already holds the new weights.
        """
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(f"state_dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
        for name, t in own.items():
            src = state_dict[name]
            if src.shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(t.shape)}")
            t.copy_(src)


def make_rollout(
    kind: Literal["hf", "vllm"],
    model: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    cfg: RolloutConfig | None = None,
    model_path: str | None = None,
    **kwargs: Any,
):
    """Pick a rollout engine: "hf" wraps `model`; "vllm" loads `model_path` into vLLM.

    Extra kwargs go to `vllm.LLM` (e.g. gpu_memory_utilization) for "vllm".
    """
    if kind == "hf":
        if model is None:
            raise ValueError("the hf rollout needs a model object")
        return HFRollout(model, tokenizer, cfg)
    if kind == "vllm":
        if model_path is None:
            raise ValueError("the vllm rollout needs model_path (a local HF checkpoint directory)")
        from distflow_lab.engines.rollout_vllm import VLLMRollout

        return VLLMRollout(model_path, tokenizer, cfg, **kwargs)
    raise ValueError(f"unknown rollout kind {kind!r}; expected 'hf' or 'vllm'")
