"""DAG planner (paper §5.1): linearize the DAG by logical depth into one task
chain that every worker runs. Nodes at the same depth become a chain in
declaration order (paper Fig. 4: two parallel inference nodes -> a chain).

Data flows along the chain. Each edge between consecutive stages is "local"
when both stages have the same data-parallel size (the batch stays in the
worker's local cache) and "redistribute" when it changes (through the
DataBuffer, with load balancing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from distflow_lab.core.config import Contract, DataSpec, check_groups
from distflow_lab.core.errors import DAGError
from distflow_lab.graph.drawing import plan_html
from distflow_lab.graph.nodes import StageFn, depths

if TYPE_CHECKING:
    from distflow_lab.graph.dag import DAG

EdgeKind = Literal["local", "redistribute"]


@dataclass(frozen=True)
class Stage:
    index: int
    id: str
    role: str
    type: str
    depth: int
    dp: int
    tp: int
    group_size: int  # workers that share one dp rank's data (tp and replicas)
    fn_name: str
    fn: StageFn | str
    deps: tuple[str, ...]
    data: DataSpec | None = field(default=None, hash=False, compare=False)
    contract: Contract = field(default_factory=Contract, hash=False, compare=False)
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    timeout_s: float | None = None
    group: str | None = None  # the worker group it runs on (None: every worker)
    first: int = 0  # its workers are ranks first .. first + workers - 1
    workers: int = 0

    def dp_rank(self, worker: int) -> int:
        return (worker - self.first) // self.group_size

    def group_rank(self, worker: int) -> int:
        return (worker - self.first) % self.group_size

    def runs_on(self, worker: int) -> bool:
        return self.first <= worker < self.first + self.workers

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.workers)

    def worker_of(self, dp_rank: int, group_rank: int = 0) -> int:
        return self.first + dp_rank * self.group_size + group_rank


@dataclass(frozen=True)
class Edge:
    src: int  # stage index
    dst: int
    kind: EdgeKind
    name: str  # "src->dst"


@dataclass(frozen=True)
class Plan:
    dag_name: str
    world_size: int
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    logical_edges: tuple[tuple[str, str], ...]
    groups: tuple[tuple[str, int, int], ...] = ()  # (name, first rank, workers) of each worker group

    def stages_on(self, worker: int) -> list[Stage]:
        return [s for s in self.stages if s.runs_on(worker)]

    def stage(self, id_or_index: str | int) -> Stage:
        if isinstance(id_or_index, int):
            return self.stages[id_or_index]
        for s in self.stages:
            if s.id == id_or_index:
                return s
        raise KeyError(f"plan has no stage {id_or_index!r}; stages: {[s.id for s in self.stages]}")

    def edge_into(self, index: int) -> Edge | None:
        return self.edges[index - 1] if index > 0 else None

    def edge_out_of(self, index: int) -> Edge | None:
        return self.edges[index] if index < len(self.edges) else None

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for s in self.stages:
            e = self.edge_into(s.index)
            rows.append({
                "stage": s.index, "id": s.id, "role": s.role, "type": s.type, "depth": s.depth,
                "dp": s.dp, "tp": s.tp, "group_size": s.group_size, "fn": s.fn_name,
                "edge_in": e.kind if e else "-", **({"group": s.group, "ranks": f"{s.first}-{s.first + s.workers - 1}"}
                                                    if self.groups else {}),
            })
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        lines = [f"Plan {self.dag_name!r} on {self.world_size} workers:"]
        for s in self.stages:
            e = self.edge_into(s.index)
            arrow = f"  --{e.kind}-->" if e else "  "
            where = f", group {s.group} ranks {s.first}-{s.first + s.workers - 1}" if s.group else ""
            lines.append(f"{arrow} [{s.index}] {s.id} ({s.role}/{s.type}, dp={s.dp} tp={s.tp}{where})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return plan_html(self)


def logical_depths(dag: "DAG") -> dict[str, int]:
    return depths({n.id: list(n.deps) for n in dag})


def plan(dag: "DAG", world_size: int, resolve: bool = True) -> Plan:
    """Validate the DAG for `world_size` workers and linearize it."""
    if world_size < 1:
        raise DAGError(f"world_size must be >= 1, got {world_size}")
    dag.validate(world_size, resolve=resolve)
    depth = logical_depths(dag)
    order = {n.id: i for i, n in enumerate(dag)}
    chain = sorted(dag, key=lambda n: (depth[n.id], order[n.id]))
    entries = [n for n in chain if not n.deps]
    if chain[0].type != "data_load" and any(n.type == "data_load" for n in chain):
        raise DAGError(f"node {chain[0].id!r} comes before the data_load node; the data node must be the entry")
    if len([n for n in chain if n.type == "data_load"]) > 1:
        raise DAGError("only one data_load node is supported, found "
                       f"{[n.id for n in chain if n.type == 'data_load']}")
    if len(entries) > 1 and chain[0].type == "data_load":
        extra = [n.id for n in entries[1:]]
        raise DAGError(f"node(s) {extra} have no dependencies but the DAG starts at data node {chain[0].id!r}")
    spans = group_spans(dag.groups, world_size)
    stages = []
    for i, n in enumerate(chain):
        first, workers = spans[n.layout.group] if n.layout.group else (0, world_size)
        dp, group = n.layout.resolve(workers)
        stages.append(Stage(i, n.id, n.role, n.type, depth[n.id], dp, n.layout.tp, group,
                            n.fn_name(), n.fn, tuple(n.deps), n.data, n.contract, dict(n.params), n.timeout_s,
                            n.layout.group, first, workers))
    edges = tuple(
        Edge(a.index, b.index, "local" if (a.dp, a.first, a.workers) == (b.dp, b.first, b.workers)
             else "redistribute", f"{a.id}->{b.id}")
        for a, b in zip(stages, stages[1:])
    )
    logical = tuple((d, n.id) for n in dag for d in n.deps)
    return Plan(dag.name, world_size, tuple(stages), edges, logical,
                tuple((g, first, size) for g, (first, size) in spans.items()))


def group_spans(groups: dict[str, int] | None, world_size: int) -> dict[str, tuple[int, int]]:
    """(first rank, workers) of each named group, in declaration order; they must fill the workers."""
    if not groups:
        return {}
    check_groups(groups, world_size=world_size, error=DAGError)
    out, first = {}, 0
    for name, size in groups.items():
        out[name], first = (first, size), first + size
    return out
