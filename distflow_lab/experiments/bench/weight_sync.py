"""The weight sync, part by part, against this machine's memcpy in the same run.

    distflow-lab bench weight-sync [--models 135m,59m,tiny] [--dtypes float32,bfloat16]
                                   [--paths shm,groups,colocated,pickled] [--loads copy,map]
                                   [--repeats 3] [--json F]

Paths (the reader is an HF rollout or a vLLM engine; each path is what the product runs):
  shm        worker groups on one node (runtime/weight_transport.py + shm_slots.py): the publisher
             (this process) gathers the policy (`TrainEngine.weight_buckets`, one rank: no
             all-gather) and writes it into its shared-memory slots, rewritten in place (`publish`
             with a `SlotRing`); a reader actor in another process maps each bucket (kept mapped),
             checks every tensor's fingerprint and copies it into its model (`receive` + `load_weights`).
  groups     worker groups across nodes: the same, with the buckets as numpy objects in Ray's
             object store (what `weight_sync.transport: object_store` runs).
  colocated  one process: the actor's buckets straight into the rollout's parameters (`sync_weights`).
  pickled    the path before issue 35: a dict of torch tensors through `ray.put` (pickled in band),
             `ray.get` (a deserialized copy), then `load_weights` (a third copy). The baseline.

Loads (shm and groups, HF reader; `weight_sync.load`): `copy` copies each checked view into the
model's own parameters; `map` makes the parameters the views themselves (the reader keeps the slot,
or the object, until the next version): one copy in all, the publisher's. `delta`
(`weight_sync.mode: delta`, load copy): between syncs the publisher's policy changes in
`DELTA_FRACTION` of each tensor's elements (3 %: the real model's bfloat16 updates change 2.1-4.9 %,
benchmarks/results/probe_weight_delta.json); the reader, holding the version before, reads only the
changes (`sent_mib`) and patches its own weights. GB/s and x memcpy count the policy's bytes.

The `135m` policy has SmolLM2-135M's shapes (Llama, 30 layers, hidden 576, tied embedding:
134.5M parameters, 513 MiB in float32), `59m` the 59M policy of the async bench; random init
(bandwidth does not depend on the values). `bfloat16` is what a bfloat16 rollout is sent
(`ActorWeights` casts to the rollout's dtype). Per cell: GB/s end to end (bytes / the sync's wall
seconds, publish + pull), x memcpy, each part's seconds, and the reader's private memory growth
(USS after the sync minus before the path's first: a copy held beyond the model shows here).
The first sync of each cell is a warm-up and is not counted (shm: the first of each of its
RING_SLOTS slots, whose pages it faults in; a run pays that once per slot).
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distflow_lab.core.config import RolloutOptions
from distflow_lab.experiments.bench.common import print_table, summarize, write_json
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import save_model_dir
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.tokenizer import build_char_tokenizer
from distflow_lab.observe.bandwidth import memcpy_gbps
from distflow_lab.runtime.cluster import connect
from distflow_lab.runtime.shm_slots import SlotReader, SlotRing
from distflow_lab.runtime.weight_transport import (DeltaBase, SyncReport, apply_delta, check_loaded, patch_targets,
                                                   publish, receive)
from distflow_lab.runtime.weights import ring_slots

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "135m": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M
    "59m": (640, 10, 10, 2, 1728, 32768),
    "tiny": (64, 2, 4, 2, 128, 260),
}
PATHS = ("shm", "groups", "colocated", "pickled")
LOADS = ("copy", "map", "delta")
DELTA_FRACTION = 0.03
RING_SLOTS = ring_slots(0)  # what a one_step_off run keeps
SYNC_TIMEOUT_S = 300.0  # one sync of the largest policy takes seconds; a hang is an error, never a wait


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    if name not in SHAPES:
        raise ValueError(f"model {name!r}: one of {sorted(SHAPES)}")
    h, layers, heads, kv, inter, vocab = SHAPES[name]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _private_mib() -> float:
    """This process's private memory (USS): what a sync adds beyond the object store's shared pages,
    which RSS would count in every process that maps them."""
    return psutil.Process().memory_full_info().uss / 2**20


@ray.remote(num_cpus=0)
class Reader:
    """A rollout worker's half, in its own process: an HF model, or a vLLM engine on the same
    checkpoint (`model_dir`, saved by the driver)."""

    def __init__(self, name: str, dtype: str, engine: str = "hf", model_dir: str | None = None) -> None:
        torch.set_num_threads(1)
        tok, opts = build_char_tokenizer(), RolloutOptions(n=1, engine=engine)
        if engine == "hf":
            self.rollout = HFRollout(build(name, getattr(torch, dtype)), tok, opts, 8)
        else:
            from distflow_lab.models.rollout_vllm import VLLMRollout

            self.rollout = VLLMRollout(model_dir, tok, opts, 8, dtype=dtype, seed=0, sleep_at_start=False)
        self.slots = SlotReader(0)
        self.mem0 = _private_mib()
        self.version = 0

    def next_path(self) -> None:
        """Memory growth counts from here; mappings of the last path's segments go."""
        self.slots.close()
        gc.collect()
        self.mem0, self.version = _private_mib(), 0

    def pull(self, manifest: Any, load: str = "copy") -> dict:
        report = SyncReport("pull", manifest.version, load=load)
        loaded: set[str] = set()
        t0 = time.perf_counter()
        if load == "delta" and manifest.delta is not None and manifest.delta.base == self.version:
            loaded = apply_delta(manifest, patch_targets(self.rollout.model), SYNC_TIMEOUT_S, report)
        else:
            tensors = receive(manifest, SYNC_TIMEOUT_S, report, self.slots, keep=load == "map")
            buckets = ([(n, t)] for n, t in tensors if not loaded.add(n))
            self.rollout.load_weights(buckets, bind=True) if load == "map" else self.rollout.load_weights(buckets)
        check_loaded(manifest, loaded)
        self.version = manifest.version
        row = report.row()
        row["wall_s"] = time.perf_counter() - t0
        row["load_s"] = row["wall_s"] - row["read_s"] - row["verify_s"]  # the copies into the model
        row["private_growth_mib"] = _private_mib() - self.mem0
        return row

    def pull_pickled(self, refs: list) -> dict:
        t0 = time.perf_counter()
        self.rollout.load_weights(ray.get(refs[0], timeout=SYNC_TIMEOUT_S))
        return {"wall_s": time.perf_counter() - t0, "private_growth_mib": _private_mib() - self.mem0}


def _groups(engine: TrainEngine, reader: Any, version: int, bucket_bytes: int, ring: SlotRing | None,
            load: str, delta: DeltaBase | None = None) -> dict:
    if delta is not None and version > 1:
        _change(engine.model, DELTA_FRACTION, seed=version)
    rep = SyncReport("publish", version)
    t0 = time.perf_counter()
    m = publish(engine.weight_buckets(bucket_bytes, device="cpu"), version, engine.tied_aliases(), report=rep,
                ring=ring, deadline_s=SYNC_TIMEOUT_S, delta=delta)
    pub = rep.row()
    pub_wall = time.perf_counter() - t0
    pull = ray.get(reader.pull.remote(m, load), timeout=SYNC_TIMEOUT_S)
    return {"bytes": m.nbytes, "sent": pull["bytes"], "wall_s": pub_wall + pull["wall_s"], "gather_s": pub["gather_s"],
            "write_s": pub["write_s"] + pub["delta_s"], "read_s": pull["read_s"],
            "verify_s": pub["verify_s"] + pull["verify_s"], "load_s": pull["load_s"],
            "private_growth_mib": pull["private_growth_mib"]}


@torch.no_grad()
def _change(model: torch.nn.Module, fraction: float, seed: int) -> None:
    """An update that changes `fraction` of each tensor's elements (at random positions)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        flat = p.view(-1)
        at = torch.randint(flat.numel(), (max(1, int(fraction * flat.numel())),), generator=g)
        flat[at] += (0.01 * torch.randn(at.numel(), generator=g)).to(p.dtype)


def _pickled(engine: TrainEngine, reader: Any) -> dict:
    t0 = time.perf_counter()
    refs = [ray.put(dict(engine.model.state_dict()))]
    write = time.perf_counter() - t0
    pull = ray.get(reader.pull_pickled.remote(refs), timeout=SYNC_TIMEOUT_S)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in engine.model.state_dict().values()}
    return {"bytes": sum(unique.values()), "wall_s": write + pull["wall_s"], "write_s": write,
            "private_growth_mib": pull["private_growth_mib"]}


def _colocated(engine: TrainEngine, rollout: HFRollout) -> dict:
    stats = {"bytes": 0, "tensors": 0}
    mem0 = _private_mib()
    t0 = time.perf_counter()
    rollout.load_weights(engine.weight_buckets(rollout.bucket_bytes, stats=stats))
    return {"bytes": stats["bytes"], "wall_s": time.perf_counter() - t0, "private_growth_mib": _private_mib() - mem0}


def cells(name: str, dtype: str, paths: list[str], repeats: int, bucket_mib: int, engine_name: str = "hf",
          workdir: Path | None = None, loads: tuple[str, ...] = ("copy",)) -> dict[tuple[str, str], list[dict]]:
    """(path, load) -> `repeats` syncs (after one warm-up) of one model and dtype; one reader process
    serves every path that needs one. vLLM: groups only (its colocated path is the same reload, in
    process), copy only (it processes what it loads)."""
    engine = TrainEngine(build(name, getattr(torch, dtype)), None, device="cpu", use_fsdp=False)
    model_dir = None
    if engine_name == "vllm":
        paths = [p for p in paths if p in ("shm", "groups")]
        model_dir = str((workdir or Path(tempfile.mkdtemp())) / f"{name}-{dtype}")
        save_model_dir(engine.model, build_char_tokenizer(), model_dir)
    reader = Reader.remote(name, dtype, engine_name, model_dir) if set(paths) - {"colocated"} else None
    rollout = HFRollout(build(name, getattr(torch, dtype)), build_char_tokenizer(), RolloutOptions(n=1), 8) \
        if "colocated" in paths else None
    out: dict[tuple[str, str], list[dict]] = {}
    cases = [(path, load) for path in paths
             for load in (loads if path in ("shm", "groups") and engine_name == "hf" else ("copy",))]
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}  # a delta case changes the policy
    for path, load in cases:
        out[path, load] = []
        if reader is not None:
            ray.get(reader.next_path.remote(), timeout=SYNC_TIMEOUT_S)
        ring = SlotRing(RING_SLOTS) if path == "shm" else None
        warmups = RING_SLOTS if ring is not None else 1  # each slot's pages are faulted in by its first write
        delta = DeltaBase() if load == "delta" else None
        engine.model.load_state_dict(original)
        for v in range(1, repeats + warmups + 1):
            if path in ("shm", "groups"):
                r = _groups(engine, reader, v, bucket_mib << 20, ring, load, delta)
            elif path == "pickled":
                r = _pickled(engine, reader)
            else:
                r = _colocated(engine, rollout)
            if v > warmups:
                out[path, load].append(r)
        if ring is not None:
            ring.close()
    if reader is not None:
        ray.kill(reader)
    return out


def run(models: list[str], dtypes: list[str], paths: list[str], repeats: int = 3, bucket_mib: int = 256,
        json_path: str | None = None, engines: tuple[str, ...] = ("hf",), loads: tuple[str, ...] = ("copy",)
        ) -> list[dict]:
    bad = sorted(set(paths) - set(PATHS))
    if bad:
        raise ValueError(f"paths {bad}: choose from {PATHS}")
    if set(loads) - set(LOADS) or not loads:
        raise ValueError(f"loads {list(loads)}: choose from {LOADS}")
    torch.set_num_threads(1)
    connect(num_cpus=4)
    memcpy = memcpy_gbps()
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    for engine_name, name, dtype in ((e, m, d) for e in engines for m in models for d in dtypes):
        for (path, load), syncs in cells(name, dtype, paths, repeats, bucket_mib, engine_name, workdir,
                                         tuple(loads)).items():
            nbytes = syncs[0]["bytes"]
            gbps = summarize([nbytes / s["wall_s"] / 1e9 for s in syncs])
            parts = {k: summarize([s[k] for s in syncs])["median"]
                     for k in ("gather_s", "write_s", "read_s", "verify_s", "load_s") if k in syncs[0]}
            records.append({"engine": engine_name, "model": name, "dtype": dtype, "path": path, "load": load,
                            "mib": nbytes / 2**20,
                            "sent_mib": summarize([s.get("sent", nbytes) / 2**20 for s in syncs])["median"],
                            "s_per_update": summarize([s["wall_s"] for s in syncs]),
                            "gbps": gbps, "x_memcpy": gbps["median"] / memcpy, "memcpy_gbps": memcpy, **parts,
                            "private_growth_mib": max(s["private_growth_mib"] for s in syncs)})
    rows = [{**r, "s_per_update": r["s_per_update"]["median"], "gbps_min": r["gbps"]["min"],
             "gbps_max": r["gbps"]["max"], "gbps": r["gbps"]["median"]} for r in records]
    shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, ["engine", "model", "dtype", "path", "load", "mib", "sent_mib", "s_per_update", "gbps",
                       "gbps_min", "gbps_max",
                       "x_memcpy", "write_s", "read_s", "verify_s", "load_s", "private_growth_mib"],
                title=f"weight sync, {repeats} syncs a cell (median; min/max GB/s); memcpy {memcpy:.2f} GB/s")
    write_json(records, json_path)
    return records
