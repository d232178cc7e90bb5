"""The one registry of algorithms: which DAG each builds and which advantage
estimators it supports. Config validation comes from here, so a run config
cannot name an algorithm or estimator that would silently run something else.

Adding an algorithm = one file of stage functions with a `*_dag(cfg, data_path)`
builder, and one line in ALGORITHMS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distflow_lab.core.config import ConfigError, RunConfig
from distflow_lab.graph.nodes import resolve_function

if TYPE_CHECKING:
    from distflow_lab.graph.dag import DAG


@dataclass(frozen=True)
class Algorithm:
    dag: str  # "module:function" building its DAG from (cfg, data_path); named, so checking a config imports no torch
    estimators: tuple[str, ...]  # supported advantage estimators (names in estimators.ESTIMATORS); first = default


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("distflow_lab.algos.grpo:grpo_dag", ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus")),
    "ppo": Algorithm("distflow_lab.algos.ppo:ppo_dag", ("gae",)),
}


def check_run_config(cfg: RunConfig) -> None:
    """The algorithm and estimator exist and go together; errors name the field."""
    name = cfg.algorithm.name
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name: {name!r} is not a registered algorithm; registered: {list(ALGORITHMS)}")
    est = cfg.algorithm.adv_estimator
    if est is not None and est not in ALGORITHMS[name].estimators:
        raise ConfigError(f"algorithm.adv_estimator: {name} does not support {est!r} (its advantage stage would "
                          f"ignore it); {name} supports {list(ALGORITHMS[name].estimators)}")


def with_defaults(cfg: RunConfig) -> RunConfig:
    """`cfg` checked, with the algorithm's default estimator filled in."""
    check_run_config(cfg)
    if cfg.algorithm.adv_estimator is not None:
        return cfg
    default = ALGORITHMS[cfg.algorithm.name].estimators[0]
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"adv_estimator": default})})


def build_dag(cfg: RunConfig, data_path: str) -> "DAG":
    check_run_config(cfg)
    return resolve_function(ALGORITHMS[cfg.algorithm.name].dag, node=cfg.algorithm.name)(cfg, data_path)
