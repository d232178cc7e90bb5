"""Benchmark the partitioners (paper §6.4): quality and speed, against verl.

For every (length distribution, cost, N items, K workers) it reports the
max-load ratio (max worker load / lower bound, 1.0 = provably optimal) of

- `lpt`: constrained LPT alone (paper Algorithm 1),
- `ours`: what the data planes run, `routing.assign` with policy lpt (cost
  tokens) or workload (cost 24576·L + L², verl's `calculate_workload`):
  LPT followed by the bounded swap refinement,
- `kk`: the project's Karmarkar-Karp, `verl_kk`: verl's own
  (`verl.utils.seqlen_balancing.karmarkar_karp`, when `scripts/install_bench.sh`
  installed verl), on the same costs,
- `contiguous`: no balancing,

with the median wall time of each in milliseconds, and whether ours stays
within 0.1 % of verl's max load on every instance.

    distflow-lab bench balance --ks 8,64,512 --ns 4096,65536 --json out/balance.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from distflow_lab.dataplane.partition import (
    DEFAULT_WORKLOAD,
    constrained_lpt,
    contiguous_split,
    karmarkar_karp,
    load_stats,
    workload_cost,
)
from distflow_lab.dataplane.routing import assign

DEFAULT_KS = (8, 16, 32, 64, 128, 256, 512)
DEFAULT_NS = (1024, 4096, 16384, 65536)
DISTS = ("lognormal", "bimodal")
COSTS = ("tokens", "workload")
MAX_TOKENS = 32768
TOLERANCE = 1.001  # ours may exceed verl's max load by 0.1 %
POLICY = {"tokens": "lpt", "workload": "workload"}  # the routing policy that balances each cost


def make_lengths(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sequence lengths in tokens (ints in [1, MAX_TOKENS]) for one batch."""
    if dist == "lognormal":
        # Heavy right tail like real rollouts: median ~1000 tokens, a few near the cap.
        raw = rng.lognormal(mean=np.log(1000), sigma=1.0, size=n)
    elif dist == "bimodal":
        # 80% short answers (~200 tokens), 20% long reasoning traces (~8000 tokens).
        is_long = rng.random(n) < 0.2
        raw = np.where(is_long, rng.normal(8000, 1500, n), rng.normal(200, 50, n))
    else:
        raise ValueError(f"unknown distribution {dist!r}; choose from {DISTS}")
    return np.clip(np.rint(raw), 1, MAX_TOKENS).astype(np.int64)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() in milliseconds."""
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def predicted_ms(history: dict, key: tuple, n: int) -> float | None:
    """Extrapolate a time linearly in N from the largest smaller N measured for `key`."""
    smaller = [(m, ms) for (k, m), ms in history.items() if k == key and m < n and ms]
    if not smaller:
        return None
    m, ms = max(smaller)
    return ms * n / m


def verl_kk() -> Callable | None:
    """verl's Karmarkar-Karp, or None when verl is not installed (scripts/install_bench.sh)."""
    try:
        from verl.utils.seqlen_balancing import karmarkar_karp as kk
    except Exception:
        return None
    return lambda costs, k: kk(costs.tolist(), k, True)


def timed(fn: Callable[[], list], repeats: int, budget_s: float) -> tuple[list, float]:
    """(result, ms): the median of `repeats` calls, or the first call alone when it took over budget."""
    start = time.perf_counter()
    out = fn()
    first_ms = (time.perf_counter() - start) * 1e3
    return out, first_ms if first_ms > budget_s * 1e3 else median_ms(fn, repeats - 1 or 1)


def bench_one(lengths: np.ndarray, cost: str, k: int, repeats: int, kk_fns: dict, budget_s: float,
              history: dict, key: tuple) -> dict:
    """One grid point: ratio and ms of every policy."""
    costs = lengths if cost == "tokens" else workload_cost(lengths, DEFAULT_WORKLOAD)
    n = len(lengths)
    row: dict = {}
    lpt, row["lpt_ms"] = timed(lambda: constrained_lpt(costs, k), repeats, budget_s)
    ours, row["ours_ms"] = timed(lambda: assign(lengths, k, POLICY[cost]), repeats, budget_s)
    row["lpt_ratio"], row["ours_ratio"] = load_stats(costs, lpt).ratio, load_stats(costs, ours).ratio
    loads = {}
    for name, fn in kk_fns.items():  # Karmarkar-Karp is slow in Python: skip where predicted over budget
        row[f"{name}_ratio"] = row[f"{name}_ms"] = None
        guess = predicted_ms(history, (*key, name), n)
        if guess is None or guess <= budget_s * 1e3:
            parts, row[f"{name}_ms"] = timed(lambda: fn(costs, k), min(repeats, 3), budget_s)
            stats = load_stats(costs, parts)
            row[f"{name}_ratio"], loads[name] = stats.ratio, sorted(stats.loads)
        history[((*key, name), n)] = row[f"{name}_ms"]
    row["contiguous_ratio"] = load_stats(costs, contiguous_split(n, k)).ratio
    verl = row.get("verl_kk_ratio")
    row["ours_le_verl"] = None if verl is None else bool(row["ours_ratio"] <= verl * TOLERANCE)
    row["kk_equals_verl"] = None if len(loads) < 2 else loads["kk"] == loads["verl_kk"]
    return row


def run(
    ks: Sequence[int] = DEFAULT_KS,
    ns: Sequence[int] = DEFAULT_NS,
    dists: Sequence[str] = DISTS,
    repeats: int = 5,
    seed: int = 0,
    json_path: str | Path | None = None,
    kk_budget_s: float = 2.0,
    costs: Sequence[str] = COSTS,
    verl: bool = True,
) -> dict:
    """Run the grid, print a table and a summary, optionally write JSON ({"rows", "summary"}).

    Configs with n % k != 0 or n < k are skipped (every worker needs N/K items).
    Karmarkar-Karp (ours and verl's) is skipped (ratio = ms = None) where it is
    predicted to exceed kk_budget_s.
    """
    for name, given, known in (("distributions", dists, DISTS), ("costs", costs, COSTS)):
        unknown = [d for d in given if d not in known]
        if unknown:
            raise ValueError(f"unknown {name} {unknown}; choose from {known}")
    kk_fns: dict[str, Callable] = {"kk": karmarkar_karp}
    verl_fn = verl_kk() if verl else None
    if verl_fn is not None:
        kk_fns["verl_kk"] = verl_fn
    configs = [(d, c, n, k) for d in dists for c in costs for n in ns for k in ks if n >= k and n % k == 0]
    rows: list[dict] = []
    history: dict = {}
    for dist, cost, n, k in tqdm(configs, desc="balance bench"):
        # Same batch for every K and cost: ratios comparable across them.
        lengths = make_lengths(dist, n, np.random.default_rng([seed, DISTS.index(dist), n]))
        row = bench_one(lengths, cost, k, repeats, kk_fns, kk_budget_s, history, (dist, cost, k))
        rows.append({"dist": dist, "cost": cost, "n": n, "k": k, **row})
    result = {"rows": rows, "summary": summarize(rows)}
    print(format_table(rows))
    print(format_summary(result["summary"]))
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return result


def summarize(rows: list[dict]) -> dict:
    """Worst ours / verl per (dist, cost), the verdict, and the speed at the largest instance."""
    compared = [r for r in rows if r["ours_le_verl"] is not None]
    worst = {}
    for r in compared:
        key = f"{r['dist']}/{r['cost']}"
        worst[key] = max(worst.get(key, 0.0), r["ours_ratio"] / r["verl_kk_ratio"])
    n_max, k_max = max((r["n"] for r in rows), default=0), max((r["k"] for r in rows), default=0)
    largest = [r for r in rows if r["n"] == n_max and r["k"] == k_max]
    return {
        "instances": len(rows),
        "compared_with_verl": len(compared),
        "ours_le_verl_x1.001_everywhere": all(r["ours_le_verl"] for r in compared) if compared else None,
        "max_ours_over_verl": worst,
        "kk_equals_verl_everywhere": (all(r["kk_equals_verl"] for r in rows if r["kk_equals_verl"] is not None)
                                      if any(r["kk_equals_verl"] is not None for r in rows) else None),
        "largest": {f"{r['dist']}/{r['cost']}": {"n": n_max, "k": k_max, "lpt_ms": r["lpt_ms"],
                                                  "ours_ms": r["ours_ms"], "ours_ratio": r["ours_ratio"]}
                    for r in largest},
    }


def format_table(rows: list[dict]) -> str:
    """Plain-text table of benchmark rows (pandas, no tabulate needed)."""
    if not rows:
        return "(no configurations: need n >= k and n % k == 0)"
    cols = ["dist", "cost", "n", "k", "lpt_ratio", "ours_ratio", "kk_ratio", "verl_kk_ratio", "contiguous_ratio",
            "lpt_ms", "ours_ms", "kk_ms", "verl_kk_ms", "ours_le_verl"]
    df = pd.DataFrame(rows).reindex(columns=cols)
    formats = {c: "{:.4f}".format for c in cols if c.endswith("_ratio")}
    formats.update({c: "{:.2f}".format for c in cols if c.endswith("_ms")})
    return df.to_string(index=False, formatters=formats, na_rep="-")


def format_summary(s: dict) -> str:
    lines = [f"{s['instances']} instances, {s['compared_with_verl']} compared with verl's Karmarkar-Karp"]
    if s["compared_with_verl"]:
        lines.append(f"ours <= verl x {TOLERANCE} on every instance: {s['ours_le_verl_x1.001_everywhere']}")
        lines += [f"  worst ours / verl, {key}: {v:.5f}" for key, v in s["max_ours_over_verl"].items()]
        lines.append(f"project KK loads == verl KK loads on every instance run: {s['kk_equals_verl_everywhere']}")
    else:
        lines.append("verl not installed (scripts/install_bench.sh): no comparison")
    for key, r in s["largest"].items():
        lines.append(f"N={r['n']}, K={r['k']}, {key}: LPT {r['lpt_ms']:.1f} ms, LPT + refinement "
                     f"{r['ours_ms']:.1f} ms, ratio {r['ours_ratio']:.5f}")
    return "\n".join(lines)
