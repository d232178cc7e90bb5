"""Algorithms as declarations: `lab.register_algorithm(name, ...)` says which DAG an
algorithm builds, its default estimator and the estimator kinds it runs, its policy loss,
whether it trains a critic, its own options model and its paper's actor defaults. The DAG
builders, the engine set-up, the shared actor update and the config checks read the
declaration; nothing else compares an algorithm's name.

    lab.register_algorithm("cispo", policy_loss="cispo")   # GRPO's DAG with another loss

The built-in algorithms declare themselves in their own files (grpo.py, ppo.py, dapo.py,
gspo.py); `algorithm()` imports those on first use. Checking a config imports the
estimators and losses (torch), not Ray.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from distflow_lab.core.config import ActorOptions, ConfigError, RunConfig, parse_run_config
from distflow_lab.core.registry import Entry, NoOptions, Registry, caller_module
from distflow_lab.datasets.registry import check_data
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.environment import parse_options

if TYPE_CHECKING:
    from distflow_lab.graph.dag import DAG

GRPO_DAG = "distflow_lab.algos.grpo:grpo_dag"
BUILTIN_MODULES = ("distflow_lab.algos.grpo", "distflow_lab.algos.ppo", "distflow_lab.algos.dapo",
                   "distflow_lab.algos.gspo")  # each declares its algorithm when imported


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's declaration (see `register_algorithm`)."""

    name: str
    dag: str | Callable  # builder(cfg, data_path) -> DAG, or its "module:function"
    estimator: str  # the default advantage estimator
    estimator_kinds: tuple[str, ...]  # the estimator kinds it runs (estimators.KINDS)
    policy_loss: str  # the default policy loss
    critic: bool  # trains a critic (its DAG has values and critic_update stages)
    actor: Mapping[str, Any] = field(default_factory=dict)  # its paper's actor options, where the user set none
    check: Callable[[RunConfig], None] | None = None  # its own config rules; errors name the field
    actor_options: Callable[[RunConfig], ActorOptions] | None = None  # the update's actor options from the config


ALGORITHMS: Registry[Algorithm] = Registry("algorithm", "algorithm.name")


def register_algorithm(name: str, *, dag: str | Callable = GRPO_DAG, estimator: str = "grpo",
                       estimator_kinds: tuple[str, ...] = ("outcome", "token"), policy_loss: str = "ppo_clip",
                       critic: bool = False, options: type | None = None, actor: Mapping[str, Any] | None = None,
                       check: Callable[[RunConfig], None] | None = None,
                       actor_options: Callable[[RunConfig], ActorOptions] | None = None) -> Algorithm:
    """Declare an algorithm over the shared stages (GRPO's DAG unless `dag` says otherwise): its default
    estimator and the estimator kinds it accepts, its policy loss, whether it trains a critic, its options
    model (algorithm.options), its paper's actor defaults, its config rules. Returns the declaration."""
    bad = sorted(set(actor or {}) - set(ActorOptions.model_fields))
    if bad:
        raise ConfigError(f"algorithm {name!r}: actor default {bad[0]!r} is not an actor option")
    decl = Algorithm(name, dag, estimator, tuple(estimator_kinds), policy_loss, critic,
                     MappingProxyType({"policy_loss": policy_loss, **(actor or {})}), check, actor_options)
    ALGORITHMS.add(Entry(name, decl, options or NoOptions, {}, caller_module()))
    return decl


def algorithm(name: str) -> Algorithm:
    """The declaration of `name` (the built-in ones are declared on first use)."""
    if name not in ALGORITHMS:
        algorithm_names()
    return ALGORITHMS.get(name).obj


def algorithm_names() -> list[str]:
    """Every declared algorithm, the built-in ones first."""
    for m in BUILTIN_MODULES:
        importlib.import_module(m)
    return ALGORITHMS.names()


def algorithm_options(cfg: RunConfig) -> Any:
    """The algorithm's typed options (algorithm.options, checked by its declared model)."""
    algorithm(cfg.algorithm.name)
    return ALGORITHMS.options(cfg.algorithm.name, cfg.algorithm.options, "algorithm.options")


def effective_actor(cfg: RunConfig) -> ActorOptions:
    """The actor options the update runs with: the run's, with the algorithm's defaults where the user
    set nothing (also for a config that skipped `with_defaults`), through the algorithm's
    `actor_options(cfg)` where it declares one (DAPO's switches)."""
    decl = algorithm(cfg.algorithm.name)
    cfg = with_actor_defaults(cfg)
    return decl.actor_options(cfg) if decl.actor_options is not None else cfg.actor


def with_actor_defaults(cfg: RunConfig) -> RunConfig:
    """`cfg` with the algorithm's actor defaults (its policy loss, its paper's options) where the user set none."""
    decl = algorithm(cfg.algorithm.name)
    unset = {k: v for k, v in decl.actor.items() if k not in cfg.actor.model_fields_set}
    if not unset:
        return cfg
    actor = cfg.actor.model_copy(update=unset)
    actor.model_fields_set.update(unset)  # explicit from here on: applying defaults twice changes nothing
    return cfg.model_copy(update={"actor": actor})


def loss_agg_is(cfg: RunConfig, mode: str, why: str) -> None:
    """An algorithm that fixes the loss aggregation: an explicit, different actor.loss_agg_mode is an error."""
    if "loss_agg_mode" in cfg.actor.model_fields_set and cfg.actor.loss_agg_mode != mode:
        raise ConfigError(f"actor.loss_agg_mode={cfg.actor.loss_agg_mode!r} contradicts {why}, which uses {mode!r}; "
                          f"drop actor.loss_agg_mode or set it to {mode!r}")


def check_run_config(cfg: RunConfig) -> None:
    """The algorithm, its options, the estimator and the policy loss exist, go together and parse;
    errors name the field."""
    from distflow_lab.algos.policy_losses import POLICY_LOSSES
    from distflow_lab.algos.estimators import ESTIMATORS

    name = cfg.algorithm.name
    decl = algorithm(name)
    algorithm_options(cfg)
    est = cfg.algorithm.adv_estimator or decl.estimator
    kind = ESTIMATORS.get(est).facts["kind"]
    if kind not in decl.estimator_kinds:
        fits = [n for n in ESTIMATORS if ESTIMATORS.get(n).facts["kind"] in decl.estimator_kinds]
        raise ConfigError(f"algorithm.adv_estimator: {name} does not support {est!r} (its kind is {kind}; {name} "
                          f"runs {' and '.join(decl.estimator_kinds)} estimators: {fits})")
    ESTIMATORS.options(est, cfg.algorithm.estimator_options, "algorithm.estimator_options")
    POLICY_LOSSES.get(cfg.actor.policy_loss)
    POLICY_LOSSES.options(cfg.actor.policy_loss, cfg.actor.policy_loss_options, "actor.policy_loss_options")
    if decl.check is not None:
        decl.check(cfg)
    check_data(cfg.data)
    check_old_log_prob(cfg)
    check_multi_turn(cfg)


def check_old_log_prob(cfg: RunConfig) -> None:
    """actor.old_log_prob=from_update takes the old policy from the update's own forward: right only
    when that forward runs with the weights that will be updated and nothing else needs the column."""
    if cfg.actor.old_log_prob != "from_update":
        return
    why = None
    if cfg.actor.mini_batches > 1:
        why = (f"actor.mini_batches={cfg.actor.mini_batches}: every mini-batch after the first trains on weights "
               "the previous one changed, so its old policy is not the update's")
    elif cfg.algorithm.use_kl_in_reward:
        why = "algorithm.use_kl_in_reward: the advantage reads the old log-probs before the update runs"
    elif algorithm(cfg.algorithm.name).critic:
        why = (f"algorithm {cfg.algorithm.name} (a critic): its DAG computes values and GAE after the old "
               "log-probs (not rewired for this)")
    if why:
        raise ConfigError(f"actor.old_log_prob=from_update cannot run with {why}; use actor.old_log_prob=recompute")


def check_multi_turn(cfg: RunConfig) -> None:
    """Before any worker starts: the environment exists, its options parse, the algorithm can run it."""
    mt = cfg.rollout.multi_turn
    if mt is None:
        return
    try:
        parse_options(mt.env, mt.options)  # names the environment and the key
    except ConfigError as e:
        raise ConfigError(f"rollout.multi_turn: {e}") from None
    if mt.max_turn_tokens > cfg.rollout.max_response_len:
        raise ConfigError(f"rollout.multi_turn.max_turn_tokens={mt.max_turn_tokens} is more than the trajectory's "
                          f"budget rollout.max_response_len={cfg.rollout.max_response_len}")


def with_defaults(cfg: RunConfig) -> RunConfig:
    """`cfg` checked, with the algorithm's defaults filled in where the user set nothing: its
    default estimator, its policy loss and its paper's actor options (`Algorithm.actor`)."""
    decl = algorithm(cfg.algorithm.name)
    cfg = with_actor_defaults(cfg)
    check_run_config(cfg)
    if cfg.algorithm.adv_estimator is not None:
        return cfg
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"adv_estimator": decl.estimator})})


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML file or preset plus `a.b=value` overrides, checked against
    the schema, the sizes and the algorithm registry; nothing is started."""
    return with_defaults(parse_run_config(path, overrides))


def build_dag(cfg: RunConfig, data_path: str) -> "DAG":
    check_run_config(cfg)
    decl = algorithm(cfg.algorithm.name)
    return resolve_function(decl.dag, node=cfg.algorithm.name)(cfg, data_path)
