"""Hand-computed checks for distflow_lab.algos (advantage estimators and losses).

Every expected number is a literal derived in the comment next to it.
"""
import math

import numpy as np
import pytest
import torch

from distflow_lab.algos.estimators import (
    ESTIMATORS,
    run_estimator,
    discounted_returns,
    dr_grpo_outcome_advantage,
    gae_advantage,
    grpo_outcome_advantage,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    reinforce_plus_plus_advantage,
    rloo_advantage,
)
from distflow_lab.algos.losses import (
    LOSS_AGG_MODES,
    aggregate_loss,
    masked_mean,
    apply_kl_in_reward,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    log_probs_from_logits,
    policy_loss_ppo,
    value_loss_clipped,
)

from distflow_lab.models.token_ops import loss_count

T = torch.tensor


def close(a, b, atol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    torch.testing.assert_close(a.detach(), b.detach(), atol=atol, rtol=0)


# ---------------------------------------------------------------- masked stats


def test_masked_mean_var_whiten():
    x, m = T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0])
    close(masked_mean(x, m), 2.0)  # (1+2+3)/3
    close(masked_var(x, m), 1.0)  # (1+0+1)/2
    close(masked_var(x, m, unbiased=False), 2 / 3)  # (1+0+1)/3
    close(masked_whiten(x, m)[:3], [-1.0, 0.0, 1.0])  # (x-2)/1
    close(masked_whiten(x, m, shift_mean=False)[:3], [1.0, 2.0, 3.0])  # scale 1, mean added back
    # dim: rows [1,3 | pad] -> 2 and [5 | pad pad] -> 5
    close(masked_mean(T([[1.0, 3.0, 7.0], [5.0, 9.0, 9.0]]), T([[1, 1, 0], [1, 0, 0]]), dim=-1), [2.0, 5.0])
    # NaN/inf on padding must not leak
    close(masked_mean(T([1.0, float("nan"), float("inf")]), T([1.0, 0.0, 0.0])), 1.0)
    with pytest.raises(ValueError):
        masked_var(T([1.0, 2.0]), T([1.0, 0.0]))  # one element: unbiased var undefined


# ---------------------------------------------------------------- GRPO / Dr. GRPO


def test_grpo_single_group():
    # scores [1,0,1,0]: mean 0.5, unbiased std sqrt(4*0.25/3) = 0.57735 -> +-0.5/0.57735 = +-0.866025
    mask = torch.ones(4, 2)
    adv, ret = grpo_outcome_advantage(T([1.0, 0.0, 1.0, 0.0]), mask, np.array(["p"] * 4, dtype=object))
    close(adv[:, 0], [0.866025, -0.866025, 0.866025, -0.866025])
    close(adv[:, 1], adv[:, 0])  # broadcast to every token
    assert torch.equal(adv, ret)
    # Dr. GRPO: only the mean is subtracted -> +-0.5
    adv_dr, _ = grpo_outcome_advantage(T([1.0, 0.0, 1.0, 0.0]), mask, [0, 0, 0, 0], norm_by_std=False)
    close(adv_dr[:, 0], [0.5, -0.5, 0.5, -0.5])
    close(dr_grpo_outcome_advantage(T([1.0, 0.0, 1.0, 0.0]), mask, [0, 0, 0, 0])[0], adv_dr)


def test_grpo_groups_singleton_zero_std_and_mask():
    # group a: [2,4] mean 3, std sqrt(2) -> -0.707107, +0.707107
    # group b: [5] size 1 -> mean 0, std 1 -> 5/(1+1e-6) = 5.0 (verl convention)
    # group c: [3,3] std 0 -> 0/(0+eps) = 0
    scores = T([2.0, 5.0, 4.0, 3.0, 3.0])
    index = np.array(["a", "b", "a", "c", "c"], dtype=object)
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    adv, _ = grpo_outcome_advantage(scores, mask, index)
    close(adv[:, 0], [-0.707107, 5.0, 0.707107, 0.0, 0.0])
    close(adv[0], [-0.707107, -0.707107, 0.0])  # padding zeroed
    close(adv[1], [5.0, 0.0, 0.0])
    adv_dr, _ = grpo_outcome_advantage(scores, mask, index, norm_by_std=False)
    close(adv_dr[:, 0], [-1.0, 5.0, 1.0, 0.0, 0.0])  # a: -+1 ; b: 5 - 0
    close(scores, [2.0, 5.0, 4.0, 3.0, 3.0])  # input not modified in place
    # a torch index works too (0-d tensors must not hash by identity)
    adv_t, _ = grpo_outcome_advantage(scores, mask, torch.tensor([0, 1, 0, 2, 2]))
    close(adv_t, adv)


# ---------------------------------------------------------------- RLOO


def test_rloo():
    # [1,0,1,0]: A_0 = 1 - (0+1+0)/3 = 0.666667 ; A_1 = 0 - (1+1+0)/3 = -0.666667
    adv, ret = rloo_advantage(T([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 2), [7, 7, 7, 7])
    close(adv[:, 0], [0.666667, -0.666667, 0.666667, -0.666667])
    assert torch.equal(adv, ret)
    # groups {x: [3,1]} -> 3-1 = 2, 1-3 = -2 ; {y: [2]} size 1 -> baseline 0, A = raw score 2 (verl)
    mask = T([[1, 1], [1, 0], [1, 1]], dtype=torch.float32)
    adv, _ = rloo_advantage(T([3.0, 2.0, 1.0]), mask, ["x", "y", "x"])
    close(adv, [[2.0, 2.0], [2.0, 0.0], [-2.0, -2.0]])


# ---------------------------------------------------------------- token rewards / REINFORCE++


def test_outcome_to_token_rewards():
    mask = T([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    r = outcome_to_token_rewards(T([1.0, 2.0, 3.0]), mask)
    close(r, [[0, 1, 0], [0, 0, 2], [0, 0, 0]])  # last valid token; empty row gets nothing


def test_discounted_returns():
    # gamma 0.9, r=[0,0,1]: G = [0.81, 0.9, 1]
    close(discounted_returns(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 0.9), [[0.81, 0.9, 1.0]])
    # gamma 0.5, r=[1,2,(5 on padding)]: G_1 = 2, G_0 = 1 + 0.5*2 = 2, padding 0 and ignored
    close(discounted_returns(T([[1.0, 2.0, 5.0]]), T([[1.0, 1.0, 0.0]]), 0.5), [[2.0, 2.0, 0.0]])


def test_reinforce_plus_plus():
    # outcome scores [4,2] on masks [111],[110] -> r = [[0,0,4],[0,2,0]]
    # gamma 0.5: G = [[1,2,4],[1,2,0]]
    # whiten over the 5 valid: mean 2, dev [-1,0,2,-1,0], var 6/4 = 1.5, std 1.224745
    # -> A = [-0.816497, 0, 1.632993 | -0.816497, 0, pad 0]
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    r = outcome_to_token_rewards(T([4.0, 2.0]), mask)
    adv, ret = reinforce_plus_plus_advantage(r, mask, gamma=0.5)
    close(ret, [[1.0, 2.0, 4.0], [1.0, 2.0, 0.0]])
    close(adv, [[-0.816497, 0.0, 1.632993], [-0.816497, 0.0, 0.0]])


# ---------------------------------------------------------------- GAE


def test_gae_gamma_lam_one_is_return_minus_value():
    # gamma=lam=1: A_t = sum_{k>=t} r_k - V_t, next value after the last valid token is 0.
    # row0 r=[0,0,1], V=[.5,.2,.7]: G=[1,1,1] -> A=[.5,.8,.3], returns = A+V = [1,1,1]
    # row1 r=[0,1,pad], V=[.3,.6,9 (pad, ignored)]: G=[1,1] -> A=[.7,.4,0], returns [1,1,0]
    r = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    v = T([[0.5, 0.2, 0.7], [0.3, 0.6, 9.0]])
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, ret = gae_advantage(r, v, mask, 1.0, 1.0, whiten=False)
    close(adv, [[0.5, 0.8, 0.3], [0.7, 0.4, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # whitened: valid raw [.5,.8,.3,.7,.4] mean .54, dev [-.04,.26,-.24,.16,-.14],
    # sum sq .172, var .172/4 = .043, std .207364 -> dev/std
    adv_w, ret_w = gae_advantage(r, v, mask, 1.0, 1.0)
    close(adv_w, [[-0.192897, 1.253831, -1.157382], [0.771588, -0.675139, 0.0]])
    close(ret_w, ret)  # returns come from the raw advantages


def test_gae_discounted():
    # gamma=lam=0.5, r=[0,1], V=[1,2]:
    # t=1: delta = 1 + 0.5*0 - 2 = -1, A_1 = -1
    # t=0: delta = 0 + 0.5*2 - 1 = 0, A_0 = 0 + 0.25*(-1) = -0.25 ; returns = [0.75, 1]
    adv, ret = gae_advantage(T([[0.0, 1.0]]), T([[1.0, 2.0]]), torch.ones(1, 2), 0.5, 0.5, whiten=False)
    close(adv, [[-0.25, -1.0]])
    close(ret, [[0.75, 1.0]])


def test_registry():
    from distflow_lab.algos.registry import ALGORITHMS, algorithm
    from distflow_lab.core.batch import Batch
    from distflow_lab.core.config import AlgorithmOptions

    assert set(ESTIMATORS) >= {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"}
    algorithm("grpo")  # declares the built-in ones
    for name in ALGORITHMS:  # every declared default exists and is of a kind the algorithm runs
        decl = algorithm(name)
        assert ESTIMATORS.get(decl.estimator).facts["kind"] in decl.estimator_kinds, name
    s, m = T([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 3)
    b = Batch({"scores": s, "response_mask": m, "values": torch.zeros(4, 3)}, {"uid": ["0"] * 4})
    alg = AlgorithmOptions()
    close(run_estimator("dr_grpo", b, alg)[0][:, 0], [0.5, -0.5, 0.5, -0.5])
    close(run_estimator("grpo", b, alg)[0][:, 0], [0.866025, -0.866025] * 2)
    close(run_estimator("gae", b, alg)[0], run_estimator("reinforce_plus_plus", b, alg)[0])  # V=0, gamma=lam=1
    with_kl = b.with_columns(token_rewards=outcome_to_token_rewards(s, m) * 2)  # a stage put rewards in a column
    assert not torch.equal(run_estimator("gae", with_kl, alg)[1], run_estimator("gae", b, alg)[1])


def test_outcome_estimators_read_token_rewards():
    # A KL-shaped reward reaches every estimator (verl: score = token_level_rewards.sum(-1)).
    # token_rewards rows sum to [1, 0, 3, 0] while `scores` says [1, 0, 1, 0]:
    # dr_grpo: mean 1 -> [0, -1, 2, -1] ; rloo: s_i - (4 - s_i)/3 -> [0, -4/3, 8/3, -4/3]
    from distflow_lab.core.batch import Batch
    from distflow_lab.core.config import AlgorithmOptions

    r = T([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-0.25, 0.25, 0.0]])
    b = Batch({"scores": T([1.0, 0.0, 1.0, 0.0]), "response_mask": torch.ones(4, 3), "token_rewards": r},
              {"uid": ["0"] * 4})
    alg = AlgorithmOptions()
    close(run_estimator("dr_grpo", b, alg)[0][:, 0], [0.0, -1.0, 2.0, -1.0])
    close(run_estimator("rloo", b, alg)[0][:, 0], [0.0, -4 / 3, 8 / 3, -4 / 3])
    # grpo: unbiased std of [1,0,3,0] = sqrt((0+1+4+1)/3) = sqrt(2) -> (s - 1)/1.414214
    close(run_estimator("grpo", b, alg)[0][:, 0], [0.0, -0.707107, 1.414214, -0.707107])


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_differ_on_unequal_lengths():
    L = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])  # 99 sits on padding
    m = T([[1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    close(aggregate_loss(L, m, "token-mean"), 2.5)  # (1+2+3+4)/4
    close(aggregate_loss(L, m, "seq-mean-token-mean"), 3.0)  # (6/3 + 4/1)/2
    close(aggregate_loss(L, m, "seq-mean-token-sum"), 5.0)  # (6 + 4)/2
    close(aggregate_loss(L, m, "seq-mean-token-sum-norm"), 5.0 / 3)  # (6 + 4)/2 rows/3 = padded width
    with pytest.raises(ValueError):
        aggregate_loss(L, m, "nope")


def test_aggregation_leaves_empty_rows_out_of_the_row_count():
    # the third row has no token: it adds nothing and is not a sequence of the mean (verl's seq_mask)
    L = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    m = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    close(aggregate_loss(L, m, "token-mean"), 2.5)  # (1+2+3+4)/4
    close(aggregate_loss(L, m, "seq-mean-token-mean"), 3.0)  # (2 + 4)/2, not /3
    close(aggregate_loss(L, m, "seq-mean-token-sum"), 5.0)  # (6 + 4)/2
    close(aggregate_loss(L, m, "seq-mean-token-sum-norm"), 5.0 / 3)  # (6 + 4)/(2 * 3)
    assert [loss_count(m, k) for k in LOSS_AGG_MODES] == [4.0, 2.0, 2.0, 2.0]
    close(aggregate_loss(L, torch.zeros_like(m), "seq-mean-token-mean"), 0.0)  # no rows at all: 0 (verl: NaN)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_invariant_to_row_permutation(mode):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, Tn = 6, 7
        L = torch.randn(B, Tn, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, Tn + 1, (B,), generator=g)
        m = (torch.arange(Tn) < lengths[:, None]).double()
        perm = torch.randperm(B, generator=g)
        torch.testing.assert_close(aggregate_loss(L[perm], m[perm], mode), aggregate_loss(L, m, mode))


# ---------------------------------------------------------------- PPO policy loss


def test_policy_loss_ppo_clip_and_dual_clip():
    # old_log_prob = 0, so ratio r = exp(log_prob). eps = 0.2, c = 3.
    #  A   r    -A*r  -A*clip(r)  max   dual (A<0 only)  final  clipped? dual?
    #  +1  1.5  -1.5  -1.2        -1.2  -               -1.2   yes
    #  +1  0.5  -0.5  -0.8        -0.5  -               -0.5   no
    #  -1  0.5   0.5   0.8         0.8  min(.8,3)        0.8   yes
    #  -1  4     4     1.2         4    min(4,3)         3     no      yes
    #  +1  4    -4    -1.2        -1.2  (not applied; would give -3)  -1.2  yes
    #  -1  1     1     1           1    min(1,3)         1     no
    #  pad token: A=-100, r=100 (must be ignored)
    A = T([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -100.0]])
    r = T([[1.5, 0.5, 0.5, 4.0, 4.0, 1.0, 100.0]])
    m = T([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)
    logp = r.log().requires_grad_()
    loss, met = policy_loss_ppo(torch.zeros_like(r), logp, A, m)
    close(loss, 1.9 / 6)  # (-1.2 - .5 + .8 + 3 - 1.2 + 1)/6 = 0.316667
    assert met["clipfrac"] == pytest.approx(3 / 6)
    assert met["clipfrac_lower"] == pytest.approx(1 / 6)
    # approx_kl = mean(old - logp) = -log(1.5*.5*.5*4*4*1)/6 = -log(6)/6 = -0.298627
    assert met["approx_kl"] == pytest.approx(-math.log(6) / 6, abs=1e-6)
    assert all(isinstance(v, float) for v in met.values())
    # gradient flows only through unclipped tokens: d(-A r)/dlogp = -A r -> token1: -.5/6, token5: 1/6
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 6, 0.0, 0.0, 0.0, 1.0 / 6, 0.0]])


def test_policy_loss_asymmetric_clip_higher():
    # A=+1, r=1.25: with high=0.2 clipped to 1.2 -> -1.2 ; with high=0.28 unclipped -> -1.25
    A, r, m = T([[1.0]]), T([[1.25]]), torch.ones(1, 1)
    close(policy_loss_ppo(torch.zeros(1, 1), r.log(), A, m)[0], -1.2)
    loss, met = policy_loss_ppo(torch.zeros(1, 1), r.log(), A, m, clip_ratio_high=0.28)
    close(loss, -1.25)
    assert met["clipfrac"] == 0.0


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    # d = logp - ref = log(.5) - log(.25) = log 2 = 0.693147
    lp, ref = T([math.log(0.5), math.log(0.25)]), T([math.log(0.25), math.log(0.5)])
    close(kl_penalty(lp, ref, "k1"), [0.693147, -0.693147])
    # k3 = exp(-d) + d - 1: d=+log2 -> .5 + .693147 - 1 = .193147 ; d=-log2 -> 2 - .693147 - 1 = .306853
    close(kl_penalty(lp, ref, "k3"), [0.193147, 0.306853])
    close(kl_penalty(lp, ref, "low_var_kl"), [0.193147, 0.306853])
    close(kl_penalty(lp, ref, "abs"), [0.693147, 0.693147])
    close(kl_penalty(lp, ref, "mse"), [0.240227, 0.240227])  # 0.5 * 0.480453
    # clamp: d = -30 -> x clamped to 20, exp(20) - 21 -> clamped to 10
    close(kl_penalty(T([-30.0]), T([0.0]), "k3"), [10.0])
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "nope")


def test_kl_loss():
    # token-mean of k3 over valid tokens [.193147, .306853] (third token is padding)
    lp = T([[math.log(0.5), math.log(0.25), 0.0]])
    ref = T([[math.log(0.25), math.log(0.5), -50.0]])
    m = T([[1.0, 1.0, 0.0]])
    close(kl_loss(lp, ref, m), 0.25)  # (.193147 + .306853)/2
    close(kl_loss(lp, ref, m, kind="k1"), 0.0)


def test_apply_kl_in_reward():
    # k1 = old - ref = [[.1,.2,.3],[.4,.5,(9 pad)]], coef .1:
    # r' = [[0-.01, 0-.02, 1-.03], [0-.04, 1-.05, 0]]
    # mean_kl = mean(per-seq token-mean) = ((.1+.2+.3)/3 + (.4+.5)/2)/2 = (.2 + .45)/2 = .325
    r = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    old = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    m = T([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    r2, mean_kl = apply_kl_in_reward(r, old, torch.zeros_like(old), m, coef=0.1)
    close(r2, [[-0.01, -0.02, 0.97], [-0.04, 0.95, 0.0]])
    assert mean_kl == pytest.approx(0.325)
    close(r, [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])  # not modified in place


# ---------------------------------------------------------------- entropy / value / log-probs


def test_entropy():
    # uniform over V=8 -> log 8 = 2.079442, also for a huge constant shift (stability)
    close(entropy_from_logits(torch.zeros(2, 3, 8)), torch.full((2, 3), 2.079442))
    close(entropy_from_logits(torch.full((1, 1, 8), 1e4)), [[2.079442]])
    # p = [.25,.75] -> .25*ln4 + .75*ln(4/3) = .346574 + .215762 = .562335 ; -inf logit -> H = 0
    logits = T([[[math.log(0.25), math.log(0.75)], [0.0, float("-inf")]]])
    close(entropy_from_logits(logits), [[0.562335, 0.0]])
    # bonus = token-mean over valid tokens: (.562335) only
    close(entropy_bonus(entropy_from_logits(logits), T([[1.0, 0.0]])), 0.562335)


def test_value_loss_clipped():
    # c=.5, old=0:
    #  v=2,  R=2:  (v-R)^2=0,   v_clip=.5 -> 2.25  -> max 2.25 (clipped branch)
    #  v=.3, R=1:  .49,         v_clip=.3 -> .49   -> .49
    #  v=2,  R=-1: 9,           v_clip=.5 -> 2.25  -> 9
    #  pad: v=50, R=-50 (ignored)
    # loss = .5 * (2.25 + .49 + 9)/3 = .5 * 3.913333 = 1.956667 ; clipfrac = 1/3
    v = T([[2.0, 0.3, 2.0, 50.0]])
    R = T([[2.0, 1.0, -1.0, -50.0]])
    m = T([[1.0, 1.0, 1.0, 0.0]])
    loss, cf = value_loss_clipped(v, torch.zeros_like(v), R, m, cliprange_value=0.5)
    close(loss, 1.956667)
    assert cf == pytest.approx(1 / 3)


def test_log_probs_from_logits():
    # log softmax([1,2,3])[2] = 3 - logsumexp = 3 - 3.407606 = -0.407606
    close(log_probs_from_logits(T([[[1.0, 2.0, 3.0]]]), T([[2]])), [[-0.407606]])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 11, generator=g)
    labels = torch.randint(0, 11, (2, 4), generator=g)
    manual = torch.empty(2, 4)
    for b in range(2):
        for t in range(4):
            z = logits[b, t]
            manual[b, t] = z[labels[b, t]] - torch.log(torch.exp(z).sum())
    close(log_probs_from_logits(logits, labels), manual)
    out = log_probs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32 and out.shape == (2, 4)


def test_aggregate_metrics_max_keys_take_the_max():
    from distflow_lab.runtime.results import StageResult, aggregate_metrics

    def result(worker, group_rank, rows, metrics, counts=None):
        return StageResult(batch_id=0, stage=0, stage_id="actor_update", worker=worker, dp_rank=worker,
                           group_rank=group_rank, items_in=rows, items_out=rows, tokens_out=0, bytes_in=0, bytes_out=0, route_in="cache",
                           cache_hit=True, metrics=metrics, counts=counts or {})

    # rows 3 and 1: a mean weighs 3:1 -> (3*1 + 1*5)/4 = 2 ; a *_max is the max over ranks, 7
    # (never (3*2 + 1*7)/4 = 3.25); the rank with no rows and the tensor-parallel follower do not count
    out = aggregate_metrics([result(0, 0, 3, {"actor/loss": 1.0, "actor/is_ratio_max": 2.0}, {"kept": 3}),
                             result(1, 0, 1, {"actor/loss": 5.0, "actor/is_ratio_max": 7.0}, {"kept": 1}),
                             result(2, 0, 0, {"actor/loss": 100.0, "actor/is_ratio_max": 100.0}),
                             result(3, 1, 4, {"actor/loss": 100.0, "actor/is_ratio_max": 100.0})])
    assert out == {"actor/loss": 2.0, "actor/is_ratio_max": 7.0, "kept": 4.0}
    # no rank produced rows: the plain mean / max over all of them
    assert aggregate_metrics([result(0, 0, 0, {"a": 1.0, "a_max": 1.0}),
                              result(1, 0, 0, {"a": 3.0, "a_max": 3.0})]) == {"a": 2.0, "a_max": 3.0}
