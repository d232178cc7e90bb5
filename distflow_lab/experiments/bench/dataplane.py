"""Data-plane benchmark: the synthetic GRPO DAG in every mode (centralized,
coordinator, distributed, and verl's own dispatch when installed) on the same
workers, for several worker counts and context lengths.

Per step, data-plane seconds = step wall time - the compute critical path
(sum over stages of the slowest worker's compute). Both modes are measured the
same way, in one run, interleaved per configuration; the machine's memcpy
bandwidth is measured in the same run so numbers from different machines can
be read as ratios.

    distflow-lab bench dataplane --workers 2,4,8 --context 1024,4096,8192 --batch 64 --repeats 5
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
from tqdm.auto import tqdm

from distflow_lab.api.session import Session
from distflow_lab.experiments.bench import verl_peer
from distflow_lab.observe.bandwidth import memcpy_gbps
from distflow_lab.experiments.bench.common import print_table, step_row, summarize, write_json
from distflow_lab.experiments.bench.shape import rollout_tp_for
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.core.config import MODES
from distflow_lab.graph.dag import DAG
from distflow_lab.observe.span_stats import stage_breakdown
from distflow_lab.runtime.cluster import connect, shutdown



def bench_dag(batch: int, context: int, workers: int, n: int = 4, rollout_tp: int = 2, **kw):
    """The synthetic GRPO DAG of the benchmarks: `batch` responses per step, prompt and response
    `context // 2` each; `kw` goes to `synthetic_grpo`. The rollout runs at tp = `rollout_tp`
    where it divides `workers` (one redistribution per step), else at tp = 1."""
    tp = rollout_tp_for(workers, rollout_tp)
    return synthetic_grpo(batch_size=batch // n, n=n, max_prompt_len=context // 2, max_response_len=context // 2,
                          rollout_tp=tp, **kw)


def measure(dag, mode: str, world_size: int, steps: int, warmup: int = 1, pool: dict | None = None,
            **options: Any) -> list[dict]:
    """Run `warmup + steps` steps of `dag` in one session; one record per measured step.
    `pool` (world size -> session) lets consecutive measurements reuse worker processes;
    the caller closes what is left in it (`close_pool`)."""
    s = pool.pop(world_size, None) if pool is not None else None
    if pool:
        close_pool(pool)  # sessions of other sizes hold CPUs this one may need
    if s is None:
        s = Session(dag, mode=mode, world_size=world_size, keep_outputs=False, **options)
    else:
        s.reopen(mode=mode, dag=dag, **options)
    try:
        for _ in range(warmup):
            s.step()
        out = []
        for _ in range(steps):
            rep = s.step()
            spans = rep.spans
            out.append({"mode": mode, "update": rep.update, **step_row(rep, spans), "rpcs": rep.rpcs,
                        "breakdown": stage_breakdown(spans, [st.stage_id for st in rep.stages])})
        latency = call_latency_s(s)
        for r in out:
            r["call_latency_s"] = latency
        return out
    finally:
        if pool is not None:
            pool[world_size] = s
        else:
            s.close()


def call_latency_s(s: Session, calls: int = 30) -> float:
    """Median round trip of an empty actor call (driver -> worker 0 -> driver), this run, this machine."""
    w = s.workers[0]
    ray.get(w.ping.remote(), timeout=60)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(w.ping.remote(), timeout=60)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def critical_round_trips(plan, mode: str, nodes: int = 1) -> int:
    """Ray round trips one after another on a step's critical path (calls made in parallel
    count once): the driver's step or stage calls, and each data-plane exchange.
    distributed: per moving edge report+plan, put+add_piece, get_pieces (on one node:
    add_whole, get_pieces — no plan to wait for);
    coordinator: per moving edge publish (one way, counted whole) and get_meta;
    centralized: per stage after the data: dispatch puts, the stage call, the collect get."""
    moving = sum(1 for e in plan.edges if e.kind == "redistribute")
    if mode == "distributed":
        return 1 + (3 if nodes > 1 else 2) * moving + 1  # run_batch, the exchanges, end_batch
    if mode == "coordinator":
        return 1 + 2 * moving + 1
    return 3 * (len(plan.stages) - 1) + 1  # + the data stage on the driver


def close_pool(pool: dict) -> None:
    for s in pool.values():
        s.close()
    pool.clear()


def control_plane_overhead(world_size: int, stages: int = 6, steps: int = 5) -> dict:
    """Per-stage round trip of "run stage s" with trivial stages and tiny data:
    the driver's control cost, in ms per stage (and per stage per worker)."""
    d = DAG("noop").node("s0", "distflow_lab.experiments.bench.dataplane:noop_stage")
    for i in range(1, stages):
        d.node(f"s{i}", "distflow_lab.experiments.bench.dataplane:noop_stage", deps=[f"s{i - 1}"])
    s = Session(d, world_size=world_size, keep_outputs=False)
    try:
        s.step()
        times = []
        for _ in range(steps * stages):
            t0 = time.perf_counter()
            s.step_stage()
            times.append(time.perf_counter() - t0)
    finally:
        s.close()
    ms = summarize(np.asarray(times) * 1e3)
    return {"workers": world_size, "ms_per_stage_median": ms["median"], "ms_per_stage_max": ms["max"],
            "ms_per_stage_per_worker": ms["median"] / world_size}


def noop_stage(batch, ctx):
    return batch


def start_cluster(nodes: int, max_workers: int):
    """A local Ray cluster: one node, or `nodes` simulated nodes (separate raylets
    and object stores, so cross-node reads are real copies)."""
    if nodes <= 1:
        connect(num_cpus=max_workers * 2)
        return None
    from ray.cluster_utils import Cluster

    # loopback only; Cluster() starts Ray before connect() could set this
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    per_node = max(1, -(-max_workers // nodes))  # ceil: workers spread over every node
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node, "include_dashboard": False})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=per_node)
    c.wait_for_nodes()
    connect(address=c.address, log_to_driver=False)
    return c


def stop_cluster(c) -> None:
    """Undo `start_cluster(nodes > 1)`: disconnect, then stop the simulated nodes. A
    single-node run (`c` None) stays connected: it may be the notebook's own cluster."""
    if c is None:
        return
    shutdown()
    c.shutdown()


def config_records(by_mode: dict, bw: float, **config) -> list[dict]:
    """One record per mode of one configuration (medians over its steps). On each:
    `over_central` / `over_verl`, that mode's median data plane over the baseline's
    (and `dist_over_central` / `dist_over_verl`, distributed's, as before)."""
    out = []
    plan = config.pop("plan")
    for m, steps in by_mode.items():
        dp = summarize(r["data_plane_s"] for r in steps)
        floor = {}
        if "rpcs" in steps[0]:  # the physical floor of this mode: its copies at memcpy speed + its round trips
            moved = float(np.median([r["bytes_moved"] for r in steps]))
            lat = steps[0]["call_latency_s"]
            rtts = critical_round_trips(plan, m, config.get("nodes", 1))
            floor = {"rpcs_per_step": int(np.median([r["rpcs"] for r in steps])), "critical_round_trips": rtts,
                     "call_latency_ms": lat * 1e3, "floor_copy_s": moved / (bw * 1e9), "floor_rtt_s": rtts * lat}
            floor["floor_s"] = floor["floor_copy_s"] + floor["floor_rtt_s"]
            floor["over_floor"] = dp["median"] / floor["floor_s"]
        out.append({
            "mode": m, **config,
            "data_plane_s_median": dp["median"], "data_plane_s_min": dp["min"], "data_plane_s_max": dp["max"],
            "step_s_median": summarize(r["wall_s"] for r in steps)["median"],
            "compute_s_median": summarize(r["compute_s"] for r in steps)["median"],
            "bytes_moved": int(np.median([r["bytes_moved"] for r in steps])) if "bytes_moved" in steps[0] else None,
            "memcpy_gbps": bw,  # bytes_moved: None for verl (its transfers are not instrumented)
            "repeats": len(steps),
            "breakdown": (steps[len(steps) // 2]["breakdown"].round(5).reset_index().to_dict("records")
                          if "breakdown" in steps[0] else None),
            **floor,
        })
    med = {r["mode"]: r["data_plane_s_median"] for r in out}
    ratio = lambda a, b: float(med[a] / med[b]) if a in med and b in med and med[b] > 0 else None  # noqa: E731
    for r in out:
        r["over_central"], r["over_verl"] = ratio(r["mode"], "centralized"), ratio(r["mode"], "verl")
        r["dist_over_central"], r["dist_over_verl"] = ratio("distributed", "centralized"), ratio("distributed", "verl")
    return out


def run(workers: list[int], contexts: list[int], batch: int = 64, repeats: int = 5, n: int = 4,
        rollout_tp: int = 2, modes: tuple[str, ...] | None = None,
        json_path: str | None = None, control: bool = True, nodes: int = 1) -> list[dict]:
    modes = modes or (*MODES, *(("verl",) if verl_peer.available() else ()))
    sim_cluster = start_cluster(nodes, max(workers))
    pool: dict = {}  # reuse worker processes across configurations of one world size
    try:
        bw, records = memcpy_gbps(), []
        for w, ctx_len in tqdm([(w, c) for w in workers for c in contexts], desc="dataplane configs"):
            dag = bench_dag(batch, ctx_len, w, n, rollout_tp)
            by_mode = {}
            for m in modes:
                if m == "verl":
                    close_pool(pool)  # verl's workers need the CPUs the pooled session holds
                    by_mode[m] = verl_peer.measure(dag.plan(w), w, repeats)
                else:
                    by_mode[m] = measure(dag, m, w, repeats, pool=pool)
            records += config_records(by_mode, bw, plan=dag.plan(w), workers=w, nodes=nodes, context=ctx_len,
                                      batch=batch, rollout_tp=dag["rollout"].layout.tp)
        close_pool(pool)
        cols = ["mode", "workers", "nodes", "context", "batch", "data_plane_s_median", "data_plane_s_min",
                "data_plane_s_max", "bytes_moved", "over_central", "over_verl", "step_s_median", "memcpy_gbps"]
        print_table(records, cols, title=f"data plane, seconds per step (median/min/max of {repeats} steps)")
        print_table(records, ["mode", "workers", "context", "data_plane_s_median", "floor_copy_s", "floor_rtt_s",
                              "floor_s", "over_floor", "critical_round_trips", "rpcs_per_step", "call_latency_ms"],
                    title="against the floor: bytes / memcpy + critical-path round trips x empty-call latency")
        if control:
            ctrl = [control_plane_overhead(w) for w in workers]
            print_table(ctrl, title="control plane: driver round trip per stage (trivial stages)")
            for r in records:
                r["control_plane_ms_per_stage"] = next(c["ms_per_stage_median"] for c in ctrl
                                                       if c["workers"] == r["workers"])
        write_json(records, json_path)
    finally:
        close_pool(pool)
        stop_cluster(sim_cluster)
    return records
