"""The `coordinator` data plane (siiRL's DataCoordinator, verl's TransferQueue):
one metadata-only actor per session balances and assigns; producers put their
output once, locally; consumers pull their rows straight from the producers'
objects; the local cache still serves edges whose layout does not change.

Driver half: places the coordinator, ends batches, collects the ledger, resets a
failed attempt. Worker half (`CoordinatorPort`): `publish` (one `ray.put`, one
metadata call) and `fetch` (one metadata call, then the object store).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distflow_lab.core.batch import Batch
from distflow_lab.core.errors import CoordinatorLost
from distflow_lab.core.spans import SpanRecorder
from distflow_lab.dataplane.actor_plane import ActorPlane, ActorPort
from distflow_lab.dataplane.coordinator_actor import Coordinator, CoordinatorRestarted
from distflow_lab.dataplane.interface import PlaneSetup, Routing, kill_and_wait
from distflow_lab.dataplane.routing import item_groups, item_lengths

if TYPE_CHECKING:
    from distflow_lab.graph.planner import Edge, Stage


# ---- driver half (the batch hooks: actor_plane.ActorPlane) ------------------------------------


class CoordinatorPlane(ActorPlane):
    mode = "coordinator"
    lost = CoordinatorLost

    def __init__(self) -> None:
        super().__init__()
        self.coordinator = None

    def start(self, setup: PlaneSetup) -> "CoordinatorSpec":
        self.wait_s = min(60.0, setup.wait_timeout_s)
        here = ray.get_runtime_context().get_node_id()  # the driver's node: metadata stays near the controller
        self.coordinator = Coordinator.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
            max_restarts=3,  # a killed coordinator comes back empty; the batch is retried
        ).remote(setup.switches.double_buffer, setup.wait_timeout_s)
        self._started([self.coordinator.ping.remote()])
        return CoordinatorSpec(self.coordinator, setup.switches.local_cache, setup.routing,
                               setup.switches.rows_per_object, wait_timeout_s=setup.wait_timeout_s)

    def actors(self) -> list:
        return [self.coordinator] if self.coordinator is not None else []

    def actor_name(self, index: int) -> str:
        return "the coordinator"

    def close(self) -> None:
        self._kill_actors()
        self.coordinator = None


# ---- worker half (the local cache, the guard: actor_plane.ActorPort) -------------------------


@dataclass
class CoordinatorSpec:
    coordinator: Any
    local_cache: bool
    routing: Routing
    rows_per_object: int = 0
    loads_data: bool = True
    wait_timeout_s: float = 120.0  # the actor's own wait; a call to it is bounded a little above

    def bind(self, rank: int, recorder: SpanRecorder) -> "CoordinatorPort":
        return CoordinatorPort(self, rank, recorder)


class CoordinatorPort(ActorPort):
    route, who = "coordinator", "the coordinator"
    restarted, lost = CoordinatorRestarted, CoordinatorLost

    def __init__(self, spec: CoordinatorSpec, rank: int, rec: SpanRecorder) -> None:
        super().__init__(spec, rank, rec)
        self.coord = spec.coordinator
        self.published: list = []  # publish calls not yet checked: their errors surface at the next fetch

    def clear(self) -> None:
        super().clear()
        self.published = []

    def kill_actor(self, index: int) -> None:
        kill_and_wait(self.coord, "the coordinator")

    def _locate(self, batch_id: int, stage: "Stage", edge: "Edge", producer: "Stage") -> list[tuple[Any, Any]]:
        meta = ray.get(self.coord.get_meta.remote(batch_id, edge.name, stage.dp_rank(self.rank),
                                                  stage.group_rank(self.rank) == 0), timeout=self.call_timeout_s)
        self.rpcs += 1
        self._check_published()
        return meta

    def _publish_remote(self, batch_id: int, stage: "Stage", edge: "Edge", consumer: "Stage", out: Batch,
                        routing: Routing) -> None:
        with self._guard(batch_id, edge, stage), self.rec.span(batch_id, stage.id, "put", items=len(out)) as sp:
            k = self.spec.rows_per_object or max(1, len(out))
            refs = [ray.put(out.select(slice(i, i + k))) for i in range(0, len(out), k)]  # into this node's store
            sp.bytes = out.nbytes
            # not awaited: consumers wait for every producer anyway; its outcome is checked at the next fetch
            self.published.append(self.coord.publish.remote(batch_id, edge.name, stage.dp_rank(self.rank),
                                                            item_lengths(out), refs, k, stage.dp, consumer.dp,
                                                            routing, item_groups(out)))
            self.rpcs += len(refs) + 1  # the puts and the call

    def _check_published(self) -> None:
        """Raise the error of an earlier publish, if one failed (they have all finished once a
        consumer got its metadata: the coordinator routes only when every producer published)."""
        done, self.published = self.published, []
        if done:
            ray.get(done, timeout=60)
