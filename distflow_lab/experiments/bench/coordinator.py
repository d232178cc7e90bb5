"""The coordinator actor alone, no workers: how long its metadata handling takes
per step as producers x consumers grow (a micro-benchmark of the `coordinator`
data plane's one central actor).

Each simulated step: every producer publishes `items` item lengths and one
object ref (all calls in flight at once, as real producers would), every
consumer then asks for its rows, and the step ends. Reported per step: the
wall time seen by the caller (every call's round trip included) and the
actor's own busy time (its handlers, routing included, waits excluded), median
and spread over `steps` steps.

    distflow-lab bench coordinator --sizes 8,16,32,64 --items 16,64 --steps 20
"""
from __future__ import annotations

import time

import numpy as np
import ray
from tqdm.auto import tqdm

from distflow_lab.core.config import Balance
from distflow_lab.dataplane.coordinator_actor import Coordinator
from distflow_lab.dataplane.interface import Routing
from distflow_lab.experiments.bench.common import print_table, summarize, write_json
from distflow_lab.runtime.cluster import connect


def one_step(coord, step: int, producers: int, consumers: int, lengths: list[np.ndarray], ref) -> None:
    ray.get([coord.publish.remote(step, "e", p, lengths[p], [ref] * len(lengths[p]), 1, producers, consumers,
                                  Routing(Balance.LPT)) for p in range(producers)], timeout=120)
    ray.get([coord.get_meta.remote(step, "e", c, True) for c in range(consumers)], timeout=120)
    ray.get(coord.end_batch.remote(step), timeout=120)


def measure(producers: int, consumers: int, items: int, steps: int, seed: int = 0) -> dict:
    coord = Coordinator.remote(double_buffer=True, wait_timeout_s=60)
    rng = np.random.default_rng(seed)
    lengths = [rng.lognormal(np.log(400), 1.0, items).astype(np.int64).clip(1, 8192) for _ in range(producers)]
    ref = ray.put(np.zeros(8))  # stands in for a producer's samples: only references travel
    try:
        one_step(coord, -1, producers, consumers, lengths, ref)  # warm-up
        walls, busy = [], []
        for step in range(steps):
            before = ray.get(coord.stats.remote(), timeout=60)["busy_s"]
            t0 = time.perf_counter()
            one_step(coord, step, producers, consumers, lengths, ref)
            walls.append(time.perf_counter() - t0)
            busy.append(ray.get(coord.stats.remote(), timeout=60)["busy_s"] - before)
    finally:
        ray.kill(coord)
    w, b = summarize(np.asarray(walls) * 1e3), summarize(np.asarray(busy) * 1e3)
    return {"producers": producers, "consumers": consumers, "items_per_producer": items,
            "items": producers * items, "calls_per_step": producers + consumers + 1,
            "wall_ms_median": w["median"], "wall_ms_min": w["min"], "wall_ms_max": w["max"],
            "busy_ms_median": b["median"], "busy_ms_min": b["min"], "busy_ms_max": b["max"], "steps": steps}


def run(sizes: list[int], items: list[int] | int = (16, 64), steps: int = 20, json_path: str | None = None) -> list[dict]:
    """Every size at every items-per-producer (two or more let `sim.fit_coordinator` tell the
    per-call cost from the per-item routing cost)."""
    connect()
    counts = [items] if isinstance(items, int) else list(items)
    records = [measure(n, n, i, steps) for n in tqdm(sizes, desc="coordinator sizes") for i in counts]
    print_table(records, ["producers", "consumers", "items", "calls_per_step", "wall_ms_median", "wall_ms_min",
                          "wall_ms_max", "busy_ms_median", "busy_ms_max"],
                title=f"coordinator actor alone: metadata handling per step (median/min/max of {steps} steps)")
    write_json(records, json_path)
    return records
