"""Double buffer (paper §6.5): every batch writes into its own store; at batch end
the DataBuffer detaches that store in O(1) (a dict pop: the "pointer swap") and
frees it in a background thread, so releasing the batch's object references
(O(producers x consumers) of them per edge) is off the critical path. With the
switch off, the release runs synchronously on the buffer's event loop (the
ablation baseline): the next batch's calls queue behind it.

No `gc.collect()` here: the store holds no reference cycles, and a full
collection in a process that has imported Ray costs ~0.1 s while holding the
GIL — it would stall the buffer's event loop whether run in a thread or not.
"""
from __future__ import annotations

import threading
import time
from typing import Any


def _release(store: dict) -> None:
    store.clear()  # drops the ObjectRefs: Ray frees the payloads once nobody holds them


class DoubleBuffer:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._stores: dict[int, dict[Any, Any]] = {}
        self._freeing: list[threading.Thread] = []
        self.releases = 0

    def store(self, batch_id: int) -> dict[Any, Any]:
        """The store of `batch_id` (created on first use)."""
        s = self._stores.get(batch_id)
        if s is None:
            s = self._stores[batch_id] = {}
        return s

    def batches(self) -> list[int]:
        return sorted(self._stores)

    def release(self, batch_id: int) -> float:
        """Detach the store of `batch_id` and free it; return seconds spent on the caller's path."""
        t0 = time.perf_counter()
        old = self._stores.pop(batch_id, None)
        self.releases += 1
        if old is not None:
            if self.enabled:
                self._freeing = [t for t in self._freeing if t.is_alive()]
                t = threading.Thread(target=_release, args=(old,), daemon=True, name="distflow-free")
                t.start()
                self._freeing.append(t)
            else:
                _release(old)
        return time.perf_counter() - t0

    def drain(self, timeout: float | None = None) -> None:
        """Wait for background frees (tests and shutdown)."""
        for t in self._freeing:
            t.join(timeout)
        self._freeing = [t for t in self._freeing if t.is_alive()]
