"""Long-run memory: worker RSS, driver RSS and Ray object-store usage sampled
every few steps of the synthetic workload. They must stay flat after warm-up
(the double buffer really frees old steps; the driver never holds a batch in
distributed mode).

    distflow-lab bench memory --steps 200 --mode distributed --json runs/memory.json --html runs/memory.html
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import plotly.express as px
import psutil
import ray
from tqdm.auto import tqdm

from distflow_lab.api.session import Session
from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.experiments.bench.dataplane import bench_dag, start_cluster


def object_store_bytes() -> int:
    """Bytes in Ray's object stores (all nodes), from Ray's memory summary."""
    from ray._private.internal_api import memory_summary

    m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
    return int(m.group(1)) * 2**20 if m else 0


def sample(session, step: int) -> dict:
    workers = ray.get([w.memory.remote() for w in session.workers])
    rss = [w["rss"] for w in workers]
    return {"step": step, "driver_rss": psutil.Process().memory_info().rss, "worker_rss_max": max(rss),
            "worker_rss_mean": float(np.mean(rss)), "object_store": object_store_bytes()}


def run(steps: int = 200, mode: str = "distributed", batch: int = 64, context: int = 1024, workers: int = 4,
        every: int = 5, progress: bool = True) -> pd.DataFrame:
    start_cluster(1, workers)
    dag = bench_dag(batch, context, workers)
    # keep_outputs off and a short span history: what is left to grow is the system itself
    s = Session(dag, world_size=workers, mode=mode, keep_outputs=False, history_steps=10)
    rows = []
    try:
        for i in tqdm(range(steps), desc=f"memory ({mode})", disable=not progress, leave=False):
            s.step()
            if i % every == 0 or i == steps - 1:
                rows.append(sample(s, i))
    finally:
        s.close()
    return pd.DataFrame(rows)


def growth(df: pd.DataFrame, column: str, warmup: int = 10) -> float:
    """Bytes gained after `warmup` steps: median of the last third of the samples minus
    median of the first third (medians: the object store is a sawtooth, filled by
    each step and freed in batches, and a single sample lands anywhere on it)."""
    after = df[df["step"] >= warmup][column].to_numpy()
    k = max(1, len(after) // 3)
    return float(np.median(after[-k:]) - np.median(after[:k])) if len(after) else 0.0


def report(steps: int = 200, mode: str = "distributed", batch: int = 64, context: int = 1024, workers: int = 4,
           every: int = 5, json_path: str | None = None, html_path: str | None = None) -> pd.DataFrame:
    """`run`, then a table of growth after warm-up, the samples as JSON and a figure as HTML."""
    df = run(steps, mode, batch, context, workers, every)
    mib = {c: growth(df, c) / 2**20 for c in ("driver_rss", "worker_rss_max", "object_store")}
    print_table([{"mode": mode, "steps": steps, **{f"{k}_growth_mib": round(v, 2) for k, v in mib.items()}}],
                title="memory growth after warm-up (MiB)")
    write_json(df.to_dict("records"), json_path)
    if html_path:
        long = df.melt("step", ["driver_rss", "worker_rss_max", "worker_rss_mean", "object_store"])
        long["MiB"] = long["value"] / 2**20
        px.line(long, x="step", y="MiB", color="variable", title=f"memory over {steps} steps ({mode})") \
            .write_html(html_path, include_plotlyjs="inline")
    return df
