"""DAG builder, validation errors, YAML round trip and the planner (no Ray)."""
from __future__ import annotations

import pytest

from distflow_lab.graph.dag import DAG, DAGError, Layout
from distflow_lab.graph.shapes import GRPO_NODES, PPO_NODES
from distflow_lab.graph.planner import plan
from distflow_lab.experiments.synthetic import synthetic_grpo, synthetic_ppo

NOOP = "distflow_lab.experiments.synthetic:actor_update"


def fig4_dag() -> DAG:
    """Paper Fig. 4: two inference nodes at the same depth."""
    return (
        DAG("fig4")
        .node("gen", NOOP, role="rollout", type="generate")
        .node("inference_1", NOOP, role="reference", deps=["gen"])
        .node("inference_2", NOOP, role="critic", deps=["gen"])
        .node("train", NOOP, role="actor", type="train", deps=["inference_1", "inference_2"])
    )


def test_fig4_parallel_nodes_become_a_chain():
    p = plan(fig4_dag(), world_size=4)
    assert [s.id for s in p.stages] == ["gen", "inference_1", "inference_2", "train"]
    assert [s.depth for s in p.stages] == [0, 1, 1, 2]
    assert [e.name for e in p.edges] == ["gen->inference_1", "inference_1->inference_2", "inference_2->train"]


def test_linearization_is_deterministic_and_follows_declaration_order():
    d = fig4_dag()
    assert [s.id for s in plan(d, 4).stages] == [s.id for s in plan(d.copy(), 4).stages]
    swapped = (
        DAG("fig4b")
        .node("gen", NOOP).node("inference_2", NOOP, deps=["gen"]).node("inference_1", NOOP, deps=["gen"])
        .node("train", NOOP, deps=["inference_1", "inference_2"])
    )
    assert [s.id for s in plan(swapped, 4).stages] == ["gen", "inference_2", "inference_1", "train"]


def test_edges_are_local_or_redistribute_by_dp_size():
    p = synthetic_grpo(rollout_tp=2).plan(8)
    kinds = {e.name: e.kind for e in p.edges}
    assert kinds["advantage->old_log_prob"] == "redistribute"
    assert [k for k in kinds.values()].count("redistribute") == 1
    assert p.stage("rollout").dp == 4 and p.stage("rollout").group_size == 2
    assert p.stage("actor_update").dp == 8 and p.stage("actor_update").group_size == 1
    df = p.to_frame()
    assert list(df["edge_in"]) == ["-", "local", "local", "local", "redistribute", "local", "local"]


def test_builtin_shapes():
    assert [s.id for s in synthetic_grpo().plan(2).stages] == list(GRPO_NODES)
    assert [s.id for s in synthetic_ppo().plan(2).stages] == list(PPO_NODES)
    ppo = synthetic_ppo(rollout_tp=2).plan(4)
    assert [e.name for e in ppo.edges if e.kind == "redistribute"] == ["reward->old_log_prob"]


def test_cycle_error_prints_the_cycle():
    d = DAG("c").node("a", NOOP).node("b", NOOP, deps=["a", "d"]).node("c", NOOP, deps=["b"]).node("d", NOOP, deps=["c"])
    with pytest.raises(DAGError, match=r"cycle: b -> c -> d -> b|cycle: c -> d -> b -> c|cycle: d -> b -> c -> d"):
        d.validate()


def test_self_dependency_is_a_cycle():
    with pytest.raises(DAGError, match="'a' depends on itself"):
        DAG("s").node("a", NOOP, deps=["a"]).validate()


def test_missing_dependency_names_node():
    with pytest.raises(DAGError, match="node 'b' depends on missing node 'zzz'"):
        DAG("m").node("a", NOOP).node("b", NOOP, deps=["zzz"]).validate()


def test_duplicate_id():
    with pytest.raises(DAGError, match="duplicate node id 'a'"):
        DAG("d").node("a", NOOP).node("a", NOOP)


def test_unresolvable_function_names_node():
    with pytest.raises(DAGError, match="node 'b': module 'distflow_lab.experiments.synthetic' has no attribute 'nope'"):
        DAG("u").node("a", NOOP).node("b", "distflow_lab.experiments.synthetic:nope", deps=["a"]).validate()
    with pytest.raises(DAGError, match="node 'c': cannot import module 'no_such_mod'"):
        DAG("u").node("c", "no_such_mod:f").validate()
    with pytest.raises(DAGError, match="node 'x'.*module:function"):
        DAG("u").node("x", "not-a-function-path")


def test_layout_must_divide_worker_count():
    d = DAG("l").node("a", NOOP, layout=Layout(dp=3))
    with pytest.raises(DAGError, match="node 'a': layout dp=3 x tp=1 does not divide 4 workers"):
        plan(d, 4)
    with pytest.raises(DAGError, match="node 'a'.*does not divide 6 workers"):
        plan(DAG("l").node("a", NOOP, layout=Layout(tp=4)), 6)
    assert plan(DAG("ok").node("a", NOOP, layout=Layout(dp=2)), 4).stages[0].group_size == 2


def test_no_entry_node():
    d = DAG("n").node("a", NOOP, deps=["b"]).node("b", NOOP, deps=["a"])
    with pytest.raises(DAGError, match="cycle"):
        d.validate()
    d2 = DAG("n2")
    with pytest.raises(DAGError, match="has no nodes"):
        d2.validate()


def test_unknown_node_field_and_bad_role_name_the_node():
    with pytest.raises(DAGError, match="node 'a'.*role"):
        DAG("r").node("a", NOOP, role="wizard")
    with pytest.raises(DAGError, match="<yaml>: node 'a'.*colour"):
        DAG.from_yaml("name: x\nnodes:\n  - {id: a, fn: 'm:f', colour: red}\n")


def test_yaml_round_trip():
    d = synthetic_grpo(rollout_tp=2)
    text = d.to_yaml()
    back = DAG.from_yaml(text)
    assert back.to_yaml() == text
    assert [n.model_dump() for n in back] == [n.model_dump() for n in d]
    assert plan(back, 4).to_frame().equals(plan(d, 4).to_frame())


def test_yaml_file_round_trip(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(synthetic_ppo().to_yaml())
    assert DAG.from_yaml(str(path)).to_yaml() == path.read_text()
    with pytest.raises(DAGError, match="does not exist"):
        DAG.from_yaml(str(tmp_path / "missing.yaml"))


def test_notebook_function_cannot_go_to_yaml_but_runs():
    def my_stage(batch, ctx):
        return batch

    d = DAG("nb").node("a", my_stage)
    d.validate()
    with pytest.raises(DAGError, match="node 'a'.*defined in a notebook or locally"):
        d.to_yaml()


def test_edit_cell_by_cell():
    d = fig4_dag()
    d.replace("inference_2", layout=Layout(dp=2))
    assert plan(d, 4).edges[1].kind == "redistribute"
    d.remove("inference_2").replace("train", deps=["inference_1"])
    assert [s.id for s in plan(d, 4).stages] == ["gen", "inference_1", "train"]
    with pytest.raises(DAGError, match="no node 'ghost'"):
        d.remove("ghost")
