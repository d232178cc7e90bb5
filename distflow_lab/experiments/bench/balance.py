"""Benchmark the DataBuffer partitioners (paper §6.4): quality and speed.

For every (length distribution, N items, K workers) it reports the max-load
ratio (max worker load / lower bound, 1.0 = provably optimal) of constrained
LPT, Karmarkar-Karp and the unbalanced contiguous split, plus the median
wall time of LPT and KK in milliseconds.

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

from distflow_lab.dataplane.partition import constrained_lpt, contiguous_split, karmarkar_karp, load_stats

DEFAULT_KS = (8, 16, 32, 64, 128, 256, 512)
DEFAULT_NS = (1024, 4096, 16384, 65536)
DISTS = ("lognormal", "bimodal")
MAX_TOKENS = 32768


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


def predicted_kk_ms(history: dict, dist: str, k: int, n: int) -> float | None:
    """Extrapolate KK time linearly in N from the largest smaller N measured for (dist, k)."""
    smaller = [(m, ms) for (d, kk, m), ms in history.items() if d == dist and kk == k and m < n and ms]
    if not smaller:
        return None
    m, ms = max(smaller)
    return ms * n / m


def run(
    ks: Sequence[int] = DEFAULT_KS,
    ns: Sequence[int] = DEFAULT_NS,
    dists: Sequence[str] = DISTS,
    repeats: int = 5,
    seed: int = 0,
    json_path: str | Path | None = None,
    kk_budget_s: float = 2.0,
) -> list[dict]:
    """Run the grid, print a table, optionally write JSON; returns one dict per config.

    Configs with n % k != 0 or n < k are skipped (every worker needs N/K items).
    KK is skipped (kk_ratio = kk_ms = None) where it is predicted to exceed kk_budget_s.
    """
    unknown = [d for d in dists if d not in DISTS]
    if unknown:
        raise ValueError(f"unknown distributions {unknown}; choose from {DISTS}")
    configs = [(d, n, k) for d in dists for n in ns for k in ks if n >= k and n % k == 0]
    rows: list[dict] = []
    kk_history: dict = {}
    lengths_cache: dict = {}
    for dist, n, k in tqdm(configs, desc="balance bench"):
        if (dist, n) not in lengths_cache:  # same batch for every K: ratios comparable across K
            rng = np.random.default_rng([seed, DISTS.index(dist), n])
            lengths_cache = {(dist, n): make_lengths(dist, n, rng)}
        lengths = lengths_cache[(dist, n)]

        lpt = constrained_lpt(lengths, k)
        lpt_ms = median_ms(lambda: constrained_lpt(lengths, k), repeats)

        kk_ratio = kk_ms = None
        guess = predicted_kk_ms(kk_history, dist, k, n)
        if guess is None or guess <= kk_budget_s * 1e3:
            start = time.perf_counter()
            kk = karmarkar_karp(lengths, k)
            first_ms = (time.perf_counter() - start) * 1e3
            kk_ratio = load_stats(lengths, kk).ratio
            # One slow call is enough evidence; don't repeat it.
            kk_ms = first_ms if first_ms > kk_budget_s * 1e3 else median_ms(lambda: karmarkar_karp(lengths, k), repeats)
        kk_history[(dist, k, n)] = kk_ms

        rows.append({
            "k": k,
            "n": n,
            "dist": dist,
            "lpt_ratio": load_stats(lengths, lpt).ratio,
            "kk_ratio": kk_ratio,
            "contiguous_ratio": load_stats(lengths, contiguous_split(n, k)).ratio,
            "lpt_ms": lpt_ms,
            "kk_ms": kk_ms,
        })

    print(format_table(rows))
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2))
    return rows


def format_table(rows: list[dict]) -> str:
    """Plain-text table of benchmark rows (pandas, no tabulate needed)."""
    if not rows:
        return "(no configurations: need n >= k and n % k == 0)"
    df = pd.DataFrame(rows)[["dist", "n", "k", "lpt_ratio", "kk_ratio", "contiguous_ratio", "lpt_ms", "kk_ms"]]
    formats = {c: "{:.4f}".format for c in ("lpt_ratio", "kk_ratio", "contiguous_ratio")}
    formats.update({c: "{:.2f}".format for c in ("lpt_ms", "kk_ms")})
    return df.to_string(index=False, formatters=formats, na_rep="skipped")
