"""Distributed dataloader (paper §6.1): each worker reads only its data-parallel
rank's shard of the dataset — parquet (only the row groups that overlap the
shard are read) or jsonl (only the shard's lines are parsed) — and shuffles
it per epoch with a seed.

Sharding: rank r of dp owns the contiguous rows [start_r, end_r); sizes differ
by at most one. Every step takes `local_batch` rows from every rank, so an
epoch has min_r(shard_r) // local_batch steps and the rows left over on each
rank are reported (they change every epoch with the shuffle), never silently
dropped. The union of all shards is the dataset and shards are disjoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from distflow_lab.core.errors import DatasetError
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, load_model



class DataSource(Protocol):
    name: str

    def num_rows(self) -> int: ...

    def read_rows(self, start: int, stop: int) -> dict[str, list]: ...


class ParquetSource:
    """A parquet file; reads only the row groups that overlap the requested rows."""

    def __init__(self, path: str | Path) -> None:
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.name = str(self.path)
        if not self.path.exists():
            raise DatasetError(f"dataset {self.path} does not exist")
        try:
            self._file = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"dataset {self.path} is not a readable parquet file: {e}") from None
        meta = self._file.metadata
        self._group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.row_groups_read: list[int] = []

    def num_rows(self) -> int:
        return int(sum(self._group_rows))

    def read_rows(self, start: int, stop: int) -> dict[str, list]:
        bounds = np.cumsum([0, *self._group_rows])
        groups = [g for g in range(len(self._group_rows)) if bounds[g] < stop and bounds[g + 1] > start]
        self.row_groups_read = groups
        if not groups:
            return {name: [] for name in self._file.schema_arrow.names}
        try:
            table = self._file.read_row_groups(groups)
        except Exception as e:
            raise DatasetError(f"dataset {self.path}: cannot read row groups {groups}: {e}") from None
        first = int(bounds[groups[0]])
        return table.slice(start - first, stop - start).to_pydict()


class JsonlSource:
    """A jsonl file; lines outside the requested range are counted, not parsed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        if not self.path.exists():
            raise DatasetError(f"dataset {self.path} does not exist")
        with self.path.open("rb") as f:
            self._n = sum(1 for line in f if line.strip())

    def num_rows(self) -> int:
        return self._n

    def read_rows(self, start: int, stop: int) -> dict[str, list]:
        rows: list[dict] = []
        with self.path.open("rb") as f:
            i = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if start <= i < stop:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"dataset {self.path} line {lineno}: invalid JSON ({e})") from None
                i += 1
                if i >= stop:
                    break
        keys = list(rows[0]) if rows else []
        return {k: [r.get(k) for r in rows] for k in keys}


class SyntheticSource:
    """Rows with a prompt length only: for data-plane benchmarks. Lengths come
    from a lognormal, or from a real length list (e.g. GSM8K question lengths)."""

    def __init__(self, num_rows: int, mean_len: float = 200.0, sigma: float = 0.5,
                 max_len: int = 1024, seed: int = 0, lengths: list[int] | None = None) -> None:
        self.name = f"synthetic[{num_rows}]"
        if lengths is not None:
            base = np.asarray(lengths, dtype=np.int64)
            self._lengths = np.resize(base, num_rows)
        else:
            rng = np.random.default_rng(seed)
            raw = rng.lognormal(np.log(mean_len), sigma, size=num_rows)
            self._lengths = np.clip(raw, 1, max_len).astype(np.int64)

    def num_rows(self) -> int:
        return len(self._lengths)

    def read_rows(self, start: int, stop: int) -> dict[str, list]:
        return {"prompt_len": self._lengths[start:stop].tolist()}


def open_source(spec: str | Path | DataSource) -> DataSource:
    if not isinstance(spec, (str, Path)):
        return spec
    p = Path(spec)
    if p.suffix == ".parquet":
        return ParquetSource(p)
    if p.suffix in (".jsonl", ".json"):
        return JsonlSource(p)
    raise DatasetError(f"dataset {p}: unknown format (expected .parquet or .jsonl)")


def shard_bounds(n: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Contiguous, disjoint shards; the first n % dp ranks get one extra row."""
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (1 if dp_rank < extra else 0)


def check_shards(name: str, n: int, dp_size: int, local_batch: int) -> list[int]:
    """Shard sizes, or a clear error if some rank would get no rows or less than a step's batch."""
    sizes = [b - a for a, b in (shard_bounds(n, dp_size, r) for r in range(dp_size))]
    if min(sizes) == 0:
        empty = [r for r, s in enumerate(sizes) if s == 0]
        raise DatasetError(f"dataset {name} has {n} rows: too few for {dp_size} data-parallel "
                              f"ranks (ranks {empty} would get an empty shard)")
    if local_batch < 1 or local_batch > min(sizes):
        raise DatasetError(f"dataset {name}: local batch {local_batch} does not fit the "
                              f"smallest shard ({min(sizes)} rows on {dp_size} ranks)")
    return sizes


def data_spec(spec: DataSpec | dict) -> DataSpec:
    """A DataSpec from itself or a dict (an unknown key is an error naming it)."""
    return spec if isinstance(spec, DataSpec) else load_model(DataSpec, dict(spec), "data node")


def _data_node(spec: DataSpec, dp_size: int) -> int | None:
    """A data node's row count (synthetic sources only), after checking its batch size."""
    if spec.batch_size % dp_size:
        raise DatasetError(f"data batch_size {spec.batch_size} is not divisible by the data-parallel size {dp_size}")
    return (spec.num_rows or 4 * spec.batch_size) if spec.source == "synthetic" else None


def check_data_node(spec: DataSpec | dict, dp_size: int) -> list[int]:
    """What `make_loader` would check, from metadata only (row counts), so a bad data
    node fails in the driver before any worker starts."""
    spec = data_spec(spec)
    rows = _data_node(spec, dp_size)
    n = rows if rows is not None else open_source(spec.source).num_rows()
    return check_shards(str(spec.source), n, dp_size, spec.batch_size // dp_size)


@dataclass
class ShardReport:
    source: str
    dataset_rows: int
    dp_size: int
    dp_rank: int
    shard_rows: int
    local_batch: int
    steps_per_epoch: int
    unused_rows_per_epoch: int  # on this rank: shard_rows - steps_per_epoch * local_batch
    shard_sizes: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.source}: {self.dataset_rows} rows, rank {self.dp_rank}/{self.dp_size} holds "
                f"{self.shard_rows}; {self.steps_per_epoch} steps/epoch of {self.local_batch} rows; "
                f"{self.unused_rows_per_epoch} rows unused per epoch on this rank (reshuffled every epoch)")


class ShardedLoader:
    """The loader of one dp rank. `next_batch()` returns `local_batch` rows as a
    Batch with the source's columns (object columns) plus `row_id` (global row
    index, int64), and wraps to a freshly shuffled epoch when the shard is used up."""

    def __init__(self, source: str | Path | DataSource, dp_rank: int, dp_size: int,
                 local_batch: int, seed: int = 0, shuffle: bool = True) -> None:
        self.source = open_source(source)
        n = self.source.num_rows()
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        sizes = check_shards(self.source.name, n, dp_size, local_batch)
        self.dp_rank, self.dp_size, self.local_batch = dp_rank, dp_size, local_batch
        self.seed, self.shuffle = seed, shuffle
        self.start, self.stop = shard_bounds(n, dp_size, dp_rank)
        self._columns = self.source.read_rows(self.start, self.stop)
        self.report = ShardReport(self.source.name, n, dp_size, dp_rank, self.stop - self.start, local_batch,
                                  min(sizes) // local_batch, self.stop - self.start - (min(sizes) // local_batch) * local_batch,
                                  sizes)
        self.epoch, self.position = 0, 0
        self.rows_served = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = self.stop - self.start
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, self.dp_rank]).permutation(n)

    def next_batch(self) -> Batch:
        if self.position + 1 > self.report.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        take = self._order[self.position * self.local_batch:(self.position + 1) * self.local_batch]
        self.position += 1
        self.rows_served += len(take)
        objects = {k: [v[i] for i in take] for k, v in self._columns.items()}
        row_id = torch.from_numpy(take.astype(np.int64) + self.start)
        return Batch({"row_id": row_id}, objects, {"epoch": self.epoch, "step_in_epoch": self.position - 1})

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rows_served": self.rows_served,
                "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(f"loader state is for rank {state['dp_rank']}/{state['dp_size']}, "
                             f"this loader is rank {self.dp_rank}/{self.dp_size}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.rows_served = state["rows_served"]
        self._order = self._epoch_order(self.epoch)


def make_loader(spec: DataSpec | dict, dp_rank: int, dp_size: int, seed: int) -> ShardedLoader:
    """The loader of one data-parallel rank for a data node's `spec` (see `DataSpec`)."""
    spec = data_spec(spec)
    num_rows = _data_node(spec, dp_size)
    source: str | DataSource = spec.source
    if spec.source == "synthetic":
        lengths = None
        if spec.lengths_from:
            rows = JsonlSource(spec.lengths_from).read_rows(0, 10**9)
            lengths = [len(q) for q in rows.get("question", [])]
        source = SyntheticSource(num_rows, spec.mean_len, spec.sigma, spec.max_len, seed, lengths)
    return ShardedLoader(source, dp_rank, dp_size, spec.batch_size // dp_size, seed, spec.shuffle)


def load_batch(batch: Batch, ctx: Any) -> Batch:
    """Stage function of a data_load node: the next batch of this rank's shard."""
    if ctx.loader is None:
        raise DatasetError(f"node {ctx.stage.id!r} has no loader: give it `data` (source, batch_size, ...) and "
                           "make it the first stage")
    return ctx.loader.next_batch()
