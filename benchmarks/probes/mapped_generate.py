"""Probe: does an HF rollout generate as fast from a sync's shared-memory slot (weight_sync.load
"map": its parameters are views of the publisher's slot) as from its own memory ("copy")?

    python benchmarks/probes/mapped_generate.py [--model 135m] [--repeats 5] [--json PATH]

One process, one thread: SmolLM2-135M's shapes (random init), 8 prompts x 32 new tokens, greedy.
The two layouts alternate (copy, map, copy, map, ...) so drift hits both; after the first round
(warm-up) each `generate` is timed. The tokens are compared too: the same weights give the same
tokens. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from distflow_lab.core.config import RolloutOptions
from distflow_lab.experiments.bench.weight_sync import build
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.models.tokenizer import build_char_tokenizer
from distflow_lab.runtime.shm_slots import SlotReader, SlotRing
from distflow_lab.runtime.weight_transport import check_loaded, publish, receive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    trainer = TrainEngine(build(a.model, torch.float32), None, device="cpu", use_fsdp=False)
    opts = RolloutOptions(n=1, max_response_len=32, do_sample=False, log_probs=False, micro_batch=8)
    copied = HFRollout(build(a.model, torch.float32), tok, opts, 16)
    mapped = HFRollout(build(a.model, torch.float32), tok, opts, 16)
    ring, reader = SlotRing(2), SlotReader(0)
    m = publish(trainer.weight_buckets(256 << 20, device="cpu"), 1, trainer.tied_aliases(), ring=ring)
    check_loaded(m, copied.load_weights([p] for p in receive(m, 60.0, reader=reader)))
    check_loaded(m, mapped.load_weights(([p] for p in receive(m, 60.0, reader=reader, keep=True)), bind=True))
    ids, mask, _ = tokenize_prompts(tok, [f"{i}+{i * 7}=" for i in range(8)], 16)
    seconds: dict[str, list[float]] = {"copy": [], "map": []}
    tokens = {}
    for r in range(a.repeats + 1):
        for name, rollout in (("copy", copied), ("map", mapped)):
            t0 = time.perf_counter()
            tokens[name] = rollout.generate(ids, mask, seed=0)["responses"]
            if r:
                seconds[name].append(time.perf_counter() - t0)
    ring.close()
    rows = [{"load": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in seconds.items()]
    ratio = rows[1]["median_s"] / rows[0]["median_s"]
    same = bool(torch.equal(tokens["copy"], tokens["map"]))
    print(f"{'load':6} {'median s':>9} {'min':>7} {'max':>7}")
    for r in rows:
        print(f"{r['load']:6} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f}")
    print(f"map / copy = {ratio:.3f}; same tokens: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "repeats": a.repeats, "rows": rows, "map_over_copy": ratio,
                       "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
