"""Data-plane scaling on a simulated multi-node Ray cluster: every mode at several
worker counts and contexts, proportional or constant batch (paper Fig. 2 / App.
A.1). `experiments.sim` calibrates its cost model from these measurements."""
from __future__ import annotations

import pandas as pd

from distflow_lab.api.session import Session
from distflow_lab.experiments.bench.dataplane import MODES, bench_dag, close_pool, measure, start_cluster, stop_cluster


def measure_scaling(workers=(1, 2, 4, 8), contexts=(1024,), nodes: int = 2, batch_mode: str = "proportional",
                    repeats: int = 3, batch_per_worker: int = 16, n: int = 4, rollout_tp: int = 2,
                    us_per_token: float = 0.0, spans_at: tuple[int, int] | None = None,
                    modes=MODES, cluster=None) -> pd.DataFrame:
    """Every mode on a simulated `nodes`-node Ray cluster (started and shut down here) via
    `bench.dataplane.measure`: per (mode, workers, context) median, `_lo` (min), `_hi` (max) over
    `repeats` steps of step/data-plane/compute seconds and throughput; B = batch_per_worker *
    (workers, or max(workers) if "constant"). `spans_at=(workers, context)`: one more session per
    mode there, its spans and step walls in columns `spans`, `walls` (for `calibrate`; a separate
    session, so the check at that point also shows how much two sessions differ). `cluster`: a
    simulated cluster from `bench.dataplane.start_cluster` to measure on (several calls share one;
    the caller stops it), instead of one started and stopped here."""
    sim = start_cluster(nodes, max(workers)) if cluster is None else None
    rows, pool = [], {}
    try:
        for w, ctx in [(w, c) for w in workers for c in contexts]:
            b = batch_per_worker * (w if batch_mode == "proportional" else max(workers))
            dag = bench_dag(b, ctx, w, n, rollout_tp, us_per_token=us_per_token)
            for m in modes:
                r = pd.DataFrame(measure(dag, m, w, repeats, pool=pool)).rename(columns={"wall_s": "step_s"})
                r["throughput"] = b * ctx / r["step_s"]
                row = {"mode": m, "workers": w, "nodes": min(nodes, w), "context": ctx, "batch": b,
                       "rollout_tp": dag["rollout"].layout.tp, "batch_mode": batch_mode, "repeats": len(r),
                       "bytes_moved": r["bytes_moved"].median()}
                for k in ("step_s", "data_plane_s", "compute_s", "throughput"):
                    row.update({k: r[k].median(), f"{k}_lo": r[k].min(), f"{k}_hi": r[k].max()})
                if spans_at == (w, ctx):
                    s = pool.pop(w, None)
                    close_pool(pool)
                    if s is None:
                        s = Session(dag, mode=m, world_size=w, keep_outputs=False)
                    else:
                        s.reopen(mode=m, dag=dag)
                    pool[w] = s
                    s.run(repeats + 1, progress=False)
                    reps, sp = list(s.history)[-repeats:], s.spans  # drop the warm-up step
                    row.update(spans=sp[sp.batch_id.isin([x.update for x in reps])].reset_index(drop=True),
                               walls=[x.wall_seconds for x in reps])
                rows.append(row)
    finally:
        close_pool(pool)
        stop_cluster(sim)
    return pd.DataFrame(rows)
