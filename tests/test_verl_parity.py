"""Our formulas against verl 0.7.1's own functions (`verl.trainer.ppo.core_algos`, and its
rollout-correction helper): values and gradients, on random inputs with fixed seeds, several
shapes, ragged right-padded masks and an all-padding row.

dp=1: ours and verl on the whole batch. dp=2: ONE spawn of a 2-process gloo group for every
sharded check; each rank holds half of the batch (whole prompt groups), and our sharded
results (estimators given the group, losses as loss_sum over the global loss_count, the
training engine's micro-batched loss and metrics) must equal verl on the whole batch.

Inputs are float64 so the tolerances can be tight: verl's only constant we do not share is
the 1e-8 it adds to masked-mean denominators (a relative 1e-8 / n).

Not compared, and why (nothing is skipped silently):
  - verl's straight-through KL kinds ("k1+", "k3+", "low_var_kl+") have no counterpart here;
    `test_kl_penalty` asserts ours rejects them.
  - verl.trainer.ppo.ray_trainer.apply_kl_penalty (KL in the reward) cannot be imported in
    this venv (it needs torchdata); `test_kl_in_reward` skips with that reason and compares
    against its formula built from core_algos.kl_penalty instead.
  - verl's GAE leaves its advantages and returns unmasked on padding (ours are 0 there), so
    GAE is compared on valid tokens only.

Notebook 02's CISPO loss and OPO estimator (written as a user writes them, registered from a
cell) are compared too: the cells themselves run here (tests/notebook_cells.py), not a copy.
"""
import datetime
import socket
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import verl.trainer.ppo.core_algos as ca
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config import ActorConfig

from distflow_lab.algos.estimators import ESTIMATORS, outcome_to_token_rewards, run_estimator
from distflow_lab.algos.policy_losses import policy_loss
from distflow_lab.algos.losses import (LOSS_AGG_MODES, aggregate_loss, apply_kl_in_reward, gspo_token_loss,
                                       kl_penalty, off_policy_weights, ppo_token_loss, value_loss_clipped,
                                       value_loss_token)
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ActorOptions, AlgorithmOptions
from distflow_lab.models.token_ops import loss_count, loss_sum
from tests.notebook_cells import notebook_cells

NOTEBOOK_02 = notebook_cells("02_build_your_own.ipynb", "cispo-loss", "opo-estimator", OVERRIDES=[])

DT = torch.float64
# (group sizes, response width T): a singleton group, uneven groups, several widths
SHAPES = [((4, 4), 5), ((3, 3, 3, 3), 7), ((2, 1, 3, 2), 9)]
KL_KINDS = ("k1", "kl", "abs", "mse", "k2", "k3", "low_var_kl")
OUTCOME = {"grpo": dict(norm_adv_by_std_in_grpo=True), "dr_grpo": dict(norm_adv_by_std_in_grpo=False)}


def close(ours, theirs, what=""):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=DT), torch.as_tensor(theirs, dtype=DT),
                               rtol=1e-7, atol=1e-9, msg=lambda m: f"{what}: {m}")


def make_case(seed: int, sizes: tuple[int, ...], T: int) -> dict:
    """One batch: ragged right-padded mask with an all-padding row (in the first group of
    size > 1, so GRPO/RLOO see it), a group of equal scores (std 0), and a token forced into
    PPO's dual clip (A < 0, ratio 4.5 > c = 3)."""
    g = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    uid = np.array([f"p{i}" for i, n in enumerate(sizes) for _ in range(n)], dtype=object)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[-1] = T  # one full row
    first = next(i for i, n in enumerate(sizes) if n > 1)
    lengths[sum(sizes[:first]) + 1] = 0  # an all-padding row beside a real one of its group
    mask = (torch.arange(T) < lengths[:, None]).to(DT)
    scores = torch.randint(0, 3, (B,), generator=g).to(DT) / 2
    scores[B - sizes[-1]:] = 0.5  # the last group ties: std 0
    randn = lambda scale: scale * torch.randn(B, T, generator=g, dtype=DT)  # noqa: E731
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    c = dict(uid=uid, mask=mask, scores=scores, old=old, new=old + randn(0.6), ref=old + randn(0.3),
             rollout=old + randn(0.5), adv=randn(1.0), values=randn(1.0), returns=randn(1.0),
             loss_mat=randn(1.0))
    c["vpreds"] = c["values"] + randn(0.8)  # some beyond the 0.5 clip range, some inside
    c["new"][-1, 0], c["adv"][-1, 0] = c["old"][-1, 0] + 1.5, -1.0  # dual clip engaged
    # a KL-shaped token reward, as a use_kl_in_reward stage makes it (verl: token_level_rewards)
    c["token_rewards"] = outcome_to_token_rewards(scores, mask) - 0.05 * kl_penalty(old, c["ref"], "k1") * mask
    return c


def cases():
    return [make_case(100 + i, sizes, T) for i, (sizes, T) in enumerate(SHAPES)]


def group_split(sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Rows of rank 0 and rank 1: the first half of the prompt groups, then the rest."""
    cut = int(np.cumsum(sizes)[len(sizes) // 2 - 1])
    return [torch.arange(cut), torch.arange(cut, sum(sizes))]


def actor_config(low=0.2, high=0.28, c=3.0, **batch_info) -> ActorConfig:
    """The smallest ActorConfig verl accepts: strategy, rollout_n, a micro-batch size."""
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                       clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, global_batch_info=batch_info)


def grad_of(fn, x: torch.Tensor):
    """(value, d value / d x) of a scalar fn at a fresh leaf copy of x."""
    leaf = x.clone().requires_grad_(True)
    out = fn(leaf)
    value = out[0] if isinstance(out, tuple) else out
    return value.detach(), torch.autograd.grad(value, leaf)[0]


# ---------------------------------------------------------------- estimators (verl: whole batch)


def verl_estimator(name: str, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    r, m = c["token_rewards"].clone(), c["mask"]
    if name in OUTCOME:
        return ca.compute_grpo_outcome_advantage(r, m, c["uid"], **OUTCOME[name])
    if name == "rloo":
        return ca.compute_rloo_outcome_advantage(r, m, c["uid"])
    if name == "opo":  # notebook 02's
        return ca.compute_opo_outcome_advantage(r, m, c["uid"])
    if name == "reinforce_plus_plus":
        return ca.compute_reinforce_plus_plus_outcome_advantage(r, m, config=AlgoConfig(gamma=0.9))
    adv, ret = ca.compute_gae_advantage_return(r, c["values"], m, gamma=0.9, lam=0.8)
    return adv * m, ret * m  # verl leaves GAE's padding unmasked; ours is 0 there


def our_estimator(name: str, c: dict, rows=None, group=None, column: bool = True):
    rows = slice(None) if rows is None else rows.numpy()
    cols = {"response_mask": c["mask"][rows], "values": c["values"][rows], "scores": c["scores"][rows]}
    if column:  # the KL-shaped reward as a column; without it the outcome estimators read `scores`
        cols["token_rewards"] = c["token_rewards"][rows]
    return run_estimator(name, Batch(cols, {"uid": c["uid"][rows]}), AlgorithmOptions(gamma=0.9, lam=0.8), group)


def test_every_estimator_is_compared():
    assert set(ESTIMATORS) == {*OUTCOME, "rloo", "reinforce_plus_plus", "gae", "opo"}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators(name):
    for c in cases():
        adv, ret = verl_estimator(name, c)
        ours = our_estimator(name, c)
        close(ours[0], adv, f"{name} advantages")
        close(ours[1], ret, f"{name} returns")
        assert ours[0].abs().sum() > 0  # not trivially zero


@pytest.mark.parametrize("name", [*OUTCOME, "rloo", "opo"])
def test_outcome_estimators_on_scores(name):
    # no token_rewards column: verl's token_level_rewards is the score on the last valid token
    for c in cases():
        c = {**c, "token_rewards": outcome_to_token_rewards(c["scores"], c["mask"])}
        c["token_rewards"][c["mask"].sum(-1) == 0, -1] = c["scores"][c["mask"].sum(-1) == 0]  # verl: index -1
        adv, _ = verl_estimator(name, c)
        close(our_estimator(name, c, column=False)[0], adv, name)


# ---------------------------------------------------------------- policy losses, KL, aggregation, value


def ppo_pair(c: dict, mode: str, cfg: ActorConfig):
    ours = grad_of(lambda lp: aggregate_loss(ppo_token_loss(c["old"], lp, c["adv"], c["mask"], cfg.clip_ratio_low,
                                                            cfg.clip_ratio_high, cfg.clip_ratio_c)[0],
                                             c["mask"], mode), c["new"])
    theirs = grad_of(lambda lp: ca.compute_policy_loss_vanilla(c["old"], lp, c["adv"], c["mask"], mode, cfg)[0],
                     c["new"])
    return ours, theirs


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_dual_clip_loss(mode):
    cfg, lower = actor_config(), 0.0
    for c in cases():
        (v, g), (vv, gv) = ppo_pair(c, mode, cfg)
        close(v, vv, f"ppo {mode} value")
        close(g, gv, f"ppo {mode} grad")
        _, ours = ppo_token_loss(c["old"], c["new"], c["adv"], c["mask"], 0.2, 0.28, 3.0)
        _, theirs = ca.compute_policy_loss_vanilla(c["old"], c["new"], c["adv"], c["mask"], mode, cfg)
        for a, b in (("clipfrac", "pg_clipfrac"), ("clipfrac_lower", "pg_clipfrac_lower"), ("approx_kl", "ppo_kl")):
            assert ours[a] == pytest.approx(theirs[f"actor/{b}"], rel=1e-7, abs=1e-9), a
        lower = max(lower, ours["clipfrac_lower"])
    assert lower > 0  # the dual clip did engage


@pytest.mark.parametrize("clip,noise", [((0.2, 0.28), 0.1), ((3e-4, 4e-4), 2e-4)])
def test_gspo_loss(clip, noise):
    assert ca.get_policy_loss_fn("gspo") is ca.compute_policy_loss_gspo
    cfg = actor_config(*clip)
    for c in cases():
        new = c["old"] + noise * torch.randn(c["old"].shape, generator=torch.Generator().manual_seed(7), dtype=DT)
        ours = grad_of(lambda lp: aggregate_loss(gspo_token_loss(c["old"], lp, c["adv"], c["mask"], *clip)[0],
                                                 c["mask"], "seq-mean-token-mean"), new)
        theirs = grad_of(lambda lp: ca.compute_policy_loss_gspo(c["old"], lp, c["adv"], c["mask"], config=cfg)[0], new)
        close(ours[0], theirs[0], "gspo value")
        close(ours[1], theirs[1], "gspo grad")
        assert ours[1].abs().sum() > 0  # some responses unclipped: a real gradient compared
        _, met = ca.compute_policy_loss_gspo(c["old"], new, c["adv"], c["mask"], config=cfg)
        ours_met = gspo_token_loss(c["old"], new, c["adv"], c["mask"], *clip)[1]
        assert ours_met["clipfrac"] == pytest.approx(met["actor/pg_clipfrac"], rel=1e-7, abs=1e-9)
        assert ours_met["approx_kl"] == pytest.approx(met["actor/ppo_kl"], rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("clip", [(0.2, 0.28), (1.0, 0.28)])  # both sides clipped; the declaration's (no lower)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_loss_from_the_notebook(clip, mode):
    assert ca.get_policy_loss_fn("cispo") is ca.compute_policy_loss_cispo
    assert NOTEBOOK_02.cispo_cfg.actor.clip_ratio_low == 1.0  # what the notebook's declaration fills in
    cfg, a = actor_config(*clip), ActorOptions(clip_ratio_low=clip[0], clip_ratio_high=clip[1], policy_loss="cispo")
    clipped = 0.0
    for c in cases():
        ours = grad_of(lambda lp: aggregate_loss(policy_loss(a)(c["old"], lp, c["adv"], c["mask"])[0], c["mask"],
                                                 mode), c["new"])
        theirs = grad_of(lambda lp: ca.compute_policy_loss_cispo(c["old"], lp, c["adv"], c["mask"], mode, cfg)[0],
                         c["new"])
        close(ours[0], theirs[0], f"cispo {mode} value")
        close(ours[1], theirs[1], f"cispo {mode} grad")
        _, met = ca.compute_policy_loss_cispo(c["old"], c["new"], c["adv"], c["mask"], mode, cfg)
        mine = policy_loss(a)(c["old"], c["new"], c["adv"], c["mask"])[1]
        assert mine["clipfrac"] == pytest.approx(met["actor/pg_clipfrac"], rel=1e-7, abs=1e-9)
        assert mine["approx_kl"] == pytest.approx(met["actor/ppo_kl"], rel=1e-7, abs=1e-9)
        clipped = max(clipped, mine["clipfrac"])
    assert clipped > 0  # the clip engaged: a clipped token's gradient (not zero, unlike PPO's) is compared


def test_kl_penalty():
    for c in cases():
        w = c["mask"] * c["loss_mat"]  # a random weighting, so every token's gradient shows
        for kind in KL_KINDS:
            ours = grad_of(lambda lp: (kl_penalty(lp, c["ref"], kind) * w).sum(), c["new"])
            theirs = grad_of(lambda lp: (ca.kl_penalty(lp, c["ref"], kind) * w).sum(), c["new"])
            close(ours[0], theirs[0], f"kl {kind} value")
            close(ours[1], theirs[1], f"kl {kind} grad")
        far = c["ref"] - 30.0  # the clamps of k3: |ref - logp| > 20
        close(kl_penalty(c["new"], far, "k3"), ca.kl_penalty(c["new"], far, "k3"), "k3 clamped")
    for kind in ("k1+", "k3+", "low_var_kl+"):  # verl's straight-through variants: not implemented here
        with pytest.raises(ValueError):
            kl_penalty(c["new"], c["ref"], kind)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss(mode):
    for c in cases():
        ours = grad_of(lambda L: aggregate_loss(L, c["mask"], mode), c["loss_mat"])
        theirs = grad_of(lambda L: ca.agg_loss(L, c["mask"], mode), c["loss_mat"])
        close(ours[0], theirs[0], f"{mode} value")
        close(ours[1], theirs[1], f"{mode} grad")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss(mode):
    for c in cases():
        ours = grad_of(lambda v: value_loss_clipped(v, c["values"], c["returns"], c["mask"], 0.5, mode),
                       c["vpreds"])
        theirs = grad_of(lambda v: ca.compute_value_loss(v, c["returns"], c["values"], c["mask"], 0.5, mode),
                         c["vpreds"])
        close(ours[0], theirs[0], "value loss")
        close(ours[1], theirs[1], "value loss grad")
        _, met = value_loss_token(c["vpreds"], c["values"], c["returns"], c["mask"], 0.5)
        theirs_frac = ca.compute_value_loss(c["vpreds"], c["returns"], c["values"], c["mask"], 0.5, mode)[1]
        assert 0 < met["vf_clipfrac"] < 1 and met["vf_clipfrac"] == pytest.approx(float(theirs_frac), rel=1e-7)


def test_tis_weights():
    capped = []
    for c in cases():
        for cap in (1.5, 2.0):
            ours, met = off_policy_weights(c["old"], c["rollout"], c["mask"], "tis", cap)
            theirs, _ = compute_rollout_correction_weights(c["old"] - c["rollout"], c["mask"], "token", cap)
            close(ours, theirs, f"tis cap {cap}")
            capped.append(met["is_capped_frac"])
    assert 0 < max(capped) < 1  # the truncation did engage


def test_kl_in_reward():
    # verl: token_level_rewards = token_level_scores - beta * kl_penalty(old, ref, kind) * mask
    for c in cases():
        scores = outcome_to_token_rewards(c["scores"], c["mask"])
        for kind in ("k1", "abs", "k3"):
            ours, _ = apply_kl_in_reward(scores, c["old"], c["ref"], c["mask"], 0.05, kind)
            close(ours, scores - 0.05 * ca.kl_penalty(c["old"], c["ref"], kind) * c["mask"], f"kl reward {kind}")
        ours, _ = apply_kl_in_reward(scores, c["old"], c["ref"], c["mask"], 0.05, "k1")
        close(ours, ca.compute_rewards(scores, c["old"], c["ref"], 0.05) * c["mask"], "compute_rewards (k1)")
    try:
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty  # noqa: F401
    except ImportError as e:
        pytest.skip(f"verl's apply_kl_penalty cannot be imported here ({e}); its formula was compared above")


# ---------------------------------------------------------------- dp = 2: one gloo group for every sharded check


def _dp2_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))  # a lost peer raises, not hangs
        group = dist.group.WORLD
        for (sizes, _), c in zip(SHAPES, cases()):
            rows = group_split(sizes)[rank]
            _dp2_estimators(c, rows, group)
            _dp2_losses(c, rows, group)
        _dp2_engine(rank, group)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dp2_estimators(c: dict, rows: torch.Tensor, group) -> None:
    for name in ESTIMATORS:
        adv, ret = verl_estimator(name, c)
        ours = our_estimator(name, c, rows, group)
        close(ours[0], adv[rows], f"dp2 {name} advantages")
        close(ours[1], ret[rows], f"dp2 {name} returns")
        if name in ("reinforce_plus_plus", "gae"):  # whitening over this shard alone would differ
            assert not torch.allclose(our_estimator(name, c, rows, None)[0], adv[rows])


def _all_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _dp2_loss(per_token, x: torch.Tensor, c: dict, rows: torch.Tensor, mode: str, group):
    """(sum over ranks of loss_sum / global loss_count, gradient wrt this rank's rows of x)."""
    m = c["mask"][rows]
    count = _all_sum(torch.tensor(loss_count(m, mode), dtype=DT), group)
    value, grad = grad_of(lambda t: loss_sum(per_token(t), m, mode) / count.clamp(min=1e-8), x[rows])
    return _all_sum(value, group), grad


def _dp2_losses(c: dict, rows: torch.Tensor, group) -> None:
    cfg, r = actor_config(), rows
    for mode in LOSS_AGG_MODES:
        # the aggregation itself, also against verl's own dp arithmetic on this shard
        value, grad = _dp2_loss(lambda L: L, c["loss_mat"], c, r, mode, group)
        whole = grad_of(lambda L: ca.agg_loss(L, c["mask"], mode), c["loss_mat"])
        close(value, whole[0], f"dp2 agg {mode}")
        close(grad, whole[1][r], f"dp2 agg {mode} grad")
        info = dict(dp_size=2, batch_num_tokens=float(c["mask"].sum()),
                    global_batch_size=float((c["mask"].sum(-1) > 0).sum()))
        shard = ca.agg_loss(c["loss_mat"][r], c["mask"][r], mode, **info)  # verl: x dp_size, then averaged
        close(_all_sum(shard, group) / 2, whole[0], f"dp2 verl's own sharded agg {mode}")
        # PPO and the value loss through the same global-count path
        ppo = lambda lp: ppo_token_loss(c["old"][r], lp, c["adv"][r], c["mask"][r], 0.2, 0.28, 3.0)[0]  # noqa: E731
        value, grad = _dp2_loss(ppo, c["new"], c, r, mode, group)
        whole = grad_of(lambda lp: ca.compute_policy_loss_vanilla(c["old"], lp, c["adv"], c["mask"], mode, cfg)[0],
                        c["new"])
        close(value, whole[0], f"dp2 ppo {mode}")
        close(grad, whole[1][r], f"dp2 ppo {mode} grad")
        vf = lambda v: value_loss_token(v, c["values"][r], c["returns"][r], c["mask"][r], 0.5)[0]  # noqa: E731
        value, grad = _dp2_loss(vf, c["vpreds"], c, r, mode, group)
        whole = grad_of(lambda v: ca.compute_value_loss(v, c["returns"], c["values"], c["mask"], 0.5, mode),
                        c["vpreds"])
        close(value, whole[0], f"dp2 value loss {mode}")
        close(grad, whole[1][r], f"dp2 value loss {mode} grad")


def _dp2_engine(rank: int, group) -> None:
    """The training engine (FSDP2, token-budget micro-batches, 2 ranks): its reported loss is
    verl's agg_loss of the whole batch in every mode; a `_max` metric is the global max, any
    other metric the token-weighted mean."""
    from distflow_lab.core.config import Optim
    from distflow_lab.models.fsdp import TrainEngine
    from distflow_lab.models.model_dir import build_tiny_qwen2
    from distflow_lab.models.sequences import assemble_columns
    from distflow_lab.models.tokenizer import build_char_tokenizer

    g = torch.Generator().manual_seed(5)
    B, P, R = 10, 4, 6
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    rlen[3] = 0  # an all-padding response
    rmask = (torch.arange(R) < rlen[:, None]).long()
    cols = assemble_columns(torch.randint(4, 50, (B, P), generator=g), torch.ones(B, P, dtype=torch.long),
                            torch.randint(4, 50, (B, R), generator=g) * rmask, rmask)
    cols["L"] = torch.randn(B, R, generator=g)  # a fixed per-token loss the loss_fn hands back

    def loss_fn(mb, log_probs, _):
        m, L = mb["response_mask"], mb["L"]
        valid = L[m.bool()]
        metrics = {"L_max": float(valid.max()) if len(valid) else 0.0,
                   "L_mean": float(valid.mean()) if len(valid) else 0.0}
        return L + 0.0 * log_probs, m, metrics  # the model's graph joins in; its gradient is 0

    eng = TrainEngine(build_tiny_qwen2(build_char_tokenizer(), seed=0), Optim(lr=1e-3), micro_token_budget=12,
                      device="cpu")
    assert eng.distributed
    local = {k: v[:4] if rank == 0 else v[4:] for k, v in cols.items()}  # rank 0: 4 rows, rank 1: 6
    for mode in LOSS_AGG_MODES:
        met = eng.compute_grads(local, loss_fn, mode)
        eng.optimizer.zero_grad(set_to_none=True)
        assert met["loss"] == pytest.approx(float(ca.agg_loss(cols["L"].to(DT), rmask.to(DT), mode)), abs=1e-6), mode
        valid = cols["L"][rmask.bool()]
        assert met["L_max"] == pytest.approx(float(valid.max()), abs=1e-6)  # the max, not a mean of maxes
        assert met["L_mean"] == pytest.approx(float(valid.mean()), abs=1e-6)
        assert met["n_micro"] > 1


def test_dp2_sharded_equals_verl_whole_batch():
    with socket.socket() as s:  # a free port for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.start_processes(_dp2_worker, args=(port,), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=2):  # re-raises a rank's failure with its traceback
        if time.monotonic() > deadline:  # hung: fail instead of blocking the suite
            for p in ranks.processes:
                p.kill()
            pytest.fail("the dp=2 checks did not finish in 180 s")
