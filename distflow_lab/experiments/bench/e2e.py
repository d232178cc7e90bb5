"""End-to-end throughput: the real GRPO pipeline (tiny Qwen2, HF or vLLM rollout, FSDP2
training) in every data plane, at a short and a long context, for each rollout engine.
Per engine: tokens/s, the rollout's share of the step, and the weight-sync seconds
per update (the colocated sync of the actor's weights into the rollout engine).

Throughput = valid tokens (prompt + response, from the rollout's attention mask)
per second of step wall time. Both modes run the same config and seed, so they
do the same compute and produce the same metrics (checked: `reward_equal`); what
differs is only how data moves. Peak memory is each worker process's peak RSS
(`getrusage`), read after the measured steps.

The long context feeds real GSM8K prompts (byte-level tokens, a few hundred per
prompt) into a random-init model that rarely emits EOS, so responses run to the
length limit: long sequences, as in reasoning RL. The short context is the
arithmetic task of the tiny preset.

    distflow-lab bench e2e --context 32,1024 --steps 4 --json benchmarks/results/e2e.json
    distflow-lab bench e2e --engine hf,vllm --context 32 --modes distributed --json benchmarks/results/e2e_engines.json
"""
from __future__ import annotations

import math

import numpy as np
import ray
from tqdm.auto import tqdm

from distflow_lab.api.runner import load_run_config, open_session
from distflow_lab.api.session import PLANES
from distflow_lab.runtime.cluster import connect
from distflow_lab.experiments.bench.common import print_table, step_row, summarize, write_json


def overrides_for(context: int, workers: int, prompts: int, n: int) -> list[str]:
    """Run-config overrides: P = R = context / 2, a model with `context` positions."""
    half = context // 2
    data = ["data.train=arithmetic"] if context <= 64 else ["data.train=gsm8k", "model.warm_start.steps=0"]
    return [*data, f"data.max_prompt_len={half}", f"rollout.max_response_len={half}",
            f"model.tiny.max_position_embeddings={max(64, context)}",
            f"model.path=models/tiny-qwen2-hd32-ctx{max(64, context)}",
            f"data.prompts_per_step={prompts}", f"rollout.n={n}", f"cluster.world_size={workers}",
            f"actor.micro_token_budget={max(4096, context * 4)}", f"critic.micro_token_budget={max(4096, context * 4)}"]


def measure(context: int, mode: str, workers: int, prompts: int, n: int, steps: int, warmup: int = 1,
            engine: str = "hf") -> dict:
    cfg = load_run_config("tiny-cpu-grpo", overrides_for(context, workers, prompts, n)
                          + [f"mode={mode}", f"rollout.engine={engine}"])
    rows = []
    with open_session(cfg, progress=False) as s:
        for _ in range(warmup + steps):
            rep = s.step()
            if rep.update < warmup:
                continue
            spans = rep.spans
            tokens = int(spans[(spans["stage"] == "rollout") & (spans["phase"] == "compute")]["tokens"].sum())
            row = step_row(rep, spans)
            rollout = spans[(spans["stage"] == "rollout") & (spans["phase"] == "compute")]
            sync = spans[spans["phase"] == "weight_sync"]
            rows.append({"wall_s": rep.wall_seconds, "tokens": tokens, "data_plane_s": float(row["data_plane_s"]),
                         "bytes_moved": int(row["bytes_moved"]), "reward": rep.metrics.get("reward/mean", math.nan),
                         "rollout_share": float(rollout["seconds"].max() / rep.wall_seconds) if len(rollout) else 0.0,
                         "sync_s": float(sync.groupby("worker")["seconds"].sum().max()) if len(sync) else 0.0})
        peaks = ray.get([w.memory.remote() for w in s.workers], timeout=60)
    tps = summarize(r["tokens"] / r["wall_s"] for r in rows)
    return {"engine": engine, "mode": mode, "context": context, "workers": workers, "rows_per_step": prompts * n,
            "rollout_share_median": summarize(r["rollout_share"] for r in rows)["median"],
            "weight_sync_s_median": summarize(r["sync_s"] for r in rows)["median"],
            "tokens_per_step": int(np.median([r["tokens"] for r in rows])),
            "tokens_per_s_median": tps["median"], "tokens_per_s_min": tps["min"], "tokens_per_s_max": tps["max"],
            "step_s_median": summarize(r["wall_s"] for r in rows)["median"],
            "data_plane_s_median": summarize(r["data_plane_s"] for r in rows)["median"],
            "bytes_moved": int(np.median([r["bytes_moved"] for r in rows])),
            "peak_rss_mib_max": max(p["peak_rss"] for p in peaks) / 2**20,
            "peak_rss_mib_mean": float(np.mean([p["peak_rss"] for p in peaks])) / 2**20,
            "rewards": [r["reward"] for r in rows], "steps": len(rows)}


def run(contexts: list[int], workers: int = 2, prompts: int = 16, n: int = 4, steps: int = 4,
        json_path: str | None = None, modes: tuple[str, ...] = tuple(PLANES),
        engines: tuple[str, ...] = ("hf",)) -> list[dict]:
    """Every (engine, context, mode) in one run; ratios against the centralized mode of the same
    engine and context, and against the HF engine in the same mode and context."""
    connect(num_cpus=max(8, 2 * workers))
    records = []
    for engine in engines:
        for ctx_len in tqdm(contexts, desc=f"e2e contexts ({engine})"):
            by_mode = {m: measure(ctx_len, m, workers, prompts, n, steps, engine=engine) for m in modes}
            base = by_mode.get("centralized")
            for r in by_mode.values():
                same = base is None or bool(np.allclose(r["rewards"], base["rewards"], equal_nan=True))
                ratio = r["tokens_per_s_median"] / base["tokens_per_s_median"] if base else None
                records.append({**r, "over_central_tps": ratio, "reward_equal": same})
    hf = {(r["mode"], r["context"]): r["tokens_per_s_median"] for r in records if r["engine"] == "hf"}
    for r in records:
        r["over_hf_tps"] = r["tokens_per_s_median"] / hf[(r["mode"], r["context"])] if (r["mode"], r["context"]) in hf \
            else None
    cols = ["engine", "mode", "context", "workers", "rows_per_step", "tokens_per_step", "tokens_per_s_median",
            "tokens_per_s_min", "tokens_per_s_max", "step_s_median", "rollout_share_median", "weight_sync_s_median",
            "data_plane_s_median", "bytes_moved", "peak_rss_mib_max", "over_central_tps", "over_hf_tps",
            "reward_equal"]
    print_table(records, cols, title=f"end to end: tokens/s per step (median/min/max of {steps} steps)")
    write_json(records, json_path)
    return records
