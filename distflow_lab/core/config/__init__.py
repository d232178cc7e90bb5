"""Typed configuration (pydantic): every field documented, unknown keys are an error (never
silently dropped), YAML loads safely, CLI-style `a.b=value` overrides are parsed as YAML
scalars and an error names the key, as the user wrote it, and the override at fault.

One module per concept, one definition of each field:

* `session`: a session (mode, seed, cluster, switches, schedule, profiling) and the checks
  across its parts (switches per mode, schedule per mode, worker groups);
* `nodes`: a DAG node's data source and contract;
* `run`: the RL run (model, data, rollout, actor, critic, algorithm, reward, trainer, groups),
  which holds its session as `RunConfig.session`;
* `loading`: YAML, overrides, presets, the cache folder.

Every public name is importable from here: `from distflow_lab.core.config import RunConfig`.
"""
from __future__ import annotations

from distflow_lab.core.config.base import Strict
from distflow_lab.core.config.loading import (ENGINE_KEYS, PRESETS, apply_overrides, cache_root, canonical_key, engine_overrides,
                                              flat_sections, load_model, parse_overrides, parse_run_config, placed_key,
                                              preset_names, read_yaml, resolve_paths, set_dotted)
from distflow_lab.core.config.nodes import Contract, DataSpec
from distflow_lab.core.config.run import (SESSION_KEYS, ActorOptions, LoraOptions, AlgorithmOptions, CriticOptions,
                                          DataOptions, KLKind, check_partial_rollout, LossAgg, ModelOptions, Optim, RewardOptions,
                                          MultiTurnOptions, RolloutOptions, RunConfig, TinySpec, TrainerOptions, VLLMOptions, WarmStart,
                                          run_session)
from distflow_lab.core.config.session import (MODES, SWITCHES_BY_MODE, Balance, ClusterOptions, Mode, ProfileOptions,
                                              SCHEDULES, ScheduleFacts, ScheduleName, ScheduleOptions, SessionConfig, register_schedule,
                                              Switches, WeightSyncOptions, check_groups,
                                              check_schedule, check_switches)
from distflow_lab.core.errors import ConfigError

__all__ = [
    "ConfigError", "Strict",
    # session
    "Mode", "MODES", "Balance", "Switches", "SWITCHES_BY_MODE", "check_switches", "ClusterOptions",
    "SCHEDULES", "ScheduleFacts", "ScheduleName", "ScheduleOptions", "register_schedule", "WeightSyncOptions", "ProfileOptions", "check_schedule", "check_groups", "SessionConfig",
    # nodes
    "DataSpec", "Contract",
    # run
    "TinySpec", "WarmStart", "ModelOptions", "DataOptions", "check_partial_rollout", "VLLMOptions", "MultiTurnOptions", "RolloutOptions", "Optim", "LossAgg",
    "KLKind", "ActorOptions", "LoraOptions", "CriticOptions", "AlgorithmOptions", "RewardOptions",
    "TrainerOptions", "RunConfig", "SESSION_KEYS", "run_session",
    # loading
    "set_dotted", "parse_overrides", "ENGINE_KEYS", "engine_overrides", "flat_sections", "canonical_key", "placed_key", "apply_overrides",
    "load_model", "read_yaml", "PRESETS", "preset_names", "parse_run_config", "cache_root", "resolve_paths",
]
