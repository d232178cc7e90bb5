"""Synthetic arithmetic of adjustable difficulty, in the verl RL schema.

Built for a character-level tiny model trained with RL on a CPU, so prompts
are as short as possible: the prompt is the bare expression ("3+4=") and the
ground truth is the integer result ("7"). Difficulty knobs:

    min_operand / max_operand   operand range (non-negative)
    ops                         any of "+", "-", "*" (standard precedence)
    num_terms                   operands per expression

Results are never negative unless "-" is among `ops` (and then only if
`allow_negative`). Everything is deterministic given `seed`.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import Field, model_validator

from distflow_lab.core.registry import Options
from distflow_lab.datasets.registry import DatasetInputs, register_dataset
from distflow_lab.datasets.schema import write_parquet

DATA_SOURCE = "distflow/arithmetic"
QUESTION_SOURCE = "distflow/arithmetic_question"
STYLES = ("bare", "question")
# For an instruct model: a question it reads as one, and an instruction to end on the number. The
# reward takes the last number of the answer, a format SmolLM2-135M-Instruct already produces unprompted
# (it never used a requested "####" format: DESIGN.md).
QUESTION = "What is {expr}? Answer with the number."
SUPPORTED_OPS = ("+", "-", "*")


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with '*' binding tighter than '+'/'-'."""
    total, term = 0, operands[0]
    sign = 1
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            term *= x
        else:  # close the current product term, start a new one
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def make_arithmetic_rows(
    n: int,
    seed: int,
    min_operand: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    num_terms: int = 2,
    allow_negative: bool = True,
    split: str = "train",
    style: str = "bare",
) -> list[dict[str, Any]]:
    """`n` verl-schema rows like prompt "3+4=" -> ground_truth "7", deterministic per `seed`.

    `allow_negative=False` resamples expressions whose value is negative
    (only possible when "-" is in `ops`). `style="question"` asks "What is 3 + 4? Answer with the
    number." instead (data source `QUESTION_SOURCE`, scored on the answer's last number).
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if n < 0 or num_terms < 1:
        raise ValueError(f"need n >= 0 and num_terms >= 1, got n={n}, num_terms={num_terms}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand}..{max_operand}")
    bad = [op for op in ops if op not in SUPPORTED_OPS]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {tuple(ops)}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        for _ in range(1000):  # rejection sampling; P(value >= 0) is far above 1/1000
            xs = [rng.randint(min_operand, max_operand) for _ in range(num_terms)]
            chosen_ops = [rng.choice(tuple(ops)) for _ in range(num_terms - 1)]
            value = evaluate(xs, chosen_ops)
            if value >= 0 or allow_negative:
                break
        else:
            raise ValueError("could not sample a non-negative expression; loosen the difficulty")
        if style == "bare":
            expr = "".join(f"{x}{op}" for x, op in zip(xs, chosen_ops)) + f"{xs[-1]}="
        else:
            expr = QUESTION.format(expr="".join(f"{x} {op} " for x, op in zip(xs, chosen_ops)) + str(xs[-1]))
        rows.append(
            {
                "data_source": DATA_SOURCE if style == "bare" else QUESTION_SOURCE,
                "prompt": [{"role": "user", "content": expr}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(value)},
                "extra_info": {"split": split, "index": i, "question": expr, "answer": str(value)},
            }
        )
    return rows


def write_arithmetic_parquet(path: str | os.PathLike, n: int, seed: int, **difficulty: Any) -> Path:
    """Write `make_arithmetic_rows(n, seed, **difficulty)` to `path`; return the path."""
    return write_parquet(make_arithmetic_rows(n, seed, **difficulty), path)


class ArithmeticOptions(Options):
    """The arithmetic task (data.train: arithmetic; data.options)."""

    rows: int = Field(default=4096, ge=1)
    """Rows generated."""
    min_operand: int = Field(default=0, ge=0)
    """Smallest operand (10 with max 99: two-digit operands)."""
    max_operand: int = Field(default=9, ge=0)
    """Largest operand (difficulty)."""
    ops: str = Field(default="+", pattern=r"^[+\-*]+$")
    """The operators, any of "+-*" (e.g. "*": products a tool helps with)."""
    style: Literal["bare", "question"] = "bare"
    """bare: "3+4=" -> "7" (the tiny char-level model); question: "What is 3 + 4? Answer with the number.",
    scored on the answer's last number (an instruct model, through its chat template)."""

    @model_validator(mode="after")
    def _operand_range(self) -> "ArithmeticOptions":
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand={self.min_operand} is above max_operand={self.max_operand}")
        return self

    def difficulty(self) -> dict:
        """make_arithmetic_rows' difficulty and style."""
        return dict(min_operand=self.min_operand, max_operand=self.max_operand, ops=tuple(dict.fromkeys(self.ops)),
                    style=self.style)


@register_dataset("arithmetic", options=ArithmeticOptions)
def arithmetic(x: DatasetInputs) -> list[dict[str, Any]]:
    return make_arithmetic_rows(x.options.rows, x.seed, split=x.split, **x.options.difficulty())
