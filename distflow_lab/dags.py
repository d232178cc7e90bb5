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

from .dag import DAG, Layout, StageFn

GRPO_NODES = ("data", "rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update")
PPO_NODES = ("data", "rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage",
              "critic_update", "actor_update")


def _need(fns: Mapping[str, Any], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in fns]
    if missing:
        raise ValueError(f"stage functions missing for nodes {missing}; this DAG needs {list(names)}")


def grpo_shape(fns: Mapping[str, str | StageFn], data: dict[str, Any], rollout_tp: int = 1,
               configs: Mapping[str, dict] | None = None, name: str = "grpo") -> DAG:
    """GRPO's DAG with the given stage functions (keys: GRPO_NODES minus "data"
    unless you want a custom loader) and data-node config `data`."""
    fns = {"data": "distflow_lab.data.loader:load_batch", **fns}
    _need(fns, GRPO_NODES)
    cfg = {k: dict(v) for k, v in (configs or {}).items()}
    gen = Layout(tp=rollout_tp)
    return (
        DAG(name)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, config=dict(data))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              config=cfg.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", type="compute", deps=["rollout"], layout=gen,
              config=cfg.get("reward", {}))
        .node("advantage", fns["advantage"], role="advantage", type="compute", deps=["reward"], layout=gen,
              config=cfg.get("advantage", {}))
        .node("old_log_prob", fns["old_log_prob"], role="actor", type="compute", deps=["advantage"],
              config=cfg.get("old_log_prob", {}))
        .node("ref_log_prob", fns["ref_log_prob"], role="reference", type="compute", deps=["advantage"],
              config=cfg.get("ref_log_prob", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train",
              deps=["old_log_prob", "ref_log_prob"], config=cfg.get("actor_update", {}))
    )


def ppo_shape(fns: Mapping[str, str | StageFn], data: dict[str, Any], rollout_tp: int = 1,
              configs: Mapping[str, dict] | None = None, name: str = "ppo") -> DAG:
    """PPO's DAG: GRPO's plus critic values and a critic update (GAE advantage)."""
    fns = {"data": "distflow_lab.data.loader:load_batch", **fns}
    _need(fns, PPO_NODES)
    cfg = {k: dict(v) for k, v in (configs or {}).items()}
    gen = Layout(tp=rollout_tp)
    dag = (
        DAG(name)
        .node("data", fns["data"], role="data", type="data_load", layout=gen, config=dict(data))
        .node("rollout", fns["rollout"], role="rollout", type="generate", deps=["data"], layout=gen,
              config=cfg.get("rollout", {}))
        .node("reward", fns["reward"], role="reward", type="compute", deps=["rollout"], layout=gen,
              config=cfg.get("reward", {}))
    )
    for node, role in (("old_log_prob", "actor"), ("ref_log_prob", "reference"), ("values", "critic")):
        dag.node(node, fns[node], role=role, type="compute", deps=["rollout"], config=cfg.get(node, {}))
    return (
        dag.node("advantage", fns["advantage"], role="advantage", type="compute",
                 deps=["reward", "old_log_prob", "ref_log_prob", "values"], config=cfg.get("advantage", {}))
        .node("critic_update", fns["critic_update"], role="critic", type="train", deps=["advantage"],
              config=cfg.get("critic_update", {}))
        .node("actor_update", fns["actor_update"], role="actor", type="train", deps=["advantage"],
              config=cfg.get("actor_update", {}))
    )
