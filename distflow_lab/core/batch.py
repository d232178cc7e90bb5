"""Columnar batch: named torch tensors + numpy object columns + meta.

Every column shares the leading (row) dimension. A `Batch` crosses the Ray
object store without a pickling copy of tensor payloads: `__reduce__` hands
each tensor to pickle as a numpy view, so Ray stores it out-of-band (one
memcpy into shared memory on put) and a reader on the same node gets a view
of shared memory back (no copy on get). `benchmarks/` measures this path
against Ray's default torch pickling.

Tensors that come back from the object store are views of shared memory:
stage functions must treat input tensors as read-only and build new ones
(`Batch.update` / `with_columns`) rather than writing in place.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

# numpy has no bfloat16: such tensors travel as int16 bit patterns.
_VIEW_AS = {torch.bfloat16: (torch.int16, "bfloat16")}


def _tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in _VIEW_AS:
        as_dtype, name = _VIEW_AS[t.dtype]
        return t.view(as_dtype).numpy(), name
    return t.numpy(), None


def _numpy_to_tensor(a: np.ndarray, dtype_name: str | None) -> torch.Tensor:
    with warnings.catch_warnings():
        # Arrays from the object store are read-only views; see the module docstring.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(getattr(torch, dtype_name)) if dtype_name else t


def _rebuild(tensors: dict, objects: dict, meta: dict) -> "Batch":
    return Batch(
        {k: _numpy_to_tensor(a, name) for k, (a, name) in tensors.items()},
        objects,
        meta,
        _check=False,
    )


class Batch:
    """A set of equal-length columns. `tensors` are torch tensors (row dim 0),
    `objects` are numpy arrays (dtype object for strings, dicts, lists), `meta`
    is a small dict of scalars that travels with the batch."""

    __slots__ = ("tensors", "objects", "meta")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        objects: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        _check: bool = True,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.objects: dict[str, np.ndarray] = {
            k: v if isinstance(v, np.ndarray) else _object_array(v) for k, v in (objects or {}).items()
        }
        self.meta: dict[str, Any] = dict(meta or {})
        if _check:
            self._check_lengths()

    # ---- construction -------------------------------------------------
    @classmethod
    def empty(cls, **meta: Any) -> "Batch":
        return cls(meta=meta)

    def _check_lengths(self) -> None:
        lengths = {k: len(v) for k, v in {**self.tensors, **self.objects}.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Batch columns have different row counts: {lengths}")

    # ---- inspection ---------------------------------------------------
    def __len__(self) -> int:
        for col in self.tensors.values():
            return int(col.shape[0])
        for col in self.objects.values():
            return len(col)
        return 0

    @property
    def columns(self) -> list[str]:
        return [*self.tensors, *self.objects]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.objects

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.objects:
            return self.objects[name]
        raise KeyError(f"Batch has no column {name!r}; columns: {self.columns}")

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payloads (object columns are small and not counted exactly)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def schema(self) -> dict[str, str]:
        out = {k: f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for k, t in self.tensors.items()}
        out.update({k: f"object[{len(v)}]" for k, v in self.objects.items()})
        return out

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {v}" for k, v in self.schema().items())
        return f"Batch(rows={len(self)}, {_fmt_bytes(self.nbytes)}, {{{cols}}})"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td><code>{k}</code></td><td>{v}</td></tr>" for k, v in self.schema().items())
        meta = ", ".join(f"{k}={v!r}" for k, v in self.meta.items() if _is_small(v))
        return (
            f"<b>Batch</b> · {len(self)} rows · {_fmt_bytes(self.nbytes)}"
            f"<table><tr><th>column</th><th>type</th></tr>{rows}</table>"
            + (f"<small>meta: {meta}</small>" if meta else "")
        )

    # ---- row operations -----------------------------------------------
    def select(self, index: Sequence[int] | np.ndarray | torch.Tensor | slice) -> "Batch":
        """Rows by position (a slice keeps views; an index array gathers a copy)."""
        if isinstance(index, slice):
            return Batch(
                {k: v[index] for k, v in self.tensors.items()},
                {k: v[index] for k, v in self.objects.items()},
                self.meta,
                _check=False,
            )
        idx = np.array(index, dtype=np.int64)  # a private copy: the index may be a read-only Ray array
        tidx = torch.from_numpy(idx)
        return Batch(
            {k: v.index_select(0, tidx) for k, v in self.tensors.items()},
            {k: v[idx] for k, v in self.objects.items()},
            self.meta,
            _check=False,
        )

    reorder = select

    def split(self, sizes: int | Sequence[int]) -> list["Batch"]:
        """Contiguous chunks: `split(k)` makes k equal chunks, `split([a, b])` chunks of those sizes."""
        n = len(self)
        if isinstance(sizes, int):
            if sizes <= 0 or n % sizes:
                raise ValueError(f"cannot split {n} rows into {sizes} equal chunks")
            sizes = [n // sizes] * sizes
        if sum(sizes) != n:
            raise ValueError(f"split sizes {list(sizes)} sum to {sum(sizes)}, batch has {n} rows")
        bounds = np.cumsum([0, *sizes])
        return [self.select(slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        """Concatenate rows. Columns must match; meta comes from the first batch."""
        parts = [b for b in batches]
        if not parts:
            return Batch()
        cols = parts[0].columns
        for i, b in enumerate(parts[1:], 1):
            if b.columns != cols and set(b.columns) != set(cols):
                raise ValueError(f"concat: batch {i} has columns {b.columns}, batch 0 has {cols}")
        nonempty = [b for b in parts if len(b)] or parts[:1]
        tensors = {k: _cat_tensors([b.tensors[k] for b in nonempty]) for k in parts[0].tensors}
        objects = {k: np.concatenate([b.objects[k] for b in nonempty]) for k in parts[0].objects}
        return Batch(tensors, objects, parts[0].meta, _check=False)

    @staticmethod
    def gather(parts: Sequence[tuple["Batch", np.ndarray | slice]]) -> "Batch":
        """Rows of each batch (an index array, or a slice: a contiguous range), concatenated,
        with one copy per column (no intermediate per-part batches): a consumer reading its rows
        out of several producers' objects. Columns must match; meta comes from the first part."""
        if not parts:
            return Batch()
        first = parts[0][0]
        # private index copies: Ray arrays are read-only; slices are copied as they are (a memcpy)
        rows = [r if isinstance(r, slice) else torch.from_numpy(np.array(r, dtype=np.int64)) for _, r in parts]
        sizes = [len(range(*r.indices(len(b)))) if isinstance(r, slice) else len(r) for (b, _), r in zip(parts, rows)]
        tensors = {}
        for k, t in first.tensors.items():
            out = torch.empty((sum(sizes), *t.shape[1:]), dtype=t.dtype)
            at = 0
            for (b, _), r, n in zip(parts, rows, sizes):
                if isinstance(r, slice):
                    out[at:at + n].copy_(b.tensors[k][r])
                else:
                    torch.index_select(b.tensors[k], 0, r, out=out[at:at + n])
                at += n
            tensors[k] = out
        objects = {k: np.concatenate([b.objects[k][r if isinstance(r, slice) else r.numpy()]
                                      for (b, _), r in zip(parts, rows)]) for k in first.objects}
        return Batch(tensors, objects, first.meta, _check=False)

    # ---- column operations --------------------------------------------
    def update(self, other: "Batch") -> "Batch":
        """New batch with `other`'s columns added or replacing ours (same rows)."""
        if len(other.columns) and len(self.columns) and len(other) != len(self):
            raise ValueError(f"update: {len(other)} rows cannot join a batch of {len(self)} rows")
        return Batch(
            {**self.tensors, **other.tensors}, {**self.objects, **other.objects}, {**self.meta, **other.meta}
        )

    def with_columns(self, **columns: Any) -> "Batch":
        """New batch with these columns added: tensors go to `tensors`, anything else to `objects`."""
        tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
        objects = {k: v for k, v in columns.items() if not isinstance(v, torch.Tensor)}
        return self.update(Batch(tensors, objects))

    def pick(self, names: Iterable[str]) -> "Batch":
        """A batch with only these columns (views, no copy)."""
        names = list(names)
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; columns: {self.columns}")
        return Batch(
            {k: self.tensors[k] for k in names if k in self.tensors},
            {k: self.objects[k] for k in names if k in self.objects},
            self.meta,
            _check=False,
        )

    def changed_columns(self, before: "Batch") -> list[str]:
        """Columns that are new or not the very same object as in `before`."""
        out = []
        for k, v in self.tensors.items():
            if before.tensors.get(k) is not v:
                out.append(k)
        for k, v in self.objects.items():
            if before.objects.get(k) is not v:
                out.append(k)
        return out

    def clone(self) -> "Batch":
        """A private, writable copy of every tensor (use before in-place edits)."""
        return Batch({k: v.clone() for k, v in self.tensors.items()}, dict(self.objects), dict(self.meta))

    # ---- serialization ------------------------------------------------
    def __reduce__(self):
        tensors = {k: _tensor_to_numpy(v) for k, v in self.tensors.items()}
        return (_rebuild, (tensors, self.objects, self.meta))


def _cat_tensors(ts: list[torch.Tensor]) -> torch.Tensor:
    if len(ts) == 1:
        return ts[0]
    if all(t.dim() >= 2 for t in ts) and len({t.shape[1:] for t in ts}) > 1:
        raise ValueError(f"concat: tensor shapes differ beyond the row dim: {[tuple(t.shape) for t in ts]}")
    return torch.cat(ts, dim=0)


def _object_array(values: Any) -> np.ndarray:
    values = list(values)
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: nested lists must not broadcast
        arr[i] = v
    return arr


def _is_small(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
