"""This machine's memcpy bandwidth: the physical limit a transfer (a data-plane hand-off, a
weight sync) is reported against, measured in the same process as the transfer."""
from __future__ import annotations

import functools
import time

import numpy as np


@functools.lru_cache(maxsize=None)
def memcpy_gbps(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """GB/s of a copy between two warm buffers (median of `repeats`), measured once per process."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9
