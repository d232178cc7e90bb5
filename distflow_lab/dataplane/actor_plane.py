"""The halves the two planes whose data moves through actors (`coordinator`: one
metadata actor; `distributed`: a DataBuffer per node) share; each plane adds only
what its actors do.

Driver half (`ActorPlane`): nothing runs on the driver and stage calls take no
argument; a batch ends, aborts and resets on every actor of the plane, and an actor
that does not come back after a failure is a named `PlaneLost`.

Worker half (`ActorPort`): an edge whose layout does not change stays in the
worker's local cache (when the switch is on); otherwise only tensor-parallel rank 0
of a producer group writes, a consumer asks the plane's actor where its rows are
and reads them straight from the producers' objects, and every Ray error on the way
is a named one (the stage's error, or the actor lost).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError, RayTaskError

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import Balance
from distflow_lab.core.errors import PlaneLost, StageError
from distflow_lab.core.spans import Span, SpanRecorder
from distflow_lab.dataplane.cache import LocalCache
from distflow_lab.dataplane.interface import EndOfBatch, Fetched, Routing, wait_alive

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Stage


# ---- driver half ---------------------------------------------------------------------------


class ActorPlane:
    """A subclass places its actors in `start` and lists them in `actors()`; `lost` is the
    error for an actor that does not come back, `actor_name(i)` names actor i in it."""

    driver_moves_data = False
    bytes_to_driver = 0  # never a payload
    lost: type[PlaneLost] = PlaneLost

    def __init__(self) -> None:
        self.rpcs = 0
        self.wait_s = 60.0
        self._starting: list = []  # the actors' first answers, awaited at the first batch (see _started)

    def actors(self) -> list:
        raise NotImplementedError

    def actor_name(self, index: int) -> str:
        raise NotImplementedError

    def _started(self, pings: list) -> None:
        """Actors just created: their processes start while the workers set up (the two overlap);
        `ready` waits for them."""
        self._starting = pings

    def ready(self) -> None:
        """After the workers' setup: every actor answers, or a named error."""
        pings, self._starting = self._starting, []
        try:
            ray.get(pings, timeout=120)
        except Exception as e:
            raise self.lost(f"{self.actor_name(0)} did not start within 120 s ({type(e).__name__}): "
                            f"the data plane's actors could not be placed") from None

    def begin_batch(self, batch_id: int) -> None:
        pass

    def run_on_driver(self, batch_id: int, stage: "Stage") -> list[Span] | None:
        return None

    def stage_args(self, batch_id: int, stage: "Stage") -> list[Any]:
        return [None] * stage.workers

    def stage_done(self, batch_id: int, stage: "Stage", handoffs: list[Any]) -> list[Span]:
        return []

    def end_batch(self, batch_id: int) -> EndOfBatch:
        t0, rows, actors = time.perf_counter(), [], self.actors()
        self.rpcs += len(actors)
        for a, ref in [(a, a.end_batch.remote(batch_id)) for a in actors]:
            try:
                rows.extend(ray.get(ref, timeout=self.wait_s)[1])
            except RayError:  # restarted after this batch's data was delivered: let it serve the next batch
                if wait_alive(a, self.wait_s):
                    ray.get(a.reset_batch.remote(batch_id), timeout=self.wait_s)
        return EndOfBatch(time.perf_counter() - t0, rows)

    def abort(self, batch_id: int, reason: str) -> None:
        for a in self.actors():
            a.abort.remote(batch_id, reason)  # fire and forget: a dead actor has no waiters to free

    def reset_batch(self, batch_id: int) -> list[dict]:
        """Forget the failed attempt in every actor (after the workers left it). Waits, bounded,
        for a restarting actor; raises `lost` if one does not come back."""
        rows: list[dict] = []
        for i, a in enumerate(self.actors()):
            if not wait_alive(a, self.wait_s):
                raise self.lost(f"{self.actor_name(i)} did not come back within {self.wait_s:.0f}s after batch {batch_id} "
                                "failed", batch_id=batch_id, stage="(reset)", worker=None)
            try:
                rows.extend(ray.get(a.reset_batch.remote(batch_id), timeout=self.wait_s))
            except RayError as e:
                raise self.lost(f"{self.actor_name(i)} failed while resetting batch {batch_id}: {type(e).__name__}",
                                batch_id=batch_id, stage="(reset)", worker=None) from None
        return rows

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass

    def _kill_actors(self) -> None:
        for a in self.actors():
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass


# ---- worker half ---------------------------------------------------------------------------


class ActorPort:
    """A subclass sets `route` (how a fetched input arrived), `who` (the actor, in errors),
    `restarted` (the actor's error when it lost the batch in a restart) and `lost`, and moves
    the data: `_locate` (ask the actor for this consumer's (object ref, rows) list) and
    `_publish_remote`. `spec` has `local_cache` and `routing`."""

    route = ""
    who = ""
    restarted: type[Exception] = Exception
    lost: type[PlaneLost] = PlaneLost

    def __init__(self, spec: Any, rank: int, rec: SpanRecorder) -> None:
        self.spec, self.rank, self.rec = spec, rank, rec
        self.cache = LocalCache()
        self.rpcs = 0
        # the actor fails a wait of its own after wait_timeout_s; past this, it neither answered nor died
        self.call_timeout_s = getattr(spec, "wait_timeout_s", 120.0) + 60.0

    @contextmanager
    def _guard(self, batch_id: int, edge: "Edge", stage: "Stage"):
        try:
            yield
        except RayError as e:  # died, restarting, restarted without the batch's state, or failed the batch
            cause = getattr(e, "cause", None)
            if isinstance(e, RayTaskError) and not isinstance(cause, self.restarted):
                raise StageError(f"stage {stage.id!r} (worker {self.rank}, batch {batch_id}): {cause or e}", batch_id=batch_id,
                                 stage=stage.id, worker=self.rank) from None
            raise self.lost(f"{self.who} died during batch {batch_id} on edge {edge.name} (stage {stage.id!r}, "
                            f"worker {self.rank}): {type(e).__name__}", batch_id=batch_id, stage=stage.id,
                            worker=self.rank) from None

    def begin_batch(self, batch_id: int) -> None:
        self.clear()

    def clear(self) -> None:
        self.cache.clear()

    def _local(self, edge: "Edge") -> bool:
        return edge.kind == "local" and self.spec.local_cache

    def fetch(self, batch_id: int, stage: "Stage", edge: "Edge | None", producer: "Stage | None", arg: Any) -> Fetched:
        if edge is None:
            return Fetched(Batch.empty(), "loader" if stage.type == "data_load" else "none")
        if self._local(edge):
            with self.rec.span(batch_id, stage.id, "cache_hit", cache_hit=True) as sp:
                batch = self.cache.take(edge.name)
                sp.items = len(batch)
            return Fetched(batch, "cache", True)
        with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "wait"):
            pieces = self._locate(batch_id, stage, edge, producer)
        with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "get", cache_hit=False) as sp:
            objs = ray.get([ref for ref, _ in pieces], timeout=self.call_timeout_s)
            batch = Batch.gather([(o, rows) for o, (_, rows) in zip(objs, pieces)])  # one copy per column
            sp.items, sp.bytes = len(batch), batch.nbytes
        return Fetched(batch, self.route, False)

    def publish(self, batch_id: int, stage: "Stage", edge: "Edge | None", consumer: "Stage | None", out: Batch,
                batch_in: Batch) -> None:
        if edge is None:
            return None
        if self._local(edge):
            self.cache.put(edge.name, out)
            return None
        if stage.group_rank(self.rank) != 0:  # only tensor-parallel rank 0 writes: no duplicates
            return None
        routing = self.spec.routing if edge.kind == "redistribute" else Routing(Balance.IDENTITY)
        self._publish_remote(batch_id, stage, edge, consumer, out, routing)
        return None

    def _locate(self, batch_id: int, stage: "Stage", edge: "Edge", producer: "Stage") -> list[tuple[Any, Any]]:
        raise NotImplementedError

    def _publish_remote(self, batch_id: int, stage: "Stage", edge: "Edge", consumer: "Stage", out: Batch,
                        routing: Routing) -> None:
        raise NotImplementedError
