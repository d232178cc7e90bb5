"""The weight sync's transport (runtime/weight_transport.py) on real parts: a tiny Qwen2 policy
crosses Ray's object store, or the publisher's shared-memory slots (runtime/shm_slots.py), as
numpy buckets into an HF rollout in another process, tied weights travel once, every tensor is
checked, and each way a sync can go wrong is a named error: a damaged bucket or a missing tensor
(WeightSyncMismatch), a bucket that never arrives, whose publisher died, or whose slot was
rewritten, and a reader that never lets go of a slot (WeightSyncTimeout, within the deadline). The vLLM reader: tests/test_vllm.py.
A whole run on worker groups checks what the rollout holds against what was published
(tests/test_schedules.py)."""
from __future__ import annotations

import copy
import time

import pandas as pd
import pytest
import ray
import torch

from distflow_lab.core.config import RolloutOptions, TinySpec
from distflow_lab.core.errors import WeightSyncMismatch, WeightSyncTimeout
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.tokenizer import build_char_tokenizer
from distflow_lab.runtime.shm_slots import SlotReader, SlotRing
from distflow_lab.runtime.weight_transport import (DeltaBase, Manifest, SyncReport, apply_delta, check_loaded,
                                                   fingerprint, patch_targets, publish, read_state, receive)

CARRIERS = ("object_store", "shm")


@pytest.fixture(scope="module")
def policy():
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, TinySpec(), seed=3)
    with torch.no_grad():  # a trained policy: every tensor differs from a fresh init's
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return TrainEngine(model, None, device="cpu", use_fsdp=False), tok


def _publish(engine: TrainEngine, version: int = 1, bucket_bytes: int = 1 << 16, **kw) -> Manifest:
    return publish(engine.weight_buckets(bucket_bytes, device="cpu"), version, engine.tied_aliases(), **kw)


@ray.remote(num_cpus=0)
class Reader:
    """A rollout worker's half, in its own process: a fresh HF model of the same shape."""

    def __init__(self) -> None:
        tok = build_char_tokenizer()
        self.rollout = HFRollout(build_tiny_qwen2(tok, TinySpec(), seed=9), tok, RolloutOptions(n=1), 8)

    def pull(self, manifest: Manifest, deadline_s: float = 30.0) -> dict:
        report = SyncReport("pull", manifest.version)
        loaded = self.rollout.load_weights([pair] for pair in receive(manifest, deadline_s, report))
        check_loaded(manifest, loaded)
        return {"state": {k: v.clone() for k, v in self.rollout.model.state_dict().items()}, "report": report.row()}


@ray.remote(num_cpus=0)
class Publisher:
    def publish(self, seed: int, carrier: str) -> Manifest:
        tok = build_char_tokenizer()
        engine = TrainEngine(build_tiny_qwen2(tok, TinySpec(), seed=seed), None, device="cpu", use_fsdp=False)
        self.ring = SlotRing(2) if carrier == "shm" else None  # the ring lives (and dies) with this process
        return _publish(engine, bucket_bytes=1 << 20, ring=self.ring)  # objects above Ray's inline size


@pytest.fixture(params=CARRIERS)
def ring(request):
    """None: the object store; a SlotRing: the publisher's shared memory (closed after the test)."""
    if request.param == "object_store":
        yield None
        return
    r = SlotRing(3)
    yield r
    r.close()


def test_a_policy_crosses_checked_with_tied_weights_sent_once(ray_cluster, policy, ring):
    engine, _ = policy
    report = SyncReport("publish", 1)
    m = _publish(engine, report=report, ring=ring)
    state = engine.model.state_dict()
    tied = engine.tied_aliases()
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}  # the tiny Qwen2 ties them, like SmolLM2
    assert m.names == set(state) and set(m.aliases) == set(tied)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in state.values()}
    assert m.nbytes == sum(unique.values()) < sum(t.numel() * t.element_size() for t in state.values())
    assert len(m.buckets) > 1 and report.row()["buckets"] == len(m.buckets)  # bounded buckets, each its own object
    reader = Reader.remote()
    got = ray.get(reader.pull.remote(m), timeout=120)
    assert all(torch.equal(got["state"][k], v) for k, v in state.items())  # bit for bit, every name
    row = got["report"]
    assert row["transport"] == report.transport == ("shm" if ring is not None else "object_store")
    assert row["bytes"] == m.nbytes and row["tensors"] == len(m.entries) and row["read_s"] > 0
    assert m.checksum == pytest.approx(sum(fingerprint(state[e.name]) for e in m.entries))
    assert set(read_state(m)) == set(state)  # a checkpoint of the board reads the same policy back
    ray.kill(reader)


def test_a_damaged_bucket_or_a_missing_tensor_is_a_named_mismatch(ray_cluster, policy, ring):
    engine, _ = policy
    m = _publish(engine, version=4, corrupt=0, ring=ring)  # the publisher damages its first bucket after fingerprinting it
    first = m.entries[0].name
    with pytest.raises(WeightSyncMismatch, match=rf"policy v4: tensor '{first}': fingerprint .* != published"):
        ray.get(Reader.remote().pull.remote(m), timeout=120)
    whole = _publish(engine, version=5, ring=ring)
    short = Manifest(5, whole.entries[:-1], whole.buckets, whole.aliases, whole.nbytes)  # one tensor never sent
    with pytest.raises(WeightSyncMismatch, match=rf"policy v5: tensor '{whole.entries[-1].name}': not loaded"):
        check_loaded(whole, {name for name, _ in receive(short, 30.0)})
    rollout = HFRollout(copy.deepcopy(engine.model), build_char_tokenizer(), RolloutOptions(n=1), 8)
    with pytest.raises(WeightSyncMismatch, match="the sync covered"):  # the HF engine refuses a partial load itself
        rollout.load_weights([pair] for pair in receive(short, 30.0))


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_bucket_that_never_arrives_or_whose_publisher_died_is_a_timeout_within_the_deadline(ray_cluster, policy,
                                                                                               carrier):
    engine, _ = policy
    if carrier == "object_store":  # an object that is never produced (a slot is written before it is announced)
        never = ray.remote(num_cpus=0)(lambda: time.sleep(60)).remote()
        m = Manifest(2, _publish(engine).entries[:1], (never,), {}, 0)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match=r"policy v2: bucket 1 of 1 did not arrive within"):
            list(receive(m, deadline_s=1.0))
        assert time.monotonic() - t0 < 10
        ray.cancel(never, force=True)
    pub = Publisher.remote()
    lost = ray.get(pub.publish.remote(seed=4, carrier=carrier), timeout=120)
    ray.kill(pub)  # the owner of the buckets dies: its objects (or its segments) go with it
    # On one node Ray may still serve the dead owner's objects from shared memory, and a segment lives until
    # the dead process's resource tracker unlinks it (then every tensor is checked and the policy is whole),
    # or they are reported lost: either way a named outcome within the deadline, never a raw error or a hang.
    t0 = time.monotonic()
    try:
        got = dict(receive(lost, deadline_s=20.0))
        assert set(got) == lost.names
    except WeightSyncTimeout as e:
        assert "the worker that published it died" in str(e)
    assert time.monotonic() - t0 < 25


def test_a_rewritten_slot_and_a_reader_that_never_lets_go_are_named_timeouts(policy):
    """The slot protocol itself (one process, no Ray): a version whose slot the publisher has
    since rewritten is refused by name, the publisher waits for a reader in its slot only until
    the deadline, naming the reader, and a reader keeps only the newest publisher's segments mapped."""
    engine, _ = policy
    ring = SlotRing(2)
    try:
        old = _publish(engine, version=1, ring=ring)
        _publish(engine, version=2, ring=ring)
        _publish(engine, version=3, ring=ring)  # slot 1 again: v1 is gone
        with pytest.raises(WeightSyncTimeout, match=r"policy v1: slot 1 now holds v3 .* moved past it"):
            list(receive(old, 5.0, reader=SlotReader(7)))
        reader = SlotReader(5)
        held = _publish(engine, version=4, ring=ring)
        reader.read_bucket(4, held.buckets[0])  # reads v4 and never says done (a reader stuck mid-copy)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match=r"policy v6: reader 5 still reads policy v4 from slot 0"):
            _publish(engine, version=6, ring=ring, deadline_s=0.5)
        assert time.monotonic() - t0 < 5
        reader.done(held.buckets[0].control)
        _publish(engine, version=6, ring=ring, deadline_s=0.5)  # let go: the slot is the publisher's again
    finally:
        ring.close()
    successor = SlotRing(2)  # a new publisher (a restart, a new plan): the reader lets go of the old one's pages
    try:
        assert any(name.startswith(ring.prefix) for name in reader.maps)
        m = _publish(engine, version=7, ring=successor)
        assert set(dict(receive(m, 5.0, reader=reader))) == m.names
        assert reader.maps and all(name.startswith(successor.prefix) for name in reader.maps)
    finally:
        successor.close()


def test_a_mapped_rollout_computes_from_the_slot_it_keeps_until_the_next_version(policy):
    """weight_sync.load "map": the HF rollout's parameters become the slot's views (tied weights
    stay one parameter), the slot is held while the rollout computes from it and let go when it
    keeps the next version, and a reader that died holding one is cleared by its successor."""
    import numpy as np

    engine, tok = policy
    ring = SlotRing(2)
    try:
        rollout = HFRollout(build_tiny_qwen2(tok, TinySpec(), seed=9), tok, RolloutOptions(n=1), 8)
        reader = SlotReader(3)

        def load(m: Manifest) -> None:
            check_loaded(m, rollout.load_weights(([p] for p in receive(m, 5.0, reader=reader, keep=True)), bind=True))

        v1, v2 = _publish(engine, version=1, ring=ring), _publish(engine, version=2, ring=ring)
        load(v1)
        state = engine.model.state_dict()
        assert all(torch.equal(rollout.model.state_dict()[k], v) for k, v in state.items())
        segments = [(a := np.frombuffer(seg.buf, np.uint8).ctypes.data, a + seg.size) for seg in reader.maps.values()]
        ptrs = [p.data_ptr() for p in rollout.model.parameters()]
        assert all(any(lo <= ptr < hi for lo, hi in segments) for ptr in ptrs)  # no copy: views of the slot
        assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight
        with pytest.raises(WeightSyncTimeout, match=r"policy v3: reader 3 still reads policy v1 from slot 1"):
            _publish(engine, version=3, ring=ring, deadline_s=0.3)  # v1's slot: the rollout computes from it
        load(v2)
        v3 = _publish(engine, version=3, ring=ring, deadline_s=0.3)  # let go of v1 on keeping v2
        reborn = SlotReader(3)  # rank 3 died holding v2 (slot 0); its successor's first read clears the mark
        assert set(dict(receive(v3, 5.0, reader=reborn))) == v3.names
        _publish(engine, version=4, ring=ring, deadline_s=0.3)
    finally:
        ring.close()


def test_a_delta_carries_only_what_changed_and_a_reader_off_its_base_is_caught(ray_cluster, policy):
    """weight_sync.mode "delta": a version also carries the elements that changed since the one
    before (a tensor whose change is bigger than itself goes whole, an unchanged one not at all);
    patched into the reader's own tensors it is the new version bit for bit, and a reader that did
    not hold the base fails the fingerprints by name."""
    engine, tok = policy
    model = copy.deepcopy(engine.model).to(torch.bfloat16)  # what a bfloat16 rollout is sent
    trainer, base = TrainEngine(model, None, device="cpu", use_fsdp=False), DeltaBase()
    first = _publish(trainer, version=1, delta=base)
    assert first.delta is None  # nothing to compare with yet: full only
    reader = copy.deepcopy(model)
    names = {p: n for n, p in model.named_parameters()}
    embed, whole = list(model.parameters())[:2]
    with torch.no_grad():
        embed.view(-1)[::100] += 1.0  # 1 % of the embedding: its positions and values
        whole.add_(1.0)  # every element: the tensor goes whole
    m = _publish(trainer, version=2, delta=base)
    counts = {d.name: d.count for d in m.delta.entries}
    assert m.delta.base == 1 and counts == {names[embed]: -(-embed.numel() // 100), names[whole]: -1}, counts
    assert m.delta.nbytes < m.nbytes / 10
    assert apply_delta(m, patch_targets(reader), 30.0) == m.names
    assert all(torch.equal(reader.state_dict()[k], v) for k, v in model.state_dict().items())  # bit for bit
    same = _publish(trainer, version=3, delta=base)
    assert same.delta.entries == () and same.delta.nbytes == 0  # nothing changed, nothing sent
    stranger = build_tiny_qwen2(tok, TinySpec(), seed=4).to(torch.bfloat16)
    off_base = r"policy v2: .* after the delta from v1: .* \(did the reader hold v1\?\)"
    with pytest.raises(WeightSyncMismatch, match=off_base):
        apply_delta(m, patch_targets(stranger), 30.0)


@pytest.mark.budget(30, reason="two 3-step sessions on worker groups: full and delta")
def test_groups_send_the_policy_in_the_rollouts_dtype_and_every_sync_is_a_row(ray_cluster, tmp_path):
    """A real GRPO run on worker groups with a bfloat16 rollout beside a float32 trainer: the policy
    travels in bfloat16 (what the rollout holds anyway: half the bytes), tied embedding once, and
    s.weight_sync() has each sync's publish and pull with their parts. The same run with
    weight_sync.mode "delta" patches the rollout from the version it holds and trains the same
    policy to the bit: the same metrics, step by step."""
    from distflow_lab.api.runner import load_run_config, open_session

    def run(mode: str) -> tuple[list[dict], "pd.DataFrame"]:
        cfg = load_run_config("tiny-cpu-grpo", [f"trainer.out_dir={tmp_path}/{mode}", "model.warm_start.steps=0",
                                                "cluster.world_size=2", "data.prompts_per_step=2", "rollout.n=4",
                                                "rollout.log_probs=true", "rollout.dtype=bfloat16",
                                                "groups={rollout: 1, train: 1}", "actor.entropy_coeff=0.01",
                                                f"weight_sync.mode={mode}"])
        with open_session(cfg, progress=False) as s:
            return [s.step().metrics for _ in range(3)], s.weight_sync()

    m, syncs = run("full")
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, TinySpec(), seed=0)
    bf16 = sum(t.numel() * 2 for name, t in model.state_dict().items() if name != "lm_head.weight")  # tied: once
    pub, pull = syncs[syncs.side == "publish"], syncs[syncs.side == "pull"]
    assert len(pub) == 3 and (pub.bytes == bf16).all(), (pub.bytes.tolist(), bf16)
    assert len(pull) >= 2 and (pull.bytes == bf16).all() and (pull.load_s > 0).all()
    assert set(syncs.transport) == {"shm"}  # one node: the publisher's shared memory (weight_sync.transport auto)
    assert set(pull.load) == {"map"}  # an HF rollout computes from the slot (weight_sync.load auto)
    assert m[0]["rollout/logprob_diff_max"] > 1e-4  # a real bf16 rollout against the fp32 trainer

    md, dsyncs = run("delta")
    dpull = dsyncs[dsyncs.side == "pull"]
    assert dpull["mode"].tolist() == ["full"] + ["delta"] * (len(dpull) - 1) and len(dpull) >= 2  # v1: no base yet
    assert set(dpull.load) == {"copy"} and (dpull.transport.iloc[1:] == "object_store").all()
    learned = [k for k in m[0] if k.startswith(("reward/", "actor/", "rollout/logprob"))]
    assert learned and all(a[k] == b[k] for a, b in zip(m, md) for k in learned)


def test_bench_weight_sync_reports_every_path_against_memcpy(ray_cluster, tmp_path):
    import json

    from distflow_lab.experiments.bench import weight_sync

    out, f32_out = tmp_path / "ws.json", tmp_path / "ws32.json"  # every path and load in bfloat16, one in float32
    weight_sync.run(["tiny"], ["bfloat16"], list(weight_sync.PATHS), repeats=1, json_path=str(out),
                    loads=weight_sync.LOADS)
    weight_sync.run(["tiny"], ["float32"], ["groups"], repeats=1, json_path=str(f32_out))
    rows = json.loads(out.read_text())
    assert {(r["path"], r["load"]) for r in rows} == {
        (p, load) for p in weight_sync.PATHS for load in (weight_sync.LOADS if p in ("shm", "groups") else ("copy",))}
    for r in rows:
        assert r["gbps"]["median"] > 0 and r["x_memcpy"] > 0 and r["memcpy_gbps"] > 0, r
    deltas = [r for r in rows if r["load"] == "delta"]  # 3 % of each tensor changed: positions and values go
    assert deltas and all(r["sent_mib"] < r["mib"] / 2 for r in deltas), [(r["sent_mib"], r["mib"]) for r in deltas]
    groups = [r for r in rows if r["path"] == "groups"]
    assert all(r["write_s"] > 0 and r["load_s"] > 0 for r in groups)
    b16, f32 = groups[0]["mib"], json.loads(f32_out.read_text())[0]["mib"]
    assert b16 == pytest.approx(f32 / 2)
    with pytest.raises(ValueError, match="paths \\['nvlink'\\]"):
        weight_sync.run(["tiny"], ["float32"], ["nvlink"])
