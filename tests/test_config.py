"""The typed configs, without Ray: a RunConfig holds one SessionConfig (its mode, seed,
cluster, switches, schedule written flat as before, or under `session`), errors name the
key as the user wrote it, the one check of worker groups and the one list of modes are
used everywhere, the CLI checks its arguments without torch, and lineage is a function of
DataFrames."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pandas as pd
import pytest

from distflow_lab.core.config import (MODES, SWITCHES_BY_MODE, ClusterOptions, ConfigError, RunConfig, SessionConfig,
                                      check_groups, load_model, parse_run_config, run_session)
from distflow_lab.core.errors import DAGError


def test_every_name_of_the_old_module_is_still_importable():
    import distflow_lab.core.config as config

    old = ["ConfigError", "Strict", "Mode", "MODES", "Balance", "Switches", "SWITCHES_BY_MODE", "check_switches",
           "ClusterOptions", "ScheduleOptions", "ProfileOptions", "check_schedule", "SessionConfig", "DataSpec",
           "Contract", "TinySpec", "WarmStart", "ModelOptions", "DataOptions", "VLLMOptions", "RolloutOptions",
           "Optim", "LossAgg", "KLKind", "ActorOptions", "CriticOptions", "AlgorithmOptions",
           "RewardOptions", "TrainerOptions", "RunConfig", "set_dotted", "parse_overrides", "apply_overrides",
           "load_model", "read_yaml", "PRESETS", "preset_names", "parse_run_config", "cache_root", "resolve_paths"]
    assert [n for n in old if not hasattr(config, n)] == []
    assert set(config.__all__) <= set(dir(config))
    assert config.PRESETS.is_dir() and "tiny-cpu-grpo" in config.preset_names()


def test_run_config_holds_one_session():
    assert "mode" not in RunConfig.model_fields and "cluster" not in RunConfig.model_fields
    assert RunConfig.model_fields["session"].annotation is SessionConfig
    cfg = RunConfig()
    assert cfg.session.cluster.world_size == 2 and cfg.session.cluster.torch_distributed  # the run's default
    assert SessionConfig().cluster.world_size == 4  # a plain session's
    assert (cfg.mode, cfg.seed, cfg.cluster, cfg.switches, cfg.schedule) == (
        cfg.session.mode, cfg.session.seed, cfg.session.cluster, cfg.session.switches, cfg.session.schedule)
    sc = cfg.session_config()
    assert isinstance(sc, SessionConfig) and sc.algo is cfg and sc.cluster == cfg.session.cluster
    assert cfg.session.algo is None


def test_flat_and_nested_session_keys_are_the_same_config():
    flat = RunConfig(mode="coordinator", seed=3, cluster={"world_size": 2, "torch_distributed": True},
                     switches={"balance": "kk"}, schedule={"kind": "sync"})
    nested = RunConfig(session={"mode": "coordinator", "seed": 3, "switches": {"balance": "kk"},
                                "cluster": {"world_size": 2, "torch_distributed": True}, "schedule": {"kind": "sync"}})
    assert flat == nested and flat.switches.balance == "kk" and flat.seed == 3
    # a key not given keeps the run's default session (not a plain session's 4 workers)
    assert RunConfig(mode="coordinator").cluster == run_session().cluster
    assert RunConfig(session={"seed": 1}).cluster == run_session().cluster
    assert RunConfig(session=SessionConfig(mode="centralized")).cluster == run_session().cluster
    # and a given section replaces the default's as a whole, as before the move
    assert RunConfig(cluster={"world_size": 1}).cluster == ClusterOptions(world_size=1)


def test_presets_and_overrides_keep_their_flat_keys():
    cfg = parse_run_config("tiny-cpu-grpo", ["mode=coordinator", "switches.balance=kk", "seed=3",
                                             "cluster.world_size=2"])
    assert (cfg.session.mode, cfg.session.switches.balance, cfg.session.seed) == ("coordinator", "kk", 3)
    assert parse_run_config("tiny-cpu-grpo", ["session.mode=centralized"]).session.mode == "centralized"


def test_an_override_goes_where_the_file_wrote_the_key(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("session: {mode: distributed, cluster: {world_size: 2, torch_distributed: true}}\n")
    assert parse_run_config(nested, ["mode=coordinator"]).session.mode == "coordinator"  # the CLI's --mode
    assert parse_run_config(nested, ["cluster.world_size=1"]).session.cluster.torch_distributed
    flat = tmp_path / "flat.yaml"
    flat.write_text("mode: distributed\ncluster: {world_size: 2, torch_distributed: true}\n")
    assert parse_run_config(flat, ["session.mode=coordinator"]).session.mode == "coordinator"


@pytest.mark.parametrize("data, overrides, message", [
    ({"mode": "fast"}, [], "x.yaml: invalid configuration\n  mode: Input should be 'centralized'"),
    ({"session": {"mode": "fast"}}, [], "  session.mode: Input should be 'centralized'"),
    ({"cluster": {"worldsize": 2}}, [], "  cluster.worldsize: unknown key"),
    ({}, ["switches.balanse=kk"], "command-line overrides: invalid configuration\n  switches.balanse: unknown key "
                                  "(not a field of this section) (from the override 'switches.balanse=kk')"),
    ({"mode": "coordinator", "session": {"mode": "distributed"}}, [],
     "'mode' is given twice, as `mode` and as `session.mode`: keep one"),
    ({"session": {"profile": {"stages": ["rollout"]}}}, [], "session.profile: a run profiles with trainer.profile"),
    ({"session": {"algo": {"x": 1}}}, [], "session.algo is the run config itself"),
    ({"schedule": {"kind": "sync", "max_staleness": 2}}, [], "schedule: Value error, max_staleness has no meaning"),
])
def test_errors_name_the_key_as_written(data, overrides, message):
    from distflow_lab.core.config import apply_overrides

    with pytest.raises(ConfigError) as e:
        load_model(RunConfig, apply_overrides(dict(data), overrides, RunConfig), "x.yaml", overrides)
    assert message in str(e.value), str(e.value)


def test_one_check_of_worker_groups():
    check_groups(None)
    check_groups({"rollout": 1, "train": 3}, world_size=4, schedule="async")
    cases = [
        (dict(groups=None, schedule="one_step_off"), "schedule 'one_step_off' needs a DAG on two worker groups"),
        (dict(groups={"a": 0}), "group sizes must be positive integers, got {'a': 0}"),
        (dict(groups={"a": True}), "group sizes must be positive integers"),
        (dict(groups={"a": 1, "b": 1, "c": 1}, schedule="async"), "schedule 'async' needs two worker groups"),
        (dict(groups={"a": 1}, pair=True), "two worker groups (generation, then training), got 1"),
        (dict(groups={"a": 1, "b": 2}, world_size=4), "hold 3 workers but world_size=4"),
    ]
    for kwargs, message in cases:
        groups = kwargs.pop("groups")
        with pytest.raises(ConfigError, match=None) as e:
            check_groups(groups, **kwargs)
        assert message in str(e.value)
    with pytest.raises(DAGError, match="DAG 'd': group sizes"):
        check_groups({"a": -1}, where="DAG 'd'", error=DAGError)


def test_the_layers_use_the_one_check_of_groups():
    from distflow_lab.graph.dag import DAG
    from distflow_lab.graph.planner import group_spans
    from distflow_lab.graph.shapes import GRPO_NODES, grpo_shape

    with pytest.raises(DAGError, match="DAG 'g': group sizes must be positive integers"):
        DAG("g").with_groups(rollout=0)
    with pytest.raises(DAGError, match="hold 3 workers but world_size=4"):
        group_spans({"a": 1, "b": 2}, 4)
    with pytest.raises(DAGError, match="groups: the generation and training stages need two worker groups"):
        grpo_shape({n: "distflow_lab.experiments.synthetic:noop" for n in GRPO_NODES},
                   {"source": "synthetic", "batch_size": 2}, groups={"a": 1, "b": 1, "c": 1})
    with pytest.raises(ConfigError, match="groups: worker groups .* hold 3 workers but cluster.world_size=2"):
        parse_run_config("tiny-cpu-grpo", ["groups={rollout: 1, train: 2}"])
    with pytest.raises(ConfigError, match="schedule 'one_step_off' needs a DAG on two worker groups"):
        parse_run_config("tiny-cpu-grpo", ["schedule.kind=one_step_off"])


def test_one_list_of_modes():
    from distflow_lab.api.session import PLANES, session_config
    from distflow_lab.cli import parser

    assert MODES == ("centralized", "coordinator", "distributed")
    assert tuple(SWITCHES_BY_MODE) == MODES and sorted(PLANES) == sorted(MODES)
    assert all(PLANES[m].mode == m for m in MODES)
    hint = inspect.signature(session_config).parameters["mode"].annotation
    assert "Mode" in str(hint)
    run = parser()._subparsers._group_actions[0].choices["run"]
    assert next(a for a in run._actions if a.dest == "mode").choices == MODES


def test_one_table_of_schedules():
    """Every place that names or reasons about schedules reads SCHEDULES (core/config/session.py)."""
    from distflow_lab.api.session import session_config
    from distflow_lab.cli import parser
    from distflow_lab.core.config import SCHEDULES, ScheduleOptions, check_schedule
    from distflow_lab.experiments.soak import check as soak_check

    assert tuple(SCHEDULES)[:3] == ("sync", "one_step_off", "async")
    assert "ScheduleName" in str(inspect.signature(session_config).parameters["schedule"].annotation)
    with pytest.raises(ValueError, match=r"schedule 'later' is not one of \['sync', 'one_step_off', 'async'"):
        ScheduleOptions(kind="later")
    soak = parser()._subparsers._group_actions[0].choices["soak"]
    assert next(a for a in soak._actions if a.dest == "schedule").type("sync,async") == ("sync", "async")
    for name, facts in SCHEDULES.items():
        opts = ScheduleOptions(kind=name, **({"max_staleness": 3} if facts.partial_rollout else {}))
        assert opts.staleness == facts.bound(3) == (3 if facts.staleness is None else facts.staleness)
        if facts.needs_groups:
            with pytest.raises(ConfigError, match=f"schedule {name!r} needs the coordinator or distributed"):
                check_schedule("centralized", opts)
            with pytest.raises(ConfigError, match=f"schedule {name!r} needs the coordinator or distributed"):
                soak_check("centralized", name, "synthetic", 4, 2.0, 2)
        else:
            check_schedule("centralized", opts)
        if not facts.partial_rollout:
            with pytest.raises(ConfigError, match="partial rollouts run under schedule 'async' only"):
                soak_check("coordinator", name, "synthetic", 4, 2.0, 2, partial_rollout=True)
    with pytest.raises(ConfigError, match=r"soak: schedule 'later' is not one of \['sync', 'one_step_off', 'async'"):
        soak_check("coordinator", "later", "synthetic", 4, 2.0, 2)


def test_cli_checks_arguments_without_torch():
    code = ("import sys\nfrom distflow_lab.cli import main\n"
            "rc = main(['run', 'tiny-cpu-grpo', '--mode', 'coordinator', 'switches.num_buffers=2'])\n"
            "print(rc, 'torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr
    assert "switch 'num_buffers' has no meaning in mode 'coordinator'" in out.stderr


def test_api_runner_and_session_do_not_import_each_other():
    import ast
    from pathlib import Path

    import distflow_lab.api.session as session_module

    tree = ast.parse(Path(session_module.__file__).read_text())
    named = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "distflow_lab.api.runner" not in named
    from distflow_lab.api import runner

    assert {"rl_session", "rl_dag", "run_config", "load_run_config", "open_session"} <= set(dir(runner))


def test_session_passes_the_controllers_own_through():
    from distflow_lab.api.session import Session
    from distflow_lab.runtime.controller import Controller

    for name in ("step_stage", "step", "resume", "close", "items", "ledger", "redistribution_lengths",
                 "save_checkpoint", "load_checkpoint"):
        ours, theirs = getattr(Session, name), getattr(Controller, name)
        assert ours.__doc__ == theirs.__doc__ and inspect.signature(ours) == inspect.signature(theirs), name
    for name in ("mode", "plan", "config", "workers", "spans", "metrics", "history", "retries", "bytes_to_driver"):
        assert isinstance(getattr(Session, name), property), name
    s = Session.__new__(Session)
    s.controller = type("C", (), {"mode": "coordinator", "items": lambda self: "items!"})()
    assert s.mode == "coordinator" and s.items() == "items!"


def _frames():
    items = pd.DataFrame({
        "batch_id": [0, 0, 0, 0], "update": [0, 0, 0, 0], "stage": ["data", "reward", "data", "reward"],
        "stage_index": [0, 1, 0, 1], "worker": [0, 1, 0, 0], "dp_rank": [0, 1, 0, 0],
        "route_in": ["loader", "buffer", "loader", "cache"], "item_id": [7, 7, 8, 8], "tokens": [5, 9, 6, 10],
        "version": [-1, 0, -1, 0]})
    spans = pd.DataFrame({"batch_id": [0, 0], "stage": ["reward", "reward"], "worker": [1, 0],
                          "phase": ["get", "cache_hit"], "bytes": [400, 0], "items": [2, 1]})
    return items, spans


def test_lineage_follows_one_item():
    from distflow_lab.observe.lineage import lineage

    items, spans = _frames()
    out = lineage(items, spans, 7, {0: "node-aaaaaaaaaa", 1: "node-bbbbbbbbbb"})
    assert list(out["stage"]) == ["data", "reward"] and list(out["hop"]) == ["loader", "DataBuffer"]
    assert list(out["node"]) == ["node-aaa", "node-bbb"] and list(out["bytes"]) == [0, 200]
    assert list(out.columns) == ["item_id", "batch_id", "update", "stage", "worker", "node", "hop", "bytes", "tokens",
                                 "version"]
    assert len(lineage(items, spans, {7, 8})) == 4
    with pytest.raises(KeyError, match="no recorded item 'p9'"):
        lineage(items, spans, set(), label="p9")


def test_lineage_of_a_prompt_group():
    import numpy as np

    from distflow_lab.core.batch import Batch
    from distflow_lab.observe.lineage import uid_item_ids

    b = Batch({}, {"uid": np.array(["p1", "p2", "p1"], dtype=object), "item_id": np.array([3, 4, 5])})
    assert uid_item_ids([b, Batch({}, {"other": np.array([1])})], "p1") == {3, 5}


@pytest.mark.parametrize("override, why", [("rollout.engine=vllm", "rollout.engine=vllm processes the weights"),
                                           ("actor.lora={rank: 2}", "a LoRA policy is merged")])
def test_a_mapped_load_or_a_delta_needs_an_hf_rollout_of_the_full_policy(override, why):
    from distflow_lab.algos.registry import load_run_config

    load_run_config("tiny-cpu-grpo", ["weight_sync.load=map"]).check_sizes()
    with pytest.raises(ConfigError, match=f"weight_sync.load=map needs an HF rollout of the full policy: {why}"):
        load_run_config("tiny-cpu-grpo", ["weight_sync.load=map", override]).check_sizes()
    with pytest.raises(ConfigError, match=f"weight_sync.mode=delta patches an HF rollout's own weights: {why}"):
        load_run_config("tiny-cpu-grpo", ["weight_sync.mode=delta", override]).check_sizes()
    with pytest.raises(ConfigError, match="weight_sync.mode=delta patches the rollout's own weights, and load=map"):
        load_run_config("tiny-cpu-grpo", ["weight_sync.mode=delta", "weight_sync.load=map"]).check_sizes()


@pytest.mark.parametrize("preset", ["tiny-cpu-grpo", "tiny-cpu-ppo", "tiny-cpu-dapo", "tiny-cpu-gspo"])
def test_reopen_overrides_change_only_the_engine_keys(preset):
    """Session.reopen(overrides=...) rebuilds the engines from the run config with only the given
    micro-batch budgets changed, for every algorithm (the algorithm's own defaults survive the
    round trip); a key that may change the DAG is refused by name."""
    from distflow_lab.algos.registry import load_run_config
    from distflow_lab.core.config import engine_overrides

    cfg = load_run_config(preset)
    new = engine_overrides(cfg, ["actor.micro_token_budget=512", "critic.micro_token_budget=256"])
    assert new.model_dump() == cfg.model_copy(update={
        "actor": cfg.actor.model_copy(update={"micro_token_budget": 512}),
        "critic": cfg.critic.model_copy(update={"micro_token_budget": 256})}).model_dump()
    with pytest.raises(ConfigError, match="'rollout.n' may change the DAG"):
        engine_overrides(cfg, ["rollout.n=2"])
    with pytest.raises(ConfigError, match="has none"):
        engine_overrides(None, ["actor.micro_token_budget=512"])
