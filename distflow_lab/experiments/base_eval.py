"""How good is a model before (or after) RL, on a fixed held-out set: `distflow-lab eval PRESET`.

Greedy by default (one answer per prompt): accuracy, and how often the answer had the format the
reward reads (it finished and an answer could be extracted). With `samples=n` at a temperature it
also reports what GRPO cares about at its first step: the share of prompts whose group of n has
at least one correct answer (pass@n), and the share with a mix of right and wrong ones, the only
groups with a non-zero advantage.

It runs in this process with HF `generate` (no Ray): the same prompts, chat template, tokenizer
and reward function as a run of the preset.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from distflow_lab.algos.engine_setup import make_reward_fn
from distflow_lab.algos.registry import load_run_config
from distflow_lab.api.runner import prepare
from distflow_lab.core.config import LoraOptions, RunConfig
from distflow_lab.datasets.registry import dataset_rows, is_dataset
from distflow_lab.datasets.rewards import extract_gsm8k_answer, last_number
from distflow_lab.models.lora import merged_state_dict
from distflow_lab.models.model_dir import load_model_dir
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.sequences import decode_responses, tokenize_prompts
from distflow_lab.runtime.checkpoint_files import latest_checkpoint

HELDOUT_SEED = 1_000_003  # held-out arithmetic rows: one fixed set, drawn with a seed no training file uses

# What "answered in the reward's format" means, per data source: the answer the reward reads was found.
ANSWER_READERS = {
    "openai/gsm8k": lambda text: extract_gsm8k_answer(text, "strict"),
    "distflow/arithmetic_question": last_number,
}


@dataclass
class EvalResult:
    preset: str
    model: str
    rows: int
    samples: int
    temperature: float | None
    accuracy: float
    """Mean reward over every answer (rewards here are 0/1)."""
    format_rate: float
    """Answers that finished (an eos within the length budget) and hold an answer the reward can read."""
    finished_rate: float
    pass_at_n: float | None = None
    """Prompts with at least one correct answer among their `samples` (None when greedy)."""
    mixed_groups: float | None = None
    """Prompts whose group has both right and wrong answers: the groups GRPO learns from."""
    mean_response_tokens: float = 0.0
    seconds: float = 0.0
    examples: list[dict] = field(default_factory=list)

    def table(self) -> pd.DataFrame:
        keys = ["accuracy", "format_rate", "finished_rate", "pass_at_n", "mixed_groups", "mean_response_tokens",
                "seconds"]
        return pd.DataFrame([{k: getattr(self, k) for k in keys}], index=[self.preset])

    def _repr_html_(self) -> str:
        return self.table().to_html(float_format=lambda x: f"{x:.3f}")


def heldout_rows(cfg: RunConfig, rows: int) -> list[dict]:
    """A fixed held-out set for the preset's task, the same for every run seed: GSM8K's test split, or
    arithmetic rows drawn with a seed no training file uses."""
    if not is_dataset(cfg.data.train):
        raise ValueError(f"eval draws its held-out set from a registered dataset's test split; data.train is the "
                         f"file {cfg.data.train!r}")
    return dataset_rows(cfg.data, HELDOUT_SEED, split="test", config=cfg)[:rows]


def load_trained_policy(model: torch.nn.Module, checkpoint: str | Path, lora: LoraOptions | None = None) -> Path:
    """Put a run's trained policy into `model` (the preset's base model): `checkpoint` is a checkpoint
    folder, a run's `checkpoints/` folder or the run folder (then its newest complete checkpoint).
    A LoRA run's policy (adapters beside W0) is merged first, with `lora` (the run's actor.lora)."""
    where = Path(checkpoint)
    for candidate in (where / "checkpoints", where):
        if candidate.is_dir() and not (candidate / "actor").is_dir() and (found := latest_checkpoint(candidate)):
            where = found
            break
    weights = where / "actor" / "model.pt"
    if not weights.is_file():
        raise FileNotFoundError(f"{checkpoint}: no trained policy (expected {weights}, a run's checkpoint folder)")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if any(".lora_A." in name for name in state):
        if lora is None:
            raise ValueError(f"{weights} holds LoRA adapters: score it with the run's actor.lora options")
        state = merged_state_dict(state, lora)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # a tied head is saved once
        raise ValueError(f"{weights} does not fit the preset's model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return where


def eval_config(preset: str | RunConfig, overrides: list[str] | None = None, samples: int = 1,
                temperature: float = 1.0, batch: int = 16, progress: bool = True) -> RunConfig:
    """The preset's run config set up for scoring (greedy when samples == 1), model and data prepared."""
    cfg = preset if isinstance(preset, RunConfig) else load_run_config(preset, list(overrides or []))
    sampled = samples > 1
    rollout = cfg.rollout.model_copy(update=dict(
        n=samples, log_probs=False, micro_batch=batch * samples, do_sample=sampled,
        temperature=temperature if sampled else cfg.rollout.temperature))
    return prepare(cfg.model_copy(update={"rollout": rollout}), progress)[0]


def evaluate(preset: str | RunConfig, overrides: list[str] | None = None, rows: int = 64, samples: int = 1,
             temperature: float = 1.0, batch: int = 16, progress: bool = True, keep_examples: int = 4,
             checkpoint: str | Path | None = None) -> EvalResult:
    """Score the preset's model (or a run's trained policy: `checkpoint`) on `rows` held-out prompts
    (see the module docstring)."""
    cfg = eval_config(preset, overrides, samples, temperature, batch, progress)
    torch.manual_seed(cfg.session.seed)
    model, tok = load_model_dir(cfg.model.path)
    where = cfg.model.path if checkpoint is None else str(load_trained_policy(model, checkpoint, cfg.actor.lora))
    return score(model, tok, cfg, heldout_rows(cfg, rows), batch, progress, keep_examples, label=where)


@torch.no_grad()
def score(model: torch.nn.Module, tok, cfg: RunConfig, held: list[dict], batch: int = 16, progress: bool = True,
          keep_examples: int = 4, label: str = "") -> EvalResult:
    """Score `model` (any HF causal LM with the preset's tokenizer, e.g. a peer's trained one) on the
    held-out rows, with the sampling of `cfg.rollout` (`eval_config` sets it)."""
    samples = cfg.rollout.n
    engine = HFRollout(model, tok, cfg.rollout, cfg.data.max_prompt_len)
    reward = make_reward_fn(cfg.reward)
    scores, answered, finished, lengths, examples = [], [], [], [], []
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(held), batch), desc=f"eval {cfg.name}", disable=not progress):
        part = held[s:s + batch]
        ids, mask, _ = tokenize_prompts(tok, [r["prompt"] for r in part], cfg.data.max_prompt_len)
        cols = engine.generate(ids, mask, seed=cfg.session.seed + s)
        texts = decode_responses(tok, cols["responses"], cols["response_mask"])
        n_tokens = cols["response_mask"].sum(-1)
        last = cols["responses"].gather(-1, (n_tokens - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ended = (n_tokens > 0) & (last == tok.eos_token_id)  # pad may equal eos: read the last kept token
        for i, text in enumerate(texts):
            row = part[i // samples]
            truth, data_source = row["reward_model"]["ground_truth"], row["data_source"]
            read = ANSWER_READERS.get(data_source, lambda t: t.strip() or None)
            scores.append(reward(data_source, text, truth))
            finished.append(bool(ended[i]))
            answered.append(bool(ended[i]) and read(text) is not None)
            lengths.append(int(n_tokens[i]))
            if len(examples) < keep_examples and i % samples == 0:
                examples.append({"prompt": row["prompt"][-1]["content"], "truth": truth, "answer": text,
                                 "score": scores[-1]})
    groups = np.asarray(scores).reshape(len(held), samples)
    right = (groups > 0).sum(-1)
    greedy = not cfg.rollout.do_sample
    return EvalResult(
        preset=cfg.name, model=label or cfg.model.path, rows=len(held), samples=samples,
        temperature=None if greedy else cfg.rollout.temperature, accuracy=float(groups.mean()),
        format_rate=float(np.mean(answered)), finished_rate=float(np.mean(finished)),
        pass_at_n=None if greedy else float((right > 0).mean()),
        mixed_groups=None if greedy else float(((right > 0) & (right < samples)).mean()),
        mean_response_tokens=float(np.mean(lengths)), seconds=time.perf_counter() - t0, examples=examples)


def run(preset: str, overrides: list[str], rows: int, samples: int, temperature: float, out: str | None,
        checkpoint: str | None = None) -> EvalResult:
    """The CLI's `eval`: print the table and some answers, write JSON if asked."""
    result = evaluate(preset, overrides, rows, samples, temperature, checkpoint=checkpoint)
    with pd.option_context("display.float_format", "{:.3f}".format, "display.width", 160):
        print(result.table().to_string())
    for e in result.examples:
        print(f"\n[{e['score']:.0f}] {e['prompt']!r} (truth {e['truth']})\n    -> {e['answer'][:300]!r}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(asdict(result), indent=1))
        print(f"\nwrote {out}")
    return result
