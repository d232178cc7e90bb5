"""Typed configuration (pydantic): every field documented, unknown keys are an
error (never silently dropped), YAML loads safely, CLI-style `a.b=value`
overrides are parsed as YAML scalars.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ConfigError(ValueError):
    """A configuration that cannot run; names the key at fault."""


class Switches(Strict):
    """The data-coordinator mechanisms of the paper's ablation (Fig. 10)."""

    local_cache: bool = True
    """Keep a batch in the worker when the next stage has the same data-parallel layout (off: every edge goes through a DataBuffer)."""
    double_buffer: bool = True
    """Release a step's buffer store in the background (off: synchronously, on the buffer's event loop)."""
    balance: Literal["lpt", "kk", "none"] = "lpt"
    """Load balancing at redistribution: constrained LPT (paper Alg. 1), Karmarkar-Karp, or a contiguous split."""
    num_buffers: int | Literal["per_node"] = "per_node"
    """DataBuffer actors: one per Ray node, or this many (1 = one central buffer)."""


class ClusterOptions(Strict):
    """How the workers are placed."""

    world_size: int = Field(default=4, ge=1)
    """Number of DAG workers (one per device slot)."""
    cpus_per_worker: float = Field(default=1.0, ge=0)
    """Logical CPUs each worker reserves (Ray may oversubscribe physical cores)."""
    gpus_per_worker: float = Field(default=0.0, ge=0)
    """GPUs each worker reserves (0 on CPU machines)."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the workers."""
    threads_per_worker: int | None = None
    """torch threads per worker (None: cores // workers, at least 1)."""
    stage_timeout_s: float = Field(default=300.0, gt=0)
    """Longest a stage may run on any worker before the driver reports it (and which workers) instead of waiting."""
    buffer_wait_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a DataBuffer waits for producers before failing the step with a clear error."""
    torch_distributed: bool = False
    """Start a torch.distributed process group over the workers (gloo on CPU, nccl on GPU)."""


class SessionConfig(Strict):
    """A session: where it runs, how the data plane behaves, and the algorithm's own config."""

    mode: Literal["distributed", "centralized"] = "distributed"
    """distributed: DistFlow's multi-controller data plane; centralized: verl-style driver dispatch."""
    seed: int = 0
    """Seed for data shuffling and every stage's random generator."""
    cluster: ClusterOptions = Field(default_factory=ClusterOptions)
    """Worker placement."""
    switches: Switches = Field(default_factory=Switches)
    """Data-coordinator switches (ablations)."""
    keep_outputs: bool = True
    """Keep each stage's latest output on the workers so `peek` can show samples."""
    algo: dict[str, Any] = Field(default_factory=dict)
    """Algorithm config visible to stage functions as `ctx.config` (typed by the algorithm)."""


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (values parsed as YAML scalars: 3, true, [1,2], null)."""
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like key.path=value")
        key, raw = o.split("=", 1)
        set_dotted(data, key.strip(), yaml.safe_load(raw))
    return data


def load_model(cls: type[BaseModel], data: dict, source: str = "<config>") -> Any:
    """Validate `data` as `cls`; errors name every bad key and what is wrong with it."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = "\n".join(
            f"  {'.'.join(map(str, err['loc'])) or '(root)'}: "
            + ("unknown key (not a field of this section)" if err["type"] == "extra_forbidden" else err["msg"])
            for err in e.errors()
        )
        raise ConfigError(f"{source}: invalid configuration\n{problems}") from None


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    return data
