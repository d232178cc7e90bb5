"""The verl sequence layout shared by every rollout engine and the SFT warm start.

Prompts LEFT-padded to P = max_prompt_len, responses RIGHT-padded to R =
max_response_len:

    prompts [B*n, P]        responses [B*n, R]        input_ids = cat(prompts, responses)
    attention_mask [B*n, P+R]  (1 on real prompt tokens and real response tokens)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask [B*n, R]  (1 up to and INCLUDING the first eos, 0 after)

with the n responses of prompt i in rows i*n .. i*n+n-1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # a type only: workers of synthetic DAGs never import transformers
    from transformers import PreTrainedTokenizerBase


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
    targets: Sequence[str | Sequence[tuple[str, bool]]],
    max_prompt_len: int,
    max_response_len: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """Supervised batch in the rollout layout: target text + eos as the "response".

    A target is a text, or a demonstrated trajectory: (text, by_model) segments, e.g. a tool
    call, the tool's answer (by_model False) and the final answer. Then the batch carries a
    `loss_mask` that is 1 on the model's segments and the eos only.
    Returns (columns, n_truncated) where n_truncated counts prompts cut to P plus
    targets cut to R (a cut target loses its eos). Train it with `fsdp.sft_loss_fn`.
    """
    prompt_ids, prompt_mask, n_trunc = tokenize_prompts(tokenizer, prompts, max_prompt_len)
    R, eos, pad = max_response_len, tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.full((len(targets), R), pad, dtype=torch.long)
    response_mask = torch.zeros((len(targets), R), dtype=torch.long)
    loss_mask = torch.zeros((len(targets), R), dtype=torch.long)
    for i, target in enumerate(targets):
        ids, loss = [], []
        for text, by_model in ([(target, True)] if isinstance(target, str) else target):
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, loss = ids + seg, loss + [int(by_model)] * len(seg)
        ids, loss = ids + [eos], loss + [1]
        if len(ids) > R:
            ids, loss, n_trunc = ids[:R], loss[:R], n_trunc + 1
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(loss, dtype=torch.long)
    cols = assemble_columns(prompt_ids, prompt_mask, responses, response_mask)
    if not all(isinstance(t, str) for t in targets):
        cols["loss_mask"] = loss_mask
    return cols, n_trunc
