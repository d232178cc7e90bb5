"""Every algorithm, schedule and rollout engine on one preset's model, a few steps each: does it run
(or is it refused by name), and what does a step cost and measure. Made for the real pretrained model,
where the tiny model's numbers (mismatch, weight sync, lengths, staleness) may not carry over.

    distflow-lab bench matrix --preset smollm2-arith --json benchmarks/results/matrix_smollm2_arith.json
    distflow-lab bench matrix --cells grpo/sync/vllm/bf16,grpo/async2p/vllm --steps 3

A cell is `algorithm/schedule/engine[/dtype][+tis]`:
- schedule: sync (colocated, every stage on every worker), groups (sync on a generation worker and a
  training worker), one_step_off, async2 (bounded staleness k = 2), async2p (k = 2 with partial
  rollouts); all but sync split cluster.world_size into two groups;
- engine: hf or vllm; dtype: the rollout's, fp32 (the model's) or bf16 against the fp32 trainer;
- +tis: truncated importance sampling (actor.off_policy=tis) on top; the async cells always correct
  with it (the off-policy batches need one).
Cells that share their config (all but the schedule) share one session: `Session.reopen` switches the
schedule on the same workers. Per cell: the median over the steps after the first of step seconds and
generated tokens per second; the median over all steps of reward, response length (mean, max/median
per batch) and the train-inference
mismatch (`rollout/logprob_*`, rollout log-probs against the trainer's); weight-sync seconds and bytes
per update (worker groups); the share of trained tokens from an older policy and of responses spanning
two versions; peak RSS per worker (fresh workers, so no earlier session's peak counts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray
from tqdm.auto import tqdm

from distflow_lab.algos.registry import algorithm
from distflow_lab.api.runner import load_run_config, open_session
from distflow_lab.core.errors import ConfigError
from distflow_lab.experiments.bench.async_schedules import weight_sync_per_update
from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.runtime.cluster import connect

SCHEDULES = {"sync": ("sync", {}), "groups": ("sync", {}), "one_step_off": ("one_step_off", {}),
             "async2": ("async", {"max_staleness": 2, "partial_rollout": False}),
             "async2p": ("async", {"max_staleness": 2, "partial_rollout": True})}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_CELLS = ("grpo/sync/hf", "grpo/sync/vllm", "grpo/sync/vllm/bf16", "grpo/sync/vllm/bf16+tis",
                 "grpo/groups/vllm", "grpo/one_step_off/vllm", "grpo/async2/vllm", "grpo/async2p/vllm",
                 "grpo/async2p/hf", "dapo/sync/hf", "gspo/sync/hf", "ppo/sync/hf")
METRICS = {"reward": "reward/mean", "response_len_mean": "response_length/mean",
           "len_max_over_median": "rollout/len_max_over_median", "logprob_diff_mean": "rollout/logprob_diff_mean",
           "logprob_diff_max": "rollout/logprob_diff_max", "logprob_kl": "rollout/logprob_kl",
           "is_ratio_mean": "actor/is_ratio_mean", "staleness": "schedule/staleness",
           "stale_token_frac": "actor/stale_token_frac", "mixed_version_frac": "actor/mixed_version_frac",
           "partial_frac": "rollout/partial_frac"}


@dataclass(frozen=True)
class Cell:
    name: str
    algorithm: str
    schedule: str
    engine: str
    dtype: str = "fp32"
    tis: bool = False

    @classmethod
    def parse(cls, name: str) -> "Cell":
        base, _, extra = name.partition("+")
        parts = base.split("/")
        if len(parts) not in (3, 4) or extra not in ("", "tis"):
            raise ConfigError(f"matrix cell {name!r}: write algorithm/schedule/engine[/dtype][+tis], "
                              "e.g. grpo/async2p/vllm or grpo/sync/vllm/bf16+tis")
        algorithm, schedule, engine, dtype = (*parts, "fp32")[:4]
        if schedule not in SCHEDULES:
            raise ConfigError(f"matrix cell {name!r}: schedule {schedule!r} is not one of {list(SCHEDULES)}")
        if engine not in ("hf", "vllm"):
            raise ConfigError(f"matrix cell {name!r}: engine {engine!r} is not hf or vllm")
        if dtype not in DTYPES:
            raise ConfigError(f"matrix cell {name!r}: dtype {dtype!r} is not one of {list(DTYPES)}")
        return cls(name, algorithm, schedule, engine, dtype, extra == "tis")

    def overrides(self, workers: int) -> list[str]:
        """The config of this cell's session (the schedule itself is set by `reopen`)."""
        out = [f"algorithm.name={self.algorithm}", f"rollout.engine={self.engine}", "rollout.log_probs=true",
               f"rollout.dtype={DTYPES[self.dtype]}"]
        if self.schedule != "sync":
            out.append(f"groups={{rollout: {workers // 2}, train: {workers - workers // 2}}}")
        if self.tis or self.schedule.startswith("async"):
            out.append("actor.off_policy=tis")
        decl = algorithm(self.algorithm)
        if decl.critic:  # its DAG needs the old log-prob pass (registry.check_old_log_prob)
            out.append("actor.old_log_prob=recompute")
        # each algorithm's own estimator (the preset's may be of a kind it does not run)
        return [*out, f"algorithm.adv_estimator={decl.estimator}"]

    def config(self, preset: str, overrides: list[str] | None, workers: int):
        """The cell's checked config: the preset, the caller's overrides, then the cell's own (the
        algorithm's declared defaults fill in what the preset leaves unset)."""
        return load_run_config(preset, [*(overrides or []), *self.overrides(workers)])


def run(preset: str = "smollm2-arith", cells: tuple[str, ...] = DEFAULT_CELLS, steps: int = 2,
        overrides: list[str] | None = None, json_path: str | None = None) -> list[dict]:
    """Each cell `steps` steps (async cells one more: a schedule shows its lag from the third update)."""
    parsed = [Cell.parse(c) for c in cells]
    base = load_run_config(preset, overrides)  # a bad preset or override fails before any worker starts
    workers = base.cluster.world_size
    configs = {}
    for c in parsed:  # every cell's config checked up front: a refusal is a record, not a crash mid-run
        try:
            configs[c] = c.config(preset, overrides, workers)
        except ConfigError as e:
            configs[c] = e
    connect()
    records, session, key, opened = [], None, None, 0.0
    try:
        for c in tqdm(parsed, desc=f"matrix ({preset})"):
            cfg = configs[c]
            if isinstance(cfg, ConfigError):
                records.append({"cell": c.name, "status": "refused", "error": str(cfg)})
                continue
            if session is None or key != c.overrides(workers):  # a new config: a new session
                if session is not None:
                    session.close()
                t0 = time.perf_counter()
                session, key = open_session(cfg, progress=False, fresh_workers=True), c.overrides(workers)
                opened = time.perf_counter() - t0
            kind, opts = SCHEDULES[c.schedule]
            session.reopen(schedule=kind, **opts)
            try:
                records.append({"cell": c.name, "status": "ran", "open_s": opened,
                                **measure(session, steps + int(c.schedule.startswith("async")))})
            except Exception as e:  # noqa: BLE001 - a cell that fails is reported, the others still run
                records.append({"cell": c.name, "status": "failed", "error": f"{type(e).__name__}: {e}"})
                session.close()
                session = None
            opened = 0.0
    finally:
        if session is not None:
            session.close()
    print_table(records, ["cell", "status", "open_s", "step_s", "tokens_per_s", "reward", "response_len_mean",
                          "len_max_over_median", "logprob_diff_mean", "logprob_diff_max", "logprob_kl",
                          "is_ratio_mean", "weight_sync_ms", "weight_sync_mib", "stale_token_frac",
                          "mixed_version_frac", "peak_rss_mib_max", "error"],
                title=f"{preset}: every algorithm x schedule x engine ({steps} steps each; step seconds and "
                      "tokens/s: medians after the first step; the other metrics: medians over all steps)")
    write_json(records, json_path)
    return records


def measure(s, steps: int) -> dict:
    """The session's next `steps` steps: medians after the first (warm-up: the engine's first
    allocations, a pulled first version), peak RSS of each worker process so far."""
    m = s.run(steps, progress=False)
    timed = m.iloc[1:] if len(m) > 1 else m
    a = s.config.algo
    generated = timed["response_length/mean"] * a.data.prompts_per_step * a.rollout.n
    peaks = ray.get([w.memory.remote() for w in s.workers], timeout=120)
    return {"steps": len(m), "step_s": float(timed.wall_s.median()),
            "tokens_per_s": float(generated.sum() / timed.wall_s.sum()),
            **{k: float(m[v].median()) if v in m and m[v].notna().any() else np.nan for k, v in METRICS.items()},
            **weight_sync_per_update(s.spans, m["update"]),
            "peak_rss_mib_max": max(p["peak_rss"] for p in peaks) / 2**20,
            "peak_rss_mib": [round(p["peak_rss"] / 2**20) for p in sorted(peaks, key=lambda p: p["rank"])]}
