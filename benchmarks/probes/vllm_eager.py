"""Probe: what `rollout.vllm.enforce_eager` costs and saves on vLLM's CPU build (torch.compile or not).

    HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/probes/vllm_eager.py [--repeats 2] [--json PATH]

Each build runs in a fresh process (vLLM binds its own threads and world), compiled (the default)
and eager in turn, on the tiny random-init Qwen2 (what the test suite's vLLM sessions use): the
engine's build time, then the seconds of three `generate` calls of 16 prompts x 4 samples x 24 tokens
(median; the first call of a compiled engine warms it). Prints a table, writes JSON. The test suite
builds its vLLM sessions eager for the build time; tests/test_vllm.py keeps one compiled engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ONE = """
import json, sys, time
from distflow_lab.core.config import RolloutOptions, VLLMOptions
from distflow_lab.models.model_dir import build_tiny_qwen2, save_model_dir
from distflow_lab.models.rollout_vllm import VLLMRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.models.tokenizer import build_char_tokenizer

eager, path = sys.argv[1] == "1", sys.argv[2]
tok = build_char_tokenizer()
save_model_dir(build_tiny_qwen2(tok, seed=0), tok, path)
opts = RolloutOptions(n=4, max_response_len=24, engine="vllm", vllm=VLLMOptions(enforce_eager=eager))
t = time.perf_counter()
engine = VLLMRollout(path, tok, opts, 16, dtype="float32", seed=0, sleep_at_start=False)
build = time.perf_counter() - t
ids, mask, _ = tokenize_prompts(tok, ["12+34="] * 16, 16)
gen = []
for i in range(3):
    t = time.perf_counter()
    engine.generate(ids, mask, seed=i)
    gen.append(time.perf_counter() - t)
engine.close()
print("RESULT", json.dumps({"build_s": build, "generate_s": gen}))
"""


def one(eager: bool, workdir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE, "1" if eager else "0", str(workdir / f"m{int(eager)}")],
                         capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the probe's engine failed:\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "results" / "probe_vllm_eager.json"))
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {"compiled": [], "eager": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):  # interleaved, so drift on a shared machine hits both
            for name in runs:
                runs[name].append(one(name == "eager", Path(d)))
    rows = {name: {"build_s": statistics.median(r["build_s"] for r in rs),
                   "build_s_range": [min(r["build_s"] for r in rs), max(r["build_s"] for r in rs)],
                   "generate_s": statistics.median(g for r in rs for g in r["generate_s"][1:])}
            for name, rs in runs.items()}
    print(f"{'engine':>10} {'build s (median, range)':>26} {'generate s (median)':>20}")
    for name, r in rows.items():
        lo, hi = r["build_s_range"]
        print(f"{name:>10} {r['build_s']:>10.1f} ({lo:.1f}-{hi:.1f}) {r['generate_s']:>20.3f}")
    print(f"eager/compiled: build {rows['eager']['build_s'] / rows['compiled']['build_s']:.2f}x, "
          f"generate {rows['eager']['generate_s'] / rows['compiled']['generate_s']:.2f}x")
    Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeats": a.repeats, "rows": rows,
                                        "runs": runs}, indent=1))
    print("wrote", a.json)


if __name__ == "__main__":
    main()
