"""The real vLLM engine (its CPU build, installed by scripts/setup.sh) behind `VLLMRollout`,
against transformers on the same checkpoint: greedy tokens equal, log-probs agree in fp32,
a weight sync makes vLLM generate with the new weights (and a partial one is an error), the
trainer's random stream does not move when an engine is built, and an engine can be closed
and another built in the same process (here in bfloat16, where a real mismatch shows)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from distflow_lab.algos.grpo import mismatch
from distflow_lab.core.config import Optim, RolloutOptions, TinySpec, VLLMOptions
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import build_tiny_qwen2, save_model_dir
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.models.tokenizer import build_char_tokenizer

vllm = pytest.importorskip("vllm") if not os.environ.get("CI") else __import__("vllm")  # CI must have it
from distflow_lab.models.rollout_vllm import VLLMRollout  # noqa: E402

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
PROMPTS = ["1+2=", "7+5=", "3+3=", "9+9="]
P = 8


def opts(**kw) -> RolloutOptions:
    return RolloutOptions(**{"n": 1, "do_sample": False, "max_response_len": 6, "log_probs": True, **kw})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch.distributed as dist

    had_world = dist.is_initialized()
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, TinySpec(), seed=3)
    path = tmp_path_factory.mktemp("vllm") / "m"
    save_model_dir(model, tok, path)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    engine = VLLMRollout(str(path), tok, opts(), P, dtype="float32", seed=0, sleep_at_start=False)
    rng_kept = torch.equal(before, torch.get_rng_state())
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    yield dict(tok=tok, model=model, path=path, engine=engine, rng_kept=rng_kept, ids=ids, mask=mask)
    engine.close()
    if dist.is_initialized() and not had_world:  # vLLM made a world of one for this process: leave none behind
        dist.destroy_process_group()


def hf_greedy(setup, model):
    return HFRollout(model.eval(), setup["tok"], opts(), P).generate(setup["ids"], setup["mask"], seed=0)


def test_greedy_tokens_and_log_probs_equal_transformers(setup):
    got = setup["engine"].generate(setup["ids"], setup["mask"], seed=0)
    want = hf_greedy(setup, setup["model"])
    assert torch.equal(got["responses"], want["responses"]) and torch.equal(got["response_mask"], want["response_mask"])
    trainer = TrainEngine(copy.deepcopy(setup["model"]), Optim(), device="cpu", use_fsdp=False)
    lp, _ = trainer.forward_log_probs(*(got[k] for k in MODEL_INPUTS))
    m = mismatch(got["rollout_log_probs"], lp, got["response_mask"])
    assert m["rollout/logprob_diff_max"] < 1e-4, m  # fp32 against fp32: ~1e-6 here
    assert setup["rng_kept"]  # building the engine left the trainer's random stream where it was


def test_a_sync_makes_vllm_generate_with_the_new_weights(setup):
    e = setup["engine"]
    perturbed = copy.deepcopy(setup["model"])
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    state = perturbed.state_dict()
    assert e.load_weights(state) == len(state)
    after = e.generate(setup["ids"], setup["mask"], seed=0)
    assert torch.equal(after["responses"], hf_greedy(setup, perturbed)["responses"])
    assert not torch.equal(after["responses"], hf_greedy(setup, setup["model"])["responses"])  # they changed
    e.load_weights(state)  # the same weights again: the same output, to the bit
    again = e.generate(setup["ids"], setup["mask"], seed=0)
    assert torch.equal(again["responses"], after["responses"])
    assert torch.equal(again["rollout_log_probs"], after["rollout_log_probs"])
    half = dict(list(setup["model"].state_dict().items())[:10])
    with pytest.raises(RuntimeError, match="weight sync covered 10 of the checkpoint's"):
        e.load_weights(half)  # vLLM itself takes a partial load silently
    with pytest.raises(RuntimeError, match="partial sync"):
        e.generate(setup["ids"], setup["mask"], seed=0)
    e.load_weights(setup["model"].state_dict())  # a full sync repairs it
    assert torch.equal(e.generate(setup["ids"], setup["mask"], seed=0)["responses"],
                       hf_greedy(setup, setup["model"])["responses"])


def test_a_damaged_sync_through_the_object_store_is_a_named_mismatch_and_vllm_refuses_to_generate(setup, ray_cluster):
    """The worker-groups path into vLLM (weight_transport: numpy buckets, checked views): a bucket damaged
    after it was fingerprinted stops the load by name, and the engine refuses to generate until a whole
    policy arrives, which then generates exactly what HF does with it."""
    from distflow_lab.core.errors import WeightSyncMismatch
    from distflow_lab.runtime.weight_transport import buckets_of, check_loaded, publish, receive

    e, model = setup["engine"], setup["model"]
    engine = TrainEngine(model, None, device="cpu", use_fsdp=False)
    aliases = engine.tied_aliases()
    items = list(model.state_dict().items())
    bad = publish(buckets_of(items, 1 << 16), 7, aliases, corrupt=1)
    second = next(en for en in bad.entries if en.bucket == 1)  # a later bucket: the first one already loaded
    with pytest.raises(WeightSyncMismatch, match=rf"policy v7: tensor '{second.name}': fingerprint"):
        e.load_weights([pair] for pair in receive(bad, 30.0))
    with pytest.raises(RuntimeError, match="partial sync"):
        e.generate(setup["ids"], setup["mask"], seed=0)
    whole = publish(buckets_of(items, 1 << 16), 8, aliases)
    seen: set[str] = set()
    e.load_weights([(n, t)] for n, t in receive(whole, 30.0) if not seen.add(n))
    check_loaded(whole, seen)
    assert torch.equal(e.generate(setup["ids"], setup["mask"], seed=0)["responses"],
                       hf_greedy(setup, model)["responses"])


# ---------------------------------------------------------------- partial rollouts (rollout_vllm_stream.py)
def full_log_probs(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | prompt, tokens_<t) by one full forward: what a trainer recomputes."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, tokens])[None]).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(1)


def rows_of(out) -> dict:
    """meta -> list of (prompt, tokens, log-probs, versions), one per returned row."""
    c, got = out.columns, {}
    for i, meta in enumerate(out.prompts):
        m, pm = c["response_mask"][i].bool(), c["attention_mask"][i, :P].bool()
        got.setdefault(meta, []).append((c["input_ids"][i, :P][pm], c["responses"][i][m],
                                         c["rollout_log_probs"][i][m], c["token_versions"][i][m]))
    return got


def test_streaming_greedy_equals_generate(setup, monkeypatch):
    """Requests join as others finish (2 slots for 4 prompts): the tokens are generate's."""
    from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout

    e = setup["engine"]
    e.load_weights(setup["model"].state_dict())
    want = e.generate(setup["ids"], setup["mask"], seed=0)
    stream = VLLMStreamingRollout(e, P, slots=2)
    stream.add(setup["ids"], setup["mask"], metas=list(range(len(PROMPTS))))
    out = stream.run(len(PROMPTS), version=0, seed=0)
    assert sorted(out.prompts) == list(range(len(PROMPTS))) and stream.in_flight == 0
    for i, meta in enumerate(out.prompts):
        assert torch.equal(out.columns["responses"][i], want["responses"][meta]), meta
    assert (out.columns["token_versions"] == 0).all() and out.counts.partial == 0


def test_sequences_in_flight_resume_across_a_weight_sync_with_the_new_weights(setup, monkeypatch):
    """A sync mid-stream preempts the running requests; they keep their tokens and go on under the new
    weights, with the KV recomputed: each token's log-prob is the full forward of the policy of its version."""
    from distflow_lab.models.rollout_stream import StaleRule
    from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout

    e = setup["engine"]
    monkeypatch.setattr(e, "cfg", opts(n=2, do_sample=True))
    old, new = setup["model"], copy.deepcopy(setup["model"])
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    e.load_weights(old.state_dict())
    synced = []

    def refresh() -> int:  # the first pull brings version 1
        if not synced:
            e.load_weights(new.state_dict())
            synced.append(1)
        return 1

    stream = VLLMStreamingRollout(e, P, slots=8, refresh_every=2)
    stream.add(setup["ids"], setup["mask"], metas=list(range(len(PROMPTS))))
    before = torch.get_rng_state()
    out = stream.run(len(PROMPTS), version=0, seed=5, refresh=refresh)
    assert torch.equal(torch.get_rng_state(), before)
    assert out.counts.refreshes == 1 and out.counts.resumed >= 1 and out.counts.partial >= 1, out.counts
    for meta, rows in rows_of(out).items():
        for prompt, tokens, lp, versions in rows:
            assert (versions[1:] >= versions[:-1]).all()  # 0s, then 1s
            for v, model in ((0, old), (1, new)):
                at = versions == v
                if at.any():
                    assert torch.allclose(lp[at], full_log_probs(model, prompt, tokens)[at], atol=1e-4), (meta, v)
    # ageing out aborts requests: k = 0, the next version makes every started v1 sequence stale
    stream.add(setup["ids"], setup["mask"], metas=list(range(10, 10 + len(PROMPTS))))
    stream.run(1, version=1, seed=6)
    started = sum(bool(s.tokens) for s in stream.running.values())
    later = stream.run(len(PROMPTS) - 1, version=2, seed=7, stale=StaleRule(0, on_stale="regenerate"))
    assert later.counts.stale_regenerated >= started and (later.columns["token_versions"] == 2).all()
    assert stream.in_flight == 0 and e.llm.llm_engine.get_num_unfinished_requests() == 0


@pytest.mark.full
def test_close_then_a_bf16_engine_in_the_same_process_shows_a_real_mismatch(setup):
    setup["engine"].close()
    eager = opts(vllm=VLLMOptions(enforce_eager=True))  # builds in ~5 s (the fixture's engine is compiled)
    e = VLLMRollout(str(setup["path"]), setup["tok"], eager, P, dtype="bfloat16", seed=0, sleep_at_start=False)
    setup["engine"] = e  # the fixture closes this one
    got = e.generate(setup["ids"], setup["mask"], seed=0)
    trainer = TrainEngine(copy.deepcopy(setup["model"]), Optim(), device="cpu", use_fsdp=False)
    lp, _ = trainer.forward_log_probs(*(got[k] for k in MODEL_INPUTS))
    m = mismatch(got["rollout_log_probs"], lp, got["response_mask"])
    assert 1e-4 < m["rollout/logprob_diff_mean"] < 0.5, m  # bf16 rollout against the fp32 trainer
