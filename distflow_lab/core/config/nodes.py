"""A DAG node's typed parts that come from a config: its data source and its contract
(the rest of a node, its layout and function, lives with the DAG in `graph.nodes`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from distflow_lab.core.config.base import Strict


class DataSpec(Strict):
    """What a data_load node reads: each worker loads its data-parallel shard."""

    source: str
    """A .parquet/.jsonl path, or "synthetic" (prompt lengths only, for data-plane benchmarks)."""
    batch_size: int = Field(ge=1)
    """Prompts per step over all data-parallel ranks (must divide by dp)."""
    shuffle: bool = True
    """Shuffle each rank's shard every epoch (seeded)."""
    num_rows: int | None = Field(default=None, ge=1)
    """Synthetic sources: rows in the dataset (default 4 x batch_size)."""
    mean_len: float = Field(default=200.0, gt=0)
    """Synthetic sources: median prompt length (lognormal)."""
    sigma: float = Field(default=0.5, ge=0)
    """Synthetic sources: lognormal sigma of prompt lengths."""
    max_len: int = Field(default=1024, ge=1)
    """Synthetic sources: longest prompt."""
    lengths_from: str | None = None
    """Synthetic sources: a jsonl whose `question` lengths give real prompt lengths (e.g. GSM8K)."""


class Contract(Strict):
    """What a stage promises; a stage that breaks it fails with StageContractError naming it."""

    outputs: list[str] = Field(default_factory=list)
    """Columns that must exist in the stage's output."""
    rows: Literal["same", "any"] = "any"
    """same: the stage keeps its input's row count."""
