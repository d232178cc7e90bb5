"""Probe for issue 35 (weight sync at memory speed): how fast can a policy cross Ray's
object store as numpy buckets, against this machine's memcpy, measured in one run?

    RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
        python benchmarks/probes/weight_sync_object_store.py [--mib 512] [--repeats 5]

The publisher `ray.put`s float32 buckets as numpy arrays (pickle-5 out-of-band: one copy
into shared memory); a reader actor `ray.get`s them (a zero-copy, read-only view) and
`copy_`s each view into its own parameter. Parts: write (put), get (map), load (copy_).
Prints a table (median, min, max over repeats) and writes JSON beside the other results.
Not the product path: a measurement to design it from.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import ray
import torch

from distflow_lab.experiments.bench.common import summarize


@ray.remote
class Reader:
    def __init__(self, numel: int) -> None:
        torch.set_num_threads(1)
        self.p = torch.empty(numel)

    def load(self, refs: list) -> tuple[float, float]:
        t0 = time.perf_counter()
        arrays = ray.get(refs)
        t1 = time.perf_counter()
        off = 0
        with warnings.catch_warnings():  # the mapped arrays are read-only; we only read them
            warnings.simplefilter("ignore")
            for a in arrays:
                v = torch.from_numpy(a)
                self.p[off:off + v.numel()].copy_(v)
                off += v.numel()
        return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/probe_weight_sync_object_store.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        dst.copy_(src)
        memcpy.append(nbytes / (time.perf_counter() - t) / 1e9)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=3 << 30)
    reader = Reader.remote(src.numel())
    ray.get(reader.load.remote([]))
    rows = []
    for bucket_mib in (64, 256):
        w, g, ld, tot = [], [], [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            refs = [ray.put(c.numpy()) for c in src.split((bucket_mib << 20) // 4)]
            tw = time.perf_counter() - t
            tg, tl = ray.get(reader.load.remote(refs))
            tt = time.perf_counter() - t
            w.append(nbytes / tw / 1e9), g.append(tg), ld.append(nbytes / tl / 1e9), tot.append(nbytes / tt / 1e9)
            del refs
        rows.append({"bucket_mib": bucket_mib, "write_gbps": summarize(w), "get_s": summarize(g), "load_gbps": summarize(ld),
                     "total_gbps": summarize(tot)})
    out = {"mib": args.mib, "repeats": args.repeats, "memcpy_gbps": summarize(memcpy), "rows": rows}
    m = out["memcpy_gbps"]["median"]
    print(f"memcpy {m:.2f} GB/s (min {min(memcpy):.2f}, max {max(memcpy):.2f}); {args.mib} MiB float32")
    print(f"{'bucket':>8} {'write GB/s':>18} {'get ms':>8} {'load GB/s':>18} {'total GB/s':>18} {'x memcpy':>9}")
    for r in rows:
        f = lambda d: f"{d['median']:.2f} [{d['min']:.2f},{d['max']:.2f}]"  # noqa: E731
        print(f"{r['bucket_mib']:>6}Mi {f(r['write_gbps']):>18} {r['get_s']['median'] * 1e3:>8.1f} "
              f"{f(r['load_gbps']):>18} {f(r['total_gbps']):>18} {r['total_gbps']['median'] / m:>9.2f}")
    Path(args.json).write_text(json.dumps(out, indent=1))
    print("wrote", args.json)


if __name__ == "__main__":
    main()
