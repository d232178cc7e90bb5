"""GSM8K jsonl -> verl RL parquet, the same rows verl's `examples/data_preprocess/gsm8k.py` makes.

Input: one JSON object per line with "question" and "answer"; the answer's
final number follows "#### " (e.g. "... #### 1,000"). Output row:

    data_source  = "openai/gsm8k"
    prompt       = [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability      = "math"
    reward_model = {"style": "rule", "ground_truth": "1000"}   # commas removed
    extra_info   = {"split", "index", "question", "answer"}
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distflow_lab.core.registry import Options
from distflow_lab.datasets.registry import DatasetInputs, register_dataset
from distflow_lab.datasets.schema import DatasetError, write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The repo root is the parent of the `distflow_lab` package directory.
REPO_ROOT = Path(__file__).resolve().parents[2]


def default_gsm8k_dir() -> Path:
    """Directory holding GSM8K {train,test}.jsonl.

    `$DISTFLOW_GSM8K_DIR` if set, else `<repo root>/../shared/datasets/gsm8k`.
    """
    env = os.environ.get("DISTFLOW_GSM8K_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return (REPO_ROOT / ".." / "shared" / "datasets" / "gsm8k").resolve()


def extract_ground_truth(answer: str) -> str | None:
    """The number after the last '####' in a GSM8K answer, commas removed; None if absent."""
    if "####" not in answer:
        return None
    gt = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return gt or None


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One verl-schema row from a GSM8K (question, answer) pair."""
    gt = extract_ground_truth(answer)
    if gt is None:
        raise ValueError("answer has no final number after '####'")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def read_gsm8k(jsonl_path: str | os.PathLike, split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """verl-schema rows from a GSM8K jsonl file. `split` defaults to the file stem ("train" / "test");
    `limit` keeps the first N rows. A malformed line raises `DatasetError` naming the file and 1-based
    line number. Blank lines are skipped."""
    jsonl_path = Path(jsonl_path)
    if not jsonl_path.is_file():
        raise DatasetError(f"{jsonl_path}: GSM8K jsonl file does not exist")
    split = split or jsonl_path.stem
    rows: list[dict[str, Any]] = []
    with open(jsonl_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            where = f"{jsonl_path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            missing = [k for k in ("question", "answer") if not isinstance(rec.get(k), str)]
            if missing:
                raise DatasetError(f"{where}: missing or non-string key(s) {missing}")
            try:
                rows.append(gsm8k_row(rec["question"], rec["answer"], split, len(rows)))
            except ValueError as e:
                raise DatasetError(f"{where}: {e}") from e
    if not rows:
        raise DatasetError(f"{jsonl_path}: no rows found")
    return rows


def convert_gsm8k(
    jsonl_path: str | os.PathLike,
    parquet_path: str | os.PathLike,
    split: str | None = None,
    limit: int | None = None,
    row_group_size: int = 256,
) -> int:
    """Convert a GSM8K jsonl file to verl-schema parquet (`read_gsm8k`); return the number of rows written."""
    rows = read_gsm8k(jsonl_path, split, limit)
    write_parquet(rows, parquet_path, row_group_size=row_group_size)
    return len(rows)


class GSM8KOptions(Options):
    """Where GSM8K's train.jsonl and test.jsonl are (data.options.gsm8k)."""

    dir: str | None = None
    """None: $DISTFLOW_GSM8K_DIR, else ../shared/datasets/gsm8k."""


@register_dataset("gsm8k", options=GSM8KOptions)
def gsm8k(x: DatasetInputs) -> list[dict[str, Any]]:
    """GSM8K's train or test split, converted as verl's own preprocessing does."""
    src = Path(x.options.dir) if x.options.dir else default_gsm8k_dir()
    return read_gsm8k(src / f"{x.split}.jsonl", split=x.split)
