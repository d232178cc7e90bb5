"""The weight sync's transport between worker groups: a policy version as numpy buckets,
described by a `Manifest`, checked tensor by tensor on arrival. Two carriers:

    shm (one node)        the publisher rewrites its own shared-memory slots in place
                          (runtime/shm_slots.py): warm pages, one copy in, one copy out
    object_store (nodes)  ray.put([numpy view of each tensor]) -> one object per bucket

    publisher (training rank 0):  buckets = actor's gathered tensors, at most `bucket_bytes` each,
                                  written to the carrier; Manifest(version, entries, buckets) ->
                                  the WeightBoard
    reader (each rollout worker): read-only views of each bucket (a mapping, no copy); each view is
                                  checked against its fingerprint, then the rollout copies it into
                                  its own parameter (the one copy on this side).

Why numpy, not torch tensors: Ray pickles numpy arrays out of band (pickle 5), so a put is one
copy into shared memory and a get maps it without copying; a dict of torch tensors is pickled
in band and copied again on the way out (benchmarks/probes/weight_sync_object_store.py: reader
at 6.9 GB/s against 7.9 GB/s memcpy). bfloat16/float16 travel as int16 bits.

Tied weights (embed_tokens / lm_head) travel once: the manifest lists the other names as
aliases. Each entry carries a fingerprint (64 runs of 64 elements spread over the tensor, dotted with a ramp,
in float64): a tensor that is missing, zeroed, shifted, truncated or from another version shows;
a single flipped bit between samples does not (that is the object store's own integrity).

`SyncReport` is one sync as a researcher reads it: the parts (gather, write, read, load,
verify), bytes, GB/s. The worker records one per sync, on both sides.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from distflow_lab.core.errors import WeightSyncMismatch, WeightSyncTimeout
from distflow_lab.models.buckets import DEFAULT_BUCKET_BYTES, buckets_of
from distflow_lab.runtime.shm_slots import MAX_READERS, ShmBucket, SlotReader, SlotRing

Bucket = list[tuple[str, torch.Tensor]]
FINGERPRINT_SAMPLES, FINGERPRINT_RUN = 4096, 64
_FINGERPRINT_RUNS = FINGERPRINT_SAMPLES // FINGERPRINT_RUN
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  # numpy has no bfloat16: send the bits
_RAMP = np.arange(1, FINGERPRINT_SAMPLES + 1, dtype=np.float64)


def fingerprint(t: torch.Tensor | np.ndarray) -> float:
    """A number that changes when a tensor's content or shape changes: 4096 elements (64 runs of
    64, evenly spaced, the last ending at the tensor's last element) dotted with 1..4096 in float64, plus the
    element count. A 16-bit float is read as its bits (int16: numpy has no bfloat16), so the same
    tensor gives the same number as a torch tensor, as the numpy array a sync sends, on any device.
    Runs, not single strided elements: 256 cache lines read instead of 4096, and those misses are the
    cost: SmolLM2-135M's 273 tensors take 6.3 ms (float32) and 7.3 ms (bfloat16) with cold caches, one
    thread (sampling through torch, before: 7.0 and 8.6). `distflow-lab bench weight-sync` reports the
    whole check as `verify_s`."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        t = t.view(_BITS[t.dtype]) if t.dtype in _BITS else t
        if t.device.type != "cpu":  # sample on the device, move only the samples
            n, flat = t.numel(), t.reshape(-1)
            if n > FINGERPRINT_SAMPLES:
                step, first = _runs(n, _FINGERPRINT_RUNS)
                flat = flat.as_strided((_FINGERPRINT_RUNS, FINGERPRINT_RUN), (step, 1), flat.storage_offset() + first)
            return _dot(flat.reshape(-1).cpu().numpy(), n)
        t = t.numpy()
    flat, n = np.ascontiguousarray(t).reshape(-1), t.size  # no copy when contiguous (every sync's arrays)
    if n > FINGERPRINT_SAMPLES:
        step, first = _runs(n, _FINGERPRINT_RUNS)
        flat = np.lib.stride_tricks.as_strided(flat[first:], (_FINGERPRINT_RUNS, FINGERPRINT_RUN),
                                               (step * flat.itemsize, flat.itemsize))
    return _dot(flat, n)


def _dot(samples: np.ndarray, n: int) -> float:
    a = samples.reshape(-1).astype(np.float64)
    return float(a @ _RAMP[:a.size]) + n


def _runs(n: int, runs: int) -> tuple[int, int]:
    """(elements between run starts, where the first starts): the last run ends at the last element."""
    step = (n - FINGERPRINT_RUN) // (runs - 1)
    return step, n - FINGERPRINT_RUN - step * (runs - 1)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    bucket: int  # which object
    index: int  # which array in it
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    fingerprint: float


@dataclass(frozen=True)
class Manifest:
    """One published policy version: what a reader needs, and nothing it must trust blindly."""

    version: int
    entries: tuple[TensorEntry, ...]
    buckets: tuple[Any, ...]  # ObjectRefs, one per bucket (empty on ranks that only took part in the gather)
    aliases: dict[str, str] = field(default_factory=dict)  # a tied name -> the entry it shares
    nbytes: int = 0  # bytes sent (each tensor once)
    mode: str = "full"
    delta: "Delta | None" = None  # weight_sync.mode "delta": the changes since the version before

    @property
    def checksum(self) -> float:
        """Equal on both sides of a sync of the same weights (the sum of the fingerprints)."""
        return float(sum(e.fingerprint for e in self.entries))

    @property
    def names(self) -> set[str]:
        return {e.name for e in self.entries} | set(self.aliases)


@dataclass(frozen=True)
class DeltaEntry:
    """One tensor's change since the delta's base: `count` positions (arrays[index], int32 or int64,
    flat) and their new values (arrays[index + 1]); count -1: the whole tensor (arrays[index]),
    sent when that is smaller. A tensor with no entry did not change."""

    name: str
    bucket: int
    index: int
    count: int


@dataclass(frozen=True)
class Delta:
    """What a reader holding version `base` needs to reach its manifest's version (the object store's
    buckets; weight_sync.mode "delta")."""

    base: int
    entries: tuple[DeltaEntry, ...]
    buckets: tuple[Any, ...]
    nbytes: int


class DeltaBase:
    """The publisher's copy of the version it sent last, in the sent dtype: what the next version is
    compared with, element by element (bits, so -0.0 and NaN count as they are)."""

    def __init__(self) -> None:
        self.version = -1
        self.arrays: dict[str, np.ndarray] = {}

    def diff(self, name: str, a: np.ndarray) -> list[np.ndarray] | None:
        """[positions, values], [the whole array] when that is smaller, or None: unchanged."""
        old = self.arrays.get(name)
        self.arrays[name] = a.copy()  # `a` may be a view of the trainer's tensor, which the next update changes
        if old is None or old.shape != a.shape or old.dtype != a.dtype:
            return [a]
        bits = np.dtype(f"u{a.itemsize}")
        where = np.flatnonzero(a.reshape(-1).view(bits) != old.reshape(-1).view(bits))
        if where.size == 0:
            return None
        where = where.astype(np.int32 if a.size < 2**31 else np.int64)
        if where.size * (where.itemsize + a.itemsize) >= a.nbytes:
            return [a]
        return [where, a.reshape(-1)[where]]


@dataclass
class SyncReport:
    """One weight sync on one worker: seconds per part and the bytes moved."""

    side: str  # "publish" or "pull" (groups), "colocated"
    version: int
    mode: str = "full"
    transport: str = ""  # "shm" or "object_store" (groups), "" (colocated)
    load: str = ""  # a pull's: "copy" into the engine's weights, or "map" (they become the views)
    nbytes: int = 0
    tensors: int = 0
    buckets: int = 0
    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - t0

    def row(self) -> dict[str, Any]:
        seconds = sum(self.parts.values())
        return {"side": self.side, "version": self.version, "mode": self.mode, "transport": self.transport,
                "load": self.load, "bytes": self.nbytes,
                "tensors": self.tensors, "buckets": self.buckets, "seconds": seconds,
                **{f"{p}_s": self.parts.get(p, 0.0) for p in ("gather", "write", "read", "load", "verify", "delta")},
                "gbps": self.nbytes / seconds / 1e9 if seconds > 0 else float("nan")}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(_BITS[t.dtype]).numpy() if t.dtype in _BITS else t.numpy()


def _as_tensor(a: np.ndarray, entry: TensorEntry) -> torch.Tensor:
    """A tensor over `a`'s memory: an array of the entry's dtype, its int16 bits, or raw bytes from
    shared memory (the caller silences torch's read-only warning: we only read it)."""
    dtype = getattr(torch, entry.dtype)
    t = torch.from_numpy(a)
    return (t.view(dtype) if t.dtype != dtype else t).reshape(entry.shape)


def publish(buckets: Iterable[Bucket], version: int, aliases: dict[str, str] | None = None, put: bool = True,
            report: SyncReport | None = None, corrupt: int | None = None,
            after_put: Callable[[int], Any] | None = None, ring: SlotRing | None = None,
            deadline_s: float = 60.0, mode: str = "full", delta: DeltaBase | None = None) -> Manifest:
    """Send `buckets` (every rank of an FSDP group iterates them: the gather is collective; only
    the rank with `put` writes): into `ring`'s shared memory when given (same node), else the
    object store. `aliases`: tied names not sent (name -> the name that is). `deadline_s` bounds
    the wait for a ring slot's readers. `mode`: what the buckets are ("full": the policy; "lora": its
    adapters), shown on both sides' reports. `delta` (weight_sync.mode "delta"; the writing rank's):
    also the changes since the version it holds, as object-store buckets (`Manifest.delta`), for
    readers that hold that version; the full buckets stay, for the others. Fault injection only:
    `corrupt=i` damages bucket i's first tensor after fingerprinting it; `after_put(i)` runs after
    bucket i is written."""
    aliases = dict(aliases or {})
    slot = ring.begin(version, time.monotonic() + deadline_s) if put and ring is not None else None
    report = report or SyncReport("publish", version)
    report.transport, report.mode = "shm" if ring is not None else "object_store", mode
    entries: list[TensorEntry] = []
    refs: list[Any] = []
    nbytes = 0
    changes = _Changes(delta) if put and delta is not None else None
    it = iter(buckets)
    while True:
        with report.part("gather"):
            bucket = next(it, None)
        if bucket is None:
            break
        names, arrays = [], []
        with report.part("verify"):
            for name, t in bucket:
                if name in aliases:
                    continue
                entries.append(TensorEntry(name, len(refs), len(arrays), tuple(t.shape),
                                           str(t.dtype).removeprefix("torch."), fingerprint(t)))
                names.append(name)
                arrays.append(_as_numpy(t))
                nbytes += t.numel() * t.element_size()
        if put and arrays:
            if changes is not None:
                with report.part("delta"):
                    changes.add(names, arrays)
            if corrupt == len(refs):  # a bit flipped in every byte of its first tensor, after the fingerprint
                arrays[0] = (arrays[0].view(np.uint8) ^ 0x40).view(arrays[0].dtype)
            with report.part("write"):
                refs.append(ray.put(arrays) if slot is None else ring.write(version, slot, len(refs), arrays))
            if after_put is not None:
                after_put(len(refs) - 1)
        elif arrays:
            refs.append(None)
    if slot is not None:
        ring.finish(version, slot)
    changed = None
    if changes is not None:
        with report.part("delta"):
            changed = changes.finish(version)
        report.mode = "delta" if changed is not None else report.mode
    report.nbytes = nbytes + (changed.nbytes if changed is not None else 0)
    report.tensors, report.buckets = len(entries), len(refs)
    missing = sorted(set(aliases.values()) - {e.name for e in entries})
    if missing:
        raise WeightSyncMismatch(f"tied weights {missing} are not among the tensors published", batch_id=-1,
                                 stage="weight_sync", worker=None)
    return Manifest(version, tuple(entries), tuple(refs) if put else (), aliases, nbytes, mode, changed)


class _Changes:
    """The delta buckets of one publish: one object per full bucket that has changes."""

    def __init__(self, base: DeltaBase) -> None:
        self.base, self.from_version = base, base.version
        self.entries: list[DeltaEntry] = []
        self.refs: list[Any] = []
        self.nbytes = 0

    def add(self, names: list[str], arrays: list[np.ndarray]) -> None:
        out: list[np.ndarray] = []
        for name, a in zip(names, arrays):
            d = self.base.diff(name, a)
            if d is not None:
                self.entries.append(DeltaEntry(name, len(self.refs), len(out), -1 if len(d) == 1 else d[0].size))
                out.extend(d)
        if out:
            self.nbytes += sum(a.nbytes for a in out)
            self.refs.append(ray.put(out))

    def finish(self, version: int) -> Delta | None:
        """The delta from the base's version to `version` (None: the base held none), which the base now holds."""
        self.base.version = version
        if self.from_version < 0:
            return None
        return Delta(self.from_version, tuple(self.entries), tuple(self.refs), self.nbytes)


def apply_delta(manifest: Manifest, targets: dict[str, torch.Tensor], deadline_s: float,
                report: SyncReport | None = None) -> set[str]:
    """Patch `targets` (the reader's own tensors, at `manifest.delta.base`; tied names the same
    tensor) in place to `manifest.version`: each change written into its tensor, then every tensor
    of the manifest checked against its fingerprint (a reader that did not hold the base, or a
    damaged delta, is WeightSyncMismatch). Returns the names it covers (aliases too)."""
    delta = manifest.delta
    assert delta is not None, "a manifest without a delta"
    report = report or SyncReport("pull", manifest.version)
    report.mode, report.nbytes, report.tensors = "delta", delta.nbytes, len(delta.entries)
    report.buckets = len(delta.buckets)
    report.transport = "object_store"
    entries = {e.name: e for e in manifest.entries}
    end = time.monotonic() + deadline_s
    by_bucket: dict[int, list[DeltaEntry]] = defaultdict(list)
    for d in delta.entries:
        by_bucket[d.bucket].append(d)
    for b, ref in enumerate(delta.buckets):
        with report.part("read"):
            arrays = _get(ref, end, manifest.version, b, len(delta.buckets))
        with report.part("load"):
            for d in by_bucket[b]:
                _patch(manifest.version, targets, entries[d.name], d, arrays)
    with report.part("verify"):
        for e in manifest.entries:
            t = targets.get(e.name)
            got = fingerprint(t) if t is not None else None
            if got != e.fingerprint:
                raise _mismatch(manifest.version, e.name,
                                f"after the delta from v{delta.base}: fingerprint {got!r} != published "
                                f"{e.fingerprint!r} (did the reader hold v{delta.base}?)")
    return set(entries) | set(manifest.aliases)


def patch_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s own tensors by state-dict name, as `apply_delta` patches them (tied names: one tensor)."""
    return {name: t.data for name, t in model.state_dict(keep_vars=True).items()}


def _patch(version: int, targets: dict[str, torch.Tensor], e: TensorEntry, d: DeltaEntry,
           arrays: list[np.ndarray]) -> None:
    t = targets.get(e.name)
    if t is None or str(t.dtype).removeprefix("torch.") != e.dtype or tuple(t.shape) != e.shape:
        held = "none" if t is None else f"{t.dtype}{list(t.shape)}"
        raise _mismatch(version, e.name, f"a delta patches {e.dtype}{list(e.shape)}; the reader holds {held}")
    flat = t.detach().view(-1)
    flat = flat.view(_BITS[flat.dtype]) if flat.dtype in _BITS else flat
    with warnings.catch_warnings():  # the object store's arrays are read-only: we only read them
        warnings.simplefilter("ignore", UserWarning)
        if d.count < 0:
            flat.copy_(torch.from_numpy(arrays[d.index]).reshape(-1))
        else:
            flat[torch.from_numpy(arrays[d.index]).long()] = torch.from_numpy(arrays[d.index + 1])


def receive(manifest: Manifest, deadline_s: float, report: SyncReport | None = None,
            reader: SlotReader | None = None, keep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every name of `manifest` (aliases too), each a read-only view of the
    object store or of the publisher's shared memory (through `reader`, this process's mappings),
    checked against its fingerprint. WeightSyncTimeout past `deadline_s` (from the first bucket
    on), WeightSyncMismatch for a tensor that is not what was published. The caller copies each
    view before the next one is yielded (a shared-memory slot is held for us only until then),
    unless `keep`: then the views stay valid until the next `keep` receive (the slot stays held;
    an object-store array holds its object) and the caller may compute from them."""
    report = report or SyncReport("pull", manifest.version)
    by_bucket: dict[int, list[TensorEntry]] = defaultdict(list)
    for e in manifest.entries:
        by_bucket[e.bucket].append(e)
    shared: dict[str, list[str]] = defaultdict(list)
    for alias, owner in manifest.aliases.items():
        shared[owner].append(alias)
    end = time.monotonic() + deadline_s
    report.nbytes, report.tensors, report.buckets = manifest.nbytes, len(manifest.entries), len(manifest.buckets)
    report.mode = manifest.mode
    report.transport = "shm" if any(isinstance(b, ShmBucket) for b in manifest.buckets) else "object_store"
    for b, ref in enumerate(manifest.buckets):
        shm = isinstance(ref, ShmBucket)
        if shm:
            reader = reader or _process_reader()
        with report.part("read"):
            arrays = reader.read_bucket(manifest.version, ref) if shm else _get(ref, end, manifest.version, b,
                                                                                len(manifest.buckets))
        try:
            yield from _checked(manifest, b, by_bucket[b], arrays, shared, report)
        finally:
            if shm and not keep:
                reader.done(ref.control)
    if keep and manifest.buckets and isinstance(manifest.buckets[0], ShmBucket):
        reader.keep(manifest.buckets[0].control, manifest.version)  # and let go of the version held before


def _checked(manifest: Manifest, b: int, entries: list[TensorEntry], arrays: list[np.ndarray],
             shared: dict[str, list[str]], report: SyncReport) -> Iterator[tuple[str, torch.Tensor]]:
    for e in entries:
        with report.part("verify"), warnings.catch_warnings():  # mapped read-only: we only read it
            warnings.simplefilter("ignore", UserWarning)
            if e.index >= len(arrays):
                raise _mismatch(manifest.version, e.name, f"bucket {b} holds {len(arrays)} tensors, not {e.index + 1}")
            try:
                t = _as_tensor(arrays[e.index], e)
            except (RuntimeError, ValueError, TypeError) as err:  # not the shape or dtype published
                raise _mismatch(manifest.version, e.name, f"bucket {b} holds no {e.dtype}{list(e.shape)} at "
                                                          f"{e.index}: {err}") from None
            got = fingerprint(t)
        if got != e.fingerprint:
            raise _mismatch(manifest.version, e.name, f"fingerprint {got!r} != published {e.fingerprint!r} "
                                                      f"(bucket {b}, {e.dtype}{list(e.shape)})")
        yield e.name, t
        for alias in shared[e.name]:
            yield alias, t


@functools.lru_cache(maxsize=None)
def _process_reader() -> SlotReader:
    """This process's mappings when its caller names no reader (a driver or a probe reading the
    board): a reader mark by pid, from the top half of the marks; workers use their rank, from the
    bottom (two processes off the workers could still share one: then a torn read is caught by
    the fingerprints, as a mismatch)."""
    return SlotReader(MAX_READERS - 1 - os.getpid() % (MAX_READERS // 2))


def _get(ref: Any, end: float, version: int, b: int, n: int) -> list[np.ndarray]:
    left = end - time.monotonic()
    try:
        if left <= 0:
            raise GetTimeoutError
        return ray.get(ref, timeout=left)
    except GetTimeoutError:
        raise WeightSyncTimeout(f"policy v{version}: bucket {b + 1} of {n} did not arrive within the weight sync's "
                                "deadline (weight_sync.timeout_s)", batch_id=-1, stage="weight_sync", worker=None) from None
    except RayError as e:  # the publisher died with the objects it owned
        raise WeightSyncTimeout(f"policy v{version}: bucket {b + 1} of {n} is lost ({type(e).__name__}): the worker "
                                "that published it died; call resume()", batch_id=-1, stage="weight_sync",
                                worker=None) from None


def _mismatch(version: int, name: str, why: str) -> WeightSyncMismatch:
    return WeightSyncMismatch(f"policy v{version}: tensor {name!r}: {why}", batch_id=-1, stage="weight_sync", worker=None)


def check_loaded(manifest: Manifest, loaded: set[str]) -> None:
    """Every name of the manifest reached the engine (a partial load is never silent)."""
    missing = sorted(manifest.names - loaded)
    if missing:
        raise _mismatch(manifest.version, missing[0], f"not loaded ({len(missing)} of {len(manifest.names)} tensors "
                                                      f"missing: {missing[:5]})")


def read_state(manifest: Manifest, deadline_s: float = 60.0, reader: SlotReader | None = None) -> dict[str, torch.Tensor]:
    """The whole policy as owned tensors (a checkpoint of the board's versions)."""
    return {name: t.clone() for name, t in receive(manifest, deadline_s, reader=reader)}


def publish_state(state: dict[str, torch.Tensor], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """A state dict (a checkpoint's policy) back onto the object store."""
    return publish(buckets_of(state.items(), bucket_bytes), version)
