"""Probe: would a vLLM reader on CPU sync at memory speed if vLLM computed from plain weights?

    python benchmarks/probes/vllm_plain_gemm.py [--repeats 5] [--json PATH]

vLLM's CPU build prepacks every linear weight for oneDNN after a load (`dispatch_cpu_unquantized_gemm`
in vllm/model_executor/layers/utils.py), drops the plain tensor, and so must repack on every weight
sync (benchmarks/probes/vllm_repack.py). This builds the same engine twice, each in its own process,
on SmolLM2-135M's shapes (random init, float32, one thread): once as shipped (`onednn`), once with that
dispatch replaced by `torch.nn.functional.linear` over the parameters as loaded (`torch`), which keeps
vLLM's fused weights as plain tensors a sync could copy into (or map). Per engine, median of
`--repeats`: 8 prompts x 32 greedy tokens; vLLM's in-place `reload_weights` of the whole policy; a
plain copy into every parameter it keeps. Prints a table, writes JSON. A probe of a path we did not
ship: it patches a vLLM internal, in this process only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def one(gemm: str, model_dir: str, repeats: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    if gemm == "torch":
        import vllm.model_executor.layers.utils as vllm_utils

        def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
            layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

        vllm_utils.dispatch_cpu_unquantized_gemm = plain  # linear.py imports it when each layer loads
    torch.set_num_threads(1)
    from distflow_lab.core.config import RolloutOptions
    from distflow_lab.experiments.bench.weight_sync import build
    from distflow_lab.models.rollout_vllm import VLLMRollout
    from distflow_lab.models.sequences import tokenize_prompts
    from distflow_lab.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    opts = RolloutOptions(n=1, engine="vllm", max_response_len=32, do_sample=False, log_probs=False, micro_batch=8)
    rollout = VLLMRollout(model_dir, tok, opts, 16, dtype="float32", seed=0, sleep_at_start=False)
    ids, mask, _ = tokenize_prompts(tok, [f"{i}+{i * 7}=" for i in range(8)], 16)
    gen, reload, copy = [], [], []
    rollout.generate(ids, mask, seed=0)  # warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = rollout.generate(ids, mask, seed=0)["responses"]
        gen.append(time.perf_counter() - t0)
    state = build("135m", torch.float32).state_dict()
    for _ in range(repeats):
        t0 = time.perf_counter()
        rollout.load_weights(state)
        reload.append(time.perf_counter() - t0)
    box: list = []
    rollout.llm.apply_model(box.append)
    params = [p for p in box[0].parameters() if p.numel()]
    sources = [p.detach().clone() for p in params]
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p, s in zip(params, sources):
            p.data.copy_(s)
        copy.append(time.perf_counter() - t0)
    same = bool(torch.equal(tokens, rollout.generate(ids, mask, seed=0)["responses"]))
    return {"gemm": gemm, "generate_s": statistics.median(gen), "generate_min_s": min(gen),
            "reload_s": statistics.median(reload), "copy_s": statistics.median(copy),
            "kept_mib": sum(p.numel() * p.element_size() for p in params) / 2**20, "same_tokens_after_copy": same,
            "tokens": tokens[0, :16].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # gemm, model_dir: run one engine here
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one[0], a.one[1], a.repeats)))
        return
    import torch

    from distflow_lab.experiments.bench.weight_sync import build
    from distflow_lab.models.model_dir import save_model_dir
    from distflow_lab.models.tokenizer import build_char_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as d:
        save_model_dir(build("135m", torch.float32), build_char_tokenizer(), d)
        for gemm in ("onednn", "torch"):  # one process each: vLLM's dispatch is chosen when it loads
            out = subprocess.run([sys.executable, __file__, "--one", gemm, d, "--repeats", str(a.repeats)],
                                 capture_output=True, text=True, timeout=900)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"the {gemm} engine failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(line[7:]))
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"{'gemm':7} {'generate s':>10} {'reload s':>9} {'copy s':>7} {'kept MiB':>9}")
    for r in rows:
        print(f"{r['gemm']:7} {r['generate_s']:10.3f} {r['reload_s']:9.3f} {r['copy_s']:7.3f} {r['kept_mib']:9.0f}")
    slower = rows[1]["generate_s"] / rows[0]["generate_s"]
    print(f"torch / onednn generation: {slower:.2f}x; same tokens: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"repeats": a.repeats, "rows": rows, "torch_over_onednn_generate": slower,
                       "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
