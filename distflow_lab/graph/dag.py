"""The DAG of an RL algorithm: nodes (stages) with roles, types, dependencies,
a stage function and a parallel layout. Build it in Python cell by cell
(`DAG("grpo").node(...)`) or load it from YAML; both round-trip.

Validation happens before anything starts and every error names the node.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

from distflow_lab.core.config import check_groups
from distflow_lab.core.errors import DAGError
from distflow_lab.graph.drawing import dag_html
from distflow_lab.graph.nodes import Layout, Node, StageFn, importable, make_node
from distflow_lab.graph.planner import Plan, plan

__all__ = ["DAG", "DAGError", "Layout", "Node"]


class DAG:
    """An ordered set of nodes. Builder methods return the DAG, so cells chain:

        dag = DAG("grpo").node("data", fn=..., type="data_load", role="data")
        dag.node("rollout", fn=my_rollout, deps=["data"], layout=Layout(tp=2))
    """

    def __init__(self, name: str, nodes: list[Node] | None = None, groups: dict[str, int] | None = None) -> None:
        self.name = name
        self._nodes: dict[str, Node] = {}
        self.groups: dict[str, int] | None = None
        if groups:
            self.with_groups(**groups)
        for n in nodes or []:
            self.add(n)

    def with_groups(self, **sizes: int) -> "DAG":
        """Put stages on named worker groups (e.g. `rollout=2, train=2`): every node's layout then
        names its group, ranks are given to the groups in this order, and world_size is their sum.
        Without groups every stage runs on every worker (colocated)."""
        check_groups(sizes, where=f"DAG {self.name!r}", error=DAGError)
        self.groups = dict(sizes) or None
        return self

    # ---- building and editing ---------------------------------------------
    def node(self, id: str, fn: str | StageFn, **fields: Any) -> "DAG":
        return self.add(make_node(id=id, fn=fn, **fields))

    def add(self, node: Node) -> "DAG":
        if node.id in self._nodes:
            raise DAGError(f"duplicate node id {node.id!r} in DAG {self.name!r}")
        self._nodes[node.id] = node
        return self

    def replace(self, id: str, **changes: Any) -> "DAG":
        """Change fields of a node (e.g. swap its function for a notebook-defined one)."""
        old = self[id]
        self._nodes[id] = make_node(**{**old.model_dump(exclude={"fn"}), "fn": old.fn, **changes})
        return self

    def remove(self, id: str) -> "DAG":
        self[id]
        del self._nodes[id]
        return self

    def bypass(self, id: str) -> "DAG":
        """Remove a node; whatever depended on it depends on its dependencies instead (a pass an
        option makes unnecessary, e.g. the reference's without a KL term)."""
        before = self[id].deps
        self.remove(id)
        for n in list(self):
            if id in n.deps:
                deps = [d for d in n.deps if d != id]
                self.replace(n.id, deps=deps + [d for d in before if d not in deps])
        return self

    def copy(self, name: str | None = None) -> "DAG":
        return DAG(name or self.name, [n.model_copy(deep=True) for n in self._nodes.values()], self.groups)

    # ---- access -------------------------------------------------------------
    def __getitem__(self, id: str) -> Node:
        if id not in self._nodes:
            raise DAGError(f"DAG {self.name!r} has no node {id!r}; nodes: {list(self._nodes)}")
        return self._nodes[id]

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def ids(self) -> list[str]:
        return list(self._nodes)

    # ---- validation ---------------------------------------------------------
    def validate(self, world_size: int | None = None, resolve: bool = True) -> "DAG":
        """Raise DAGError naming the node at fault; return self when all is well."""
        if not self._nodes:
            raise DAGError(f"DAG {self.name!r} has no nodes")
        for n in self:
            for d in n.deps:
                if d not in self._nodes:
                    raise DAGError(f"node {n.id!r} depends on missing node {d!r}; nodes: {self.ids}")
                if d == n.id:
                    raise DAGError(f"node {n.id!r} depends on itself: cycle {n.id} -> {n.id}")
        cycle = self._find_cycle()
        if cycle:
            raise DAGError(f"DAG {self.name!r} has a cycle: {' -> '.join(cycle)}")
        if not [n for n in self if not n.deps]:
            raise DAGError(f"DAG {self.name!r} has no entry node (every node has dependencies)")
        for n in self:
            if self.groups and n.layout.group not in self.groups:
                raise DAGError(f"node {n.id!r}: its layout names group {n.layout.group!r}; this DAG's groups are "
                               f"{list(self.groups)} (every node names one)")
            if not self.groups and n.layout.group is not None:
                raise DAGError(f"node {n.id!r}: its layout names group {n.layout.group!r} but the DAG has no groups "
                               "(dag.with_groups(rollout=..., train=...))")
        if world_size is not None:
            for n in self:
                workers = self.groups[n.layout.group] if self.groups else world_size
                try:
                    n.layout.resolve(workers)
                except ValueError as e:
                    raise DAGError(f"node {n.id!r}: {e}") from None
        if resolve:
            for n in self:
                n.resolve_fn()
        return self

    def _find_cycle(self) -> list[str] | None:
        state: dict[str, int] = {}  # 1 = on stack, 2 = done
        stack: list[str] = []

        def visit(u: str) -> list[str] | None:
            state[u] = 1
            stack.append(u)
            for d in self._nodes[u].deps:
                if state.get(d) == 1:
                    return stack[stack.index(d):] + [d]
                if d not in state and (found := visit(d)):
                    return found
            stack.pop()
            state[u] = 2
            return None

        for u in self._nodes:
            if u not in state and (found := visit(u)):
                return list(reversed(found))  # print in data-flow direction
        return None

    # ---- YAML ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self:
            if callable(n.fn) and not importable(n.fn):
                raise DAGError(
                    f"node {n.id!r}: function {n.fn_name()!r} is defined in a notebook or locally and "
                    "cannot be written to YAML; move it into a module and refer to it as 'module:function'"
                )
            d = n.model_dump(exclude={"fn"}, exclude_defaults=True)
            nodes.append({"id": n.id, "fn": n.fn_name(), **{k: v for k, v in d.items() if k != "id"}})
        return {"name": self.name, **({"groups": dict(self.groups)} if self.groups else {}), "nodes": nodes}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> "DAG":
        if not isinstance(d, dict) or set(d) - {"name", "nodes", "groups"} or "nodes" not in d:
            raise DAGError(f"{source}: a DAG needs the keys 'name' and 'nodes' (and optionally 'groups'), "
                           f"got {list(d or {})}")
        dag = cls(str(d.get("name", "dag")), groups=d.get("groups"))
        for i, raw in enumerate(d["nodes"] or []):
            node_id = raw.get("id", f"#{i}") if isinstance(raw, dict) else f"#{i}"
            if not isinstance(raw, dict):
                raise DAGError(f"{source}: node #{i} must be a mapping, got {type(raw).__name__}")
            dag.add(make_node(_source=f"{source}: node {node_id!r}", **raw))
        return dag

    @classmethod
    def from_yaml(cls, text_or_path: str) -> "DAG":
        p = Path(text_or_path)
        is_path = "\n" not in text_or_path and p.suffix in (".yaml", ".yml")
        if is_path and not p.exists():
            raise DAGError(f"DAG file {p} does not exist")
        text = p.read_text() if is_path else text_or_path
        return cls.from_dict(yaml.safe_load(text), source=str(p) if is_path else "<yaml>")

    # ---- display --------------------------------------------------------------
    def plan(self, world_size: int) -> Plan:
        return plan(self, world_size)

    def __repr__(self) -> str:
        lines = [f"DAG {self.name!r} ({len(self)} nodes{f', groups {self.groups}' if self.groups else ''})"]
        for n in self:
            deps = f" <- {', '.join(n.deps)}" if n.deps else ""
            lines.append(f"  {n.id} [{n.role}/{n.type}, {n.layout}] {n.fn_name()}{deps}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return dag_html(self)

