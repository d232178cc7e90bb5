"""Token-budget micro-batches (verl's use_dynamic_bsz) against fixed-size ones on GSM8K-length
sequences: tokens/s of a training pass (forward + backward, `TrainEngine.compute_grads`) and of a
log-prob pass (`forward_log_probs`), per wall second and per CPU second of this process; the
micro-batch count; the padding waste (padded / real tokens the forwards run on); and the largest
gradient difference to the fixed-size run (float noise only: grouping never changes the update).

Three ways to cut the same rows:
  fixed           `fixed_rows` rows per micro-batch, sized so the longest rows fit (verl without
                  use_dynamic_bsz: ppo_micro_batch_size_per_gpu)
  budget          consecutive rows up to `budget` real tokens (the engine's micro_token_budget;
                  default fixed_rows x (P + R): the same worst case as `fixed`)
  budget+sorted   the same budget over rows ordered by length, so a micro-batch holds rows of
                  similar length (the gradient is order-free, so a stage may sort)

Sequences: GSM8K train questions with verl's instruction through the chat template (byte-level
tokens, left-padded to P, the longest cut) and their reference answers as responses (right-padded
to R), on a random-init tiny Qwen2. CPU by default; on a GPU pass device="cuda".

    distflow-lab bench microbatch --rows 64 --fixed-rows 4 --json benchmarks/results/microbatch.json
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from distflow_lab.algos.losses import ppo_token_loss
from distflow_lab.core.config import Optim, TinySpec
from distflow_lab.datasets.gsm8k import default_gsm8k_dir, gsm8k_row
from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.sequences import build_sft_batch
from distflow_lab.models.tokenizer import build_char_tokenizer

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


class FixedRows(TrainEngine):
    """Micro-batches of a fixed row count instead of a token budget."""

    def __init__(self, *args, rows: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = rows

    def _plan(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.arange(attention_mask.shape[0]).split(self.rows))


def gsm8k_columns(tokenizer, rows: int, prompt_len: int, response_len: int, seed: int = 0,
                  gsm8k_dir: str | None = None) -> dict[str, torch.Tensor]:
    """`rows` random GSM8K train pairs as a batch in the rollout layout, plus the policy-loss columns."""
    path = (Path(gsm8k_dir) if gsm8k_dir else default_gsm8k_dir()) / "train.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rng = np.random.default_rng(seed)
    pick = [lines[i] for i in rng.choice(len(lines), size=rows, replace=False)]
    prompts = [gsm8k_row(r["question"], r["answer"], "train", i)["prompt"] for i, r in enumerate(pick)]
    cols, _ = build_sft_batch(tokenizer, prompts, [r["answer"] for r in pick], prompt_len, response_len)
    g = torch.Generator().manual_seed(seed)
    mask = cols["response_mask"]
    cols["old_log_probs"] = torch.zeros(mask.shape)
    cols["advantages"] = torch.randn(rows, 1, generator=g).expand(mask.shape) * mask
    return cols


def pg_loss(mb: dict, log_probs: torch.Tensor, _: torch.Tensor | None):
    loss, metrics = ppo_token_loss(mb["old_log_probs"], log_probs, mb["advantages"], mb["response_mask"])
    return loss, mb["response_mask"], metrics


def timed(engine: TrainEngine, cols: dict[str, torch.Tensor]) -> tuple[np.ndarray, dict]:
    """[wall s, CPU s] of one training pass (fresh gradients) and of one log-prob pass, and the
    training metrics. CPU seconds (this process, all threads) barely move when other processes
    share the cores; wall seconds do."""
    engine.optimizer.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = engine.compute_grads(cols, pg_loss, "token-mean")
    t1, c1 = time.perf_counter(), time.process_time()
    engine.forward_log_probs(*(cols[k] for k in MODEL_INPUTS))
    t2, c2 = time.perf_counter(), time.process_time()
    return np.array([t1 - t0, c1 - c0, t2 - t1, c2 - c1]), metrics


def run(rows: int = 64, prompt_len: int = 512, response_len: int = 512, fixed_rows: int = 4,
        budget: int | None = None, repeats: int = 3, hidden_size: int = 128, num_layers: int = 2,
        seed: int = 0, device: str = "cpu", threads: int | None = None, gsm8k_dir: str | None = None,
        json_path: str | None = None) -> list[dict]:
    if threads:  # 1 on a shared CPU: multi-threaded kernels slow down badly when the cores are busy
        torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    cols = gsm8k_columns(tok, rows, prompt_len, response_len, seed, gsm8k_dir)
    budget = budget or fixed_rows * (prompt_len + response_len)
    spec = TinySpec(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                    intermediate_size=4 * hidden_size, max_position_embeddings=prompt_len + response_len)
    order = torch.argsort(cols["attention_mask"].sum(-1), stable=True)
    variants = {
        "fixed": (lambda m: FixedRows(m, Optim(), rows=fixed_rows, device=device), cols),
        "budget": (lambda m: TrainEngine(m, Optim(), micro_token_budget=budget, device=device), cols),
        "budget+sorted": (lambda m: TrainEngine(m, Optim(), micro_token_budget=budget, device=device),
                          {k: v[order] for k, v in cols.items()}),
    }
    engines = {name: (make(build_tiny_qwen2(tok, spec, seed=seed)), batch) for name, (make, batch) in variants.items()}
    times: dict[str, list[np.ndarray]] = {name: [] for name in variants}
    metrics: dict[str, dict] = {}
    for i in range(repeats + 1):  # round-robin, so a busy moment slows every variant alike
        for name, (engine, batch) in engines.items():
            t, metrics[name] = timed(engine, batch)
            if i:  # the first pass warms allocators and kernels up
                times[name].append(t)
    real = int(cols["attention_mask"].sum())
    median = {name: np.median(np.array(t), axis=0) for name, t in times.items()}
    grads = {name: engine.gathered_grads() for name, (engine, _) in engines.items()}
    records = []
    for name in variants:
        (train_s, train_cpu, logprob_s, logprob_cpu), base = median[name], median["fixed"]
        records.append({
            "micro_batching": name, "rows": rows, "fixed_rows": fixed_rows if name == "fixed" else None,
            "token_budget": budget if name != "fixed" else None, "n_micro": int(metrics[name]["n_micro"]),
            "real_tokens": real, "padding_waste": metrics[name]["padding_waste"],
            "train_tokens_per_s": real / train_s, "logprob_tokens_per_s": real / logprob_s,
            "train_tokens_per_cpu_s": real / train_cpu, "logprob_tokens_per_cpu_s": real / logprob_cpu,
            "train_speedup": base[0] / train_s, "logprob_speedup": base[2] / logprob_s,
            "train_speedup_cpu": base[1] / train_cpu, "logprob_speedup_cpu": base[3] / logprob_cpu,
            "grad_max_diff": max(float((g - grads["fixed"][k]).abs().max()) for k, g in grads[name].items()),
            "train_s": float(train_s), "logprob_s": float(logprob_s), "train_cpu_s": float(train_cpu),
            "logprob_cpu_s": float(logprob_cpu), "repeats": repeats,
            "prompt_len": prompt_len, "response_len": response_len, "hidden_size": hidden_size,
            "num_layers": num_layers, "device": device, "threads": torch.get_num_threads(),
        })
    print_table(records, ["micro_batching", "n_micro", "padding_waste", "train_tokens_per_s", "train_speedup",
                          "train_speedup_cpu", "logprob_tokens_per_s", "logprob_speedup", "logprob_speedup_cpu",
                          "grad_max_diff"],
                title=f"micro-batching on {rows} GSM8K rows ({real} real tokens, P={prompt_len}, R={response_len}, "
                      f"budget {budget} tokens vs {fixed_rows} rows)")
    write_json(records, json_path)
    return records
