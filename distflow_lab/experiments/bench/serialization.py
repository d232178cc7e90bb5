"""How a batch crosses Ray's object store: put in the driver, get in another
process on the same node. Three ways, measured in one run:

    batch          distflow_lab's Batch: tensors reduce to numpy views (pickle protocol 5
                   out-of-band buffers): one memcpy into shared memory on put, a view on get
    torch-pickle   a dict of torch tensors with Ray's default serializer
    torch-zerocopy the same dict with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 (Ray's option) in
                   both processes

    distflow-lab bench serialization [--mib 16,64,256] [--repeats 7] [--json PATH]
"""
from __future__ import annotations

import time

import ray
import torch

from distflow_lab.core.batch import Batch
from distflow_lab.observe.bandwidth import memcpy_gbps
from distflow_lab.experiments.bench.common import print_table, summarize, write_json


@ray.remote(num_cpus=0)
class Peer:
    """One process of the round trip. Ray's zero-copy torch option is read when Ray
    starts in a process, so each way gets processes started with its environment."""

    def put(self, mib: int, as_batch: bool) -> tuple[float, list]:
        tensors = make(mib)
        obj = Batch(tensors) if as_batch else tensors
        t0 = time.perf_counter()
        ref = ray.put(obj)
        return time.perf_counter() - t0, [ref]

    def get(self, refs: list) -> tuple[float, bool]:
        t0 = time.perf_counter()
        obj = ray.get(refs[0], timeout=120)
        t = time.perf_counter() - t0
        first = next(iter((obj.tensors if isinstance(obj, Batch) else obj).values()))
        return t, isinstance(first, torch.Tensor)


def make(mib: int) -> dict[str, torch.Tensor]:
    rows = max(1, mib * 2**20 // (4096 * 8 * 2))
    return {"input_ids": torch.randint(0, 32000, (rows, 4096)), "attention_mask": torch.ones(rows, 4096, dtype=torch.int64)}


WAYS = {"batch": (True, {}), "torch-pickle": (False, {}),
        "torch-zerocopy": (False, {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"})}


def run(mibs: list[int], repeats: int = 7, json_path: str | None = None) -> list[dict]:
    from distflow_lab.runtime.cluster import connect

    connect(num_cpus=2)
    records = []
    nbytes = {mib: sum(t.nbytes for t in make(mib).values()) for mib in mibs}  # the same for every way
    for name, (as_batch, env) in WAYS.items():
        writer, reader = (Peer.options(runtime_env={"env_vars": env} if env else None).remote() for _ in range(2))
        for mib in mibs:
            puts, gets = [], []
            for _ in range(repeats):
                p, refs = ray.get(writer.put.remote(mib, as_batch), timeout=300)
                g, ok = ray.get(reader.get.remote(refs), timeout=300)
                puts.append(p)
                gets.append(g)
                del refs
            p, g, nb = summarize(puts)["median"], summarize(gets)["median"], nbytes[mib]
            records.append({"way": name, "mib": round(nb / 2**20), "put_ms": p * 1e3, "get_ms": g * 1e3,
                            "put_gbps": nb / p / 1e9, "get_gbps": nb / max(g, 1e-9) / 1e9,
                            "tensor_out": ok, "repeats": repeats})
        ray.kill(writer)
        ray.kill(reader)
    bw = memcpy_gbps()
    for r in records:
        r["memcpy_gbps"] = bw
    print_table(records, title="object store round trip (put in one process, get in another, same node)")
    write_json(records, json_path)
    return records
