"""Built-in DAG shapes for GRPO and PPO. The shape (nodes, roles, types,
dependencies, layouts) is fixed here; the stage functions are passed in, so the
synthetic workload, the real algorithms and a researcher's variants share it.

GRPO (paper Table 1 order):
    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update
PPO adds critic values before the advantage (GAE needs them) and a critic update:
    data -> rollout -> reward -> old_log_prob -> ref_log_prob -> values -> advantage
         -> critic_update -> actor_update
Rollout, reward and advantage run with the rollout layout (tensor parallel
`rollout_tp`); the rest with the training layout (dp = world size). So the
single layout change — and the only DataBuffer redistribution — is where the
data enters the training stages, as in the paper's Table 1.

With `groups` (e.g. {"rollout": 2, "train": 2}) the generation stages (data,
rollout, reward, advantage) run on the first group and the training stages on
the second: disjoint workers, the layout the asynchronous schedules need.
"""
from __future__ import annotations

from typing import Any, Mapping

from distflow_lab.core.config import DataSpec, check_groups
from distflow_lab.core.errors import DAGError
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.nodes import Layout, StageFn

GRPO_NODES = ("data", "rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update")
PPO_NODES = ("data", "rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage",
             "critic_update", "actor_update")


def _need(fns: Mapping[str, Any], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in fns]
    if missing:
        raise ValueError(f"stage functions missing for nodes {missing}; this DAG needs {list(names)}")


def _layouts(rollout_tp: int, groups: Mapping[str, int] | None) -> tuple[Layout, Layout]:
    """(generation layout, training layout); with groups, each on its own group."""
    if not groups:
        return Layout(tp=rollout_tp), Layout()
    check_groups(groups, pair=True, where="groups", error=DAGError)
    gen, train = list(groups)
    return Layout(tp=rollout_tp, group=gen), Layout(group=train)


def grpo_shape(fns: Mapping[str, str | StageFn], data: DataSpec | dict, rollout_tp: int = 1,
               extras: Mapping[str, dict] | None = None, name: str = "grpo",
               groups: Mapping[str, int] | None = None) -> DAG:
    """GRPO's DAG with the given stage functions (keys: GRPO_NODES; "data" is usually the sharded
    loader `datasets.loader.load_batch`, which callers pass: graph sits below datasets), the data node's `data`, and per-node
    `extras` (node fields such as `contract`, `params`, `timeout_s`)."""
    fns = dict(fns)
    _need(fns, GRPO_NODES)
    x = {k: dict(v) for k, v in (extras or {}).items()}
    gen, train = _layouts(rollout_tp, groups)
    return (
        DAG(name, groups=dict(groups) if groups else None)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, data=data, **x.get("data", {}))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              **x.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", deps=["rollout"], layout=gen, **x.get("reward", {}))
        .node("advantage", fns["advantage"], role="advantage", deps=["reward"], layout=gen,
              **x.get("advantage", {}))
        .node("old_log_prob", fns["old_log_prob"], role="actor", deps=["advantage"], layout=train,
              **x.get("old_log_prob", {}))
        .node("ref_log_prob", fns["ref_log_prob"], role="reference", deps=["advantage"], layout=train,
              **x.get("ref_log_prob", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train",
              deps=["old_log_prob", "ref_log_prob"], layout=train, **x.get("actor_update", {}))
    )


def ppo_shape(fns: Mapping[str, str | StageFn], data: DataSpec | dict, rollout_tp: int = 1,
              extras: Mapping[str, dict] | None = None, name: str = "ppo",
              groups: Mapping[str, int] | None = None) -> DAG:
    """PPO's DAG: GRPO's plus critic values and a critic update (GAE advantage)."""
    fns = dict(fns)
    _need(fns, PPO_NODES)
    x = {k: dict(v) for k, v in (extras or {}).items()}
    gen, train = _layouts(rollout_tp, groups)
    dag = (
        DAG(name, groups=dict(groups) if groups else None)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, data=data, **x.get("data", {}))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              **x.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", deps=["rollout"], layout=gen, **x.get("reward", {}))
    )
    for node, role in (("old_log_prob", "actor"), ("ref_log_prob", "reference"), ("values", "critic")):
        dag.node(node, fns[node], role=role, deps=["rollout"], layout=train, **x.get(node, {}))
    return (
        dag.node("advantage", fns["advantage"], role="advantage",
                 deps=["reward", "old_log_prob", "ref_log_prob", "values"], layout=train, **x.get("advantage", {}))
        .node("critic_update", fns["critic_update"], role="critic", type="train", deps=["advantage"],
              layout=train, **x.get("critic_update", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train", deps=["advantage"],
              layout=train, **x.get("actor_update", {}))
    )
