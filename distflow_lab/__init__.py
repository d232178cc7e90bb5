"""distflow_lab: a Jupyter-first toolkit for multi-controller RL post-training
(DistFlow) with a verl-style centralized baseline beside it.

    import distflow_lab as lab
    lab.connect()
    s = lab.session(lab.synthetic_grpo(), world_size=4)
    s.step_stage()

Names are imported lazily so that light processes (the DataBuffer actors)
do not pay for torch when they import a submodule.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "connect": "distflow_lab.cluster", "shutdown": "distflow_lab.cluster",
    "session": "distflow_lab.lab", "rl_session": "distflow_lab.lab", "rl_dag": "distflow_lab.lab",
    "run_config": "distflow_lab.lab", "Session": "distflow_lab.lab",
    "stepper": "distflow_lab.viz.stepper",
    "DAG": "distflow_lab.dag", "Layout": "distflow_lab.dag", "Node": "distflow_lab.dag", "DAGError": "distflow_lab.dag",
    "Batch": "distflow_lab.data.batch",
    "RunConfig": "distflow_lab.config", "SessionConfig": "distflow_lab.config", "ConfigError": "distflow_lab.config",
    "load_run_config": "distflow_lab.config",
    "synthetic_grpo": "distflow_lab.synthetic", "synthetic_ppo": "distflow_lab.synthetic",
    "grpo_shape": "distflow_lab.dags", "ppo_shape": "distflow_lab.dags",
    "StageError": "distflow_lab.errors",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'distflow_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
