"""The DAG of an RL algorithm: nodes (stages) with roles, types, dependencies,
a stage function and a parallel layout. Build it in Python cell by cell
(`DAG("grpo").node(...)`) or load it from YAML; both round-trip.

Validation happens before anything starts and every error names the node.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Iterator, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import FriendlyError

Role = Literal["actor", "rollout", "reference", "critic", "reward", "advantage", "data", "custom"]
NodeType = Literal["data_load", "generate", "compute", "train"]
StageFn = Callable[..., Any]


class DAGError(FriendlyError, ValueError):
    """A DAG that cannot run. The message names the node at fault."""


class Layout(BaseModel):
    """Parallel layout of one stage. `dp=None` means "as many data-parallel
    ranks as the workers allow": world_size // tp."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dp: int | None = Field(default=None, ge=1, description="data-parallel size (None: world_size // tp)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel size (ranks that see the same data)")

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(dp, group_size): group_size workers share each dp rank's data; only group rank 0 writes."""
        dp = self.dp if self.dp is not None else world_size // self.tp
        if dp < 1 or dp * self.tp > world_size or world_size % (dp * self.tp):
            raise ValueError(f"layout dp={dp} x tp={self.tp} does not divide {world_size} workers")
        return dp, world_size // dp

    def __str__(self) -> str:
        return f"dp={'auto' if self.dp is None else self.dp},tp={self.tp}"


class Node(BaseModel):
    """One stage of the algorithm. `fn` is a callable `fn(batch, ctx) -> batch`
    (or `fn(batch) -> batch`) or a "module:function" string."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    id: str = Field(min_length=1)
    role: Role = "custom"
    type: NodeType = "compute"
    deps: list[str] = Field(default_factory=list)
    fn: str | StageFn
    layout: Layout = Field(default_factory=Layout)
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("fn")
    @classmethod
    def _fn_form(cls, v: Any) -> Any:
        if isinstance(v, str) and v.count(":") != 1:
            raise ValueError(f"function {v!r} must look like 'package.module:function'")
        return v

    def resolve_fn(self) -> StageFn:
        return resolve_function(self.fn, node=self.id)

    def fn_name(self) -> str:
        return self.fn if isinstance(self.fn, str) else f"{self.fn.__module__}:{self.fn.__qualname__}"


def resolve_function(fn: str | StageFn, node: str = "?") -> StageFn:
    if callable(fn):
        return fn
    module_name, _, attr = fn.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise DAGError(f"node {node!r}: cannot import module {module_name!r} for function {fn!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise DAGError(f"node {node!r}: module {module_name!r} has no attribute {attr!r} (function {fn!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise DAGError(f"node {node!r}: {fn!r} is not callable")
    return obj


def call_stage(fn: StageFn, batch: Any, ctx: Any) -> Any:
    """Call a stage function as `fn(batch, ctx)` or, if it takes one argument, `fn(batch)`."""
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 2
    return fn(batch) if n == 1 else fn(batch, ctx)


class DAG:
    """An ordered set of nodes. Builder methods return the DAG, so cells chain:

        dag = DAG("grpo").node("data", fn=..., type="data_load", role="data")
        dag.node("rollout", fn=my_rollout, deps=["data"], layout=Layout(tp=2))
    """

    def __init__(self, name: str, nodes: list[Node] | None = None) -> None:
        self.name = name
        self._nodes: dict[str, Node] = {}
        for n in nodes or []:
            self.add(n)

    # ---- building and editing ---------------------------------------------
    def node(self, id: str, fn: str | StageFn, **fields: Any) -> "DAG":
        if isinstance(fields.get("layout"), dict):
            fields["layout"] = Layout(**fields["layout"])
        return self.add(_make_node(id=id, fn=fn, **fields))

    def add(self, node: Node) -> "DAG":
        if node.id in self._nodes:
            raise DAGError(f"duplicate node id {node.id!r} in DAG {self.name!r}")
        self._nodes[node.id] = node
        return self

    def replace(self, id: str, **changes: Any) -> "DAG":
        """Change fields of a node (e.g. swap its function for a notebook-defined one)."""
        old = self[id]
        if isinstance(changes.get("layout"), dict):
            changes["layout"] = Layout(**changes["layout"])
        self._nodes[id] = _make_node(**{**old.model_dump(), "fn": old.fn, **changes})
        return self

    def remove(self, id: str) -> "DAG":
        self[id]
        del self._nodes[id]
        return self

    def copy(self, name: str | None = None) -> "DAG":
        return DAG(name or self.name, [n.model_copy(deep=True) for n in self._nodes.values()])

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
        if world_size is not None:
            for n in self:
                try:
                    n.layout.resolve(world_size)
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
            if callable(n.fn) and not _importable(n.fn):
                raise DAGError(
                    f"node {n.id!r}: function {n.fn_name()!r} is defined in a notebook or locally and "
                    "cannot be written to YAML; move it into a module and refer to it as 'module:function'"
                )
            d = n.model_dump(exclude={"fn"})
            d["fn"] = n.fn_name()
            d["layout"] = n.layout.model_dump()
            nodes.append({k: d[k] for k in ("id", "role", "type", "deps", "fn", "layout", "config")})
        return {"name": self.name, "nodes": nodes}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> "DAG":
        if not isinstance(d, dict) or set(d) - {"name", "nodes"} or "nodes" not in d:
            raise DAGError(f"{source}: a DAG needs exactly the keys 'name' and 'nodes', got {list(d or {})}")
        dag = cls(str(d.get("name", "dag")))
        for i, raw in enumerate(d["nodes"] or []):
            node_id = raw.get("id", f"#{i}") if isinstance(raw, dict) else f"#{i}"
            if not isinstance(raw, dict):
                raise DAGError(f"{source}: node #{i} must be a mapping, got {type(raw).__name__}")
            dag.add(_make_node(_source=f"{source}: node {node_id!r}", **raw))
        return dag

    @classmethod
    def from_yaml(cls, text_or_path: str) -> "DAG":
        from pathlib import Path

        p = Path(text_or_path)
        is_path = "\n" not in text_or_path and p.suffix in (".yaml", ".yml")
        if is_path and not p.exists():
            raise DAGError(f"DAG file {p} does not exist")
        text = p.read_text() if is_path else text_or_path
        return cls.from_dict(yaml.safe_load(text), source=str(p) if is_path else "<yaml>")

    # ---- display --------------------------------------------------------------
    def plan(self, world_size: int):
        from .planner import plan

        return plan(self, world_size)

    def __repr__(self) -> str:
        lines = [f"DAG {self.name!r} ({len(self)} nodes)"]
        for n in self:
            deps = f" <- {', '.join(n.deps)}" if n.deps else ""
            lines.append(f"  {n.id} [{n.role}/{n.type}, {n.layout}] {n.fn_name()}{deps}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from .viz.dag import dag_html

        return dag_html(self)


def _make_node(_source: str | None = None, **fields: Any) -> Node:
    try:
        return Node(**fields)
    except ValidationError as e:
        where = _source or f"node {fields.get('id')!r}"
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'node'}: {err['msg']}" for err in e.errors())
        raise DAGError(f"{where}: {problems}") from None


def _importable(fn: StageFn) -> bool:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        return False
    try:
        return resolve_function(f"{mod}:{qual}") is fn
    except DAGError:
        return False
