"""How much of the policy changes per update: the case for (or against) a delta weight sync.

    .venv/bin/python benchmarks/probes/weight_delta.py [--steps 5] [--lr 1e-5] [--json PATH]

A real GRPO run of SmolLM2-135M-Instruct (preset smollm2-arith, worker groups: 1 rollout + 1 train
worker, so every update is published to the WeightBoard); after each step the driver reads the
newest published policy back (`weight_transport.read_state`, every tensor checked) and compares it
with the one before, element by element:
  changed_fp32   elements whose float32 value changed (the trainer's dtype)
  changed_bf16   elements whose value rounded to bfloat16 changed (what a bfloat16 rollout is sent)
  blocks_fp32/bf16  4 KiB blocks (of the tensor's bytes in that dtype) holding any changed element:
                 what a block-level delta would send
  tensors_bf16   tensors with any bfloat16 change: what a tensor-level delta would send
Fractions of the policy's elements (or blocks, or tensors). JSON: one record per update.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import ray
import torch

BLOCK_BYTES = 4096


def changed(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> dict[str, float]:
    n = sum(t.numel() for t in cur.values())
    out = {"elements": n, "changed_fp32": 0, "changed_bf16": 0, "blocks_fp32": 0, "blocks_bf16": 0, "blocks_total_fp32": 0,
           "blocks_total_bf16": 0, "tensors_bf16": 0, "tensors": len(cur)}
    for name, t in cur.items():
        a, b = prev[name].reshape(-1).float(), t.reshape(-1).float()
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            diff = a != b if dtype == "fp32" else a.bfloat16() != b.bfloat16()
            per = BLOCK_BYTES // size
            pad = (-diff.numel()) % per
            blocks = torch.nn.functional.pad(diff, (0, pad)).reshape(-1, per).any(dim=1)
            out[f"changed_{dtype}"] += int(diff.sum())
            out[f"blocks_{dtype}"] += int(blocks.sum())
            out[f"blocks_total_{dtype}"] += blocks.numel()
            if dtype == "bf16":
                out["tensors_bf16"] += int(diff.any())
    return {"changed_fp32": out["changed_fp32"] / n, "changed_bf16": out["changed_bf16"] / n,
            "blocks_fp32": out["blocks_fp32"] / out["blocks_total_fp32"],
            "blocks_bf16": out["blocks_bf16"] / out["blocks_total_bf16"],
            "tensors_bf16": out["tensors_bf16"] / out["tensors"], "elements": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from distflow_lab.api.runner import load_run_config, open_session
    from distflow_lab.runtime.weight_transport import read_state

    out_dir = tempfile.mkdtemp(prefix="weight-delta-")
    cfg = load_run_config("smollm2-arith", [f"trainer.out_dir={out_dir}", "groups={rollout: 1, train: 1}",
                                            "data.prompts_per_step=4", "rollout.n=4", "rollout.max_response_len=32",
                                            f"actor.lr={a.lr}", f"trainer.steps={a.steps}"])
    rows = []
    with open_session(cfg, progress=True) as s:
        board = s.controller.board
        prev = None
        for step in range(a.steps):
            metrics = s.step().metrics
            version, manifest, _, _ = ray.get(board.latest.remote(), timeout=120)
            cur = read_state(manifest)
            if prev is not None and version != prev[0]:
                row = {"step": step, "version": version, "from_version": prev[0],
                       "reward": metrics.get("reward/mean", float("nan")), **changed(prev[1], cur)}
                rows.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            prev = (version, cur)
    path = a.json or str(Path(__file__).resolve().parents[1] / "results" / "probe_weight_delta.json")
    Path(path).write_text(json.dumps({"lr": a.lr, "preset": "smollm2-arith", "block_bytes": BLOCK_BYTES,
                                      "updates": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
