"""Probe: how much of a vLLM reader's weight load is vLLM repacking the weights for its CPU kernels?

    python benchmarks/probes/vllm_repack.py [--repeats 3] [--json PATH]

vLLM's CPU build does not compute from the checkpoint's weights: after a load it prepacks every
linear layer's weight for its GEMM kernel (`dispatch_cpu_unquantized_gemm` in
vllm/model_executor/layers/utils.py: oneDNN's `create_onednn_mm`, or sgl-kernel's
`convert_weight_packed` for small layers), and `reload_weights` does that again for every layer
it reloads. This times that step alone, on SmolLM2-135M's 121 linear weights (30 layers x qkv, o,
gate_up, down, plus the tied head), one thread, beside a plain copy (`clone`) of the same tensors.
Prints a table, writes JSON (median of `--repeats`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

H, LAYERS, HEADS, KV, INTER, VOCAB = 576, 30, 9, 3, 1536, 49152  # SmolLM2-135M


def shapes() -> list[tuple[int, int]]:
    hd = H // HEADS
    per_layer = [((HEADS + 2 * KV) * hd, H), (H, H), (2 * INTER, H), (H, INTER)]  # vLLM's fused layers
    return per_layer * LAYERS + [(VOCAB, H)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(n, k).to(dtype) for n, k in shapes()]
        pack, copy = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for w in ws:
                if check_cpu_sgl_kernel(*w.shape, dtype):
                    torch.ops._C.convert_weight_packed(w)
                else:
                    ops.create_onednn_mm(w.t(), 32)
            pack.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for w in ws:
                w.clone()
            copy.append(time.perf_counter() - t0)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "layers": len(ws),
                     "mib": sum(w.numel() * w.element_size() for w in ws) / 2**20,
                     "repack_s": statistics.median(pack), "clone_s": statistics.median(copy),
                     "onednn": bool(ops._supports_onednn)})
    print(f"{'dtype':9} {'layers':>6} {'MiB':>6} {'repack s':>9} {'clone s':>8}")
    for r in rows:
        print(f"{r['dtype']:9} {r['layers']:6d} {r['mib']:6.0f} {r['repack_s']:9.3f} {r['clone_s']:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
