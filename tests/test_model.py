"""Char tokenizer, tiny Qwen2 build/save/load, generation on CPU. All offline."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoTokenizer

from distflow_lab.core.config import TinySpec as TinyModelSpec
from distflow_lab.models.model_dir import (
    build_tiny_qwen2,
    count_params,
    ensure_tiny_model,
    load_model_dir,
    save_model_dir,
)
from distflow_lab.models.tokenizer import BASE_CHARS, build_char_tokenizer, save_tokenizer
from distflow_lab.datasets.arithmetic import make_arithmetic_rows

TEXTS = [
    BASE_CHARS,
    "Natalia sold 48/2 = <<48/2=24>>24 clips.\n\n#### 72",
    "  two  spaces, 're 's\ttab and $1,000.50",
    "café costs 3€ — ok",
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tiny")
    save_model_dir(build_tiny_qwen2(tok, TinyModelSpec(), seed=0), tok, d)
    return d


def test_char_tokenizer_round_trip(tok):
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert tok.convert_tokens_to_ids("0") == 4
    for ch in BASE_CHARS:
        assert len(tok(ch)["input_ids"]) == 1, repr(ch)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    ids = tok("3+4=")["input_ids"]
    assert len(ids) == 4 and tok.eos_token_id not in ids  # no special tokens added
    assert tok.decode(ids + [tok.eos_token_id, 0, 0], skip_special_tokens=True) == "3+4="


def test_extra_chars_become_single_tokens():
    tok = build_char_tokenizer(extra_chars="€é")
    assert len(tok("€")["input_ids"]) == 1 and len(tok("é")["input_ids"]) == 1
    assert tok.decode(tok("3€ café")["input_ids"]) == "3€ café"


def test_auto_tokenizer_reload_matches(tok, tmp_path, model_dir):
    save_tokenizer(tok, tmp_path / "tok")
    plain = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    # A qwen2 model dir makes transformers 5 rebuild the tokenizer as Qwen2Tokenizer: same ids.
    qwen = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    for t in (plain, qwen):
        assert (t.pad_token_id, t.eos_token_id, len(t)) == (tok.pad_token_id, tok.eos_token_id, len(tok))
        for text in TEXTS:
            assert t(text)["input_ids"] == tok(text)["input_ids"]
            assert t.decode(t(text)["input_ids"]) == text


def test_chat_template_on_verl_prompt(tok):
    prompt = make_arithmetic_rows(1, seed=0)[0]["prompt"]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert text == prompt[0]["content"]
    # transformers 5: tokenize=True returns a BatchEncoding, not a list of ids.
    enc = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    assert enc["input_ids"] == tok(text)["input_ids"]


def test_build_is_seeded_and_small(tok):
    a, b = build_tiny_qwen2(tok, seed=1), build_tiny_qwen2(tok, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, build_tiny_qwen2(tok, seed=2).lm_head.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied
    assert 50_000 < count_params(a) < 2_000_000
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id


def test_save_load_identical_logits(tok, model_dir):
    original = build_tiny_qwen2(tok, TinyModelSpec(), seed=0)
    model, loaded_tok = load_model_dir(model_dir)
    assert model.dtype == torch.float32 and not model.training
    x = torch.tensor([tok("12+34=46")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(original(x).logits, model(x).logits)
    assert loaded_tok.decode(x[0].tolist()) == "12+34=46"


def test_generate_sampling_stops(tok, model_dir):
    model, tok2 = load_model_dir(model_dir)
    enc = tok2(["3+4=", "12+30="], return_tensors="pt", padding=True, padding_side="left")
    n_prompt = enc["input_ids"].shape[1]
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=7, pad_token_id=tok2.pad_token_id)
    assert n_prompt < out.shape[1] <= n_prompt + 7
    for row in out[:, n_prompt:].tolist():  # after an eos only padding follows
        if tok2.eos_token_id in row:
            assert set(row[row.index(tok2.eos_token_id) + 1 :]) <= {tok2.pad_token_id}
    # Every token an eos: each row must stop after one new token.
    out = model.generate(**enc, do_sample=True, max_new_tokens=7, eos_token_id=list(range(len(tok2))), pad_token_id=tok2.pad_token_id)
    assert out.shape[1] == n_prompt + 1


def test_load_errors_name_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*config.json"):
        load_model_dir(tmp_path / "empty")


def test_ensure_tiny_model_idempotent(tmp_path):
    d = ensure_tiny_model(tmp_path / "m", seed=0)
    weights = d / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_tiny_model(d, seed=1) == d  # another seed: the same model folder, reused
    assert weights.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="holds a tiny model built with .*'hidden_size': 64.* asks for .*32"):
        ensure_tiny_model(d, spec=TinyModelSpec(hidden_size=32))  # never silently the other spec's model
    model, _ = load_model_dir(d)
    assert model.config.hidden_size == TinyModelSpec().hidden_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir cleaned up
