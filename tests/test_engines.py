"""Rollout (HF), training engine (plain and FSDP2 over 2 gloo ranks), critic. CPU, offline, no Ray."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib
import copy
import datetime
import math
import socket
import traceback

import pytest
from pydantic import ValidationError
import torch
import torch.multiprocessing as mp

from distflow_lab.algos.losses import aggregate_loss
from distflow_lab.models.critic import build_critic_from
from distflow_lab.core.config import Optim as OptimConfig
from distflow_lab.core.config import RolloutOptions
from distflow_lab.core.errors import WeightSyncMismatch
from distflow_lab.models.fsdp import TrainEngine, micro_batches, padding_tokens, sft_loss_fn
from distflow_lab.models.model_dir import build_tiny_qwen2, save_model_dir
from distflow_lab.models.sequences import assemble_columns, build_sft_batch, decode_responses, tokenize_prompts
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.rollout import make_rollout
from distflow_lab.models.tokenizer import build_char_tokenizer

P, R = 10, 12
EOS, PAD = 2, 0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tok, one_torch_thread


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_qwen2(tok, seed=0)


@contextlib.contextmanager
def eos_bias(model, value: float):
    """Add `value` to the eos logit (a forward hook on lm_head) so p(eos) is controllable."""
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = value
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        yield
    finally:
        hook.remove()


def synthetic_batch(B: int, seed: int) -> dict[str, torch.Tensor]:
    """Random verl-layout batch with varied prompt/response lengths, plus PPO columns."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = torch.full((B, P), PAD), torch.full((B, R), PAD)
    pmask, rmask = torch.zeros((B, P), dtype=torch.long), torch.zeros((B, R), dtype=torch.long)
    for i in range(B):
        lp = int(torch.randint(2, P + 1, (1,), generator=g))
        lr = int(torch.randint(1, R + 1, (1,), generator=g))
        prompts[i, P - lp:], pmask[i, P - lp:] = torch.randint(4, 100, (lp,), generator=g), 1
        responses[i, :lr], rmask[i, :lr] = torch.randint(4, 100, (lr,), generator=g), 1
        if lr < R:
            responses[i, lr - 1] = EOS
    cols = assemble_columns(prompts, pmask, responses, rmask)
    cols["old_log_probs"] = (-5.5 + 0.3 * torch.randn(B, R, generator=g)) * rmask
    cols["advantages"] = torch.randn(B, 1, generator=g).expand(B, R) * rmask
    return cols


def ppo_loss(mb, log_probs, entropy):
    """Per-token clipped PPO loss (a matrix, not aggregated) + data-independent metric keys."""
    mask = mb["response_mask"]
    ratio = torch.exp(log_probs - mb["old_log_probs"])
    adv = mb["advantages"]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    m = mask.bool()
    return loss, mask, {"ratio": ratio.detach()[m].mean().item() if m.any() else 0.0}


def subset(batch, idx):
    return {k: v[idx] for k, v in batch.items()}


def fwd_cols(b):
    return [b[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")]


# ---------------------------------------------------------------- tokenize / rollout


def test_tokenize_prompts_left_pads_and_truncates_tail(tok):
    ids, mask, n_trunc = tokenize_prompts(tok, ["ab", [{"role": "user", "content": "3+4="}], "0123456789xyz"], 8)
    assert ids.shape == mask.shape == (3, 8) and n_trunc == 1
    assert tok.decode(ids[0, -2:].tolist()) == "ab" and mask[0].tolist() == [0] * 6 + [1, 1]
    assert (ids[0, :6] == tok.pad_token_id).all()
    assert tok.decode(ids[1][mask[1].bool()].tolist()) == "3+4="
    assert tok.decode(ids[2].tolist()) == "456789xyz"[-8:] and mask[2].all()  # kept the LAST 8 tokens
    with pytest.raises(ValueError):
        tokenize_prompts(tok, [""], 8)


def test_hf_rollout_columns_groups_eos_and_seed(tok, model):
    ids, mask, _ = tokenize_prompts(tok, ["3+4=", "12*3=", "hello"], P)
    cfg = RolloutOptions(n=4, max_response_len=R, micro_batch=5)
    with eos_bias(model, 3.8):  # p(eos) ~ 0.15 per step: a mix of lengths
        ro = HFRollout(model, tok, cfg, P)
        out, again, other = (ro.generate(ids, mask, seed=s) for s in (7, 7, 8))
    shapes = {"prompts": (B := 12, P), "responses": (B, R), "input_ids": (B, P + R), "attention_mask": (B, P + R),
              "position_ids": (B, P + R), "response_mask": (B, R)}
    assert {k: tuple(v.shape) for k, v in out.items()} == shapes
    assert all(v.dtype == torch.long for v in out.values())
    assert all(torch.equal(out[k], again[k]) for k in out)  # same seed -> same sample
    assert not torch.equal(out["responses"], other["responses"])
    # n responses of prompt i are rows i*n .. i*n+n-1
    assert torch.equal(out["prompts"], ids.repeat_interleave(4, 0))
    resp, rm = out["responses"], out["response_mask"]
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], resp], -1))
    assert torch.equal(out["attention_mask"], torch.cat([mask.repeat_interleave(4, 0), rm], -1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    lengths = rm.sum(-1)
    assert (rm[:, :-1] >= rm[:, 1:]).all() and (lengths >= 1).all()  # prefix masks
    n_eos = 0
    for row, n in zip(resp, lengths.tolist()):
        eos_at = (row == EOS).nonzero().flatten().tolist()
        if n < R:
            assert row[n - 1] == EOS and eos_at[0] == n - 1  # mask includes the FIRST eos
        else:
            assert not eos_at or eos_at[0] == R - 1
        n_eos += bool(eos_at)
        assert (row[n:] == PAD).all()
    assert 0 < n_eos < B and len(set(lengths.tolist())) > 2
    assert [type(t) for t in decode_responses(tok, resp, rm)] == [str] * B


def test_hf_rollout_immediate_eos(tok, model):
    ids, mask, _ = tokenize_prompts(tok, ["3+4=", "x"], P)
    with eos_bias(model, 50.0):
        out = HFRollout(model, tok, RolloutOptions(n=2, max_response_len=R), P).generate(ids, mask, 0)
    assert (out["responses"][:, 0] == EOS).all() and (out["responses"][:, 1:] == PAD).all()
    assert out["response_mask"].tolist() == [[1] + [0] * (R - 1)] * 4
    assert decode_responses(tok, out["responses"], out["response_mask"]) == [""] * 4


def test_forward_log_probs_match_manual_and_rollout(tok, model):
    model = copy.deepcopy(model)  # the frozen engine below flips requires_grad on it
    ids, mask, _ = tokenize_prompts(tok, ["3+4=", "12*3=", "a much longer prompt"], P)
    with eos_bias(model, 3.0):
        ro = HFRollout(model, tok, RolloutOptions(n=3, max_response_len=R, log_probs=True), P)
        b = ro.generate(ids, mask, seed=1)
        eng = TrainEngine(model, None, micro_token_budget=40, device="cpu")  # shares the module: colocated
        lp, ent = eng.forward_log_probs(*fwd_cols(b), with_entropy=True)
        with torch.no_grad():
            logits = model(**{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits[:, P - 1 : -1]
    logp_all = torch.log_softmax(logits.float(), -1)
    manual = logp_all.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1) * b["response_mask"]
    manual_ent = -(logp_all.exp() * logp_all).sum(-1) * b["response_mask"]
    assert lp.shape == ent.shape == (9, R) and lp.dtype == torch.float32
    assert torch.allclose(lp, manual, atol=1e-5)
    assert torch.allclose(ent, manual_ent, atol=1e-4)
    assert torch.allclose(lp, b["rollout_log_probs"], atol=1e-4)  # trainer sees the sampled distribution
    assert not model.training and all(p.requires_grad is False for p in model.parameters())


def test_micro_batches_cover_rows_within_budget():
    g = torch.Generator().manual_seed(0)
    am = (torch.rand(37, 30, generator=g) < torch.rand(37, 1, generator=g)).long()
    am[5] = 1  # one row (30 tokens) longer than the budget
    for budget in (1, 20, 29, 10**6):
        mbs = micro_batches(am, budget)
        assert torch.equal(torch.cat(mbs), torch.arange(37))  # each row once, in order
        assert all(len(idx) == 1 or am[idx].sum() <= budget for idx in mbs)
    assert len(micro_batches(am, 10**6)) == 1 and len(micro_batches(am, 1)) == 37


# ---------------------------------------------------------------- training invariance


def grads_of(eng, batch, mode):
    eng.optimizer.zero_grad(set_to_none=True)
    metrics = eng.compute_grads(batch, ppo_loss, mode)
    return eng.gathered_grads(), metrics


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grads_independent_of_micro_batching_and_order(model, mode):
    batch = synthetic_batch(16, seed=3)
    eng = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=10**6, device="cpu")
    g_one, m_one = grads_of(eng, batch, mode)
    eng.budget = 25
    g_many, m_many = grads_of(eng, batch, mode)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    g_perm, m_perm = grads_of(eng, subset(batch, perm), mode)
    assert m_one["n_micro"] == 1 and m_many["n_micro"] > 5
    assert max_diff(g_one, g_many) < 1e-6 and max_diff(g_one, g_perm) < 1e-6
    for m in (m_many, m_perm):
        assert m["loss"] == pytest.approx(m_one["loss"], abs=1e-6)
        assert m["ratio"] == pytest.approx(m_one["ratio"], abs=1e-6)
    # ... and equal to a direct full-batch computation with algos.losses.aggregate_loss
    ref = copy.deepcopy(model).train().requires_grad_(True)
    logits = ref(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits[:, P - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    (loss := aggregate_loss(*ppo_loss(batch, lp, None)[:2], mode)).backward()
    g_ref = {n: p.grad for n, p in ref.named_parameters()}
    assert max_diff(g_one, g_ref) < 1e-6 and m_one["loss"] == pytest.approx(loss.item(), abs=1e-6)
    # one AdamW step: same parameters whatever the micro-batching
    params = []
    for budget in (10**6, 25):
        e = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=budget, device="cpu")
        metrics = e.train_step(batch, ppo_loss, mode)
        assert math.isfinite(metrics["grad_norm"]) and metrics["skipped"] == 0
        params.append(e.full_state_dict())
    # Adam step 1 ~ lr * g / (|g| + eps): where |g| is near eps, float noise in g moves the update by a
    # fraction of lr (1.4e-5 seen once on a 2-core CI machine), so the bound is 5 % of lr
    assert max_diff(*params) < 5e-5
    assert max_diff(params[0], model.state_dict()) > 1e-4  # the step did move the weights


def test_old_log_prob_from_update_gives_the_recomputed_gradient(model):
    """actor.old_log_prob=from_update (no old_log_prob pass) is the same update as a recomputed
    old policy when one mini-batch trains on the weights that scored it."""
    from distflow_lab.algos.actor_update import actor_loss
    from distflow_lab.core.config import ActorOptions
    batch = synthetic_batch(16, seed=5)
    eng = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=40, device="cpu")
    old, _ = eng.forward_log_probs(*(batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")))
    grads = {}
    for how in ("recompute", "from_update"):
        cols = {**batch, "old_log_probs": old} if how == "recompute" else {k: v for k, v in batch.items()
                                                                             if k != "old_log_probs"}
        eng.optimizer.zero_grad(set_to_none=True)
        eng.compute_grads(cols, actor_loss(ActorOptions(use_kl_loss=False, old_log_prob=how)))
        grads[how] = eng.gathered_grads()
    assert max_diff(grads["recompute"], grads["from_update"]) < 1e-6
    assert max(g.abs().max().item() for g in grads["from_update"].values()) > 1e-4  # a real gradient


class FixedRowsEngine(TrainEngine):
    """Micro-batches of a fixed row count, as verl without use_dynamic_bsz (ppo_micro_batch_size_per_gpu)."""

    rows = 4

    def _plan(self, attention_mask):
        return list(torch.arange(attention_mask.shape[0]).split(self.rows))


def test_padding_tokens_hand_computed():
    # P = 2; rows (prompt | response): [0 1 | 1 1 0] 3 real, [1 1 | 1 0 0] 3 real, [0 1 | 1 1 1] 4 real
    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    # rows 0+1 run on columns 0..3 (2 x 4 = 8 positions, 6 real: 2 padded); row 2 on 1..4 (4, 4 real: 0)
    assert padding_tokens(am, 2, [torch.tensor([0, 1]), torch.tensor([2]), None]) == (2.0, 10.0)  # dummy: left out
    assert padding_tokens(am, 2, [torch.tensor([0]), torch.tensor([1]), torch.tensor([2])]) == (0.0, 10.0)
    assert padding_tokens(am, 2, [torch.arange(3)]) == (5.0, 10.0)  # 3 rows x columns 0..4 = 15, 10 real


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_fixed_size_gradients(model, mode):
    """verl's use_dynamic_bsz: micro-batches cut by a real-token budget instead of a row count
    give the same gradients; each reports its padding waste (padded / real tokens)."""
    batch = synthetic_batch(24, seed=5)
    fixed = FixedRowsEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), device="cpu")
    budget = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=60, device="cpu")
    g_fixed, m_fixed = grads_of(fixed, batch, mode)
    g_budget, m_budget = grads_of(budget, batch, mode)
    assert m_fixed["n_micro"] == 6 and m_budget["n_micro"] not in (1, 6)  # two different groupings
    assert max_diff(g_fixed, g_budget) < 1e-6 and m_budget["loss"] == pytest.approx(m_fixed["loss"], abs=1e-6)
    for eng, m in ((fixed, m_fixed), (budget, m_budget)):
        padded, real = padding_tokens(batch["attention_mask"], P, eng._plan(batch["attention_mask"]))
        assert m["padding_waste"] == pytest.approx(padded / real) and 0 < m["padding_waste"] < 1
    budget.forward_log_probs(*fwd_cols(batch))  # log-prob passes record theirs on the engine
    assert budget.padding_waste == pytest.approx(m_budget["padding_waste"])


def test_save_load_round_trip_gives_identical_next_step(tok, model, tmp_path):
    b1, b2 = synthetic_batch(8, seed=10), synthetic_batch(8, seed=11)
    a = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=50, device="cpu")
    a.train_step(b1, ppo_loss)
    a.save(tmp_path / "ckpt")
    assert set(torch.load(tmp_path / "ckpt" / "optim.pt", weights_only=True)) == {"state", "param_groups"}
    a.train_step(b2, ppo_loss)
    b = TrainEngine(build_tiny_qwen2(tok, seed=5), OptimConfig(lr=1e-3), micro_token_budget=50, device="cpu")
    b.load(tmp_path / "ckpt")
    b.train_step(b2, ppo_loss)
    assert max_diff(a.full_state_dict(), b.full_state_dict()) == 0.0  # Adam moments restored too


def test_weight_sync_into_rollout_and_sft(tok, model):
    policy = TrainEngine(copy.deepcopy(model), OptimConfig(lr=3e-3), micro_token_budget=200, device="cpu")
    batch, n_trunc = build_sft_batch(tok, ["1+1=", "2+2="] * 4, ["2", "4"] * 4, P, R)
    assert n_trunc == 0 and batch["response_mask"].sum(-1).tolist() == [2] * 8  # digit + eos
    losses = [policy.train_step(batch, sft_loss_fn)["loss"] for _ in range(12)]
    assert losses[-1] < losses[0] - 0.5
    rollout = HFRollout(copy.deepcopy(model), tok, RolloutOptions(n=1, max_response_len=R), P)
    rollout.load_weights(policy.full_state_dict())
    assert max_diff(rollout.model.state_dict(), policy.model.state_dict()) == 0.0
    with pytest.raises(WeightSyncMismatch, match="'not.a.weight' is not a weight of the rollout model"):
        rollout.load_weights({"not.a.weight": torch.zeros(1)})
    half = dict(list(policy.full_state_dict().items())[:3])
    with pytest.raises(WeightSyncMismatch, match=r"the sync covered 3 of the model's \d+ tensors"):
        rollout.load_weights(half)  # a partial load is never silent


# ---------------------------------------------------------------- critic, factory


def test_critic_values_zero_at_init_and_trainable(tok, model, tmp_path):
    batch = synthetic_batch(6, seed=4)
    critic = build_critic_from(model)
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert torch.equal(critic.model.embed_tokens.weight, model.model.embed_tokens.weight)
    eng = TrainEngine(critic, OptimConfig(lr=1e-2), micro_token_budget=30, device="cpu")
    v0 = eng.forward_values(*fwd_cols(batch))
    assert v0.shape == (6, R) and (v0 == 0).all()
    value_loss = lambda mb, log_probs, values: ((values - 1.0) ** 2, mb["response_mask"], {})  # noqa: E731
    metrics = [eng.train_step(batch, value_loss)["loss"] for _ in range(3)]
    assert metrics[0] == pytest.approx(1.0) and metrics[-1] < metrics[0]
    v1 = eng.forward_values(*fwd_cols(batch))
    assert (v1 * (1 - batch["response_mask"]) == 0).all() and v1.abs().sum() > 0
    save_model_dir(model, tok, tmp_path / "lm")
    from_dir = build_critic_from(tmp_path / "lm")
    assert torch.equal(from_dir.model.norm.weight, model.model.norm.weight) and (from_dir.score.weight == 0).all()


def test_make_rollout_picks_the_engine(tok, model):
    assert isinstance(make_rollout(model, tok, RolloutOptions(), P), HFRollout)
    with pytest.raises(ValidationError):  # an unknown engine is a config error
        RolloutOptions(engine="sglang")
    pytest.raises(ValueError, make_rollout, None, tok, RolloutOptions(engine="vllm"), P)  # no model_path
    # the real vLLM engine behind make_rollout: tests/test_vllm.py


# ---------------------------------------------------------------- FSDP2, 2 gloo ranks


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str, batch: dict, split: int, mode: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        tok = build_char_tokenizer()
        eng = TrainEngine(build_tiny_qwen2(tok, seed=0), OptimConfig(lr=1e-3), micro_token_budget=30, device="cpu")
        assert eng.distributed and eng.world == world
        rows = torch.arange(split) if rank == 0 else torch.arange(split, batch["input_ids"].shape[0])
        local = subset(batch, rows)
        lp, _ = eng.forward_log_probs(*fwd_cols(local))
        grads, _ = grads_of(eng, local, mode)
        metrics = eng.train_step(local, ppo_loss, mode)
        state = eng.full_state_dict()
        eng.save(os.path.join(out_dir, "ckpt"))
        n_local = len(micro_batches(local["attention_mask"], eng.budget))
        torch.save({"n_local": n_local, "log_probs": lp, "grads": grads, "state": state, "metrics": metrics},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.full)])
def test_fsdp2_two_ranks_equal_one_rank(tok, model, tmp_path, mode):
    batch, split = synthetic_batch(12, seed=21), 4  # rank 0: 4 rows, rank 1: 8 -> uneven tokens and micro counts
    with socket.socket() as s:  # a free port for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        ctx, port = mp.get_context("spawn"), s.getsockname()[1]
    procs = [ctx.Process(target=_fsdp_worker, args=(r, 2, port, str(tmp_path), batch, split, mode)) for r in range(2)]
    [p.start() for p in procs]
    for p in procs:
        p.join(timeout=150)
        if p.is_alive():  # hung collective: fail instead of blocking the suite
            p.kill()
            p.join()
    errors = [e.read_text() for e in sorted(tmp_path.glob("error*.txt"))] or [p.exitcode for p in procs]
    assert errors == [0, 0], errors[0]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["metrics"] == r1["metrics"]  # identical floats on every rank
    assert r0["n_local"] != r1["n_local"]  # one rank ran dummy micro-batches to stay in lock-step
    assert r0["metrics"]["n_micro"] == max(r0["n_local"], r1["n_local"])
    # reference: one process, plain module, the whole batch
    ref = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), micro_token_budget=10**6, device="cpu")
    lp_ref, _ = ref.forward_log_probs(*fwd_cols(batch))
    assert torch.allclose(torch.cat([r0["log_probs"], r1["log_probs"]]), lp_ref, atol=1e-5)
    g_ref, _ = grads_of(ref, batch, mode)
    assert max_diff(r0["grads"], g_ref) < 1e-6 and max_diff(r1["grads"], g_ref) < 1e-6
    m_ref = ref.train_step(batch, ppo_loss, mode)
    for k in ("loss", "grad_norm", "ratio", "n_tokens"):
        assert r0["metrics"][k] == pytest.approx(m_ref[k], abs=1e-5), k
    s_ref = ref.full_state_dict()
    # Adam's first step is ~lr * g / (|g| + eps): where |g| is near eps, float-level gradient
    # differences (< 1e-6 above) move a weight by a visible fraction of lr (1e-3)
    assert max_diff(r0["state"], s_ref) < 1e-4 and max_diff(r1["state"], s_ref) < 1e-4
    # the FSDP checkpoint loads into a plain 1-process engine
    plain = TrainEngine(copy.deepcopy(model), OptimConfig(lr=1e-3), device="cpu")
    plain.load(tmp_path / "ckpt")
    assert max_diff(plain.full_state_dict(), s_ref) < 1e-4  # see above: Adam near eps
