"""LoRA policies (models/lora.py): peft's adapters train under the TrainEngine, a sync carries only
them, and the rollout's merge of them reproduces the trained policy exactly. CPU, no Ray (the
sessions that train LoRA on every plane, schedule and engine: tests/test_algo_matrix.py)."""
import copy

import pytest
import torch

from distflow_lab.core.config import LoraOptions
from distflow_lab.core.config import Optim as OptimConfig
from distflow_lab.core.config import RolloutOptions
from distflow_lab.core.errors import ConfigError
from distflow_lab.models.fsdp import TrainEngine, sft_loss_fn
from distflow_lab.experiments.base_eval import load_trained_policy
from distflow_lab.models.lora import LoraMerge, apply_lora
from distflow_lab.models.model_dir import build_tiny_qwen2, save_model_dir
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.sequences import build_sft_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tok, one_torch_thread
P, R = 10, 6


@pytest.fixture(scope="module")
def base(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-base")
    model = build_tiny_qwen2(tok, seed=0)
    save_model_dir(model, tok, d)
    return model, d


def log_probs(engine_or_model, batch):
    eng = engine_or_model if isinstance(engine_or_model, TrainEngine) else TrainEngine(engine_or_model, device="cpu")
    return eng.forward_log_probs(*(batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")))[0]


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "down_proj"]])
def test_adapters_train_alone_and_the_rollouts_merge_is_the_trained_policy(tok, base, targets, tmp_path):
    model, model_dir = base
    opts = LoraOptions(rank=4, alpha=8, target_modules=targets)
    policy = TrainEngine(apply_lora(copy.deepcopy(model), opts), OptimConfig(lr=1e-2), device="cpu")
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)  # W0 frozen: only the adapters train
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    batch, _ = build_sft_batch(tok, ["1+1=", "2+3="] * 4, ["2", "5"] * 4, P, R)
    losses = [policy.train_step(batch, sft_loss_fn)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in policy.model.named_parameters() if n in frozen)

    stats = {}
    adapters = [nt for b in policy.adapter_buckets(stats=stats) for nt in b]
    names = {n for n, _ in adapters}
    layers = model.config.num_hidden_layers
    per_layer = 7 if targets == "all-linear" else 2
    assert len(names) == 2 * per_layer * layers and "model.layers.0.self_attn.q_proj.lora_A" in names
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in adapters) < full / 4  # only the adapters

    rollout = HFRollout(copy.deepcopy(model), tok, RolloutOptions(n=1, max_response_len=R), P)
    merge = LoraMerge(model_dir, opts)
    loaded = rollout.load_weights(merge.merged(iter(adapters)), partial=True)
    if targets != "all-linear":  # q_proj's fused siblings (k, v) go along whole, with their biases
        assert {n.rsplit(".", 2)[-2] for n in loaded} == {"q_proj", "k_proj", "v_proj", "down_proj"}
    want, got = log_probs(policy, batch), log_probs(rollout.model, batch)
    assert (got - want).abs().max() < 1e-5  # the merge is the trained policy
    assert (log_probs(copy.deepcopy(model), batch) - want).abs().max() > 1e-3  # which moved away from W0
    assert [n for b in merge.merged(iter(adapters), everything=True) for n, _ in b] == merge.order  # a refill: all

    policy.save(tmp_path / "actor")  # the run's checkpoint, scored by the evaluation: merged on load
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        load_trained_policy(copy.deepcopy(model), tmp_path)
    scored = copy.deepcopy(model)
    load_trained_policy(scored, tmp_path, opts)
    assert (log_probs(scored, batch) - want).abs().max() < 1e-5


def test_a_bad_target_or_a_half_sync_is_named(tok, base):
    model, model_dir = base
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules=\['qproj'\].*linear layers: \[.*'q_proj'"):
        apply_lora(copy.deepcopy(model), LoraOptions(target_modules=["qproj"]))
    merge = LoraMerge(model_dir, LoraOptions(rank=2))
    with pytest.raises(ValueError, match="arrived without both lora_A and lora_B"):
        list(merge.merged([("model.layers.0.mlp.up_proj.lora_A", torch.zeros(2, 64))]))
    with pytest.raises(ConfigError, match="holds no model.safetensors"):
        LoraMerge(model_dir.parent, LoraOptions())


def test_one_worker_generates_with_the_peft_model_it_trains(tok, base):
    """World size 1, HF, one dtype: the rollout generates with the actor's own PeftModel (no sync,
    no merge), so what it samples and scores is the adapted policy after every update."""
    from types import SimpleNamespace

    from distflow_lab.algos.engine_setup import setup_engines
    from distflow_lab.algos.registry import load_run_config
    from distflow_lab.models.sequences import tokenize_prompts

    model, model_dir = base
    cfg = load_run_config("tiny-cpu-grpo", [f"model.path={model_dir}", "model.warm_start.steps=0",
                                            "cluster.world_size=1", "actor.lora={rank: 4, alpha: 8}",
                                            f"rollout.max_response_len={R}", "rollout.log_probs=true"])
    e = setup_engines(SimpleNamespace(groups={}, roles=frozenset({"rollout", "actor", "reference"})), cfg)
    assert e.policy.shared and e.lora is None and e.rollout.model is e.actor.model  # the PeftModel itself
    ids, mask, _ = tokenize_prompts(tok, ["1+1=", "2+3="], P)
    batch, _ = build_sft_batch(tok, ["1+1=", "2+3="] * 4, ["2", "5"] * 4, P, R)
    before = log_probs(copy.deepcopy(e.actor.model), batch)
    for _ in range(4):
        e.actor.train_step(batch, sft_loss_fn)
    cols = e.rollout.generate(ids, mask, seed=0)
    assert cols["responses"].shape[0] == 2 * cfg.rollout.n
    assert (log_probs(e.rollout.model, batch) - before).abs().max() > 1e-3  # generates with the trained adapters
    assert all(".lora_" in n for n, p in e.actor.model.named_parameters() if p.requires_grad)
