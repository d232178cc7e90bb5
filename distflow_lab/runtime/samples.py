"""A few rows of a batch as plain values for a notebook: token columns decoded
to text (when a tokenizer is at hand), per-row means of token-level floats."""
from __future__ import annotations

from typing import Any

import numpy as np

from distflow_lab.core.batch import Batch
from distflow_lab.models.sequences import decode_responses

TOKEN_FLOATS = ("advantages", "returns", "old_log_probs", "ref_log_probs", "values")
OBJECTS = ("uid", "ground_truth", "data_source", "question")


def sample_rows(batch: Batch, n: int, tokenizer: Any = None, worker: int = 0) -> list[dict]:
    small = batch.select(np.arange(min(n, len(batch))))
    rows: list[dict] = [{"worker": worker} for _ in range(len(small))]
    for name in ("prompts", "responses"):
        if name in small.tensors:
            ids = small[name]
            mask = small["attention_mask"][:, :ids.shape[1]] if name == "prompts" else small["response_mask"]
            if tokenizer:
                texts = decode_responses(tokenizer, ids, mask)
            else:
                texts = [f"<{int(m.bool().sum())} tokens>" for m in mask]
            for r, text in zip(rows, texts):
                r[name[:-1]] = text
    mask = small.tensors.get("response_mask")
    for name, t in small.tensors.items():
        if t.dim() == 1 and t.is_floating_point():
            for r, v in zip(rows, t.tolist()):
                r[name] = v
        elif name in TOKEN_FLOATS and mask is not None:
            means = (t * mask).sum(1) / mask.sum(1).clamp(min=1)
            for r, v in zip(rows, means.tolist()):
                r[f"{name}(mean)"] = v
    for name in OBJECTS:
        if name in small.objects:
            for r, v in zip(rows, small.objects[name].tolist()):
                r[name] = v
    return rows
