"""Streaming decode on the HF engine (models/rollout_stream.py): continuous batching with a KV
cache kept across iterations and calls, partial rollouts across weight updates, ageing out.
CPU, tiny Qwen2; the engine tests need no Ray, one session runs GRPO async with partial rollouts."""
from __future__ import annotations

import copy

import pytest
import torch

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.rollout_stream import HFStreamingRollout, StaleRule, StreamBatch
from distflow_lab.models.sequences import tokenize_prompts

P, R = 10, 12
PROMPTS = ["3+4=", "12*3=", "hello", "a much longer", "x", "77-8=", "q", "abcdef", "zz", "8*8="]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tok, one_torch_thread


@pytest.fixture(scope="module")
def prompts(tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    return ids, mask


def stopping_model(tok, every: int = 9):
    """A tiny Qwen2 whose eos wins, also greedily, where (7 x position + last token) % every == 0: responses of
    mixed lengths that only the inputs decide (a forward hook: generate and the stream both go through it)."""
    model = build_tiny_qwen2(tok, seed=0)
    eos = tok.eos_token_id

    def hook(mod, args, kwargs, out):
        last = (kwargs["position_ids"][:, -1] * 7 + kwargs["input_ids"][:, -1]) % every == 0
        out.logits[:, -1, eos] += 100.0 * last
        return out

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def eos_bias(model, tok, value: float):
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = value
    return model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)


def drain(stream: HFStreamingRollout, calls: int, groups: int, version: int = 0, **kw) -> list[StreamBatch]:
    return [stream.run(groups, version=version, seed=100 + i, **kw) for i in range(calls)]


def by_prompt(batches: list[StreamBatch], column: str) -> dict:
    return {meta: b.columns[column][i] for b in batches for i, meta in enumerate(b.prompts)}


def manual_log_probs(model, prompt: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token_t | prompt, tokens_<t) by one full forward (what a trainer recomputes)."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, tokens])[None]).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(1)


def test_greedy_equals_generate_while_rows_leave_and_join(tok, prompts):
    model = stopping_model(tok)
    cfg = RolloutOptions(n=1, do_sample=False, max_response_len=R, log_probs=True)
    ref = HFRollout(model, tok, cfg, P).generate(*prompts, seed=0)
    lengths = ref["response_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 4  # rows leave at many different iterations
    stream = HFStreamingRollout(model, tok, cfg, P, slots=3)  # 3 slots for 10 prompts: rows join as others leave
    stream.add(*prompts, metas=list(range(len(PROMPTS))))
    batches = drain(stream, calls=5, groups=2)
    assert [len(b.prompts) for b in batches] == [2] * 5 and not stream.in_flight
    responses, logps = by_prompt(batches, "responses"), by_prompt(batches, "rollout_log_probs")
    for i in range(len(PROMPTS)):  # per prompt, the same tokens as generate: the merged cache is right
        assert torch.equal(responses[i], ref["responses"][i]), i
        assert torch.allclose(logps[i], ref["rollout_log_probs"][i], atol=1e-5), i
    first, rows = batches[0].columns, torch.tensor(batches[0].prompts)
    for name in ("prompts", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(first[name], ref[name][rows]), name  # verl's layout, row for row
    assert (first["token_versions"] == 0).all() and (first["version"] == 0).all()


@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.7, top_k=20, top_p=0.9)], ids=["plain", "truncated"])
def test_behaviour_log_probs_are_the_trainers(tok, prompts, opts):
    model = build_tiny_qwen2(tok, seed=0)
    hook = eos_bias(model, tok, 2.0)  # p(eos) ~ 0.05-0.2 a token: mixed lengths
    try:
        cfg = RolloutOptions(n=3, max_response_len=R, log_probs=True, **opts)
        stream = HFStreamingRollout(model, tok, cfg, P, slots=5)
        stream.add(*prompts, metas=list(range(len(PROMPTS))))
        batches = drain(stream, calls=3, groups=3)
        rows = 0
        for b in batches:
            c = b.columns
            assert c["responses"].shape == (9, R)
            assert b.prompts == [p for p in dict.fromkeys(b.prompts) for _ in range(3)]  # whole groups, n rows each
            for i in range(len(b.prompts)):
                m = c["response_mask"][i].bool()
                want = manual_log_probs(model, c["prompts"][i][c["attention_mask"][i, :P].bool()],
                                        c["responses"][i][m], cfg.temperature)
                assert torch.allclose(c["rollout_log_probs"][i][m], want, atol=1e-4), (i, opts)
                rows += 1
        lengths = torch.cat([b.columns["response_mask"].sum(1) for b in batches])
        assert rows == 27 and len(set(lengths.tolist())) > 3
    finally:
        hook.remove()


def perturbing_refresh(model, at_version: int = 1):
    """A refresh that loads new weights in place once (noise on every parameter) and returns the new version."""
    state = {"version": 0}

    def refresh() -> int:
        if state["version"] < at_version:
            g = torch.Generator().manual_seed(state["version"])
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            state["version"] += 1
        return state["version"]

    return refresh


@pytest.mark.parametrize("recompute", [False, True], ids=["stale-kv", "recomputed-kv"])
def test_a_sequence_in_flight_crosses_a_weight_update(tok, prompts, recompute):
    model = build_tiny_qwen2(tok, seed=0)
    old = copy.deepcopy(model)
    for m in (model, old):
        eos_bias(m, tok, -100.0)  # no eos: every response runs to R
    cfg = RolloutOptions(n=1, max_response_len=R, log_probs=True)
    stream = HFStreamingRollout(model, tok, cfg, P, slots=1, refresh_every=4, recompute_kv_on_update=recompute)
    stream.add(prompts[0][:1], prompts[1][:1], metas=["only"])
    out = stream.run(1, version=0, seed=0, refresh=perturbing_refresh(model))
    c = out.columns
    assert c["token_versions"][0].tolist() == [0] * 4 + [1] * (R - 4)  # refreshed after the 4th iteration
    assert c["version"].tolist() == [0] and out.counts.partial == 1 and out.counts.refreshes == 1
    prompt, tokens, lp = prompts[0][0][prompts[1][0].bool()], c["responses"][0], c["rollout_log_probs"][0]
    assert torch.allclose(lp[:4], manual_log_probs(old, prompt, tokens[:4]), atol=1e-5)  # the old weights
    fresh = manual_log_probs(model, prompt, tokens)[4:]  # the new weights over a prefix they computed themselves
    if recompute:
        assert torch.allclose(lp[4:], fresh, atol=1e-5)
    else:  # the new weights over the cache the old ones built (prompt + tokens 0..2; token 3 is fed after the switch)
        with torch.no_grad():
            cache = old(input_ids=torch.cat([prompt, tokens[:3]])[None], use_cache=True).past_key_values
            logits = model(input_ids=tokens[3:-1][None], past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(len(prompt) + 3, len(prompt) + R - 1)[None]).logits[0]
        want = torch.log_softmax(logits.float(), -1).gather(-1, tokens[4:, None]).squeeze(1)
        assert torch.allclose(lp[4:], want, atol=1e-5)
        assert not torch.allclose(lp[4:], fresh, atol=1e-4)  # and that is not what a fresh prefix gives


@pytest.mark.parametrize("k,trains_by", [(0, None), (1, 2)], ids=["k0", "k1-trains-at-2"])
@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_sequences_too_stale_to_train_age_out(tok, prompts, on_stale, k, trains_by):
    """After an update to v1, v0 tokens are too old: with k = 0 at once; with k = 1 because the batch
    trains at update 2 (generation runs ahead)."""
    model = stopping_model(tok)
    cfg = RolloutOptions(n=1, do_sample=False, max_response_len=R, log_probs=True)
    stream = HFStreamingRollout(model, tok, cfg, P, slots=4)
    stream.add(*prompts, metas=list(range(len(PROMPTS))))
    rule = StaleRule(max_staleness=k, trains_by=trains_by, on_stale=on_stale)
    first = stream.run(2, version=0, seed=0, stale=rule)
    assert len(stream.active) >= 2 and (first.columns["token_versions"] == 0).all()
    later = drain(stream, calls=6, groups=2, version=1, stale=rule)  # an update: every v0 token is too old
    counts = [b.counts for b in later]
    returned = [m for b in [first, *later] for m in b.prompts]
    assert all((b.columns["token_versions"][b.columns["response_mask"].bool()] == 1).all() for b in later)
    assert len(returned) == len(set(returned))  # never twice
    if on_stale == "drop":
        assert counts[0].stale_dropped >= 2 and sum(c.stale_regenerated for c in counts) == 0
        assert len(returned) == len(PROMPTS) - counts[0].stale_dropped  # the dropped prompts never come back
    else:
        assert counts[0].stale_regenerated >= 2 and sum(c.stale_dropped for c in counts) == 0
        assert sorted(returned) == list(range(len(PROMPTS)))  # nothing lost: started again, at v1


def test_a_call_tops_up_its_slots_after_ageing_out(tok, prompts):
    """At k = 1 the last call's unreturned sequences are too old for the next: they go first, then
    refill() fills the freed slots with later prompts (models/stream_slots.top_up). Counted before
    the drop they filled the slots, nothing later was admitted, and a call had to finish every
    prompt of its own batch, its long tail too."""
    model = stopping_model(tok)
    cfg = RolloutOptions(n=1, do_sample=False, max_response_len=R, log_probs=True)
    stream = HFStreamingRollout(model, tok, cfg, P, slots=4)
    ids, mask = prompts
    stream.add(ids[:4], mask[:4], metas=[0, 1, 2, 3])
    stream.run(1, version=0, seed=0, stale=StaleRule(max_staleness=1, trains_by=1))
    left = stream.in_flight
    assert left >= 1  # started at v0: too old for a batch that trains at update 2
    stream.add(ids[4:4 + 4 - left], mask[4:4 + 4 - left], metas=list(range(4, 8 - left)))  # the slots look full
    later, refills = iter(range(8 - left, len(PROMPTS))), []

    def refill():
        i = next(later)
        refills.append(i)
        stream.add(ids[i:i + 1], mask[i:i + 1], metas=[i])

    out = stream.run(1, version=1, seed=1, stale=StaleRule(max_staleness=1, trains_by=2), refill=refill)
    assert out.counts.stale_dropped == left and len(refills) == left, (out.counts, refills)
    assert (out.columns["token_versions"][out.columns["response_mask"].bool()] == 1).all()


def test_seeded_and_the_global_rng_untouched(tok, prompts):
    model = build_tiny_qwen2(tok, seed=0)
    hook = eos_bias(model, tok, 3.0)
    cfg = RolloutOptions(n=2, max_response_len=R, log_probs=True)
    try:
        def sample(seed: int) -> list[StreamBatch]:
            stream = HFStreamingRollout(model, tok, cfg, P, slots=5)
            stream.add(*prompts, metas=list(range(len(PROMPTS))))
            return [stream.run(3, version=0, seed=seed + i) for i in range(2)]

        before = torch.get_rng_state()
        a, b, other = sample(7), sample(7), sample(8)
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        hook.remove()
    for x, y in zip(a, b):
        assert x.prompts == y.prompts and all(torch.equal(x.columns[k], y.columns[k]) for k in x.columns)
    assert not all(torch.equal(x.columns["responses"], y.columns["responses"]) for x, y in zip(a, other))


# ---------------------------------------------------------------- through a session (Ray)


@pytest.mark.full
def test_grpo_async_with_partial_rollouts_on_the_hf_engine(ray_cluster, tmp_path):
    from distflow_lab.api.runner import load_run_config, open_session

    k = 2
    cfg = load_run_config("tiny-cpu-grpo", [
        f"trainer.out_dir={tmp_path}/out",
        "model.warm_start.steps=30",  # a short SFT: responses end at different lengths, so some stay in flight
        "actor.entropy_coeff=0.01", "cluster.world_size=2", "data.prompts_per_step=2", "rollout.n=4",
        "rollout.log_probs=true", "cluster.stage_timeout_s=60", "groups={rollout: 1, train: 1}", "mode=distributed",
        "schedule.kind=async", f"schedule.max_staleness={k}", "schedule.partial_rollout=true", "actor.off_policy=tis"])
    with open_session(cfg, progress=False) as s:
        trainer = s.plan.stage("old_log_prob").ranks[0]
        m, trained = [], []
        for _ in range(3):
            m.append(s.step().metrics)
            trained.append(s.controller.peek("old_log_prob", trainer, n=1 << 30,
                                             columns=["token_versions", "response_mask", "version"]))
    assert all("rollout/partial_frac" in x and "actor/loss" in x for x in m), m
    assert max(x["schedule/staleness"] for x in m) <= k
    assert [x["schedule/policy_version"] for x in m] == [1.0, 2.0, 3.0]
    for update, b in enumerate(trained):  # trained at policy version `update`: no token older than k
        mask = b["response_mask"].bool()
        assert len(b) == 8 and (b["token_versions"][mask] >= update - k).all(), (update, b["token_versions"])
        oldest = torch.where(mask, b["token_versions"], 1 << 30).min(1).values
        assert torch.equal(oldest, b["version"])  # a row's version is its oldest token's
