"""Long-run memory: worker RSS, driver RSS and Ray object-store usage sampled
every few steps of the synthetic workload. They must stay flat after warm-up
(the double buffer really frees old steps; the driver never holds a batch in
distributed mode).

    distflow-lab bench memory --steps 200 --mode distributed --json runs/memory.json --html runs/memory.html

`sweep_batch` measures the driver instead: bytes through it and its peak RSS against the
batch size, for every data plane (`bench memory --sweep-batch 16,64,256`, once the CLI has it).
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
from distflow_lab.core.config import MODES
from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.experiments.bench.dataplane import bench_dag, start_cluster


def object_store_bytes() -> int:
    """Bytes in Ray's object stores (all nodes), from Ray's memory summary."""
    from ray._private.internal_api import memory_summary

    m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
    return int(m.group(1)) * 2**20 if m else 0


def sample(session, step: int) -> dict:
    workers = ray.get([w.memory.remote() for w in session.workers], timeout=60)
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


# ---- driver memory against batch size, per data plane -------------------------------------------

def release_free_memory() -> None:
    """Give memory malloc holds but nobody uses back to the OS (glibc's malloc_trim; a no-op
    elsewhere), so RSS measured next counts what is allocated then."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """The driver's peak RSS while the block runs, sampled every `every_s` by a thread
    (ru_maxrss cannot be reset, so a sweep in one process needs its own peak)."""

    def __init__(self, every_s: float = 0.002) -> None:
        import threading

        self.every_s, self._stop, self.peak, self.before = every_s, threading.Event(), 0, 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        p = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, p.memory_info().rss)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "PeakRSS":
        self.before = self.peak = psutil.Process().memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.every_s + 1)  # it wakes every every_s
        self.peak = max(self.peak, psutil.Process().memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


def sweep_batch(batches: list[int] = (16, 64, 256), modes: list[str] = tuple(reversed(MODES)),
                context: int = 1024, workers: int = 4, steps: int = 3, n: int = 4, session=None,
                json_path: str | None = None, progress: bool = True) -> pd.DataFrame:
    """For each data plane and batch (responses per step): bytes through the driver per step
    (`bytes_to_driver`) and the driver's RSS growth at its peak during `steps` steps (after
    one warm-up step), against batch x length (tokens per step; batch x n x length in prompt
    terms). One session is reused (`reopen`), so worker start-up is paid once. Prints a table,
    writes the rows as JSON."""
    import gc

    from distflow_lab.api.session import Session

    own = session is None
    if own:
        start_cluster(1, workers)
    s = session
    rows = []
    try:
        for mode in modes:
            for batch in batches:
                dag = bench_dag(batch, context, workers, n=n)
                if s is None:
                    s = Session(dag, world_size=workers, mode=mode, keep_outputs=False, history_steps=4)
                else:
                    s.reopen(mode=mode, dag=dag, keep_outputs=False, history_steps=4)
                s.step()  # warm-up: first-step allocations are not the batch's
                gc.collect()
                release_free_memory()  # else the warm-up's freed batch, kept by malloc, hides the steps' growth
                sent = s.bytes_to_driver
                with PeakRSS() as rss:
                    for _ in range(steps):
                        s.step()
                rows.append({"mode": mode, "batch": batch, "n": n, "context": context,
                             "tokens_per_step": batch * context,
                             "driver_bytes_per_step": (s.bytes_to_driver - sent) / steps,
                             "driver_rss_before": rss.before, "driver_rss_peak": rss.peak,
                             "driver_rss_growth": rss.growth})
                if progress:
                    r = rows[-1]
                    print(f"{mode:12s} batch {batch:5d}: {r['driver_bytes_per_step'] / 2**20:9.2f} MiB/step to the "
                          f"driver, RSS +{r['driver_rss_growth'] / 2**20:8.2f} MiB at peak", flush=True)
    finally:
        if own and s is not None:
            s.close()
    df = pd.DataFrame(rows)
    shown = df.assign(driver_mib_per_step=df["driver_bytes_per_step"] / 2**20,
                      rss_growth_mib=df["driver_rss_growth"] / 2**20)
    print_table(shown.to_dict("records"), ["mode", "batch", "tokens_per_step", "driver_mib_per_step",
                                           "rss_growth_mib"], title="driver memory against batch size")
    write_json(df.to_dict("records"), json_path)
    return df
