"""The `coordinator` data plane (siiRL's DataCoordinator, verl's TransferQueue):
one metadata-only actor per session balances and assigns; producers put their
output once, locally; consumers pull their rows straight from the producers'
objects; the local cache still serves edges whose layout does not change.

Driver half: places the coordinator, ends steps, collects the ledger, resets a
failed attempt. Worker half (`CoordinatorPort`): `publish` (one `ray.put`, one
metadata call) and `fetch` (one metadata call, then the object store).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import Balance
from distflow_lab.core.errors import CoordinatorLost, StageError
from distflow_lab.core.spans import Span, SpanRecorder
from distflow_lab.dataplane.cache import LocalCache
from distflow_lab.dataplane.coordinator_actor import Coordinator, CoordinatorRestarted
from distflow_lab.dataplane.interface import EndOfStep, Fetched, PlaneSetup, Routing, kill_and_wait, wait_alive
from distflow_lab.dataplane.routing import item_groups, item_lengths

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Stage


# ---- driver half ---------------------------------------------------------------------------


class CoordinatorPlane:
    mode = "coordinator"
    driver_moves_data = False
    bytes_to_driver = 0  # never a payload

    def __init__(self) -> None:
        self.coordinator = None
        self.wait_s = 60.0
        self.rpcs = 0

    def start(self, setup: PlaneSetup) -> "CoordinatorSpec":
        self.wait_s = min(60.0, setup.wait_timeout_s)
        here = ray.get_runtime_context().get_node_id()  # the driver's node: metadata stays near the controller
        self.coordinator = Coordinator.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
            max_restarts=3,  # a killed coordinator comes back empty; the step is retried
        ).remote(setup.switches.double_buffer, setup.wait_timeout_s)
        ray.get(self.coordinator.ping.remote(), timeout=120)
        return CoordinatorSpec(self.coordinator, setup.switches.local_cache, setup.routing,
                               setup.switches.rows_per_object)

    def begin_step(self, step: int) -> None:
        pass

    def run_on_driver(self, step: int, stage: "Stage") -> list[Span] | None:
        return None

    def stage_args(self, step: int, stage: "Stage") -> list[Any]:
        return [None] * stage.workers

    def stage_done(self, step: int, stage: "Stage", handoffs: list[Any]) -> list[Span]:
        return []

    def end_step(self, step: int) -> EndOfStep:
        t0 = time.perf_counter()
        self.rpcs += 1
        try:
            _, rows = ray.get(self.coordinator.end_step.remote(step), timeout=self.wait_s)
        except RayError:  # restarted after the step's data was delivered: let it serve the next step
            rows = []
            if wait_alive(self.coordinator, self.wait_s):
                ray.get(self.coordinator.reset_step.remote(step), timeout=self.wait_s)
        return EndOfStep(time.perf_counter() - t0, rows)

    def abort(self, step: int, reason: str) -> None:
        self.coordinator.abort.remote(step, reason)  # fire and forget

    def reset_step(self, step: int) -> list[dict]:
        if not wait_alive(self.coordinator, self.wait_s):
            raise CoordinatorLost(f"the coordinator did not come back within {self.wait_s:.0f}s after step {step} "
                                  "failed", step=step, stage="(reset)", worker=None)
        try:
            return ray.get(self.coordinator.reset_step.remote(step), timeout=self.wait_s)
        except RayError as e:
            raise CoordinatorLost(f"the coordinator failed while resetting step {step}: {type(e).__name__}",
                                  step=step, stage="(reset)", worker=None) from None

    def actors(self) -> list:
        return [self.coordinator] if self.coordinator is not None else []

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        if self.coordinator is not None:
            try:
                ray.kill(self.coordinator)
            except Exception:  # already gone
                pass
        self.coordinator = None


# ---- worker half ---------------------------------------------------------------------------


@dataclass
class CoordinatorSpec:
    coordinator: Any
    local_cache: bool
    routing: Routing
    rows_per_object: int = 0
    loads_data: bool = True

    def bind(self, rank: int, recorder: SpanRecorder) -> "CoordinatorPort":
        return CoordinatorPort(self, rank, recorder)


class CoordinatorPort:
    def __init__(self, spec: CoordinatorSpec, rank: int, rec: SpanRecorder) -> None:
        self.spec, self.rank, self.rec = spec, rank, rec
        self.coord = spec.coordinator
        self.cache = LocalCache()
        self.rpcs = 0
        self.published: list = []  # publish calls not yet checked: their errors surface at the next fetch

    @contextmanager
    def _guard(self, step: int, edge: "Edge", stage: "Stage"):
        try:
            yield
        except RayError as e:  # died, restarting, restarted without the metadata, or failed the step
            cause = getattr(e, "cause", None)
            if isinstance(e, RayTaskError) and not isinstance(cause, CoordinatorRestarted):
                raise StageError(f"stage {stage.id!r} (worker {self.rank}, step {step}): {cause or e}", step=step,
                                 stage=stage.id, worker=self.rank) from None
            raise CoordinatorLost(f"the coordinator died during step {step} on edge {edge.name} (stage {stage.id!r}, "
                                  f"worker {self.rank}): {type(e).__name__}", step=step, stage=stage.id,
                                  worker=self.rank) from None

    def begin_step(self, step: int) -> None:
        self.cache.clear()
        self.published = []

    def clear(self) -> None:
        self.cache.clear()
        self.published = []

    def kill_actor(self, index: int) -> None:
        kill_and_wait(self.coord, "the coordinator")

    def _local(self, edge: "Edge") -> bool:
        return edge.kind == "local" and self.spec.local_cache

    def fetch(self, step: int, stage: "Stage", edge: "Edge | None", producer: "Stage | None", arg: Any) -> Fetched:
        if edge is None:
            return Fetched(Batch.empty(), "loader" if stage.type == "data_load" else "none")
        if self._local(edge):
            with self.rec.span(step, stage.id, "cache_hit", cache_hit=True) as sp:
                batch = self.cache.take(edge.name)
                sp.items = len(batch)
            return Fetched(batch, "cache", True)
        me = stage.dp_rank(self.rank)
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "wait"):
            meta = ray.get(self.coord.get_meta.remote(step, edge.name, me, stage.group_rank(self.rank) == 0))
            self.rpcs += 1
            self._check_published()
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "get", cache_hit=False) as sp:
            objs = ray.get([ref for ref, _ in meta])
            batch = Batch.gather([(o, rows) for o, (_, rows) in zip(objs, meta)])
            sp.items, sp.bytes = len(batch), batch.nbytes
        return Fetched(batch, "coordinator", False)

    def publish(self, step: int, stage: "Stage", edge: "Edge | None", consumer: "Stage | None", out: Batch,
                batch_in: Batch) -> None:
        if edge is None:
            return None
        if self._local(edge):
            self.cache.put(edge.name, out)
            return None
        if stage.group_rank(self.rank) != 0:  # only tensor-parallel rank 0 writes: no duplicates
            return None
        routing = self.spec.routing if edge.kind == "redistribute" else Routing(Balance.IDENTITY)
        with self._guard(step, edge, stage), self.rec.span(step, stage.id, "put", items=len(out)) as sp:
            k = self.spec.rows_per_object or max(1, len(out))
            refs = [ray.put(out.select(slice(i, i + k))) for i in range(0, len(out), k)]  # into this node's store
            sp.bytes = out.nbytes
            # not awaited: consumers wait for every producer anyway; its outcome is checked at the next fetch
            self.published.append(self.coord.publish.remote(step, edge.name, stage.dp_rank(self.rank),
                                                            item_lengths(out), refs, k, stage.dp, consumer.dp,
                                                            routing, item_groups(out)))
            self.rpcs += len(refs) + 1  # the puts and the call
        return None

    def _check_published(self) -> None:
        """Raise the error of an earlier publish, if one failed (they have all finished once a
        consumer got its metadata: the coordinator routes only when every producer published)."""
        done, self.published = self.published, []
        if done:
            ray.get(done, timeout=60)
