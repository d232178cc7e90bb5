"""`distflow-lab` command line: the same code paths as the notebook API.

    distflow-lab run CONFIG.yaml [--mode M] [--steps N] [--out DIR] [key=value ...]
    distflow-lab ablate [--batches 64,128] [--repeats R] [--out DIR]
    distflow-lab bench dataplane|balance|serialization|memory|e2e [...]
    distflow-lab data gsm8k|arithmetic [...]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

BENCHES = {
    "dataplane": "distflow_lab.bench.dataplane",
    "balance": "distflow_lab.bench.balance",
    "serialization": "distflow_lab.bench.serialization",
    "memory": "distflow_lab.bench.memory",
    "e2e": "distflow_lab.bench.e2e",
}


def _local_defaults() -> None:
    # The embedded cluster binds loopback only (must be set before Ray starts).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _local_defaults()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"usage: distflow-lab bench {{{'|'.join(BENCHES)}}} [options]  (--help on each)")
            return 2
        importlib.import_module(BENCHES[rest[0]]).main(rest[1:])
        return 0
    if cmd == "run":
        from .runner import main as run_main

        return run_main(rest)
    if cmd == "ablate":
        from .ablation import main as ablate_main

        return ablate_main(rest)
    if cmd == "data":
        return _data(rest)
    print(f"unknown command {cmd!r}\n{__doc__}")
    return 2


def _data(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="distflow-lab data")
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gsm8k", help="convert GSM8K jsonl to verl-schema parquet")
    g.add_argument("--src", default=None, help="folder with train.jsonl/test.jsonl (default ../shared/datasets/gsm8k)")
    g.add_argument("--out", default="runs/data", help="where data.train=gsm8k looks (data.cache_dir)")
    a = sub.add_parser("arithmetic", help="write the synthetic arithmetic task as parquet")
    a.add_argument("--out", default="runs/data/arithmetic")
    a.add_argument("--n", type=int, default=2048)
    a.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "gsm8k":
        from .data.gsm8k import convert_gsm8k, default_gsm8k_dir

        src = Path(args.src) if args.src else default_gsm8k_dir()
        for split in ("train", "test"):  # the names the runner's data.train=gsm8k reads
            n = convert_gsm8k(src / f"{split}.jsonl", out / f"gsm8k-{split}.parquet", split=split)
            print(f"{out / f'gsm8k-{split}.parquet'}: {n} rows")
    else:
        from .tasks.arithmetic import write_arithmetic_parquet

        for split, seed in (("train", args.seed), ("test", args.seed + 1)):
            path = write_arithmetic_parquet(out / f"{split}.parquet", args.n, seed)
            print(f"{path}: {args.n} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
