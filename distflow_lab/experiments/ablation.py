"""The paper's Fig. 10 ablation ladder, measured: each rung adds one
data-coordinator mechanism to the one before.

    O1 baseline             no local cache, synchronous buffer reset, no balancing, one central buffer
    O2 +local cache         same-layout edges stay in the worker
    O3 +double buffer       buffer reset off the critical path
    O4 +load balance        constrained LPT at the layout change
    O5 +distributed buffer  one DataBuffer per node

Workload: the synthetic GRPO DAG with a long-tailed response-length
distribution and simulated compute proportional to tokens (so stragglers are
real), on `nodes` simulated Ray nodes. Every rung runs `repeats` measured steps
per batch size; we report the median step time, its 95 % bootstrap interval,
and the speedup over O1.

    distflow-lab ablate --batches 64,128,256 --repeats 8 --nodes 2 --out runs/ablation
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.experiments.bench.dataplane import bench_dag, close_pool, measure, start_cluster, stop_cluster
from distflow_lab.observe.curves import ablation_figure

RUNGS: list[tuple[str, dict]] = [
    ("O1 baseline", dict(local_cache=False, double_buffer=False, balance="none", num_buffers=1)),
    ("O2 +local cache", dict(local_cache=True, double_buffer=False, balance="none", num_buffers=1)),
    ("O3 +double buffer", dict(local_cache=True, double_buffer=True, balance="none", num_buffers=1)),
    ("O4 +load balance", dict(local_cache=True, double_buffer=True, balance="lpt", num_buffers=1)),
    ("O5 +distributed buffer", dict(local_cache=True, double_buffer=True, balance="lpt", num_buffers="per_node")),
]


def median_ci(x: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Median and its 95 % bootstrap interval."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n_boot, len(x)), replace=True), axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(np.median(x)), float(lo), float(hi)


def run(batches: list[int], repeats: int = 8, workers: int = 4, nodes: int = 2, context: int = 2048,
        us_per_token: float = 1.0, out: str | Path | None = None) -> pd.DataFrame:
    cluster = start_cluster(nodes, workers)
    rows, pool = [], {}  # one set of worker processes for every rung
    try:
        for batch in batches:
            dag = bench_dag(batch, context, workers, us_per_token=us_per_token, response_len_sigma=1.0)
            for rung, switches in tqdm(RUNGS, desc=f"batch {batch}", leave=False):
                steps = measure(dag, "distributed", workers, repeats, pool=pool, **switches)
                wall, dp = np.array([s["wall_s"] for s in steps]), [s["data_plane_s"] for s in steps]
                med, lo, hi = median_ci(wall)
                rows.append({"rung": rung, "batch": batch, "median": med, "lo": lo, "hi": hi,
                             "data_plane_median": float(np.median(dp)),
                             "repeats": len(steps), "step_s": wall.tolist(),  # the raw samples, for intervals
                             "data_plane_s": dp,
                             **{k: str(v) for k, v in switches.items()}})
    finally:
        close_pool(pool)
        stop_cluster(cluster)
    df = pd.DataFrame(rows)
    base = df[df.rung == RUNGS[0][0]].set_index("batch")["median"]
    df["speedup"] = df["batch"].map(base) / df["median"]
    print_table(df.to_dict("records"), ["rung", "batch", "median", "lo", "hi", "speedup", "data_plane_median"],
                title=f"Fig. 10 ablation: step seconds, median [95% CI] of {repeats} steps, {workers} workers on "
                      f"{nodes} node(s)")
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(df.to_dict("records"), out / "ablation.json")
        df.to_csv(out / "ablation.csv", index=False)
        ablation_figure(df, value="median").write_html(out / "ablation.html", include_plotlyjs="inline")
    return df
