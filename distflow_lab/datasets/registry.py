"""Datasets by name: `data.train: <name>` with its options in `data.options.<name>`, or a
parquet/jsonl path.

    @lab.register_dataset("countdown", options=CountdownOptions)
    def countdown(x: lab.DatasetInputs) -> list[dict]:       # verl-schema rows (datasets/schema.py)
        return [...]                                         # x.options, x.seed, x.split, x.config

The rows are written once to `<data.cache_dir>/<name>-<digest>.parquet` (the digest of the rows:
other options, another seed or split, another file) and checked against the schema before any worker
starts. The built-in ones (arithmetic, long_tail, guess_number, gsm8k) register themselves in their
own files.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distflow_lab.core.errors import ConfigError
from distflow_lab.core.registry import Registry, caller_module
from distflow_lab.datasets.schema import read_table, validate_table, write_parquet

DATASETS: Registry["Dataset"] = Registry("dataset", "data.train")
BUILTIN_MODULES = ("distflow_lab.datasets.arithmetic", "distflow_lab.datasets.long_tail",
                   "distflow_lab.datasets.guess_number", "distflow_lab.datasets.gsm8k")  # each registers itself


@dataclass(frozen=True)
class DatasetInputs:
    """What a dataset function sees: its typed options (data.options), the run's seed, the split
    ("train", or "test" for a held-out set), and the run config (e.g. rollout.max_response_len)."""

    options: Any
    seed: int
    split: str = "train"
    config: Any = None


Dataset = Callable[[DatasetInputs], list[dict]]


def register_dataset(name: str, *, options: type | None = None) -> Callable:
    """Decorator: `fn(x: DatasetInputs) -> rows` becomes the dataset `name` (data.train: name)."""
    return DATASETS.register(name, options=options, origin=caller_module())


def dataset_names() -> list[str]:
    for m in BUILTIN_MODULES:
        importlib.import_module(m)
    return sorted(DATASETS.names())


def is_dataset(name: str) -> bool:
    """A registered dataset's name (not a file)."""
    return name in DATASETS or name in dataset_names()


def dataset_options(data: Any, name: str | None = None) -> Any:
    """The typed options of dataset `name` (default data.train) from a DataOptions: a wrong or unknown
    key names the dataset and the key."""
    name = name or data.train
    return DATASETS.options(name, data.options.get(name, {}), f"data.options.{name}")


def check_data(data: Any) -> None:
    """Every section of data.options names a registered dataset and parses; data.train names a
    registered dataset or a file that exists (checked for its schema when the run prepares it)."""
    for name in data.options:
        if not is_dataset(name):
            raise ConfigError(f"data.options.{name}: {name!r} is not a registered dataset; registered: "
                              f"{dataset_names()}")
        dataset_options(data, name)
    if not is_dataset(data.train) and not Path(data.train).exists():
        raise ConfigError(f"data.train: {data.train!r} is neither a registered dataset ({dataset_names()}) nor a "
                          "file; add one with lab.register_dataset")


def dataset_rows(data: Any, seed: int, split: str = "train", config: Any = None) -> list[dict]:
    """The rows of the registered dataset `data.train` for this seed and split."""
    is_dataset(data.train)  # the built-in ones registered
    rows = DATASETS.get(data.train).obj(DatasetInputs(dataset_options(data), seed, split, config))
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"dataset {data.train!r} returned {type(rows).__name__} "
                          f"{'(empty)' if isinstance(rows, list) else ''}; it must return a non-empty list of "
                          "verl-schema rows")
    return rows


def prepare_dataset(data: Any, seed: int, config: Any = None) -> Path:
    """The training file: `data.train` itself (a path), or the registered dataset's rows written once
    under data.cache_dir (named by their digest). Checked against the verl schema; errors name the file."""
    if not is_dataset(data.train):
        path = Path(data.train)
    else:
        rows = dataset_rows(data, seed, "train", config)
        digest = hashlib.sha1(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:12]
        path = Path(data.cache_dir) / f"{data.train}-{len(rows)}-{digest}.parquet"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_parquet(rows, path)
    validate_table(read_table(path), path)  # names the file and the missing column
    return path
