"""Distributed dataloader: shards are disjoint, cover the dataset, read only
their own rows, shuffle per epoch deterministically and report leftovers."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow_lab.datasets.loader import (DatasetError, JsonlSource, ParquetSource, ShardedLoader, make_loader,
                                      shard_bounds)


@pytest.fixture
def parquet_file(tmp_path):
    n = 103  # not divisible by the dp sizes used below
    table = pa.table({"q": [f"question {i}" for i in range(n)], "k": list(range(n))})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=10)
    return path


@pytest.mark.parametrize("dp", [1, 2, 4, 7])
def test_shards_are_disjoint_and_cover(dp):
    n = 103
    bounds = [shard_bounds(n, dp, r) for r in range(dp)]
    rows = [i for a, b in bounds for i in range(a, b)]
    assert rows == list(range(n))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_parquet_reads_only_overlapping_row_groups(parquet_file):
    src = ParquetSource(parquet_file)
    cols = src.read_rows(25, 37)
    assert cols["k"] == list(range(25, 37))
    assert src.row_groups_read == [2, 3]  # groups of 10 rows: 20-29 and 30-39


def test_loaders_union_is_the_dataset(parquet_file):
    dp, local = 4, 5
    loaders = [ShardedLoader(parquet_file, r, dp, local, seed=3) for r in range(dp)]
    seen = []
    for ld in loaders:
        for _ in range(ld.report.steps_per_epoch):
            seen.extend(ld.next_batch()["row_id"].tolist())
    # every row served at most once per epoch, all from this rank's shard only
    assert len(seen) == len(set(seen))
    rep = loaders[0].report
    assert rep.shard_sizes == [26, 26, 26, 25]
    assert rep.steps_per_epoch == 5  # min shard 25 // 5
    # leftovers are reported per rank, not dropped silently
    assert [ld.report.unused_rows_per_epoch for ld in loaders] == [1, 1, 1, 0]
    assert len(seen) + sum(ld.report.unused_rows_per_epoch for ld in loaders) == 103
    for r, ld in enumerate(loaders):
        a, b = shard_bounds(103, dp, r)
        assert ld.start == a and ld.stop == b


def test_shuffle_is_deterministic_per_epoch_and_changes_between_epochs(parquet_file):
    a = ShardedLoader(parquet_file, 1, 2, 10, seed=7)
    b = ShardedLoader(parquet_file, 1, 2, 10, seed=7)
    first = [a.next_batch()["row_id"].tolist() for _ in range(5)]
    assert first == [b.next_batch()["row_id"].tolist() for _ in range(5)]
    second_epoch = a.next_batch()
    assert second_epoch.meta["epoch"] == 1
    rows = sum(first, [])  # rank 1 owns rows 52..102; one of its 51 rows is left over this epoch
    assert len(set(rows)) == 50 and set(rows) <= set(range(52, 103))
    c = ShardedLoader(parquet_file, 1, 2, 10, seed=8)
    assert c.next_batch()["row_id"].tolist() != first[0]


def test_state_dict_resume(parquet_file):
    a = ShardedLoader(parquet_file, 0, 2, 10, seed=1)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    b = ShardedLoader(parquet_file, 0, 2, 10, seed=1)
    b.load_state_dict(state)
    assert a.next_batch()["row_id"].tolist() == b.next_batch()["row_id"].tolist()
    with pytest.raises(ValueError, match="rank 0/2"):
        ShardedLoader(parquet_file, 1, 2, 10, seed=1).load_state_dict(state)


def test_jsonl_shard_and_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(9)) + "\n")
    ld = ShardedLoader(path, 2, 3, 3, shuffle=False)
    assert ld.next_batch()["question"].tolist() == ["q6", "q7", "q8"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a"}\n{not json\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: invalid JSON"):
        JsonlSource(bad).read_rows(0, 2)


def test_errors_name_the_file(tmp_path, parquet_file):
    with pytest.raises(DatasetError, match="missing.parquet does not exist"):
        ParquetSource(tmp_path / "missing.parquet")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"this is not parquet at all")
    with pytest.raises(DatasetError, match="corrupt.parquet is not a readable parquet"):
        ParquetSource(corrupt)
    with pytest.raises(DatasetError, match="ranks \\[3\\] would get an empty shard"):
        ShardedLoader(_tiny(tmp_path, 3), 0, 4, 1)
    with pytest.raises(DatasetError, match="local batch 40 does not fit"):
        ShardedLoader(parquet_file, 0, 4, 40)


def _tiny(tmp_path, n):
    p = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"k": list(range(n))}), p)
    return p


def test_make_loader_synthetic_uses_real_lengths(gsm8k_dir):
    ld = make_loader({"source": "synthetic", "batch_size": 8, "num_rows": 64,
                      "lengths_from": str(gsm8k_dir / "test.jsonl")}, 0, 2, seed=0)
    lens = np.asarray(ld.next_batch()["prompt_len"].tolist())
    assert len(lens) == 4 and lens.min() >= 42 and lens.max() <= 985  # GSM8K question lengths
    with pytest.raises(DatasetError, match="not divisible by the data-parallel size 3"):
        make_loader({"source": "synthetic", "batch_size": 8}, 0, 3, seed=0)
