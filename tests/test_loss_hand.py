"""Hand-computed 2x3 cases: off-policy weights (none / decoupled with AReaL's behaviour cap /
truncated IS), the clipped value loss, and the composed actor loss of `algos.actor_update`.

Every expected number is a literal worked out in the comment next to it. Row 1's last token
is padding everywhere (mask [[1, 1, 1], [1, 1, 0]]) and carries values that must not leak.
"""
import math

import pytest
import torch

from distflow_lab.algos.actor_update import actor_loss
from distflow_lab.algos.losses import aggregate_loss, off_policy_weights, value_loss_token
from distflow_lab.core.config import ActorOptions

T = torch.tensor
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ln = math.log


def close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32).detach(),
                               torch.as_tensor(b, dtype=torch.float32), atol=atol, rtol=0)


# w = pi_prox / pi_b = exp(old - behaviour): [[0.5, 1, 3], [2.5, 1.5, (pad) 9]]
OLD = torch.zeros(2, 3)
BEHAVIOUR = -T([[ln(0.5), 0.0, ln(3.0)], [ln(2.5), ln(1.5), ln(9.0)]])


def test_off_policy_none():
    w, met = off_policy_weights(OLD, BEHAVIOUR, MASK, "none")
    close(w, torch.ones(2, 3))
    assert met == {}


def test_off_policy_decoupled():
    # as is, times the mask; mean over the 5 valid = (.5 + 1 + 3 + 2.5 + 1.5)/5 = 8.5/5 = 1.7
    w, met = off_policy_weights(OLD, BEHAVIOUR, MASK, "decoupled")
    close(w, [[0.5, 1.0, 3.0], [2.5, 1.5, 0.0]])
    assert met == pytest.approx({"is_ratio_mean": 1.7, "is_ratio_max": 3.0, "is_capped_frac": 0.0,
                                 "behav_capped_frac": 0.0})


def test_off_policy_decoupled_behaviour_cap():
    # AReaL's behav_imp_weight_cap = 2: tokens with w > 2 (3 and 2.5) leave the loss (w = 0);
    # the padded 9 is not a token. kept: .5, 1, 1.5 -> mean (.5 + 1 + 0 + 0 + 1.5)/5 = .6, max 1.5
    w, met = off_policy_weights(OLD, BEHAVIOUR, MASK, "decoupled", behav_cap=2.0)
    close(w, [[0.5, 1.0, 0.0], [0.0, 1.5, 0.0]])
    assert met == pytest.approx({"is_ratio_mean": 0.6, "is_ratio_max": 1.5, "is_capped_frac": 0.0,
                                 "behav_capped_frac": 2 / 5})
    # a cap of exactly 2.5 keeps 2.5 (AReaL keeps w <= cap): only 3 goes
    w, _ = off_policy_weights(OLD, BEHAVIOUR, MASK, "decoupled", behav_cap=2.5)
    close(w, [[0.5, 1.0, 0.0], [2.5, 1.5, 0.0]])


def test_off_policy_tis_cap():
    # min(w, 2): [[.5, 1, 2], [2, 1.5, 0]] -> mean 7/5 = 1.4, max 2; capped 3 and 2.5: 2/5
    w, met = off_policy_weights(OLD, BEHAVIOUR, MASK, "tis", cap=2.0)
    close(w, [[0.5, 1.0, 2.0], [2.0, 1.5, 0.0]])
    assert met == pytest.approx({"is_ratio_mean": 1.4, "is_ratio_max": 2.0, "is_capped_frac": 2 / 5,
                                 "behav_capped_frac": 0.0})
    assert not (w.requires_grad or off_policy_weights(OLD.clone().requires_grad_(), BEHAVIOUR, MASK, "tis")[0].requires_grad)


def test_behaviour_cap_only_with_decoupled():
    for kind in ("tis", "none"):
        with pytest.raises(ValueError, match="decoupled"):
            off_policy_weights(OLD, BEHAVIOUR, MASK, kind, behav_cap=2.0)
    with pytest.raises(ValueError):
        ActorOptions(behav_imp_weight_cap=1.0)  # AReaL: must be > 1


def test_value_loss_token():
    # c = .5, old values -.1 everywhere: the range is [-.6, .4]
    #  v=.3,  R=.3: inside, v_clip = v exactly (verl's min/max form) -> 0, not clipped; the form
    #               old + clamp(v - old) gives .30000000000000004 and would count a clip
    #  v=2,   R=0:  v_clip = .4  -> max(4, .16) = 4      -> .5 * 4 = 2
    #  v=-1,  R=1:  v_clip = -.6 -> max(4, 2.56) = 4     -> 2
    #  v=.9,  R=2:  v_clip = .4  -> max(1.21, 2.56) = 2.56 -> 1.28 (clipped)
    #  v=0,   R=-1: inside       -> 1                    -> .5
    #  pad:   v=50, R=-50 (ignored)
    v = T([[0.3, 2.0, -1.0], [0.9, 0.0, 50.0]], dtype=torch.float64)
    R = T([[0.3, 0.0, 1.0], [2.0, -1.0, -50.0]], dtype=torch.float64)
    loss, met = value_loss_token(v, torch.full_like(v, -0.1), R, MASK.double(), 0.5)
    close(loss[MASK.bool()], [0.0, 2.0, 2.0, 1.28, 0.5])
    assert met == pytest.approx({"vf_clipfrac": 1 / 5})


# ---------------------------------------------------------------- the composed actor loss


def test_actor_loss_ppo_decoupled_kl_entropy():
    # old log-probs 0, so the ratio r = exp(log_prob). clip .2/.2, dual clip c = 3.
    #  tok   A   r    -A r   -A clip(r)  PPO            w (decoupled, cap 2)  PPO*w
    #  0,0   +1  1.5  -1.5   -1.2        -1.2 (clip)    .5                    -.6
    #  0,1   +1  .5   -.5    -.8         -.5            1                     -.5
    #  0,2   -1  1    1      1           1              3 -> 0                0
    #  1,0   -1  1.1  1.1    1.1         1.1            2.5 -> 0              0
    #  1,1   -1  4    4      1.2         4 -> 3 (dual)  1.5                   4.5
    # + KL k1 = log_prob - ref = d = [[.1, .2, .3], [.4, .5]] times coef .1
    # - entropy [[.5, .5, .5], [1, 1]] times coeff .1
    # total: [[-.6 + .01 - .05, -.5 + .02 - .05, 0 + .03 - .05], [0 + .04 - .1, 4.5 + .05 - .1]]
    #      = [[-.64, -.53, -.02], [-.06, 4.45]] ; token-mean = 3.2/5 = .64
    a = ActorOptions(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="k1", entropy_coeff=0.1, off_policy="decoupled", behav_imp_weight_cap=2.0)
    lp = T([[ln(1.5), ln(0.5), 0.0], [ln(1.1), ln(4.0), 0.0]]).requires_grad_()
    d = T([[0.1, 0.2, 0.3], [0.4, 0.5, 7.0]])
    mb = {"response_mask": MASK, "old_log_probs": OLD, "advantages": T([[1.0, 1.0, -1.0], [-1.0, -1.0, 5.0]]),
          "rollout_log_probs": BEHAVIOUR, "ref_log_probs": lp.detach() - d}
    loss, mask, met = actor_loss(a)(mb, lp, T([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]]))
    assert mask is MASK
    close(loss[MASK.bool()], [-0.64, -0.53, -0.02, -0.06, 4.45])
    total = aggregate_loss(loss, mask, "token-mean")
    close(total, 0.64)
    # gradient of the token-mean: PPO term only where unclipped and w > 0, i.e. token (0,1):
    # d(-A r w)/dlp = -A r w = -.5 ; KL k1: +.1 on every valid token ; all over 5 tokens
    total.backward()
    close(lp.grad, [[0.1 / 5, (-0.5 + 0.1) / 5, 0.1 / 5], [0.1 / 5, 0.1 / 5, 0.0]])
    # metrics: clipfrac 1/5 (token 0,0) ; dual clip 1/5 (token 1,1) ;
    # approx_kl = -mean(log r) = -ln(1.5 * .5 * 1 * 1.1 * 4)/5 = -ln(3.3)/5 ; kl = mean(d) = 1.5/5
    assert met == pytest.approx({"clipfrac": 0.2, "clipfrac_lower": 0.2, "approx_kl": -ln(3.3) / 5, "kl": 0.3,
                                 "is_ratio_mean": 0.6, "is_ratio_max": 1.5, "is_capped_frac": 0.0,
                                 "behav_capped_frac": 0.4}, abs=1e-6)


def test_actor_loss_gspo_tis():
    # GSPO (clip .2/.2), old log-probs 0. Row 0: log r = [ln 2, 0, -ln 2] -> mean 0 -> s = 1;
    # row 1: log r = [ln 1.5, ln 1.5] -> s = 1.5. A = +1 on row 0, -1 on row 1.
    #   row 0: -A s = -1 (unclipped) ; row 1: max(-A s, -A clip(s)) = max(1.5, 1.2) = 1.5 (unclipped)
    # TIS weights, cap 2: w = [[1, 3 -> 2, .5], [1, 1]]
    # loss = [[-1, -2, -.5], [1.5, 1.5]] ; token-mean (-3.5 + 3)/5 = -.1
    # seq-mean-token-mean: (-3.5/3 + 3/2)/2 = (-1.166667 + 1.5)/2 = .166667
    a = ActorOptions(clip_ratio_low=0.2, clip_ratio_high=0.2, use_kl_loss=False, entropy_coeff=0.0,
                     off_policy="tis", is_cap=2.0, policy_loss="gspo")
    lp = T([[ln(2.0), 0.0, -ln(2.0)], [ln(1.5), ln(1.5), 0.0]]).requires_grad_()
    mb = {"response_mask": MASK, "old_log_probs": OLD, "advantages": T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
          "rollout_log_probs": -T([[0.0, ln(3.0), ln(0.5)], [0.0, 0.0, 0.0]])}
    loss, mask, met = actor_loss(a)(mb, lp, None)
    close(loss[MASK.bool()], [-1.0, -2.0, -0.5, 1.5, 1.5])
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 1 / 6)
    # GSPO-token gradient: dL[i,t]/dlp_t = -A_i s_i w_t -> [[-1, -2, -.5], [1.5, 1.5]], token-mean /5
    aggregate_loss(loss, mask, "token-mean").backward()
    close(lp.grad, [[-0.2, -0.4, -0.1], [0.3, 0.3, 0.0]])
    # ratio metric: mean of s over tokens = (3 * 1 + 2 * 1.5)/5 = 1.2 ; nothing clipped
    assert met["ratio"] == pytest.approx(1.2) and met["clipfrac"] == 0.0
    assert met["is_capped_frac"] == pytest.approx(0.2) and met["is_ratio_max"] == pytest.approx(2.0)
