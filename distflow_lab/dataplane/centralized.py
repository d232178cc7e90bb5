"""The `centralized` data plane (verl-style single controller) — the baseline.

The same stage functions run on the same workers, but the driver loads the
data and, at every stage, splits the global batch, dispatches the chunks,
collects the outputs and concatenates them, as verl's trainer does. It is the
best honest version of that pattern: the same zero-copy serialization as the
other modes, chunks put into the object store in parallel threads (as verl's
newer dispatch does), and workers return only the columns a stage changed
(verl's `union` of new keys), not the whole batch.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from distflow_lab.core.batch import Batch
from distflow_lab.core.spans import DRIVER, Span, SpanRecorder
from distflow_lab.dataplane.interface import EndOfBatch, Fetched, PlaneSetup, ledger_row
from distflow_lab.dataplane.routing import assign, item_groups, item_lengths
from distflow_lab.datasets.loader import ShardedLoader, make_loader
from distflow_lab.graph.nodes import call_stage, resolve_function

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Stage


class CentralizedPlane:
    mode = "centralized"
    driver_moves_data = True

    def __init__(self) -> None:
        self.batch = Batch.empty()  # the global batch lives on the driver between stages
        self.rank_sizes: list[int] = []
        self.loaders: list[ShardedLoader] = []
        self._loaders_at_batch_start: list[dict] = []
        self._counts: dict[str, dict] = {}  # edge -> items in/out this batch (the ledger)
        self.pool: ThreadPoolExecutor | None = None
        self.bytes_to_driver = 0
        self.rpcs = 0

    def start(self, setup: PlaneSetup) -> "DriverSpec":
        self.plan, self.routing, self.context = setup.plan, setup.routing, setup.driver_context
        self.rec = SpanRecorder(DRIVER, ray.get_runtime_context().get_node_id()[:8], self.mode)
        self.pool = ThreadPoolExecutor(max_workers=min(16, setup.plan.world_size), thread_name_prefix="dispatch")
        first = setup.plan.stages[0]
        self.loaders = ([make_loader(first.data, r, first.dp, setup.seed) for r in range(first.dp)]
                        if first.type == "data_load" and first.data is not None else [])
        return DriverSpec()

    def ready(self) -> None:
        """Nothing started in the background: the driver is the plane."""

    def begin_batch(self, batch_id: int) -> None:
        self._loaders_at_batch_start = [ld.state_dict() for ld in self.loaders]
        self._counts = {}

    def run_on_driver(self, batch_id: int, stage: "Stage") -> list[Span] | None:
        if stage.index != 0 or stage.type != "data_load":
            return None
        fn = resolve_function(stage.fn, node=stage.id)
        with self.rec.span(batch_id, stage.id, "load") as sp:
            parts = [call_stage(fn, Batch.empty(), self.context(batch_id, stage, r, ld)) for r, ld in enumerate(self.loaders)]
            self.batch = Batch.concat(parts)
            self.rank_sizes = [len(p) for p in parts]
            sp.items, sp.bytes = len(self.batch), self.batch.nbytes
        return self.rec.take()

    def stage_args(self, batch_id: int, stage: "Stage") -> list[Any]:
        if stage.index == 0:
            return [[] for _ in stage.ranks]
        edge = self.plan.edge_into(stage.index)
        with self.rec.span(batch_id, stage.id, "split") as sp:
            if edge.kind == "redistribute":
                parts = assign(item_lengths(self.batch), stage.dp, self.routing.policy, groups=item_groups(self.batch),
                               **self.routing.kwargs())
                self.batch = self.batch.select(np.concatenate(parts))  # global order = rank order from here
                self.rank_sizes = [len(p) for p in parts]
            chunks = self.batch.split(self.rank_sizes)
            sp.items, sp.bytes = len(self.batch), self.batch.nbytes
        with self.rec.span(batch_id, stage.id, "dispatch") as sp:
            refs = list(self.pool.map(ray.put, chunks))
            sp.bytes = sum(c.nbytes for c in chunks)
            self.rpcs += len(chunks)
        self._counts[edge.name] = ledger_row(batch_id, edge.name, items_reported=len(self.batch),
                                             items_in=sum(len(c) for c in chunks), pieces_in=len(chunks))
        return [[refs[stage.dp_rank(w)]] for w in stage.ranks]

    def stage_done(self, batch_id: int, stage: "Stage", handoffs: list[Any]) -> list[Span]:
        writers = [h for w, h in zip(stage.ranks, handoffs) if stage.group_rank(w) == 0]  # dp-rank order
        edge = self.plan.edge_into(stage.index)
        if edge is not None and edge.name in self._counts:
            c = self._counts[edge.name]
            c["items_out"] += sum(h.rows_in for h in writers)
            c["pieces_out"] += len(writers)
        with self.rec.span(batch_id, stage.id, "collect") as sp:
            outs = ray.get([h.refs[0] for h in writers], timeout=600)
            self.rpcs += 1
            sp.bytes = sum(o.nbytes for o in outs)
            self.bytes_to_driver += sp.bytes
        with self.rec.span(batch_id, stage.id, "concat") as sp:
            merged = Batch.concat(outs)
            if all(h.delta for h in writers):
                self.batch = self.batch.update(merged)  # only changed columns came back
            else:
                self.batch = merged
                self.rank_sizes = [len(o) for o in outs]
            sp.items, sp.bytes = len(self.batch), merged.nbytes
        return self.rec.take()

    def end_batch(self, batch_id: int) -> EndOfBatch:
        rows, self._counts = list(self._counts.values()), {}
        self.batch = Batch.empty()
        return EndOfBatch(0.0, rows)

    def abort(self, batch_id: int, reason: str) -> None:
        pass

    def reset_batch(self, batch_id: int) -> list[dict]:
        for ld, state in zip(self.loaders, self._loaders_at_batch_start):
            ld.load_state_dict(state)
        rows = [{**c, "edge": c["edge"] + " (aborted attempt)"} for c in self._counts.values()]
        self._counts, self.batch = {}, Batch.empty()
        self.rec.take()
        return rows

    def actors(self) -> list:
        return []

    def save(self, directory: Path) -> None:
        for r, loader in enumerate(self.loaders):  # the same files the workers write in the other modes
            (directory / f"loader_dp{r}.json").write_text(json.dumps(loader.state_dict()))

    def load(self, directory: Path) -> None:
        for r, loader in enumerate(self.loaders):
            f = directory / f"loader_dp{r}.json"
            if not f.exists():
                raise FileNotFoundError(f"checkpoint {directory} has no loader state for data-parallel rank {r} "
                                        f"({f.name})")
            loader.load_state_dict(json.loads(f.read_text()))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.pool, self.batch = None, Batch.empty()


# ---- worker half ---------------------------------------------------------------------------


@dataclass
class Handoff:
    """A worker's answer to the driver: its output (as an object ref) and how to merge it."""

    refs: list  # [ref] on tensor-parallel rank 0, [] elsewhere
    delta: bool  # only the changed columns came back (rows unchanged)
    rows_in: int


@dataclass
class DriverSpec:
    loads_data: bool = False

    def bind(self, rank: int, recorder: SpanRecorder) -> "DriverPort":
        return DriverPort(rank, recorder)


class DriverPort:
    """Input from the chunk the driver dispatched; output back to the driver."""

    def __init__(self, rank: int, rec: SpanRecorder) -> None:
        self.rank, self.rec = rank, rec
        self.rpcs = 0

    def begin_batch(self, batch_id: int) -> None:
        pass

    def clear(self) -> None:
        pass

    def kill_actor(self, index: int) -> None:
        raise ValueError("the centralized data plane has no actors to kill")

    def fetch(self, batch_id: int, stage: "Stage", edge: "Edge | None", producer: "Stage | None", arg: Any) -> Fetched:
        if not arg:
            return Fetched(Batch.empty(), "none")
        with self.rec.span(batch_id, stage.id, "dispatch") as sp:
            batch = ray.get(arg[0], timeout=600)
            sp.items, sp.bytes = len(batch), batch.nbytes
            self.rpcs += 1
        return Fetched(batch, "driver")

    def publish(self, batch_id: int, stage: "Stage", edge: "Edge | None", consumer: "Stage | None", out: Batch,
                batch_in: Batch) -> Handoff:
        changed = out.changed_columns(batch_in)
        delta = len(out) == len(batch_in) and len(batch_in) > 0 and len(changed) < len(out.columns)
        refs: list = []
        if stage.group_rank(self.rank) == 0:
            with self.rec.span(batch_id, stage.id, "collect") as sp:
                payload = out.pick(changed) if delta else out
                sp.items, sp.bytes = len(payload), payload.nbytes
                refs = [ray.put(payload)]
                self.rpcs += 1
        return Handoff(refs, delta, len(batch_in))

