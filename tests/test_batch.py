"""The columnar Batch: row/column operations and its zero-copy path through Ray."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from distflow_lab.core.batch import Batch


def make(n: int = 6) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32),
         "half": torch.ones(n, 2, dtype=torch.bfloat16) * torch.arange(n)[:, None]},
        {"uid": [f"u{i}" for i in range(n)], "msgs": [[{"role": "user", "content": str(i)}] for i in range(n)]},
        {"epoch": 1},
    )


def test_lengths_must_match():
    with pytest.raises(ValueError, match="different row counts"):
        Batch({"a": torch.zeros(3)}, {"b": [1, 2]})


def test_select_split_concat_reorder():
    b = make()
    assert len(b) == 6 and b.columns == ["ids", "score", "half", "uid", "msgs"]
    s = b.select([4, 1])
    assert s["uid"].tolist() == ["u4", "u1"] and s["ids"][0].tolist() == [12, 13, 14]
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert [len(p) for p in b.split([1, 5])] == [1, 5]
    with pytest.raises(ValueError, match="cannot split 6 rows into 4"):
        b.split(4)
    with pytest.raises(ValueError, match="sum to 5"):
        b.split([2, 3])
    back = Batch.concat(parts)
    assert torch.equal(back["ids"], b["ids"]) and back["uid"].tolist() == b["uid"].tolist()
    perm = [5, 3, 1, 0, 2, 4]
    r = b.reorder(perm)
    assert r["score"].tolist() == [float(i) for i in perm]
    assert r["msgs"][0][0]["content"] == "5"


def test_concat_rejects_mismatched_columns_and_shapes():
    a = Batch({"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="columns"):
        Batch.concat([a, Batch({"y": torch.zeros(2, 3)})])
    with pytest.raises(ValueError, match="shapes differ"):
        Batch.concat([a, Batch({"x": torch.zeros(2, 4)})])


def test_columns_update_pick_changed():
    b = make(4)
    c = b.with_columns(adv=torch.ones(4), note=["a", "b", "c", "d"])
    assert set(c.changed_columns(b)) == {"adv", "note"}
    assert c["ids"] is b["ids"]  # no copy of untouched columns
    with pytest.raises(ValueError, match="3 rows cannot join"):
        b.update(Batch({"z": torch.ones(3)}))
    assert b.pick(["uid"]).columns == ["uid"]
    with pytest.raises(KeyError, match="no column"):
        b.pick(["nope"])
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]


def test_nbytes_and_repr():
    b = make(4)
    assert b.nbytes == 4 * 3 * 8 + 4 * 4 + 4 * 2 * 2
    assert "rows=4" in repr(b) and "<table>" in b._repr_html_()


def test_pickle_keeps_tensor_payloads_out_of_band():
    """Pickle protocol 5 (what Ray uses) must see the tensors as out-of-band
    buffers: the in-band pickle stays small whatever the tensor size."""
    big = Batch({"x": torch.randn(1000, 1000), "m": torch.ones(1000, 1000, dtype=torch.bfloat16)}, {"u": ["a"] * 1000})
    buffers: list = []
    inband = pickle.dumps(big, protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(b).nbytes for b in buffers) == big.nbytes
    assert len(inband) < 20_000
    back = pickle.loads(inband, buffers=buffers)
    assert torch.equal(back["x"], big["x"]) and torch.equal(back["m"], big["m"])
    assert back["m"].dtype == torch.bfloat16


def test_ray_round_trip_is_zero_copy_on_get(ray_cluster):
    ray = ray_cluster
    b = Batch({"x": torch.randn(256, 1024)}, {"u": ["z"] * 256})
    back = ray.get(ray.put(b))
    assert torch.equal(back["x"], b["x"]) and back["u"].tolist() == b["u"].tolist()
    # two gets of one object share the same memory: each reader sees a view of
    # the shared-memory object, not a private copy
    ref = ray.put(b)
    a1, a2 = ray.get(ref), ray.get(ref)
    assert a1["x"].data_ptr() == a2["x"].data_ptr()


def test_object_columns_keep_nested_values():
    b = Batch(objects={"m": [[1, 2], [3, 4]]})
    assert b["m"].dtype == object and b["m"][1] == [3, 4]
    assert np.asarray(Batch.concat([b, b])["m"]).shape == (4,)


def test_gather_takes_index_arrays_and_slices_like_select_then_concat():
    a, b = make(6), make(4)
    parts = [(a, np.array([4, 0, 2])), (b, slice(1, 3)), (a, slice(5, 6)), (b, np.array([], dtype=np.int64))]
    got, want = Batch.gather(parts), Batch.concat([x.select(r) for x, r in parts])
    assert len(got) == 6 and set(got.columns) == set(want.columns)
    for k in want.columns:
        g, w = got[k], want[k]
        assert (torch.equal(g, w) if isinstance(w, torch.Tensor) else list(g) == list(w)), k
