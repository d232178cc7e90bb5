"""Local cache (paper §6.3): when two consecutive stages have the same
data-parallel layout, the batch stays in the worker's memory — no object
store, no buffer, no copy."""
from __future__ import annotations

from distflow_lab.core.batch import Batch


class LocalCache:
    def __init__(self) -> None:
        self._held: dict[str, Batch] = {}
        self.hits = 0

    def put(self, edge: str, batch: Batch) -> None:
        self._held[edge] = batch

    def take(self, edge: str) -> Batch:
        if edge not in self._held:
            raise KeyError(f"local cache holds nothing for edge {edge!r} (held: {list(self._held)}); "
                           "was the producing stage run on this worker?")
        self.hits += 1
        return self._held.pop(edge)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
