"""The per-step state of a data-plane actor (the coordinator plane's `Coordinator`,
the distributed plane's `DataBuffer`; each holds one `StepState`):

- an entry per (step, edge), in the step's own store of a double buffer;
- the item counts of every (step, edge), handed to the driver as ledger rows when
  the step ends (the driver keeps them: they survive this actor);
- the steps aborted (a worker died or a stage raised: every waiter fails at once);
- whether this process is a restart: Ray restarts a killed actor empty, so the steps
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
    """Items through one (step, edge) of one actor: what went in, what came out."""

    step: int
    edge: str
    items_reported: int = 0
    items_in: int = 0
    items_out: int = 0
    pieces_in: int = 0
    pieces_out: int = 0

    def row(self) -> dict:
        return ledger_row(self.step, self.edge, items_reported=self.items_reported, items_in=self.items_in,
                          items_out=self.items_out, pieces_in=self.pieces_in, pieces_out=self.pieces_out)


class StepState:
    """`who` names the actor and `what` the state it keeps in errors ("buffer 0" ... "data");
    `error` is raised for an aborted step, `restarted` (a subclass of it) after a restart."""

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

    def entry(self, step: int, edge: str) -> Any:
        """The entry of (step, edge), created on first use; refused after a restart or an abort."""
        if step < self.accept_from:
            raise self.restarted(f"{self.who} was restarted: the {self.what} of step {step} edge {edge} is lost")
        if step in self.aborted:
            raise self.error(f"step {step} was aborted: {self.aborted[step]}")
        store = self.store.store(step)
        e = store.get(edge)
        if e is None:
            e = store[edge] = self.new_entry()
        return e

    def count(self, step: int, edge: str) -> EdgeCount:
        c = self.counts.get((step, edge))
        if c is None:
            c = self.counts[(step, edge)] = EdgeCount(step, edge)
        return c

    def _pop_counts(self, closed: Callable[[int], bool], suffix: str = "") -> list[dict]:
        """Move the counts of the `closed` steps to the finished ones (their edge name
        + `suffix`); returns them as ledger rows."""
        rows = []
        for key in [k for k in self.counts if closed(k[0])]:
            c = self.counts.pop(key)
            c.edge += suffix
            self.done.append(c)
            rows.append(c.row())
        return rows

    def end(self, step: int) -> tuple[float, list[dict]]:
        """Release the step's store (background with the double buffer): the critical-path
        seconds and the ledger rows of this step and any earlier one still open."""
        counts = self._pop_counts(lambda s: s <= step)
        return self.store.release(step), counts

    def reset(self, step: int) -> list[dict]:
        """Forget an aborted attempt of `step` so it can run again (its partial counts stay
        in the ledger, marked as an aborted attempt)."""
        aborted = self._pop_counts(lambda s: s == step, " (aborted attempt)")
        self.aborted.pop(step, None)
        self.accept_from = min(self.accept_from, step)
        self.store.release(step)
        return aborted

    def abort(self, step: int, reason: str) -> list[Any]:
        """Mark `step` aborted; returns its entries, whose waiters the actor must wake."""
        self.aborted[step] = reason
        return list(self.store.store(step).values())

    def ledger(self) -> list[dict]:
        return [c.row() for c in (*self.done, *self.counts.values())]
