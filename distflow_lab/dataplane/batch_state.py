"""The per-batch state of a data-plane actor (the coordinator plane's `Coordinator`,
the distributed plane's `DataBuffer`; each holds one `BatchState`):

- an entry per (batch, edge), in the batch's own store of a double buffer;
- the item counts of every (batch, edge), handed to the driver as ledger rows when
  the batch ends (the driver keeps them: they survive this actor);
- the batches aborted (a worker died or a stage raised: every waiter fails at once);
- whether this process is a restart: Ray restarts a killed actor empty, so the batches
  in flight lost their state here and are refused until the driver resets them,
  instead of waiting for producers that never come.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from distflow_lab.dataplane.double_buffer import DoubleBuffer
from distflow_lab.dataplane.ledger import ledger_row


@dataclass
class EdgeCount:
    """Items through one (batch, edge) of one actor: what went in, what came out."""

    batch_id: int
    edge: str
    items_reported: int = 0
    items_in: int = 0
    items_out: int = 0
    pieces_in: int = 0
    pieces_out: int = 0

    def row(self) -> dict:
        return ledger_row(self.batch_id, self.edge, items_reported=self.items_reported, items_in=self.items_in,
                          items_out=self.items_out, pieces_in=self.pieces_in, pieces_out=self.pieces_out)


class BatchState:
    """`who` names the actor and `what` the state it keeps in errors ("buffer 0" ... "data");
    `error` is raised for an aborted batch, `restarted` (a subclass of it) after a restart."""

    def __init__(self, double_buffer: bool, new_entry: Callable[[], Any], who: str, what: str,
                 error: type[Exception], restarted: type[Exception]) -> None:
        self.store = DoubleBuffer(double_buffer)
        self.new_entry, self.who, self.what = new_entry, who, what
        self.error, self.restarted = error, restarted
        self.counts: dict[tuple[int, str], EdgeCount] = {}
        self.done: deque[EdgeCount] = deque(maxlen=10_000)
        self.aborted: dict[int, str] = {}
        with warnings.catch_warnings():  # Ray 2.60 warns about an attribute it uses inside this property
            warnings.simplefilter("ignore")
            restart = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.accept_from = float("inf") if restart else float("-inf")

    def entry(self, batch_id: int, edge: str) -> Any:
        """The entry of (batch, edge), created on first use; refused after a restart or an abort."""
        if batch_id < self.accept_from:
            raise self.restarted(f"{self.who} was restarted: the {self.what} of batch {batch_id} edge {edge} is lost")
        if batch_id in self.aborted:
            raise self.error(f"batch {batch_id} was aborted: {self.aborted[batch_id]}")
        store = self.store.store(batch_id)
        e = store.get(edge)
        if e is None:
            e = store[edge] = self.new_entry()
        return e

    def count(self, batch_id: int, edge: str) -> EdgeCount:
        c = self.counts.get((batch_id, edge))
        if c is None:
            c = self.counts[(batch_id, edge)] = EdgeCount(batch_id, edge)
        return c

    def _pop_counts(self, closed: Callable[[int], bool], suffix: str = "") -> list[dict]:
        """Move the counts of the `closed` batches to the finished ones (their edge name
        + `suffix`); returns them as ledger rows."""
        rows = []
        for key in [k for k in self.counts if closed(k[0])]:
            c = self.counts.pop(key)
            c.edge += suffix
            self.done.append(c)
            rows.append(c.row())
        return rows

    def end(self, batch_id: int) -> tuple[float, list[dict]]:
        """Release the batch's store (background with the double buffer): the critical-path
        seconds and the ledger rows of this batch and any earlier one still open."""
        counts = self._pop_counts(lambda s: s <= batch_id)
        return self.store.release(batch_id), counts

    def reset(self, batch_id: int) -> list[dict]:
        """Forget an aborted attempt of `batch_id` so it can run again (its partial counts stay
        in the ledger, marked as an aborted attempt)."""
        aborted = self._pop_counts(lambda s: s == batch_id, " (aborted attempt)")
        self.aborted.pop(batch_id, None)
        self.accept_from = min(self.accept_from, batch_id)
        self.store.release(batch_id)
        return aborted

    def abort(self, batch_id: int, reason: str) -> list[Any]:
        """Mark `batch_id` aborted; returns its entries, whose waiters the actor must wake."""
        self.aborted[batch_id] = reason
        return list(self.store.store(batch_id).values())

    def ledger(self) -> list[dict]:
        return [c.row() for c in (*self.done, *self.counts.values())]
