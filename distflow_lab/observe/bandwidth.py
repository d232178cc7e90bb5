"""This machine's memcpy bandwidth: the physical limit a transfer (a data-plane hand-off, a
weight sync) is reported against, measured in the same process as the transfer."""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

import numpy as np


@functools.lru_cache(maxsize=None)
def memcpy_gbps(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """GB/s of the faster of numpy's copyto and torch's copy_ between two warm buffers, one thread
    (median of `repeats` each), measured once per process. Both, because either can be the faster
    one here (13.4 vs 13.6 GB/s at 512 MiB; 10.9 vs 13.3 at 64 MiB): the limit is the better one."""
    import torch

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    with _one_thread(torch):
        t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst)
        best = max(_median_gbps(lambda: np.copyto(dst, src), nbytes, repeats),
                   _median_gbps(lambda: t_dst.copy_(t_src), nbytes, repeats))
    return best


def _median_gbps(copy: Callable[[], object], nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


@contextlib.contextmanager
def _one_thread(torch: Any) -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
