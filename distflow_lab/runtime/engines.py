"""What a DAG worker asks of its engines: a typed object, never a dict read by key.

A session names an engine factory `(ctx, config) -> engines`; each worker calls it
once at set-up. The runtime needs four things of what it returns, and nothing else:

    weights         the policy this worker publishes or pulls between worker groups
                    (`weights.PolicyWeights`), or None
    tokenizer       decodes samples for `peek`/`samples` (None: token ids only)
    checkpointed()  the engines a checkpoint saves and loads, by folder name
    after_load()    a checkpoint replaced their state (e.g. the rollout's weights now lag)
    close()         free models, engines and their memory

The built-in RL algorithms' engines are `algos.engine_setup.RLEngines`; a DAG without a
factory gets `StageState`, where a stage may keep its own objects between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from distflow_lab.core.errors import ConfigError
from distflow_lab.runtime.weights import PolicyWeights


@runtime_checkable
class Checkpointable(Protocol):
    def save(self, directory: Path) -> Any:
        """Write this engine's state under `directory` (collective where the engine is sharded)."""

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""


@runtime_checkable
class WorkerEngines(Protocol):
    weights: PolicyWeights | None
    tokenizer: Any

    def checkpointed(self) -> dict[str, Checkpointable]: ...

    def after_load(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class StageState:
    """The engines of a DAG without a factory: a stage may set `weights` (the synthetic
    workload's policy) and keep its own objects in `scratch` between steps on this worker."""

    weights: PolicyWeights | None = None
    tokenizer: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)

    def checkpointed(self) -> dict[str, Checkpointable]:
        return {}

    def after_load(self) -> None:
        pass

    def close(self) -> None:
        self.scratch.clear()


def check_engines(engines: Any, factory: str) -> WorkerEngines:
    """`engines` as the runtime needs it, or an error naming the factory and what is missing."""
    if engines is None:
        return StageState()
    missing = [name for name in ("weights", "tokenizer", "checkpointed", "after_load", "close")
               if not hasattr(engines, name)]
    if missing:
        raise ConfigError(f"engine factory {factory!r} returned a {type(engines).__name__} without {missing}; it must "
                          "return an object with weights, tokenizer, checkpointed(), after_load() and close() "
                          "(distflow_lab.runtime.engines.WorkerEngines; e.g. a dataclass like StageState)")
    return engines
