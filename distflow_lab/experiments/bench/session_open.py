"""Seconds to open a session on new worker processes (cold) vs on workers parked by the last
session (pooled, runtime/worker_pool.py): what a notebook user waits between `s.close()` and the
next `lab.rl_session(...)` returning. Real GRPO sessions on the tiny preset (2 workers, FSDP2 over
gloo), per rollout engine; the model and its warm start are prepared before timing (cached).

Each repeat opens the session twice: once with `cluster.fresh_workers=true` (new processes, killed
at close) and once from the pool, which the first repeat's pooled close filled. Both open the
same config and seed, so both run the same first step: `metrics_equal` checks it.

    distflow-lab bench session-open --engine hf,vllm --repeats 3 --json benchmarks/results/session_open.json
"""
from __future__ import annotations

import time

import numpy as np

from distflow_lab.api.runner import load_run_config, open_session, prepare
from distflow_lab.experiments.bench.common import print_table, summarize, write_json
from distflow_lab.runtime.cluster import connect
from distflow_lab.runtime.worker_pool import POOL


def _open_and_step(cfg, fresh: bool) -> tuple[float, dict, list[int]]:
    t0 = time.perf_counter()
    s = open_session(cfg, progress=False, fresh_workers=fresh)
    opened = time.perf_counter() - t0
    try:
        import ray

        pids = [m["pid"] for m in ray.get([w.memory.remote() for w in s.controller.workers], timeout=60)]
        metrics = s.step().metrics
    finally:
        s.close()
    return opened, metrics, pids


def measure(engine: str, repeats: int) -> dict:
    cfg = load_run_config("tiny-cpu-grpo", [f"rollout.engine={engine}", "data.prompts_per_step=8"])
    prepare(cfg, progress=False)  # model, warm start and data built before anything is timed
    POOL.drain()
    _open_and_step(cfg, fresh=False)  # fills the pool (its own open is cold: not counted)
    cold, pooled, equal, same_pids = [], [], True, True
    for _ in range(repeats):
        t, m_cold, _ = _open_and_step(cfg, fresh=True)
        cold.append(t)
        before = list(POOL.idle[-1][1].workers) if POOL.idle else []
        t, m_pool, _ = _open_and_step(cfg, fresh=False)
        pooled.append(t)
        equal &= m_cold == m_pool
        same_pids &= bool(before) and POOL.idle and list(POOL.idle[-1][1].workers) == before
    c, p = summarize(cold), summarize(pooled)
    return {"engine": engine, "cold_s": c["median"], "cold_min": c["min"], "cold_max": c["max"],
            "pooled_s": p["median"], "pooled_min": p["min"], "pooled_max": p["max"],
            "speedup": float(np.median(cold) / np.median(pooled)), "repeats": repeats,
            "metrics_equal": bool(equal), "same_workers": bool(same_pids)}


def run(engines: tuple[str, ...] = ("hf",), repeats: int = 3, json_path: str | None = None) -> list[dict]:
    connect()
    records = [measure(e, repeats) for e in engines]
    print_table(records, title="session open: new workers (cold) vs parked workers (pooled), seconds")
    write_json(records, json_path)
    return records
