"""distflow_lab: a Jupyter-first toolkit for RL post-training systems research:
the same DAG of stages on three data planes (centralized, coordinator,
distributed), measured side by side.

    import distflow_lab as lab
    lab.connect()
    s = lab.session(lab.synthetic_grpo(), world_size=4, mode="coordinator")
    s.step_stage()

Names are imported lazily so that light processes (the data-plane actors, the
CLI's argument checks) do not pay for torch when they import a submodule.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "connect": "distflow_lab.runtime.cluster", "shutdown": "distflow_lab.runtime.cluster",
    "session": "distflow_lab.api.session", "rl_session": "distflow_lab.api.runner",
    "rl_dag": "distflow_lab.api.runner", "run_config": "distflow_lab.api.runner",
    "Session": "distflow_lab.api.session", "OPTIONS": "distflow_lab.api.session",
    "stepper": "distflow_lab.api.stepper", "notebook": "distflow_lab.api.notebook",
    "DAG": "distflow_lab.graph.dag", "Layout": "distflow_lab.graph.nodes", "Node": "distflow_lab.graph.nodes",
    "Batch": "distflow_lab.core.batch", "StageContext": "distflow_lab.runtime.context",
    "local_context": "distflow_lab.runtime.context",
    "RunConfig": "distflow_lab.core.config", "SessionConfig": "distflow_lab.core.config",
    "DataSpec": "distflow_lab.core.config", "Contract": "distflow_lab.core.config",
    "load_run_config": "distflow_lab.api.runner",
    "synthetic_grpo": "distflow_lab.experiments.synthetic", "synthetic_ppo": "distflow_lab.experiments.synthetic",
    "grpo_shape": "distflow_lab.graph.shapes", "ppo_shape": "distflow_lab.graph.shapes",
    "ConfigError": "distflow_lab.core.errors", "DAGError": "distflow_lab.core.errors",
    "DatasetError": "distflow_lab.core.errors", "StageError": "distflow_lab.core.errors",
    "WorkerLost": "distflow_lab.core.errors", "StageTimeout": "distflow_lab.core.errors",
    "BufferLost": "distflow_lab.core.errors", "CoordinatorLost": "distflow_lab.core.errors",
    "StageContractError": "distflow_lab.core.errors", "EnvError": "distflow_lab.core.errors",
    "register_env": "distflow_lab.models.environment", "EnvStep": "distflow_lab.models.environment",
    "EnvOptions": "distflow_lab.models.environment", "Latency": "distflow_lab.models.environment",
    "EnvPool": "distflow_lab.models.environment_pool",
    "replay": "distflow_lab.experiments.replay", "replay_accuracy": "distflow_lab.experiments.replay",
    "schedule_replay_accuracy": "distflow_lab.experiments.schedule_replay",
    "advise": "distflow_lab.experiments.advisor",
    "register_schedule": "distflow_lab.core.config", "ScheduleFacts": "distflow_lab.core.config",
    "Options": "distflow_lab.core.registry",
    "register_estimator": "distflow_lab.algos.estimators", "EstimatorInputs": "distflow_lab.algos.estimators",
    "register_policy_loss": "distflow_lab.algos.policy_losses", "LossInputs": "distflow_lab.algos.policy_losses",
    "register_algorithm": "distflow_lab.algos.registry",
    "register_dataset": "distflow_lab.datasets.registry", "DatasetInputs": "distflow_lab.datasets.registry", "masked_mean": "distflow_lab.algos.losses",
    "soak": "distflow_lab.experiments.soak", "SoakReport": "distflow_lab.experiments.soak",
    "WeightBoardLost": "distflow_lab.core.errors",
    "WeightSyncMismatch": "distflow_lab.core.errors",
    "WeightSyncTimeout": "distflow_lab.core.errors",
    "worker_pool": "distflow_lab.runtime.worker_pool",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'distflow_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
