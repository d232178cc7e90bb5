"""The one actor update and the KL-in-reward path, without Ray: every algorithm's
actor_update advances the policy version (so worker groups get new weights), reads
every column its enabled terms need, and every estimator sees a KL-shaped reward;
each algorithm's paper defaults fill in only what the user left unset."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from distflow_lab.algos import grpo
from distflow_lab.algos.engine_setup import Policy, RLEngines
from distflow_lab.algos.registry import algorithm_names, build_dag, with_defaults
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ConfigError, RunConfig, load_model
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.sequences import assemble_columns
from distflow_lab.runtime.context import local_context

T = torch.tensor


def run_config(name: str, **sections) -> RunConfig:
    base = {"cluster": {"world_size": 1, "torch_distributed": False}, "data": {"prompts_per_step": 2},
            "rollout": {"n": 2, "max_response_len": 3, "log_probs": True}, "algorithm": {"name": name}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return with_defaults(load_model(RunConfig, base))


class FakeActor:
    """Records what the update hands TrainEngine.train_step, and runs the loss once."""

    def __init__(self):
        self.calls = []

    def train_step(self, mini, loss_fn, agg, with_entropy=False, mask_key="response_mask"):
        lp = mini.get("old_log_probs", -torch.ones_like(mini["advantages"])) + 0.1  # from_update: no column
        loss, mask, metrics = loss_fn(mini, lp, torch.ones_like(lp) if with_entropy else None)
        self.calls.append((set(mini), agg, loss))
        return {"loss": float(loss.sum()), "is_ratio_max": float(len(self.calls)), **metrics}


def batch(rows: int = 4) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 20, (rows, 2), generator=g)
    responses = torch.randint(3, 20, (rows, 3), generator=g)
    mask = T([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])[:rows]
    cols = assemble_columns(prompts, torch.ones_like(prompts), responses, mask)
    lp = -torch.rand(rows, 3, generator=g) * mask
    return Batch({**cols, "old_log_probs": lp, "ref_log_probs": lp - 0.2 * mask, "rollout_log_probs": lp + 0.05 * mask,
                  "advantages": torch.randn(rows, 3, generator=g) * mask, "scores": T([1.0, 0.0, 1.0, 0.0])[:rows],
                  "values": torch.zeros(rows, 3)},
                 {"uid": np.array(["a"] * rows, dtype=object)})


@pytest.mark.parametrize("name", algorithm_names())
@pytest.mark.parametrize("off_policy", ["none", "decoupled", "tis"])
def test_every_algorithms_update_advances_the_policy_and_reads_what_it_needs(name, off_policy):
    cfg = run_config(name, actor={"off_policy": off_policy, "use_kl_loss": True, "mini_batches": 2})
    dag = build_dag(cfg, "unused.parquet")
    fn = resolve_function(dag["actor_update"].fn)
    engines = RLEngines(None, None, Policy(shared=False), actor=FakeActor())
    out = fn(batch(), local_context(dag.plan(1), "actor_update", config=cfg, engines=engines))
    assert len(out) == 4
    assert engines.policy.version == 1 and engines.policy.stale  # published (groups) / synced (colocated) next
    cols, agg, _ = engines.actor.calls[0]
    assert len(engines.actor.calls) == 2  # one optimizer step per mini-batch
    assert {"old_log_probs", "advantages", "ref_log_probs"} <= cols
    assert ("rollout_log_probs" in cols) == (off_policy != "none")
    if name == "gspo":
        assert agg == "seq-mean-token-mean"


def test_update_metrics_average_over_mini_batches_but_max_stays_a_max():
    cfg = run_config("grpo", actor={"mini_batches": 2})
    ctx = local_context(build_dag(cfg, "u.parquet").plan(1), "actor_update", config=cfg,
                        engines=RLEngines(None, None, actor=FakeActor()))
    grpo.actor_update(batch(), ctx)
    assert ctx.metrics["actor/is_ratio_max"] == 2.0  # the max of the two steps (1, 2), not their mean
    losses = [float(c[2].sum()) for c in ctx.engines.actor.calls]
    assert ctx.metrics["actor/loss"] == pytest.approx(sum(losses) / 2)


@pytest.mark.parametrize("name", [n for n in algorithm_names() if n != "ppo"])
@pytest.mark.parametrize("groups", [None, {"rollout": 1, "train": 1}])
def test_old_log_prob_from_update_drops_the_pass_and_measures_the_mismatch_in_the_update(name, groups):
    cfg = run_config(name, actor={"old_log_prob": "from_update", "off_policy": "tis", "use_kl_loss": True},
                     cluster={"world_size": 2 if groups else 1, "torch_distributed": bool(groups)},
                     **({"groups": groups} if groups else {}))
    dag = build_dag(cfg, "unused.parquet")
    assert "old_log_prob" not in dag.ids and "ref_log_prob" in dag.ids
    order = [s.id for s in dag.plan(cfg.cluster.world_size).stages]
    assert order.index("advantage") < order.index("ref_log_prob") < order.index("actor_update")
    ctx = local_context(dag.plan(cfg.cluster.world_size), "actor_update", config=cfg,
                        engines=RLEngines(None, None, actor=FakeActor()))
    rows = batch()
    resolve_function(dag["actor_update"].fn)(Batch({k: v for k, v in rows.tensors.items() if k != "old_log_probs"},
                                                   rows.objects), ctx)
    cols = ctx.engines.actor.calls[0][0]
    assert "old_log_probs" not in cols and "rollout_log_probs" in cols
    # the update's forward is the old policy: ratio 1, and the mismatch is rollout vs that forward (1 - 0.1 - lp)
    assert ctx.metrics["rollout/logprob_diff_mean"] > 0 and "actor/rollout/logprob_diff_mean" not in ctx.metrics


@pytest.mark.parametrize("change, named", [({"actor": {"mini_batches": 2}}, "actor.mini_batches=2"),
                                           ({"algorithm": {"use_kl_in_reward": True}}, "use_kl_in_reward"),
                                           ({"algorithm": {"name": "ppo"}}, "algorithm ppo")])
def test_old_log_prob_from_update_is_refused_where_the_update_is_not_the_old_policy(change, named):
    sections = {"actor": {"old_log_prob": "from_update", **change.get("actor", {})},
                **{k: v for k, v in change.items() if k != "actor"}}
    with pytest.raises(ConfigError, match=rf"actor.old_log_prob=from_update .*{named}"):
        run_config(sections.get("algorithm", {}).get("name", "grpo"), **sections)


@pytest.mark.parametrize("name", algorithm_names())
@pytest.mark.parametrize("groups", [None, {"rollout": 1, "train": 1}])
def test_kl_in_reward_puts_the_advantage_after_both_log_probs(name, groups):
    cfg = run_config(name, algorithm={"use_kl_in_reward": True}, actor={"use_kl_loss": False},
                     cluster={"world_size": 2 if groups else 1, "torch_distributed": bool(groups)},
                     **({"groups": groups} if groups else {}))
    dag = build_dag(cfg, "unused.parquet")
    order = [s.id for s in dag.plan(cfg.cluster.world_size).stages]
    assert order.index("advantage") > max(order.index("old_log_prob"), order.index("ref_log_prob"))
    assert dag["advantage"].layout == dag["old_log_prob"].layout  # the training layout (and group)
    off = run_config(name, actor={"use_kl_loss": False})
    if name != "ppo":  # nothing reads the reference without a KL term: no reference pass
        assert "ref_log_prob" not in build_dag(off, "unused.parquet").ids


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"])
def test_every_estimator_sees_the_kl_shaped_reward(estimator):
    name = "ppo" if estimator == "gae" else "grpo"
    b = batch()
    plain = run_config(name, algorithm={"adv_estimator": estimator})
    shaped = run_config(name, algorithm={"adv_estimator": estimator, "use_kl_in_reward": True, "kl_coef": 0.5,
                                         "kl_penalty": "k1"})

    def adv(cfg, b):
        ctx = local_context(build_dag(cfg, "u.parquet").plan(1), "advantage", config=cfg)
        return grpo.advantage(b, ctx)["advantages"], ctx

    a0, _ = adv(plain, b)
    a1, ctx = adv(shaped, b)
    assert not torch.allclose(a0, a1)  # old - ref = 0.2 per token: lengths now differ in reward
    # KL per token 0.2 (k1 of old vs ref), mean over rows of the per-row token mean
    assert ctx.metrics["reward/kl_penalty"] == pytest.approx(0.2, abs=1e-6)
    same = b.with_columns(ref_log_probs=b["old_log_probs"])
    torch.testing.assert_close(adv(shaped, same)[0], a0)  # no KL: the same advantages


def test_paper_defaults_fill_only_what_the_user_left_unset():
    g = run_config("gspo")
    assert (g.actor.clip_ratio_low, g.actor.clip_ratio_high) == (3e-4, 4e-4)
    g2 = run_config("gspo", actor={"clip_ratio_high": 0.01})
    assert (g2.actor.clip_ratio_low, g2.actor.clip_ratio_high) == (3e-4, 0.01)
    d = run_config("dapo")
    assert (d.actor.clip_ratio_low, d.actor.clip_ratio_high, d.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert with_defaults(d) == d  # applying them twice changes nothing
    p = run_config("grpo")
    assert (p.actor.clip_ratio_high, p.actor.clip_ratio_c) == (0.2, 3.0)
