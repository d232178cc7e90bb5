"""Tiny randomly initialised Qwen2 models, and one loader for any local HF checkpoint.

The tiny model is a real `Qwen2ForCausalLM`, so every code path the rollout
and training engines use (generate, forward logits, save/load) is the same
one a Qwen2.5 checkpoint takes: swapping in a real model is a path change.
Everything is local: nothing here touches the HF hub.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from distflow_lab.core.config import TinySpec
from distflow_lab.models.tokenizer import build_char_tokenizer

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase, spec: TinySpec | None = None, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised float32 `Qwen2ForCausalLM` sized by `spec`, deterministic per `seed`.

    Embeddings are tied to the LM head; pad/bos/eos ids come from `tokenizer`.
    The global torch RNG is left untouched (init runs under a forked RNG).
    """
    spec = spec or TinySpec()
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"need num_heads | hidden_size and num_kv_heads | num_heads: {spec}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        # transformers 5 replaced `rope_theta=` with a `rope_parameters` dict.
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        attn_implementation="sdpa",  # works on CPU; fastest built-in path there
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | os.PathLike) -> Path:
    """Save model weights/config and tokenizer side by side, the layout HF checkpoints use."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def has_model(directory: str | os.PathLike) -> bool:
    """True if `directory` holds a config.json and model weights."""
    d = Path(directory)
    return (d / "config.json").is_file() and any((d / f).is_file() for f in _WEIGHT_FILES)


def checkpoint_tensors(directory: str | os.PathLike) -> dict[str, Path]:
    """Every tensor name of a local HF checkpoint's safetensors files -> the file holding it, in
    file order (empty when it has none)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(Path(directory).expanduser().glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            where.update(dict.fromkeys(sf.keys(), f))
    return where


def load_model_dir(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from a local HF checkpoint directory, never the hub.

    Works for the tiny models saved here and for real checkpoints (e.g. a local
    Qwen2.5-Instruct). The model comes back in eval mode. If the tokenizer has
    no pad token, EOS doubles as pad (batched generation needs one).
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model directory {directory} has no config.json (not a HF checkpoint dir)")
    transformers.logging.disable_progress_bar()  # no "Loading weights" bars from every worker in the notebook
    # `dtype=` (transformers 5 name; `torch_dtype=` is deprecated).
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def ensure_tiny_model(directory: str | os.PathLike, spec: TinySpec | None = None, seed: int = 0) -> Path:
    """Build and save a tiny char-level Qwen2 at `directory` unless one is already there.

    Idempotent: an existing model built here with the same spec is reused (whatever its seed); one
    built with another spec is an error naming both (never silently the wrong model). The model is written
    to a sibling temp dir and renamed into place, so a concurrent caller never loads a
    half-written directory.
    """
    directory = Path(directory)
    note = f"{(spec or TinySpec()).model_dump()} seed={seed}\n"
    if has_model(directory):
        built = directory / "tiny_model_spec.txt"
        have, want = built.read_text().split(" seed=")[0] if built.exists() else None, note.split(" seed=")[0]
        if have is not None and have != want:
            raise ValueError(f"model.path {directory} holds a tiny model built with {have}; this config asks for "
                             f"{want} (model.tiny): give model.path a new folder (or delete it)")
        return directory
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, spec, seed)
    if directory.is_dir() and any(directory.iterdir()):
        # A non-empty dir without a model (e.g. holding a notebook's notes): write in place.
        save_model_dir(model, tokenizer, directory)
        (directory / "tiny_model_spec.txt").write_text(note)
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(model, tokenizer, tmp)
    (tmp / "tiny_model_spec.txt").write_text(note)
    try:
        if directory.is_dir():
            directory.rmdir()  # empty placeholder dir
        os.replace(tmp, directory)
    except OSError:
        # Another process won the race: keep its model.
        shutil.rmtree(tmp, ignore_errors=True)
        if not has_model(directory):
            raise
    return directory
