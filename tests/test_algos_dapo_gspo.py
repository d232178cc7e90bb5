"""DAPO and GSPO without Ray: hand-computed losses and advantages, the dynamic-sampling stage
on fake engines, config errors that name the field. Every expected number is a literal
derived in the comment next to it."""
import math

import numpy as np
import pytest
import torch

from distflow_lab.algos import dapo, grpo
from distflow_lab.algos.engine_setup import RLEngines
from distflow_lab.algos.losses import aggregate_loss, gspo_token_loss
from distflow_lab.algos.registry import algorithm_options, build_dag, with_defaults
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ConfigError, RunConfig, load_model, parse_run_config
from distflow_lab.graph.nodes import resolve_function
from distflow_lab.models.sequences import assemble_columns
from distflow_lab.models.tokenizer import build_char_tokenizer
from distflow_lab.runtime.context import local_context

T = torch.tensor
TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def close(a, b, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32).detach(),
                               torch.as_tensor(b, dtype=torch.float32), atol=atol, rtol=0)


def run_config(**sections) -> RunConfig:
    """A small DAPO config on one worker (dp 1); `sections` replace parts of it."""
    base = {"cluster": {"world_size": 1, "torch_distributed": False}, "data": {"prompts_per_step": 2},
            "rollout": {"n": 2, "max_response_len": 4},
            "algorithm": {"name": "dapo", "options": {"oversample": 2.0, "overlong_shaping": False}}}
    return load_model(RunConfig, {**base, **sections})


# ---------------------------------------------------------------- GSPO


def test_gspo_loss_hand_computed():
    old = T([[0.0, 0.0], [0.0, 0.0]])
    logp = T([[0.1, 0.3], [-0.2, 5.0]], requires_grad=True)  # 5.0 sits on padding: must not count
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    loss_mat, m = gspo_token_loss(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # s_0 = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.221403; s_1 = exp(-0.2 / 1) = 0.818731 (padding ignored)
    # row 0, A = +1: max(-1.221403, -clip(1.221403, 0.8, 1.2) = -1.2) = -1.2 (clipped), on both tokens
    # row 1, A = -2: max(2 * 0.818731, 2 * 0.818731) = 1.637462 (inside the range)
    close(loss_mat * mask, [[-1.2, -1.2], [1.637462, 0.0]])
    loss = aggregate_loss(loss_mat, mask, "seq-mean-token-mean")
    close(loss, 0.218731)  # (-1.2 + 1.637462) / 2
    loss.backward()
    # row 0 clipped: no gradient; row 1: d/dlogp (1/2)(1/1)(-A s_1,t) = 0.5 * 2 * s_1 = 0.818731
    close(logp.grad, [[0.0, 0.0], [0.818731, 0.0]])
    assert m["clipfrac"] == pytest.approx(2 / 3)  # 2 of 3 valid tokens are in the clipped response
    assert m["ratio"] == pytest.approx((2 * math.exp(0.2) + math.exp(-0.2)) / 3, abs=1e-6)
    assert m["approx_kl"] == pytest.approx(-(0.1 + 0.3 - 0.2) / 3, abs=1e-6)


def test_gspo_token_form_equals_sequence_objective():
    """The per-token form, seq-mean-token-mean aggregated, has GSPO's sequence-level objective
    (Eq. 5) as its value and its gradient, on random data with some responses clipped."""
    g = torch.Generator().manual_seed(0)
    B, L = 6, 5
    old = -torch.rand(B, L, generator=g) * 2
    new = (old + 0.3 * torch.randn(B, L, generator=g)).requires_grad_(True)
    mask = (torch.arange(L) < torch.randint(1, L + 1, (B, 1), generator=g)).float()
    a = torch.randn(B, generator=g)
    loss_mat, m = gspo_token_loss(old, new, a[:, None].expand(B, L), mask, 0.05, 0.1)
    aggregate_loss(loss_mat, mask, "seq-mean-token-mean").backward()
    grad_token = new.grad.clone()
    new.grad = None
    s = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))  # Eq. (7)
    j = torch.minimum(s * a, s.clamp(1 - 0.05, 1 + 0.1) * a).mean()  # Eq. (5)
    (-j).backward()
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-mean"), -j)
    close(grad_token, new.grad)
    assert 0 < m["clipfrac"] < 1  # both branches were exercised


class FakeActor:
    """Records what an actor_update hands to TrainEngine.train_step."""

    def train_step(self, mini, loss_fn, agg, with_entropy=False, mask_key="response_mask"):
        self.mini, self.loss_fn, self.agg = mini, loss_fn, agg
        return {"loss": 0.0}


def update_batch(ratio: float, adv: float) -> Batch:
    """One response of two tokens whose ratio pi/pi_old is `ratio` on every token."""
    cols = assemble_columns(T([[5, 6]]), T([[1, 1]]), T([[11, EOS]]), T([[1, 1]]))
    return Batch({**cols, "old_log_probs": torch.zeros(1, 2), "ref_log_probs": torch.zeros(1, 2),
                  "advantages": torch.full((1, 2), adv)}, {"uid": np.array(["p"], dtype=object)})


def run_update(cfg, batch):
    """The actor update stage of `cfg`'s DAG (every algorithm's is the shared one) on a fake engine."""
    dag = build_dag(cfg, "unused.parquet")
    actor = FakeActor()
    ctx = local_context(dag.plan(1), "actor_update", config=cfg, engines=RLEngines(TOK, None, actor=actor))
    resolve_function(dag["actor_update"].fn)(batch, ctx)
    return actor


def test_gspo_update_uses_sequence_mean_and_its_clip():
    cfg = run_config(algorithm={"name": "gspo"}, actor={"clip_ratio_low": 0.1, "clip_ratio_high": 0.1,
                                                        "use_kl_loss": False})
    b = update_batch(1.0, 1.0)
    actor = run_update(cfg, b)
    assert actor.agg == "seq-mean-token-mean" and "ref_log_probs" not in actor.mini
    logp = torch.log(T([[1.5, 1.5]]))  # s = 1.5 > 1.1: clipped to 1.1, A = 1 -> -1.1 per token
    loss, _, metrics = actor.loss_fn(actor.mini, logp, None)
    close(loss, [[-1.1, -1.1]])
    assert metrics["clipfrac"] == 1.0


# ---------------------------------------------------------------- DAPO: loss


@pytest.mark.parametrize("clip_higher, expected", [(True, -1.25), (False, -1.2)])
def test_dapo_clip_higher(clip_higher, expected):
    cfg = run_config(actor={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
                     algorithm={"name": "dapo", "options": {"clip_higher": clip_higher}})
    actor = run_update(cfg, update_batch(1.0, 1.0))
    # ratio 1.25, A = +1: clip-higher bound 1.28 leaves it, -1.25; the symmetric bound 1.2 cuts it, -1.2
    loss, _, _ = actor.loss_fn(actor.mini, torch.log(T([[1.25, 1.25]])), None)
    close(loss, [[expected, expected]])
    # ratio 0.75, A = -1: the low bound 1 - 0.2 = 0.8 holds either way: max(0.75, 0.8) = 0.8
    actor.mini["advantages"] = -torch.ones(1, 2)
    loss, _, _ = actor.loss_fn(actor.mini, torch.log(T([[0.75, 0.75]])), None)
    close(loss, [[0.8, 0.8]])


def test_dapo_token_level_loss_switch():
    on = run_update(run_config(), update_batch(1.0, 1.0))
    off = run_update(run_config(algorithm={"name": "dapo", "options": {"token_level_loss": False}}),
                     update_batch(1.0, 1.0))
    assert (on.agg, off.agg) == ("token-mean", "seq-mean-token-mean")
    # what the switch changes: losses [[1, 1, 1, 1], [3, pad, pad, pad]]
    loss, mask = T([[1.0, 1, 1, 1], [3, 9, 9, 9]]), T([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    close(aggregate_loss(loss, mask, "token-mean"), 1.4)  # (4 + 3) / 5 tokens: each token weighs the same
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.0)  # (1 + 3) / 2: each response weighs the same


# ---------------------------------------------------------------- DAPO: reward and advantage


def test_overlong_penalty_hand_computed():
    # L_max = 4, L_cache = 2: free up to 2 tokens, then -(|y| - 2) / 2, -1 past L_max; times 0.5
    close(dapo.overlong_penalty(T([1, 2, 3, 4, 5]), 4, 2, factor=0.5), [0.0, 0.0, -0.25, -0.5, -0.5])
    close(dapo.overlong_penalty(T([16, 17, 20]), 20, 4), [0.0, -0.25, -1.0])  # the paper's formula, factor 1


def scored_batch(cfg, texts, uids, lengths=None):
    """Responses spelled by `texts` (+ eos when they fit), prompts "1+6=", scored by dapo.score."""
    R = cfg.rollout.max_response_len
    resp, rmask = torch.zeros(len(texts), R, dtype=torch.long), torch.zeros(len(texts), R, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = (TOK.encode(t, add_special_tokens=False) + [EOS])[:R]
        resp[i, :len(ids)], rmask[i, :len(ids)] = T(ids), 1
    prompts = T([TOK.encode("1+6=", add_special_tokens=False)] * len(texts))
    cols = assemble_columns(prompts, torch.ones_like(prompts), resp, rmask)
    objects = {"uid": np.array(uids, dtype=object), "ground_truth": np.array(["7"] * len(texts), dtype=object),
               "data_source": np.array(["x"] * len(texts), dtype=object)}
    plan = build_dag(cfg, "unused.parquet").plan(1)
    engines = RLEngines(TOK, lambda src, text, truth: float(text.startswith(truth)))
    ctx = local_context(plan, "reward", config=cfg, engines=engines)
    return dapo.reward(Batch(cols, objects), ctx), ctx


def test_dapo_reward_and_advantage_hand_computed():
    cfg = run_config(algorithm={"name": "dapo", "options": {"overlong_shaping": True, "overlong_buffer_len": 2}})
    # lengths with eos: "7" 2, "77" 3, "xxxx" 4 (cut, no eos), "7777" 4; L_max 4, L_cache 2
    b, ctx = scored_batch(cfg, ["7", "77", "xxxx", "7777"], ["p0", "p0", "p1", "p1"])
    close(b["acc"], [1.0, 1.0, 0.0, 1.0])
    close(b["scores"], [1.0, 0.5, -1.0, 0.0])  # acc + [0, -(3-2)/2, -(4-2)/2, -(4-2)/2]
    assert ctx.metrics["reward/mean"] == 0.75 and ctx.metrics["reward/overlong_frac"] == 0.75
    adv = grpo.advantage(b, local_context(build_dag(cfg, "u.parquet").plan(1), "advantage", config=cfg))["advantages"]
    # p0: scores [1, 0.5], mean 0.75, unbiased std sqrt(2 * 0.25^2) = 0.353553 -> +-0.25 / 0.353553 = +-0.707107
    # p1: scores [-1, 0], mean -0.5, std 0.707107 -> -+0.707107; on every valid token
    close(adv[:, 0], [0.707105, -0.707105, -0.707106, 0.707106])
    close(adv * (1 - b["response_mask"]), torch.zeros(4, 4))


# ---------------------------------------------------------------- DAPO: dynamic sampling


class ScriptedRollout:
    """generate() answers from a script: one list of n texts per prompt, one script per call."""

    def __init__(self, scripts, R=4):
        self.scripts, self.R, self.calls = list(scripts), R, []

    def generate(self, prompt_ids, prompt_mask, seed):
        script = self.scripts.pop(0)
        assert len(script) == len(prompt_ids)
        self.calls.append((prompt_ids.clone(), seed))
        texts = [t for answers in script for t in answers]
        n = len(script[0])
        resp, rmask = (torch.zeros(len(texts), self.R, dtype=torch.long) for _ in range(2))
        for i, t in enumerate(texts):
            ids = TOK.encode(t, add_special_tokens=False) + [EOS]
            resp[i, :len(ids)], rmask[i, :len(ids)] = T(ids), 1
        return assemble_columns(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), resp, rmask)


def sample(cfg, scripts):
    """The rollout's first round over prompts p0..p3 ("0+7=", "1+6=", ...), scored; then dynamic_sampling."""
    rollout = ScriptedRollout(scripts)
    prompts = T([TOK.encode(f"{i}+{7 - i}=", add_special_tokens=False) for i in range(4)])
    cols = rollout.generate(prompts, torch.ones_like(prompts), seed=0)
    objects = {"uid": np.repeat([f"p{i}" for i in range(4)], 2).astype(object),
               "ground_truth": np.array(["7"] * 8, dtype=object), "data_source": np.array(["x"] * 8, dtype=object)}
    engines = RLEngines(TOK, lambda src, text, truth: float(text == truth), rollout=rollout)
    plan = build_dag(cfg, "unused.parquet").plan(1)
    b = dapo.score(Batch(cols, objects), local_context(plan, "reward", config=cfg, engines=engines))
    ctx = local_context(plan, "dynamic_sampling", config=cfg, engines=engines, seed=5)
    return dapo.dynamic_sampling(b, ctx), ctx, rollout, prompts


def test_dynamic_sampling_drops_equal_groups_and_samples_again():
    cfg = run_config()  # 2 prompts to train on, 4 generated (oversample 2), n = 2
    out, ctx, rollout, prompts = sample(cfg, [
        [["7", "x"], ["7", "7"], ["x", "x"], ["x", "x"]],  # round 1: p0 mixed; p1 all right; p2, p3 all wrong
        [["7", "7"], ["x", "7"], ["7", "x"]],  # round 2 (p1, p2, p3 again): p2 and p3 mixed now
    ])
    assert list(out["uid"]) == ["p0", "p0", "p2", "p2"]  # first 2 kept groups: p0 (round 1), p2 (round 2)
    close(out["acc"], [1.0, 0.0, 0.0, 1.0])  # p2's answers are round 2's
    assert torch.equal(rollout.calls[1][0], prompts[1:])  # round 2 re-sampled exactly the dropped prompts
    assert rollout.calls[1][1] == ctx.seed + 1  # with a seed of its own
    assert ctx.counts == {"dynamic_sampling/groups_generated": 7.0,  # 4 + 3
                          "dynamic_sampling/groups_dropped": 4.0,  # p1, p2, p3 in round 1, p1 in round 2
                          "dynamic_sampling/groups_trimmed": 1.0,  # p3: 3 kept, 2 needed
                          "dynamic_sampling/groups_short": 0.0, "dynamic_sampling/fallback": 0.0,
                          "dynamic_sampling/rows_out": 4.0}
    assert ctx.metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/fill": 1.0}


def test_dynamic_sampling_round_cap_leaves_the_batch_short():
    cfg = run_config(algorithm={"name": "dapo", "options": {"max_rounds": 2, "overlong_shaping": False}})
    out, ctx, rollout, _ = sample(cfg, [[["7", "x"], ["7", "7"], ["x", "x"], ["x", "x"]],
                                        [["7", "7"], ["x", "x"], ["x", "x"]]])  # round 2: still nothing new
    assert list(out["uid"]) == ["p0", "p0"] and not rollout.scripts  # 1 group of 2, after exactly 2 rounds
    assert ctx.counts["dynamic_sampling/groups_short"] == 1 and ctx.counts["dynamic_sampling/groups_dropped"] == 6
    assert ctx.metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/fill": 0.5}


def test_dynamic_sampling_never_empty():
    cfg = run_config(algorithm={"name": "dapo", "options": {"max_rounds": 1, "overlong_shaping": False}})
    out, ctx, _, _ = sample(cfg, [[["7", "7"], ["7", "7"], ["x", "x"], ["x", "x"]]])
    assert list(out["uid"]) == ["p0", "p0"]  # nothing mixed: the first dropped group, zero advantage
    assert ctx.counts["dynamic_sampling/fallback"] == 1 and ctx.metrics["dynamic_sampling/rounds"] == 1


def test_group_helpers():
    uid = np.array(["b", "b", "a", "a", "c"], dtype=object)
    assert dapo.mixed_groups(uid, T([1.0, 0.0, 1.0, 1.0, 0.0])).tolist() == [True, True, False, False, False]
    b = Batch({"x": torch.arange(5)}, {"uid": uid})
    assert dapo.first_groups(b, 2)["x"].tolist() == [0, 1, 2, 3]  # b then a, by first appearance
    assert dapo.num_groups(b) == 3 and len(dapo.mixed_groups(uid[:0], T([]))) == 0


# ---------------------------------------------------------------- DAGs and config


def test_dags_and_pool_size():
    cfg = with_defaults(parse_run_config("tiny-cpu-dapo"))
    plan = build_dag(cfg, "unused.parquet").plan(cfg.cluster.world_size)
    assert [s.id for s in plan.stages] == ["data", "rollout", "reward", "dynamic_sampling", "advantage",
                                           "old_log_prob", "actor_update"]  # no KL term: no reference pass
    assert plan.stages[0].data.batch_size == dapo.pool_size(cfg) == 48  # 32 prompts x 1.5
    odd = run_config(data={"prompts_per_step": 3}, cluster={"world_size": 2},
                     algorithm={"name": "dapo", "options": {"oversample": 1.5}})
    assert dapo.pool_size(odd) == 6  # 3 x 1.5 = 4.5 prompts, up to a multiple of dp 2
    off = with_defaults(parse_run_config("tiny-cpu-dapo", ["algorithm.options.dynamic_sampling=false",
                                                            "actor.use_kl_loss=true"]))
    plan = build_dag(off, "unused.parquet").plan(2)
    assert "dynamic_sampling" not in [s.id for s in plan.stages] and plan.stages[0].data.batch_size == 32
    assert "ref_log_prob" in [s.id for s in plan.stages]
    g = with_defaults(parse_run_config("tiny-cpu-gspo"))
    assert g.algorithm.adv_estimator == "grpo"
    assert [s.id for s in build_dag(g, "u.parquet").plan(2).stages][-2:] == ["old_log_prob", "actor_update"]


@pytest.mark.parametrize("preset, overrides, message", [
    ("tiny-cpu-dapo", ["actor.clip_ratio_high=0.1"],
     r"actor\.clip_ratio_high=0\.1 < actor\.clip_ratio_low=0\.2: DAPO's clip-higher"),
    ("tiny-cpu-dapo", ["algorithm.options.overlong_buffer_len=4"],
     r"algorithm\.options\.overlong_buffer_len=4 must be < rollout\.max_response_len=4"),
    ("tiny-cpu-dapo", ["actor.loss_agg_mode=seq-mean-token-sum"],
     r"actor\.loss_agg_mode='seq-mean-token-sum' contradicts algorithm\.options\.token_level_loss=true"),
    ("tiny-cpu-dapo", ["algorithm.options.max_round=2"], r"algorithm\.options: algorithm 'dapo': option 'max_round': unknown key"),
    ("tiny-cpu-dapo", ["algorithm.options.oversample=0.5"], r"algorithm\.options: algorithm 'dapo': option 'oversample': Input should be greater"),
    ("tiny-cpu-dapo", ["algorithm.adv_estimator=gae"], r"algorithm\.adv_estimator: dapo does not support 'gae'"),
    ("tiny-cpu-grpo", ["algorithm.options.max_rounds=2"],
     r"algorithm\.options: algorithm 'grpo': option 'max_rounds': unknown key \(its options: none\)"),
    ("tiny-cpu-gspo", ["actor.loss_agg_mode=token-mean"],
     r"actor\.loss_agg_mode='token-mean' contradicts GSPO's sequence-level objective"),
])
def test_config_errors_name_the_field(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        with_defaults(parse_run_config(preset, overrides))


def test_switches_off_are_valid():
    # clip-higher off ignores clip_ratio_high (the symmetric clip uses the low bound), so high < low is fine
    cfg = with_defaults(parse_run_config("tiny-cpu-dapo", ["algorithm.options.clip_higher=false",
                                                            "actor.clip_ratio_high=0.1"]))
    assert dapo.dapo_actor(cfg).clip_ratio_high == 0.2
    cfg = with_defaults(parse_run_config("tiny-cpu-dapo", ["algorithm.options.overlong_shaping=false",
                                                            "algorithm.options.overlong_buffer_len=9"]))
    assert algorithm_options(cfg).buffer_len(4) == 9  # unused with shaping off
    assert dapo.DAPOOptions().buffer_len(8) == 2  # default: a quarter of the longest response
