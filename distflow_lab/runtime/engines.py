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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from distflow_lab.core.errors import ConfigError
from distflow_lab.runtime.weights import PolicyWeights, SyntheticWeights


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
    workload's policy) and keep its own objects in `scratch` between steps on this worker.
    A checkpoint keeps the policy's version (and the synthetic policy itself)."""

    weights: PolicyWeights | None = None
    tokenizer: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the worker's: each rank's policy is its own (a rollout group's lags the trainers')

    def checkpointed(self) -> dict[str, Checkpointable]:
        return {f"policy_version_rank{self.rank}": _PolicyVersion(self)}

    def after_load(self) -> None:
        pass

    def close(self) -> None:
        self.scratch.clear()


@dataclass
class _PolicyVersion:
    """A StageState's policy version in a checkpoint: what the synthetic policy is a function of."""

    state: StageState

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        w = self.state.weights
        spec = {"version": w.version if w is not None else 0}
        if isinstance(w, SyntheticWeights):  # its content is a function of (size, seed, version)
            spec.update(numel=w.numel, seed=w.seed)
        (directory / "version.json").write_text(json.dumps(spec))

    def load(self, directory: Path) -> None:
        spec = json.loads((directory / "version.json").read_text())
        if "numel" in spec:
            self.state.weights = SyntheticWeights.at(spec["numel"], spec["seed"], spec["version"])
        elif self.state.weights is not None:
            self.state.weights.version = spec["version"]


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
