"""Rows for the guess-the-number game (models/env_guess_number.py): the prompt states the
range ("1-15?"), the ground truth is the secret, drawn uniformly per row. The environment
answers each guess with "<;" or ">;" until the model finds it."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from pydantic import Field

from distflow_lab.core.registry import Options
from distflow_lab.datasets.registry import DatasetInputs, register_dataset
from distflow_lab.datasets.schema import write_parquet

DATA_SOURCE = "distflow/guess_number"


def make_guess_number_rows(n: int, seed: int, high: int = 15, split: str = "train") -> list[dict[str, Any]]:
    """`n` verl-schema rows "1-<high>?" -> a secret in [1, high], deterministic per `seed`."""
    if n < 0 or high < 1:
        raise ValueError(f"need n >= 0 and high >= 1, got n={n}, high={high}")
    rng, prompt = random.Random(seed), f"1-{high}?"
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}], "ability": "search",
             "reward_model": {"style": "rule", "ground_truth": str(rng.randint(1, high))},
             "extra_info": {"split": split, "index": i, "question": prompt, "high": high}} for i in range(n)]


def write_guess_number_parquet(path: str | os.PathLike, n: int, seed: int, high: int = 15) -> Path:
    """Write `make_guess_number_rows(n, seed, high)` to `path`; return the path."""
    return write_parquet(make_guess_number_rows(n, seed, high), path)


class GuessNumberOptions(Options):
    """The guess-the-number game's rows (data.train: guess_number; data.options): a secret in [1, high] each."""

    rows: int = Field(default=4096, ge=1)
    """Rows generated."""
    high: int = Field(default=15, ge=1)
    """The secret's range is 1..high (the prompt states it)."""


@register_dataset("guess_number", options=GuessNumberOptions)
def guess_number(x: DatasetInputs) -> list[dict[str, Any]]:
    return make_guess_number_rows(x.options.rows, x.seed, x.options.high, split=x.split)
