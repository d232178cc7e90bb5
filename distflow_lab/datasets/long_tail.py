"""A task whose response lengths are long-tailed by construction, for studying schedules
and partial rollouts on a real engine: the prompt names a length ("L37="), the answer is
the first N characters of "0123456789" repeated, and N is drawn per prompt from a
lognormal. After the SFT warm start the model's own sampling follows the targets
(roughly), so generation time has the long tail of the lengths; nothing is simulated.

    median, sigma   the lognormal of the target lengths (in tokens)
    max_len         targets are clipped to [1, max_len] (leave room for the eos)

With sigma 1.4 the longest of 32 prompts is ~15x the median in a typical batch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from distflow_lab.core.registry import Options
from distflow_lab.datasets.registry import DatasetInputs, register_dataset
from distflow_lab.datasets.schema import write_parquet

DATA_SOURCE = "distflow/long_tail"
DIGITS = "0123456789"


def answer(n: int) -> str:
    """The target response of length n: digits counting up, wrapping at 9."""
    return (DIGITS * (n // 10 + 1))[:n]


def target_lengths(n: int, seed: int, median: float, sigma: float, max_len: int) -> np.ndarray:
    """`n` lognormal lengths (median `median`, log-sd `sigma`), rounded and clipped to [1, max_len]."""
    if median <= 0 or sigma < 0 or max_len < 1:
        raise ValueError(f"need median > 0, sigma >= 0 and max_len >= 1, got {median}, {sigma}, {max_len}")
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), 1, max_len).astype(int)


def make_long_tail_rows(n: int, seed: int, median: float = 6.0, sigma: float = 1.4, max_len: int = 95,
                        split: str = "train") -> list[dict[str, Any]]:
    """`n` verl-schema rows "L<N>=" -> the N-character answer, deterministic per `seed`."""
    rows = []
    for i, length in enumerate(target_lengths(n, seed, median, sigma, max_len).tolist()):
        prompt = f"L{length}="
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}],
                     "ability": "length", "reward_model": {"style": "rule", "ground_truth": answer(length)},
                     "extra_info": {"split": split, "index": i, "question": prompt, "answer": str(length)}})
    return rows


def write_long_tail_parquet(path: str | os.PathLike, n: int, seed: int, **shape: Any) -> Path:
    """Write `make_long_tail_rows(n, seed, **shape)` to `path`; return the path."""
    return write_parquet(make_long_tail_rows(n, seed, **shape), path)


class LongTailOptions(Options):
    """The long-tail task (data.train: long_tail; data.options): target lengths from a lognormal."""

    rows: int = Field(default=4096, ge=1)
    """Rows generated."""
    median: float = Field(default=6.0, gt=0)
    """Median target length in tokens."""
    sigma: float = Field(default=1.4, ge=0)
    """Log-sd of the target lengths (1.4: the longest of 32 prompts is ~15x the median)."""


@register_dataset("long_tail", options=LongTailOptions)
def long_tail(x: DatasetInputs) -> list[dict[str, Any]]:
    max_len = x.config.rollout.max_response_len - 1  # room for the eos
    o = x.options
    return make_long_tail_rows(o.rows, x.seed, median=o.median, sigma=o.sigma, max_len=max_len, split=x.split)
