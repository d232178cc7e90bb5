"""Same-node weight sync through shared memory that stays mapped (weight_sync.transport "shm").

Why not the object store on one node: `ray.put` writes into pages the store hands out cold, so a
517 MB policy goes in at about 0.6 GB/s against a 13 GB/s memcpy (issue 35's probe). A segment
rewritten in place every version is warm after the first, and a reader that keeps it mapped
copies from it at memcpy speed. So a sync is two warm copies: the publisher's write, the reader's load.

    publisher  `SlotRing(slots)`: version v goes into slot v % slots; bucket b of it into segment
               "<ring>-<slot>-<b>" (created on first use, recreated when its size changes), each
               tensor at a 64-byte aligned offset. `slots` = the versions the WeightBoard keeps, so
               every version the board names is still in its slot.
    control    one small segment per slot of int64 words: HELD (the version the slot holds; 0 while
               it is being written), READY + b (the version bucket b holds), READERS + r (the version
               reader r is reading, 0 when none).
    reader     `read_bucket`: marks READERS + r = v, checks HELD == v, maps the bucket (kept mapped
               for the next sync) and returns views; `done` clears the mark. A reader whose engine
               computes from the views (weight_sync.load "map") `keep`s the mark instead, until it
               keeps the next version's slot. A reader's first sight of a ring clears any mark its
               rank left there in an earlier life (a worker that died and came back).
    publisher  before overwriting a slot, waits (within the deadline) until no reader marks the
               version the slot holds; a reader that never lets go is WeightSyncTimeout naming it.

The words are plain stores through numpy: ordered on x86-64 (TSO). On a weakly ordered CPU a torn
read is still caught, by the fingerprint every tensor is checked against (weight_transport.receive).
A publisher that dies takes its segments with it (Python's resource tracker unlinks them): a
reader that maps one afterwards gets WeightSyncTimeout, as with an object the store lost.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from distflow_lab.core.errors import WeightSyncTimeout

ALIGN = 64
CONTROL_WORDS = 8192
HELD, READY, READERS = 0, 8, 1032  # word offsets: 1024 buckets, 7160 readers
MAX_BUCKETS, MAX_READERS = READERS - READY, CONTROL_WORDS - READERS


@dataclass(frozen=True)
class ShmBucket:
    """Where one bucket of one version lies: what a Manifest carries instead of an object ref."""

    control: str  # the slot's control segment
    segment: str
    slot: int
    bucket: int
    spans: tuple[tuple[int, int], ...]  # (offset, bytes) per tensor, in the bucket's order


def _timeout(why: str) -> WeightSyncTimeout:
    return WeightSyncTimeout(why, batch_id=-1, stage="weight_sync", worker=None)


def shm_free_bytes() -> int:
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0


class SlotRing:
    """The publisher's side: `slots` versions in shared memory, rewritten in place."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.prefix = f"dfl-w{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.control = [self._create(f"{self.prefix}-{s}-ctl", CONTROL_WORDS * 8) for s in range(self.slots)]
        for c in self.control:
            _words(c)[:] = 0
        self.segments: dict[tuple[int, int], shared_memory.SharedMemory] = {}

    @staticmethod
    def _create(name: str, size: int) -> shared_memory.SharedMemory:
        if size > shm_free_bytes():  # writing past /dev/shm's free space is SIGBUS, not an error: refuse first
            raise _timeout(f"weight_sync.transport 'shm': /dev/shm has {shm_free_bytes() >> 20} MiB free, a bucket "
                           f"needs {size >> 20} MiB; set weight_sync.transport: object_store")
        return shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))

    def begin(self, version: int, deadline: float) -> int:
        """Take the slot for `version`: wait until no reader reads the version it holds, then mark it
        being written (HELD = 0, every READY = 0). Returns the slot."""
        slot = version % self.slots
        words = _words(self.control[slot])
        old = int(words[HELD])
        while old and (busy := np.flatnonzero(words[READERS:] == old)).size:
            if time.monotonic() > deadline:
                raise _timeout(f"policy v{version}: reader {int(busy[0])} still reads policy v{old} from slot {slot} "
                               "past the weight sync's deadline (weight_sync.timeout_s)")
            time.sleep(0.001)
        words[HELD] = 0
        words[READY:READERS] = 0
        return slot

    def write(self, version: int, slot: int, bucket: int, arrays: list[np.ndarray]) -> ShmBucket:
        """Copy `arrays` into bucket `bucket` of `slot` (the one copy on this side) and mark it ready."""
        if bucket >= MAX_BUCKETS:
            raise _timeout(f"policy v{version}: more than {MAX_BUCKETS} buckets; raise weight_sync.bucket_mib")
        spans, end = [], 0
        for a in arrays:
            spans.append((end, a.nbytes))
            end += -(-a.nbytes // ALIGN) * ALIGN
        seg = self.segments.get((slot, bucket))
        if seg is None or seg.size < end:
            if seg is not None:
                seg.close()
                seg.unlink()
            seg = self.segments[(slot, bucket)] = self._create(f"{self.prefix}-{slot}-{bucket}-{uuid.uuid4().hex[:6]}",
                                                               end)
        buf = np.ndarray((seg.size,), np.uint8, buffer=seg.buf)
        for (offset, n), a in zip(spans, arrays):
            np.copyto(buf[offset:offset + n], a.reshape(-1).view(np.uint8))
        del buf
        _words(self.control[slot])[READY + bucket] = version
        return ShmBucket(self.control[slot].name, seg.name, slot, bucket, tuple(spans))

    def finish(self, version: int, slot: int) -> None:
        _words(self.control[slot])[HELD] = version

    def close(self) -> None:
        for seg in [*self.segments.values(), *self.control]:
            seg.close()
            seg.unlink()
        self.segments, self.control = {}, []


class SlotReader:
    """The reader's side: segments by name, mapped once and kept (a fresh mapping faults every
    page in again, which is what makes a first read slow). Only the newest ring's current
    segments stay mapped: a segment its publisher replaced or left behind (it died, or a new plan
    made a new ring) is unlinked, and our mapping would be the last holder of its pages."""

    def __init__(self, reader: int) -> None:
        if not 0 <= reader < MAX_READERS:
            raise ValueError(f"reader {reader}: one of 0..{MAX_READERS - 1}")
        self.reader = reader
        self.maps: dict[str, shared_memory.SharedMemory] = {}
        self.current: dict[tuple[str, int], str] = {}  # (control, bucket) -> the segment mapped for it
        self.kept: dict[str, int] = {}  # control -> the version our engine computes from (load "map")
        self.marked: set[str] = set()  # controls where our mark is set
        self.rings: set[str] = set()  # rings whose old marks of ours are cleared
        self.busy: list[shared_memory.SharedMemory] = []  # let go of, but an engine still computes from them

    def _map(self, name: str, version: int) -> shared_memory.SharedMemory:
        seg = self.maps.get(name)
        if seg is None:
            try:
                seg = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                raise _timeout(f"policy v{version}: its shared memory ({name}) is gone: the worker that published it "
                               "died; call resume()") from None
            # Python < 3.13 registers a segment it only attached to: its tracker would unlink it at our exit
            # (unless this process published it: then the registration is the publisher's own)
            if not name.startswith(f"dfl-w{os.getpid()}-"):
                resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            self.maps[name] = seg
        return seg

    def read_bucket(self, version: int, ref: ShmBucket) -> list[np.ndarray]:
        """Views (uint8) of bucket `ref` of `version`; the caller copies them before `done`."""
        words = _words(self._map(ref.control, version))
        self._claim(_ring_of(ref.control), version)
        words[READERS + self.reader] = version
        self.marked.add(ref.control)
        held, ready = int(words[HELD]), int(words[READY + ref.bucket])
        if held != version or ready != version:
            words[READERS + self.reader] = self.kept.get(ref.control, 0)
            raise _timeout(f"policy v{version}: slot {ref.slot} now holds v{held} (bucket {ref.bucket}: v{ready}); "
                           "the publisher moved past it")
        self._let_go_of_stale(ref)
        buf = self._map(ref.segment, version).buf
        return [np.ndarray((n,), np.uint8, buffer=buf, offset=offset) for offset, n in ref.spans]

    def _let_go_of_stale(self, ref: ShmBucket) -> None:
        ring = _ring_of(ref.control)
        stale = [name for name in self.maps if _ring_of(name) != ring]  # another (older) publisher's ring
        replaced = self.current.get((ref.control, ref.bucket))
        if replaced is not None and replaced != ref.segment:
            stale.append(replaced)
        self.current = {k: v for k, v in self.current.items() if _ring_of(k[0]) == ring}
        self.current[(ref.control, ref.bucket)] = ref.segment
        for name in stale:
            self._close(name)
        busy, self.busy = self.busy, []
        for seg in busy:
            self._close_segment(seg)

    def _claim(self, ring: str, version: int) -> None:
        """Clear the marks our reader number left in `ring`'s slots before this process read from it
        (a worker of that rank that died holding one would block the publisher for good)."""
        if ring in self.rings:
            return
        self.rings.add(ring)
        for slot in range(MAX_BUCKETS):
            try:
                seg = self._map(f"{ring}-{slot}-ctl", version)
            except WeightSyncTimeout:  # no such slot: the ring has `slot` slots
                break
            _words(seg)[READERS + self.reader] = 0

    def done(self, control: str) -> None:
        """The read of `control`'s slot is over: its mark goes (back to the kept version, if kept)."""
        seg = self.maps.get(control)
        if seg is not None:
            _words(seg)[READERS + self.reader] = self.kept.get(control, 0)
        if control not in self.kept:
            self.marked.discard(control)

    def keep(self, control: str, version: int) -> None:
        """Our engine now computes from `version` in `control`'s slot (its parameters are views of
        it): hold that slot, let go of the one held before."""
        for old in (self.marked | set(self.kept)) - {control}:  # a read that failed half way left one too
            if old in self.maps:
                _words(self.maps[old])[READERS + self.reader] = 0
        self.kept, self.marked = {control: version}, {control}
        _words(self._map(control, version))[READERS + self.reader] = version

    def close(self) -> None:
        """Let go of every slot (our marks cleared) and unmap every segment no view still uses."""
        for control in self.marked | set(self.kept):
            if control in self.maps:
                _words(self.maps[control])[READERS + self.reader] = 0
        for name in list(self.maps):
            self._close(name)
        busy, self.busy = self.busy, []
        for seg in busy:
            self._close_segment(seg)
        self.current, self.kept, self.marked, self.rings = {}, {}, set(), set()

    def _close(self, name: str) -> None:
        seg = self.maps.pop(name, None)
        if seg is not None:
            self._close_segment(seg)

    def _close_segment(self, seg: shared_memory.SharedMemory) -> None:
        try:
            seg.close()
        except BufferError:  # a view of it is still alive (the engine's weights): tried again later
            self.busy.append(seg)


def _ring_of(name: str) -> str:
    return "-".join(name.split("-")[:3])  # "dfl-w<pid>-<uuid>-<slot>-..." -> "dfl-w<pid>-<uuid>"


def _words(seg: shared_memory.SharedMemory) -> np.ndarray:
    return np.ndarray((CONTROL_WORDS,), np.int64, buffer=seg.buf)
