"""LOGIC tests of the GPU path (vLLM rollout beside FSDP2), on CPU, without vLLM, without Ray.

What they check is OUR side of the contract with vLLM: the engine and sampling arguments we
build, the seeds, how `RequestOutput`s become HFRollout's columns, the sleep / wake / weight-sync
order, the bucketed weight stream, the chunked log-prob head and the config errors.

`FakeLLM`, `FakeSamplingParams`, `Completion`, `RequestOut` and `Logprob` below are STAND-INS for
vLLM's `LLM`, `SamplingParams`, `CompletionOutput`, `RequestOutput` and `Logprob` (shaped after
vllm/entrypoints/llm.py, vllm/sampling_params.py, vllm/outputs.py, vllm/logprobs.py). They are not
vLLM: that vLLM behaves as they assume is checked only on a GPU, by scripts/gpu_check.sh, which has
not been run on this machine.
"""
import copy
import datetime
import os
import random
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError

from distflow_lab.algos.engine_setup import Policy, RLEngines, sync_weights
from distflow_lab.core.config import Optim, RolloutOptions, parse_run_config
from distflow_lab.core.errors import ConfigError
from distflow_lab.core.spans import SpanRecorder
from distflow_lab.models.fsdp import TrainEngine, head_token_stats
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.rollout_vllm import (VLLMRollout, _external_launcher_env, assemble_outputs,
                                              clear_stale_cpu_shm, engine_kwargs, request_seeds, sampling_kwargs)
from distflow_lab.models.sequences import assemble_columns, tokenize_prompts
from distflow_lab.models.tokenizer import build_char_tokenizer

from .conftest import free_port

P, R, EOS, PAD = 10, 12, 2, 0
FWD = ("input_ids", "attention_mask", "position_ids", "responses")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tok, one_torch_thread


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_qwen2(tok, seed=0)


# ---------------------------------------------------------------- stand-ins for vLLM classes
class Logprob(SimpleNamespace):  # vllm.logprobs.Logprob: .logprob (+ rank, decoded_token)
    pass


class Completion(SimpleNamespace):  # vllm.outputs.CompletionOutput: index, token_ids, logprobs
    pass


class RequestOut(SimpleNamespace):  # vllm.outputs.RequestOutput: outputs (the n completions, any order)
    pass


class FakeSamplingParams:
    """Records its keywords; rejects what vllm/sampling_params.py rejects for our use."""

    def __init__(self, **kw):
        if kw.get("temperature", 1.0) == 0 and kw.get("n", 1) > 1:
            raise ValueError("n must be 1 when using greedy sampling")
        if kw.get("temperature", 1.0) > 2:
            raise ValueError("temperature must be in [0, 2]")
        self.kw = kw


class FakeLLM:
    """In-process `vllm.LLM` as on a GPU (sleep mode): records calls, holds a model for the in-place
    reload (`collective_rpc("reload_weights")`), answers `generate`
    with scripted token ids. Calling a discarded (slept) part raises, as real sleep would corrupt."""

    def __init__(self, model=None, script=None):
        self.model, self.script, self.calls, self.asleep = model, script, [], set()
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")))

    def sleep(self, level):
        assert not self.asleep, "sleep while asleep"
        self.calls.append(f"sleep{level}")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags):
        self.calls.append(f"wake{sorted(tags)}")
        self.asleep -= set(tags)

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights" and "weights" not in self.asleep, "load into discarded weights"
        self.calls.append("reload_weights")
        return [self.model.load_weights(kwargs["weights_iterator"])]

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params, use_tqdm):
        assert not self.asleep and not use_tqdm and len(prompts) == len(sampling_params)
        self.calls.append("generate")
        self.params = sampling_params
        return [RequestOut(outputs=[Completion(index=k, token_ids=self.script(p, sp.kw, k), logprobs=None)
                                    for k in reversed(range(sp.kw["n"]))])
                for p, sp in zip(prompts, sampling_params)]


FAKE_VLLM = SimpleNamespace(SamplingParams=FakeSamplingParams)


class LoaderModel(torch.nn.Module):
    """Stands in for a vLLM model: `load_weights(weights=iterable of (hf_name, tensor))` copies into
    an HF model by name, and remembers every bucket it got."""

    def __init__(self, target):
        super().__init__()
        self.target, self.buckets = target, []

    def load_weights(self, weights):
        own, names = self.target.state_dict(), []
        for name, t in weights:
            own[name].copy_(t)
            names.append(name)
        self.buckets.append(names)
        return set(names)


def vllm_opts(**kw) -> RolloutOptions:
    return RolloutOptions(engine="vllm", max_response_len=R, **kw)


# ---------------------------------------------------------------- settings reach the engine
def test_engine_kwargs_carry_tp_dtype_lengths_memory_and_logprobs_mode():
    opts = vllm_opts(tp=2, micro_batch=64, log_probs=True,
                     vllm={"gpu_memory_utilization": 0.3, "kv_cache_gib": 6, "enforce_eager": True})
    assert engine_kwargs(opts, P, "bfloat16", 7, cpu=False) == dict(
        tensor_parallel_size=2, distributed_executor_backend="external_launcher", dtype="bfloat16", seed=7,
        max_model_len=P + R, max_num_seqs=64, gpu_memory_utilization=0.3, enable_sleep_mode=True,
        enable_prefix_caching=True, enforce_eager=True, skip_tokenizer_init=True,
        kv_cache_memory_bytes=6 * 2**30, logprobs_mode="processed_logprobs",
        disable_custom_all_reduce=True)  # tp >= 2 with one visible GPU per worker: no peer access
    plain = engine_kwargs(vllm_opts(), P, "float32", 0, cpu=False)
    assert "kv_cache_memory_bytes" not in plain and plain["logprobs_mode"] == "processed_logprobs"
    assert "disable_custom_all_reduce" not in plain
    assert plain["enable_prefix_caching"] and plain["tensor_parallel_size"] == 1


def test_sampling_params_mapping():
    sampled = sampling_kwargs(vllm_opts(n=4, temperature=0.7, top_p=0.9, top_k=5, log_probs=True), EOS, 123)
    assert sampled == dict(n=4, max_tokens=R, seed=123, stop_token_ids=[EOS], ignore_eos=True, detokenize=False,
                           logprobs=0, temperature=0.7, top_p=0.9, top_k=5)
    assert sampling_kwargs(vllm_opts(), EOS, 0)["logprobs"] is None and sampling_kwargs(vllm_opts(), EOS, 0)["top_k"] == 0
    greedy = sampling_kwargs(vllm_opts(n=1, do_sample=False), EOS, 5)
    assert greedy["temperature"] == 0.0 and greedy["n"] == 1 and "top_p" not in greedy
    FakeSamplingParams(**greedy)  # what vLLM accepts


def test_stale_cpu_shared_memory_is_removed_and_a_live_one_is_an_error(tmp_path):
    """vLLM's CPU all-reduce names its shared memory by TP ranks only and never unlinks it: a dead
    engine's files would fail the next tp=2 engine (errno 17). Each rank removes its own; a file a
    live process maps belongs to another engine and is a named error."""
    import subprocess
    import sys

    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "-tp:0-[2-3]-cpushm_0", "-tp:0-[2-3]-cpushm_1"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 4096)
    assert [f.name for f in clear_stale_cpu_shm(1, 2, tmp_path)] == [names[1]]
    assert [f.name for f in clear_stale_cpu_shm(2, 2, tmp_path)] == [names[2]]
    assert sorted(f.name for f in tmp_path.iterdir()) == [names[0], names[3]]
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\nf = open(sys.argv[1], 'r+b')\n"
                               "m = mmap.mmap(f.fileno(), 0)\nprint('mapped', flush=True)\ntime.sleep(60)",
                               str(tmp_path / names[0])], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with pytest.raises(ConfigError, match=r"another vLLM engine on this host \(pid \d+\) .*cpushm_0"):
            clear_stale_cpu_shm(0, 2, tmp_path)
        assert (tmp_path / names[0]).exists()
    finally:
        holder.kill()


def test_request_seeds_give_every_row_its_own_stream():
    n, B = 4, 6
    rows = lambda seed: {s + k for s in request_seeds(seed, B, n) for k in range(n)}  # noqa: E731  vLLM: seed + k
    a, b = rows(11), rows(12)
    assert len(a) == len(b) == B * n and not a & b  # distinct rows, disjoint calls
    assert request_seeds(11, B, n) == request_seeds(11, B, n) and max(a) < 2**63
    with pytest.raises(ValueError):
        request_seeds(0, 2**22, 8)


# ---------------------------------------------------------------- outputs -> HFRollout's columns
@pytest.mark.parametrize("log_probs", [False, True])
def test_assembled_outputs_equal_hf_rollout_columns(tok, model, log_probs):
    """HF samples; the same samples handed over as RequestOutputs (completions out of order, one
    over-long output, top-k entries besides the sampled token) give exactly HF's columns."""
    n = 3
    ids, mask, _ = tokenize_prompts(tok, ["3+4=", "12*3=", "hello"], P)
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 3.0  # early eos in some rows, full length in others
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        hf = HFRollout(model, tok, RolloutOptions(n=n, max_response_len=R, log_probs=log_probs), P).generate(ids, mask, 3)
    finally:
        hook.remove()
    lengths = hf["response_mask"].sum(1)
    assert (lengths < R).any() and (lengths == R).any()
    rng = random.Random(0)
    outputs = []
    for i in range(3):
        comps = []
        for k in range(n):
            r = i * n + k
            tokens = hf["responses"][r, : lengths[r]].tolist()
            lps = [{t: Logprob(logprob=float(hf["rollout_log_probs"][r, j]) if log_probs else 0.0), 99: Logprob(logprob=-9.0)}
                   for j, t in enumerate(tokens)]
            if lengths[r] == R:  # an output longer than max_response_len is cut
                tokens, lps = tokens + [5, 6], lps + [{5: Logprob(logprob=-1.0)}, {6: Logprob(logprob=-1.0)}]
            comps.append(Completion(index=k, token_ids=tokens, logprobs=lps if log_probs else None))
        rng.shuffle(comps)
        outputs.append(RequestOut(outputs=comps))
    cols = assemble_outputs(outputs, ids, mask, n, R, EOS, PAD, log_probs)
    assert list(cols) == list(hf) and all(cols[k].dtype == hf[k].dtype for k in hf)
    assert all(torch.equal(cols[k], hf[k]) for k in hf)


def test_assemble_outputs_tokens_after_eos_and_errors():
    ids, mask = torch.tensor([[PAD, 7, 8]]), torch.tensor([[0, 1, 1]])
    out = [RequestOut(outputs=[Completion(index=0, token_ids=[9, EOS, 9, 9], logprobs=None)])]
    cols = assemble_outputs(out, ids, mask, 1, 5, EOS, PAD, False)
    ref = assemble_columns(ids, mask, torch.tensor([[9, EOS, PAD, PAD, PAD]]), torch.tensor([[1, 1, 0, 0, 0]]))
    assert all(torch.equal(cols[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="log-prob"):  # asked for, not returned
        assemble_outputs(out, ids, mask, 1, 5, EOS, PAD, True)
    with pytest.raises(ValueError, match="samples"):  # a sample missing
        assemble_outputs([RequestOut(outputs=[Completion(index=1, token_ids=[9], logprobs=None)])], ids, mask, 2, 5,
                         EOS, PAD, False)
    with pytest.raises(ValueError, match="request outputs"):
        assemble_outputs(out * 2, ids, mask, 1, 5, EOS, PAD, False)


# ---------------------------------------------------------------- sleep / wake / generate / sync
def script(prompt, kw, k):
    """Deterministic 'sampling': the seed and sample index pick the tokens; some rows stop on eos."""
    g = random.Random(kw["seed"] + k)
    toks = [g.randrange(4, 60) for _ in range(kw["max_tokens"])]
    return toks[: g.randrange(1, kw["max_tokens"])] + [EOS] if g.random() < 0.5 else toks


def test_sleep_wake_sync_generate_order(tok, model):
    llm = FakeLLM(LoaderModel(copy.deepcopy(model)), script)
    ro = VLLMRollout.attach(FAKE_VLLM, llm, tok, vllm_opts(n=2), P, dtype="float32", cpu=False)
    ro.sleep()  # what __init__ does after building the engine
    assert ro.needs_weights and llm.calls == ["sleep2"]
    ids, mask, _ = tokenize_prompts(tok, ["1+1=", "22", "abc"], P)
    with pytest.raises(RuntimeError, match="load_weights first"):
        ro.generate(ids, mask, seed=5)
    state = list(model.state_dict().items())
    assert ro.load_weights([state[:3], state[3:]]) == len(state)
    out = ro.generate(ids, mask, seed=5)
    ro.generate(ids[:1], mask[:1], seed=6)  # a second round in the same step (DAPO): no sync needed
    assert llm.calls == ["sleep2", "wake['weights']", "reload_weights", "reset_prefix_cache",
                         "wake['kv_cache']", "generate", "generate"]
    seeds = [sp.kw["seed"] for sp in llm.params]
    assert seeds == request_seeds(6, 1, 2)
    assert out["responses"].shape == (6, R) and out["input_ids"].shape == (6, P + R)
    assert torch.equal(out["prompts"], ids.repeat_interleave(2, 0))
    # the trainers put it to sleep before they compute (engine_setup hangs ro.sleep on before_compute)
    actor = TrainEngine(copy.deepcopy(model), None, device="cpu")
    actor.before_compute.append(ro.sleep)
    actor.forward_log_probs(*[out[k] for k in FWD])
    actor.forward_log_probs(*[out[k] for k in FWD])
    assert llm.calls[-1] == "sleep2" and llm.calls.count("sleep2") == 2 and ro.needs_weights
    ro.close()
    assert llm.calls[-1] == "shutdown" and ro.llm is None
    ro.close()  # idempotent


def test_request_seeds_reach_sampling_params(tok, model):
    llm = FakeLLM(LoaderModel(copy.deepcopy(model)), script)
    ro = VLLMRollout.attach(FAKE_VLLM, llm, tok, vllm_opts(n=2, temperature=0.5, log_probs=False), P)
    ids, mask, _ = tokenize_prompts(tok, ["1+1=", "22", "abc"], P)
    ro.generate(ids, mask, seed=5)
    assert [sp.kw["seed"] for sp in llm.params] == request_seeds(5, 3, 2)  # one seed per prompt
    assert all(sp.kw == sampling_kwargs(ro.cfg, EOS, sp.kw["seed"]) for sp in llm.params)


def test_without_sleep_mode_nothing_sleeps(tok, model):
    llm = FakeLLM(LoaderModel(copy.deepcopy(model)), script)
    ro = VLLMRollout.attach(FAKE_VLLM, llm, tok, vllm_opts(n=1, vllm={"enable_sleep_mode": False}), P)
    ro.sleep()
    ids, mask, _ = tokenize_prompts(tok, ["9"], P)
    ro.generate(ids, mask, seed=0)
    assert llm.calls == ["generate"] and not ro.needs_weights


# ---------------------------------------------------------------- weight sync: bounded buckets
def test_weight_buckets_round_trip_bounded_and_without_copies(tok, model):
    src = TrainEngine(build_tiny_qwen2(tok, seed=3), Optim(), device="cpu")
    state = src.model.state_dict()
    bound = 40_000  # bytes: several buckets for this ~0.3 MB model
    stats = {}
    buckets = list(src.weight_buckets(bucket_bytes=bound, stats=stats))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert len(buckets) > 3 and all(s <= bound or len(b) == 1 for s, b in zip(sizes, buckets))
    assert [n for b in buckets for n, _ in b] == list(state)  # every name once, state-dict order
    flat = dict(p for b in buckets for p in b)
    assert flat["lm_head.weight"] is flat["model.embed_tokens.weight"]  # tied: gathered once
    assert stats == {"bytes": sum(p.numel() * 4 for p in src.model.parameters()), "tensors": len(state)}
    assert all(flat[n].data_ptr() == t.data_ptr() for n, t in state.items())  # on-device, unsharded: no copy
    assert {t.dtype for b in src.weight_buckets(bound, dtype=torch.bfloat16) for _, t in b} == {torch.bfloat16}
    # round trip into a stand-in vLLM model, through the rollout's streaming load
    loader = LoaderModel(copy.deepcopy(model))
    ro = VLLMRollout.attach(FAKE_VLLM, FakeLLM(loader), tok, vllm_opts(), P, dtype="float32")
    assert ro.load_weights(src.weight_buckets(bucket_bytes=bound)) == len(state)
    assert len(loader.buckets) == 1  # one streamed reload, the buckets consumed one at a time
    assert all(torch.equal(loader.target.state_dict()[n], t) for n, t in state.items())


def test_sync_weights_streams_and_records_a_span(tok, model):
    actor = TrainEngine(build_tiny_qwen2(tok, seed=4), Optim(), device="cpu")
    loader = LoaderModel(copy.deepcopy(model))
    llm = FakeLLM(loader, script)
    ro = VLLMRollout.attach(FAKE_VLLM, llm, tok, vllm_opts(n=1), P, dtype="float32", cpu=False)
    ro.bucket_bytes = 1 << 20  # as engine_setup sets it from weight_sync.bucket_mib=1
    rec = SpanRecorder(0, "local")
    ctx = SimpleNamespace(engines=RLEngines(tok, None, Policy(shared=False), actor=actor, rollout=ro),
                          span=lambda phase, **c: rec.span(0, "rollout", phase, **c))
    sync_weights(ctx)  # nothing stale, engine awake: no sync
    assert rec.take() == [] and llm.calls == []
    ro.sleep()  # level 2: the engine's weights are gone
    sync_weights(ctx)
    (span,) = rec.take()
    n_bytes = sum(p.numel() * 4 for p in actor.model.parameters())
    assert span.phase == "weight_sync" and span.bytes == n_bytes and span.items == len(actor.model.state_dict())
    assert span.end >= span.start and not ro.needs_weights
    assert all(torch.equal(loader.target.state_dict()[n], t) for n, t in actor.model.state_dict().items())
    ctx.engines.policy.updated()  # an actor update
    sync_weights(ctx)
    assert len(rec.take()) == 1 and not ctx.engines.policy.stale


def test_setup_engines_passes_run_settings_and_hangs_sleep_on_the_trainers(tok, model, tmp_path, monkeypatch):
    from distflow_lab.algos import engine_setup
    from distflow_lab.models.model_dir import save_model_dir

    save_model_dir(model, tok, tmp_path / "m")
    cfg = parse_run_config("tiny-cpu-grpo", [f"model.path={tmp_path / 'm'}", "cluster.world_size=1", "seed=3",
                                             "weight_sync.bucket_mib=7"])
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "vllm"})})  # as on a GPU
    got = {}

    def fake_make_rollout(gen_model, tokenizer, opts, max_prompt_len, model_path=None, **kw):
        got.update(kw, gen_model=gen_model, model_path=model_path)
        return VLLMRollout.attach(FAKE_VLLM, FakeLLM(), tokenizer, opts, max_prompt_len, kw["dtype"], cpu=False)

    monkeypatch.setattr(engine_setup, "make_rollout", fake_make_rollout)
    ctx = SimpleNamespace(groups={}, roles=frozenset({"rollout", "actor", "reference"}))  # colocated: every role
    engines = engine_setup.setup_engines(ctx, cfg)
    assert got == {"dtype": "float32", "seed": 3, "gen_model": None, "model_path": str(tmp_path / "m"),
                   "sleep_at_start": True}  # colocated: the trainer gets the memory until the first rollout
    sleep = engines.rollout.sleep
    assert engines.actor.before_compute == [sleep] and engines.ref.before_compute == [sleep]
    assert not engines.policy.shared
    assert engines.rollout.bucket_bytes == 7 << 20  # one bucket size for every sync, colocated ones too


def test_external_launcher_env_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="rollout.tp=2"):
        _external_launcher_env(2)
    _external_launcher_env(1)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["RANK"] == "0"
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0


# ---------------------------------------------------------------- config errors
def test_the_old_vllm_bucket_key_names_its_new_place():
    with pytest.raises(ConfigError, match=r"rollout.vllm.weight_sync_bucket_mib is now weight_sync.bucket_mib"):
        parse_run_config("tiny-cpu-grpo", ["rollout.vllm.weight_sync_bucket_mib=512"])


def test_greedy_with_n_above_one_and_temperature_above_two_are_config_errors():
    with pytest.raises(ConfigError, match=r"n=8 with do_sample=false"):
        parse_run_config("tiny-cpu-grpo", ["rollout.do_sample=false"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        parse_run_config("tiny-cpu-grpo", ["rollout.temperature=2.5"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.gpu_memory_utilization"):
        parse_run_config("tiny-cpu-grpo", ["rollout.vllm.gpu_memory_utilization=1.0"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.kv_cache: unknown key"):
        parse_run_config("tiny-cpu-grpo", ["rollout.vllm.kv_cache=8"])
    assert parse_run_config("tiny-cpu-grpo", ["rollout.do_sample=false", "rollout.n=1"]).rollout.n == 1
    with pytest.raises(ValidationError):
        RolloutOptions(do_sample=False, n=2)


# ---------------------------------------------------------------- memory: the chunked log-prob head
def batch_of(B: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = torch.full((B, P), PAD), torch.full((B, R), PAD)
    pmask, rmask = torch.zeros((B, P), dtype=torch.long), torch.zeros((B, R), dtype=torch.long)
    for i in range(B):
        lp, lr = int(torch.randint(2, P + 1, (1,), generator=g)), int(torch.randint(1, R + 1, (1,), generator=g))
        prompts[i, P - lp:], pmask[i, P - lp:] = torch.randint(4, 90, (lp,), generator=g), 1
        responses[i, :lr], rmask[i, :lr] = torch.randint(4, 90, (lr,), generator=g), 1
    cols = assemble_columns(prompts, pmask, responses, rmask)
    cols["advantages"] = torch.randn(B, 1, generator=g).expand(B, R) * rmask
    return cols


def pg_loss(mb, log_probs, entropy):
    return -mb["advantages"] * log_probs - 0.01 * entropy, mb["response_mask"], {}


def test_head_chunks_are_bounded_and_numerics_unchanged(model):
    head, seen = model.lm_head, []
    hook = head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[0]))
    hidden, labels = torch.randn(3, 7, model.config.hidden_size), torch.randint(0, 90, (3, 7))
    try:
        lp, ent = head_token_stats(head, hidden, labels, temperature=0.7, chunk=4, with_entropy=True)
    finally:
        hook.remove()
    assert max(seen) <= 4 and sum(seen) == 21
    logp = torch.log_softmax(head(hidden).float() / 0.7, -1)
    assert torch.allclose(lp, logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-5)
    batch = batch_of(6, seed=1)
    small, big = (TrainEngine(copy.deepcopy(model), Optim(), device="cpu", temperature=0.9, logits_chunk=c)
                  for c in (3, 10**6))
    (lp_s, ent_s), (lp_b, ent_b) = (e.forward_log_probs(*[batch[k] for k in FWD], with_entropy=True)
                                    for e in (small, big))
    assert torch.allclose(lp_s, lp_b, atol=1e-6) and torch.allclose(ent_s, ent_b, atol=1e-6)
    m_s, m_b = (e.compute_grads(batch, pg_loss, with_entropy=True) for e in (small, big))
    g_s, g_b = small.gathered_grads(), big.gathered_grads()
    assert m_s["loss"] == pytest.approx(m_b["loss"], abs=1e-6)
    assert max((g_s[k] - g_b[k]).abs().max().item() for k in g_b) < 1e-6


def _fsdp_rank(rank: int, port: int, out_dir: str, batch: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        eng = TrainEngine(build_tiny_qwen2(build_char_tokenizer(), seed=0), Optim(), device="cpu",
                          micro_token_budget=40, logits_chunk=5)
        local = {k: v[rank * 3 : rank * 3 + 3] for k, v in batch.items()}
        lp, ent = eng.forward_log_probs(*[local[k] for k in FWD], with_entropy=True)
        eng.compute_grads(local, pg_loss, with_entropy=True)
        grads = eng.gathered_grads()
        stats = {}
        buckets = [[(n, t.clone()) for n, t in b] for b in eng.weight_buckets(bucket_bytes=30_000, stats=stats)]
        torch.save({"lp": lp, "ent": ent, "grads": grads, "buckets": buckets, "stats": stats,
                    "state": eng.full_state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp2_chunked_head_and_weight_buckets_match_one_process(tok, model, tmp_path):
    """FSDP2 over 2 gloo ranks with 5-token logits chunks (checkpointed under grad, the LM head's
    gathered root weights used inside the forward) equals one plain process; the bucket stream
    gathers the same full weights on both ranks."""
    batch = batch_of(6, seed=2)
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, str(tmp_path), batch)) for r in range(2)]
    [p.start() for p in procs]
    for p in procs:
        p.join(timeout=150)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [e.read_text() for e in sorted(tmp_path.glob("error*.txt"))] or [p.exitcode for p in procs]
    assert errors == [0, 0], errors[0]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    ref = TrainEngine(copy.deepcopy(model), Optim(), device="cpu", micro_token_budget=10**6, logits_chunk=10**6)
    lp, ent = ref.forward_log_probs(*[batch[k] for k in FWD], with_entropy=True)
    assert torch.allclose(torch.cat([r0["lp"], r1["lp"]]), lp, atol=1e-5)
    assert torch.allclose(torch.cat([r0["ent"], r1["ent"]]), ent, atol=1e-5)
    ref.compute_grads(batch, pg_loss, with_entropy=True)
    g_ref = ref.gathered_grads()
    for r in (r0, r1):
        assert max((r["grads"][k] - g_ref[k]).abs().max().item() for k in g_ref) < 1e-6
        flat = dict(p for b in r["buckets"] for p in b)
        assert list(flat) == list(model.state_dict()) and len(r["buckets"]) > 2
        assert all(torch.equal(flat[k], r["state"][k]) for k in flat)
        assert all(torch.equal(flat[k], v) for k, v in model.state_dict().items())  # no step: the initial weights
    assert r0["stats"] == r1["stats"] == {"bytes": sum(p.numel() * 4 for p in model.parameters()),
                                          "tensors": len(model.state_dict())}


def test_partial_rollouts_on_vllm_need_one_rank_per_engine():
    """The ranks of a tensor-parallel engine would each pull weights and could resume at different versions."""
    from distflow_lab.core.config import check_partial_rollout

    check_partial_rollout(True, "vllm", 1)
    check_partial_rollout(False, "vllm", 2)
    with pytest.raises(ConfigError, match="partial_rollout on vLLM needs rollout.tp=1"):
        check_partial_rollout(True, "vllm", 2)
