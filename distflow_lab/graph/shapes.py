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
"""
from __future__ import annotations

from typing import Any, Mapping

from distflow_lab.core.config import DataSpec
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.nodes import Layout, StageFn

GRPO_NODES = ("data", "rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update")
PPO_NODES = ("data", "rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage",
             "critic_update", "actor_update")
LOADER = "distflow_lab.datasets.loader:load_batch"


def _need(fns: Mapping[str, Any], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in fns]
    if missing:
        raise ValueError(f"stage functions missing for nodes {missing}; this DAG needs {list(names)}")


def grpo_shape(fns: Mapping[str, str | StageFn], data: DataSpec | dict, rollout_tp: int = 1,
               extras: Mapping[str, dict] | None = None, name: str = "grpo") -> DAG:
    """GRPO's DAG with the given stage functions (keys: GRPO_NODES; "data" defaults to the
    sharded loader), the data node's `data`, and per-node `extras` (node fields such as
    `contract`, `params`, `timeout_s`)."""
    fns = {"data": LOADER, **fns}
    _need(fns, GRPO_NODES)
    x = {k: dict(v) for k, v in (extras or {}).items()}
    gen = Layout(tp=rollout_tp)
    return (
        DAG(name)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, data=data, **x.get("data", {}))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              **x.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", deps=["rollout"], layout=gen, **x.get("reward", {}))
        .node("advantage", fns["advantage"], role="advantage", deps=["reward"], layout=gen,
              **x.get("advantage", {}))
        .node("old_log_prob", fns["old_log_prob"], role="actor", deps=["advantage"], **x.get("old_log_prob", {}))
        .node("ref_log_prob", fns["ref_log_prob"], role="reference", deps=["advantage"],
              **x.get("ref_log_prob", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train",
              deps=["old_log_prob", "ref_log_prob"], **x.get("actor_update", {}))
    )


def ppo_shape(fns: Mapping[str, str | StageFn], data: DataSpec | dict, rollout_tp: int = 1,
              extras: Mapping[str, dict] | None = None, name: str = "ppo") -> DAG:
    """PPO's DAG: GRPO's plus critic values and a critic update (GAE advantage)."""
    fns = {"data": LOADER, **fns}
    _need(fns, PPO_NODES)
    x = {k: dict(v) for k, v in (extras or {}).items()}
    gen = Layout(tp=rollout_tp)
    dag = (
        DAG(name)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, data=data, **x.get("data", {}))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              **x.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", deps=["rollout"], layout=gen, **x.get("reward", {}))
    )
    for node, role in (("old_log_prob", "actor"), ("ref_log_prob", "reference"), ("values", "critic")):
        dag.node(node, fns[node], role=role, deps=["rollout"], **x.get(node, {}))
    return (
        dag.node("advantage", fns["advantage"], role="advantage",
                 deps=["reward", "old_log_prob", "ref_log_prob", "values"], **x.get("advantage", {}))
        .node("critic_update", fns["critic_update"], role="critic", type="train", deps=["advantage"],
              **x.get("critic_update", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train", deps=["advantage"],
              **x.get("actor_update", {}))
    )
