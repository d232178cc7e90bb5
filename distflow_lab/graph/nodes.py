"""A DAG node and its typed parts: layout, data source, contract, the stage's own
params, its timeout. Plus resolving "module:function" names and calling a
stage function. Every validation error names the node and the key at fault."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from distflow_lab.core.config import Contract, DataSpec
from distflow_lab.core.errors import ConfigError, DAGError
from distflow_lab.core.registry import import_object

Role = Literal["actor", "rollout", "reference", "critic", "reward", "advantage", "data", "custom"]
NodeType = Literal["data_load", "generate", "compute", "train"]
StageFn = Callable[..., Any]


class Layout(BaseModel):
    """Parallel layout of one stage. `dp=None` means "as many data-parallel
    ranks as the workers allow": world_size // tp."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dp: int | None = Field(default=None, ge=1, description="data-parallel size (None: group workers // tp)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel size (ranks that see the same data)")
    group: str | None = Field(default=None, description="the DAG's worker group this stage runs on (None: all)")

    def resolve(self, workers: int) -> tuple[int, int]:
        """(dp, group_size) over the `workers` this stage runs on: group_size workers share
        each dp rank's data; only group rank 0 writes."""
        dp = self.dp if self.dp is not None else workers // self.tp
        if dp < 1 or dp * self.tp > workers or workers % (dp * self.tp):
            raise ValueError(f"layout dp={dp} x tp={self.tp} does not divide {workers} workers")
        return dp, workers // dp

    def __str__(self) -> str:
        where = f",group={self.group}" if self.group else ""
        return f"dp={'auto' if self.dp is None else self.dp},tp={self.tp}{where}"


class Node(BaseModel):
    """One stage of the algorithm. `fn` is a callable `fn(batch, ctx) -> batch`
    (or `fn(batch) -> batch`) or a "module:function" string.

    Typed parts (an unknown key in any of them is an error naming it):
    `data` (data_load nodes only: what to read), `contract` (columns and row
    count the stage promises), `params` (the stage function's own knobs, read as
    `ctx.params`), `timeout_s` (this stage's limit, over the cluster default).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    id: str = Field(min_length=1)
    role: Role = "custom"
    type: NodeType = "compute"
    deps: list[str] = Field(default_factory=list)
    fn: str | StageFn
    layout: Layout = Field(default_factory=Layout)
    data: DataSpec | None = None
    contract: Contract = Field(default_factory=Contract)
    params: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0)

    @field_validator("fn")
    @classmethod
    def _fn_form(cls, v: Any) -> Any:
        if isinstance(v, str) and v.count(":") != 1:
            raise ValueError(f"function {v!r} must look like 'package.module:function'")
        return v

    @field_serializer("fn")
    def _fn_by_name(self, fn: str | StageFn) -> str:  # a dump names the function the same way either form
        return self.fn_name()

    @model_validator(mode="after")
    def _data_only_on_loaders(self) -> "Node":
        if self.type != "data_load" and self.data is not None:
            raise ValueError(f"`data` belongs to data_load nodes; this node's type is {self.type!r}")
        return self

    def resolve_fn(self) -> StageFn:
        return resolve_function(self.fn, node=self.id)

    def fn_name(self) -> str:
        return self.fn if isinstance(self.fn, str) else f"{self.fn.__module__}:{self.fn.__qualname__}"


def make_node(_source: str | None = None, **fields: Any) -> Node:
    """A Node, or a DAGError naming the node and every bad key."""
    if isinstance(fields.get("layout"), dict):
        fields["layout"] = Layout(**fields["layout"])
    try:
        return Node(**fields)
    except ValidationError as e:
        where = _source or f"node {fields.get('id')!r}"
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'node'}: "
            + ("unknown key" if err["type"] == "extra_forbidden" else err["msg"]) for err in e.errors())
        raise DAGError(f"{where}: {problems}") from None


def resolve_function(fn: str | StageFn, node: str = "?") -> StageFn:
    if callable(fn):
        return fn
    try:
        obj = import_object(fn)
    except ConfigError as e:
        raise DAGError(f"node {node!r}: {e}") from None
    if not callable(obj):
        raise DAGError(f"node {node!r}: {fn!r} is not callable")
    return obj


def importable(fn: StageFn) -> bool:
    """True when `fn` can be named as "module:qualname" (not a notebook or local function)."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        return False
    try:
        return resolve_function(f"{mod}:{qual}") is fn
    except DAGError:
        return False


def call_stage(fn: StageFn, batch: Any, ctx: Any) -> Any:
    """Call a stage function as `fn(batch, ctx)` or, if it takes one argument, `fn(batch)`."""
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 2
    return fn(batch) if n == 1 else fn(batch, ctx)


def depths(deps: dict[str, list[str]]) -> dict[str, int]:
    """Logical depth of each node (0 = no deps). Tolerates missing deps and
    cycles (a back edge counts as depth 0) because reprs draw DAGs that do not
    validate yet; the planner validates first, so it never sees either."""
    depth: dict[str, int] = {}
    visiting: set[str] = set()

    def d(u: str) -> int:
        if u in depth:
            return depth[u]
        if u in visiting:
            return 0
        visiting.add(u)
        ds = [d(x) for x in deps[u] if x in deps and x != u]
        visiting.discard(u)
        depth[u] = 1 + max(ds) if ds else 0
        return depth[u]

    for u in deps:
        d(u)
    return depth
