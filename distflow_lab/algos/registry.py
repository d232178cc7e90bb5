"""The one registry of algorithms: which DAG each builds and which advantage
estimators it supports. Config validation comes from here, so a run config
cannot name an algorithm or estimator that would silently run something else.

Adding an algorithm = one file of stage functions with a `*_dag(cfg, data_path)`
builder, and one line in ALGORITHMS.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from distflow_lab.core.config import ConfigError, RunConfig, parse_run_config
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.environment import parse_options

if TYPE_CHECKING:
    from distflow_lab.graph.dag import DAG


@dataclass(frozen=True)
class Algorithm:
    dag: str  # "module:function" building its DAG from (cfg, data_path); named, so checking a config imports no torch
    estimators: tuple[str, ...]  # supported advantage estimators (names in estimators.ESTIMATORS); first = default
    check: Callable[[RunConfig], None] | None = None  # its own config rules (torch-free); errors name the field
    actor: Mapping[str, float] = field(default_factory=dict)  # its paper's actor options, where the user set none


def _loss_agg_is(cfg: RunConfig, mode: str, why: str) -> None:
    """An algorithm that fixes the loss aggregation: an explicit, different actor.loss_agg_mode is an error."""
    if "loss_agg_mode" in cfg.actor.model_fields_set and cfg.actor.loss_agg_mode != mode:
        raise ConfigError(f"actor.loss_agg_mode={cfg.actor.loss_agg_mode!r} contradicts {why}, which uses {mode!r}; "
                          f"drop actor.loss_agg_mode or set it to {mode!r}")


def check_dapo(cfg: RunConfig) -> None:
    d, a = cfg.algorithm.dapo, cfg.actor
    if d.clip_higher and a.clip_ratio_high < a.clip_ratio_low:
        raise ConfigError(f"actor.clip_ratio_high={a.clip_ratio_high} < actor.clip_ratio_low={a.clip_ratio_low}: "
                          "DAPO's clip-higher (algorithm.dapo.clip_higher) needs clip_ratio_high >= clip_ratio_low")
    _loss_agg_is(cfg, "token-mean" if d.token_level_loss else "seq-mean-token-mean",
                 f"algorithm.dapo.token_level_loss={str(d.token_level_loss).lower()}")
    r = cfg.rollout.max_response_len
    if d.overlong_shaping and d.buffer_len(r) >= r:
        raise ConfigError(f"algorithm.dapo.overlong_buffer_len={d.buffer_len(r)} must be < "
                          f"rollout.max_response_len={r} (the penalty window ends at the longest response)")


def check_gspo(cfg: RunConfig) -> None:
    _loss_agg_is(cfg, "seq-mean-token-mean", "GSPO's sequence-level objective")


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("distflow_lab.algos.grpo:grpo_dag", ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus")),
    "ppo": Algorithm("distflow_lab.algos.ppo:ppo_dag", ("gae",)),
    # DAPO: the paper's eps_high 0.28 (clip-higher), and verl's recipe's dual clip c = 10 (the paper has none)
    "dapo": Algorithm("distflow_lab.algos.dapo:dapo_dag", ("grpo", "dr_grpo", "rloo"), check_dapo,
                      actor={"clip_ratio_high": 0.28, "clip_ratio_c": 10.0}),
    # GSPO: the paper's sequence-ratio clip range; PPO's 0.2 would be close to no clipping at all
    "gspo": Algorithm("distflow_lab.algos.gspo:gspo_dag", ("grpo", "dr_grpo", "rloo"), check_gspo,
                      actor={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
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
    if name != "dapo" and cfg.algorithm.dapo.model_fields_set:
        field = sorted(cfg.algorithm.dapo.model_fields_set)[0]
        raise ConfigError(f"algorithm.dapo.{field}: DAPO's switches have no meaning for algorithm {name!r}")
    if ALGORITHMS[name].check is not None:
        ALGORITHMS[name].check(cfg)
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
    elif cfg.algorithm.name == "ppo":
        why = "algorithm ppo: its DAG computes values and GAE after the old log-probs (not rewired for this)"
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
    default estimator and its paper's actor options (`Algorithm.actor`)."""
    alg = ALGORITHMS[cfg.algorithm.name] if cfg.algorithm.name in ALGORITHMS else None
    if alg is not None:
        unset = {k: v for k, v in alg.actor.items() if k not in cfg.actor.model_fields_set}
        if unset:
            actor = cfg.actor.model_copy(update=unset)
            actor.model_fields_set.update(unset)  # explicit from here on: applying defaults twice changes nothing
            cfg = cfg.model_copy(update={"actor": actor})
    check_run_config(cfg)
    if cfg.algorithm.adv_estimator is not None:
        return cfg
    default = ALGORITHMS[cfg.algorithm.name].estimators[0]
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"adv_estimator": default})})


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML file or preset plus `a.b=value` overrides, checked against
    the schema, the sizes and the algorithm registry; nothing is started."""
    return with_defaults(parse_run_config(path, overrides))


def build_dag(cfg: RunConfig, data_path: str) -> "DAG":
    check_run_config(cfg)
    return resolve_function(ALGORITHMS[cfg.algorithm.name].dag, node=cfg.algorithm.name)(cfg, data_path)
