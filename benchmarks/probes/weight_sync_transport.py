"""The product's weight sync between worker groups (runtime/weight_transport.py), timed part by
part against this machine's memcpy in the same run.

    RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
        python benchmarks/probes/weight_sync_transport.py [--models 135m,59m] [--dtypes float32,bfloat16] [--repeats 3]

The publisher (this process) gathers a policy's tensors (`TrainEngine.weight_buckets`, one rank:
no all-gather), writes them as numpy buckets (`publish`); a reader actor in another process maps
each bucket, checks every tensor's fingerprint and copies it into its HF model (`receive` +
`HFRollout.load_weights`), the path a rollout worker runs. The 135M policy has SmolLM2-135M's
shapes (Llama, 30 layers, hidden 576, tied embedding: 135M parameters, 513 MiB in fp32), random
init: bandwidth does not depend on the values. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distflow_lab.core.config import RolloutOptions
from distflow_lab.experiments.bench.common import summarize
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.runtime.weight_transport import SyncReport, check_loaded, memcpy_gbps, publish, receive

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "135m": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M
    "59m": (640, 10, 10, 2, 1728, 32768),
    "tiny": (64, 2, 4, 2, 128, 260),
}


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    h, layers, heads, kv, inter, vocab = SHAPES[name]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@ray.remote
class Reader:
    def __init__(self, name: str, dtype: str) -> None:
        torch.set_num_threads(1)
        self.rollout = HFRollout(build(name, getattr(torch, dtype)), None, RolloutOptions(n=1), 8)

    def pull(self, manifest) -> dict:
        report = SyncReport("pull", manifest.version)
        loaded: set[str] = set()
        t0 = time.perf_counter()
        gen = receive(manifest, 120.0, report)

        def timed():
            for name, t in gen:
                loaded.add(name)
                yield [(name, t)]
        self.rollout.load_weights(timed())
        check_loaded(manifest, loaded)
        row = report.row()
        row["wall_s"] = time.perf_counter() - t0
        row["load_s"] = row["wall_s"] - row["read_s"] - row["verify_s"]
        return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="135m,59m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/probe_weight_sync_transport.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    memcpy = memcpy_gbps()
    rows = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            engine = TrainEngine(build(name, getattr(torch, dtype)), None, device="cpu", use_fsdp=False)
            reader = Reader.remote(name, dtype)
            pubs, pulls = [], []
            for v in range(1, args.repeats + 2):  # the first is a warm-up (cold object-store pages)
                rep = SyncReport("publish", v)
                t0 = time.perf_counter()
                m = publish(engine.weight_buckets(args.bucket_mib << 20, device="cpu"), v, engine.tied_aliases(),
                            report=rep)
                pub = {**rep.row(), "wall_s": time.perf_counter() - t0}
                pull = ray.get(reader.pull.remote(m))
                if v > 1:
                    pubs.append(pub)
                    pulls.append(pull)
                del m
            nbytes = pubs[0]["bytes"]
            e2e = [nbytes / (p["wall_s"] + q["wall_s"]) / 1e9 for p, q in zip(pubs, pulls)]
            row = {"model": name, "dtype": dtype, "bytes": nbytes, "tensors": pubs[0]["tensors"],
                   "buckets": pubs[0]["buckets"], "memcpy_gbps": memcpy,
                   "publish": {k: summarize([p[k] for p in pubs]) for k in ("gather_s", "verify_s", "write_s", "wall_s")},
                   "pull": {k: summarize([q[k] for q in pulls]) for k in ("read_s", "verify_s", "load_s", "wall_s")},
                   "end_to_end_gbps": summarize(e2e)}
            row["x_memcpy"] = row["end_to_end_gbps"]["median"] / memcpy
            rows.append(row)
            ray.kill(reader)
    print(f"memcpy {memcpy:.2f} GB/s (torch copy_, 1 thread, this run)")
    print(f"{'model':>6} {'dtype':>9} {'MiB':>6} {'write s':>8} {'read s':>7} {'verify s':>9} {'load s':>7} "
          f"{'GB/s':>6} {'x memcpy':>8}")
    for r in rows:
        med = lambda part, k: r[part][k]["median"]  # noqa: E731
        print(f"{r['model']:>6} {r['dtype']:>9} {r['bytes'] / 2**20:6.0f} {med('publish', 'write_s'):8.3f} "
              f"{med('pull', 'read_s'):7.3f} {med('publish', 'verify_s') + med('pull', 'verify_s'):9.3f} "
              f"{med('pull', 'load_s'):7.3f} {r['end_to_end_gbps']['median']:6.2f} {r['x_memcpy']:8.2f}")
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "bucket_mib": args.bucket_mib,
                                           "repeats": args.repeats, "rows": rows}, indent=1))
    print("wrote", args.json)


if __name__ == "__main__":
    main()
