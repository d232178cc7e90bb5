"""The chaos soak in the suite: 40 steps per data plane (sync) and per async-capable plane
(async), each with real faults drawn from a seeded plan (a worker or the process holding the
rollout engine exits, a DataBuffer, the coordinator or the WeightBoard is killed, a worker dies
halfway through a checkpoint, a weight sync's publisher damages a bucket or dies after writing one), recovered without help, and the books checked: nothing lost,
nothing trained twice, no raw exception, no hang, every fault detected; sync equals the
undisturbed run with the same seed, async keeps its staleness bound. Also: async resume
reproduces an undisturbed one-step-off run, and a checkpoint write killed halfway never loads."""
from __future__ import annotations

import json

import pytest

import distflow_lab as lab
from distflow_lab.core.errors import CheckpointError, SessionBroken, WorkerLost
from distflow_lab.experiments.soak import TIMING, soak
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.runtime import faults
from distflow_lab.runtime.checkpoint_files import latest_checkpoint, verify_checkpoint

# (mode, schedule, seed, partial rollouts): seeds whose plans strike every kind each plane has
# (see plan_faults: the plan is a function of the seed and the DAG, not of timing)
# (centralized-sync, seed 3: engine, worker, checkpoint, a subset of distributed-sync's kinds, cut for the
# 30-minute budget; a coordinator killed under sync: tests/test_reliability.py)
CELLS = [("distributed", "sync", 0, False),   # engine, worker, checkpoint, buffer
         ("coordinator", "async", 36, False),  # board, coordinator, a damaged weight bucket, a publisher killed mid-sync
         ("distributed", "async", 36, True)]   # board, buffer, the same two weight-sync faults; partial rollouts


@pytest.mark.full
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode,schedule,seed,partial", CELLS, ids=[f"{m}-{s}" for m, s, _, _ in CELLS])
def test_ci_soak(ray_cluster, mode, schedule, seed, partial):
    r = soak(mode, schedule, steps=40, fault_every=8, seed=seed, max_staleness=2, partial_rollout=partial,
             compare_undisturbed=schedule == "sync", progress=False)
    s = r.summary()
    assert s["faults"] >= 2 and s["detected"] == s["faults"], r
    assert r.resumes >= 1 and not r.stopped, r
    assert (r.items_lost, r.items_duplicated, len(r.raw_exceptions), r.hangs) == (0, 0, 0, 0), r.raw_exceptions
    assert r.items_trained == 40 * 8 * 4  # every update kept, each with all its rows
    assert all(f.error for f in r.faults if f.fired_at is not None)  # each surfaced as a named error or a retry
    if schedule == "sync":
        assert r.metrics_equal, r.metric_diffs
    else:
        assert r.staleness_ok and r.staleness_max <= 2
        assert {"board", "sync_corrupt", "sync_publisher"} <= set(s["by_kind"])
    assert r.ok


def _groups_dag():
    return synthetic_grpo(batch_size=8, n=4, max_prompt_len=32, max_response_len=32,
                          groups={"rollout": 1, "train": 1})


def _data(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not TIMING.search(k)}


@pytest.mark.full
@pytest.mark.timeout(240)
def test_one_step_off_resume_replays_the_batches_in_flight_and_equals_the_undisturbed_run(ray_cluster, tmp_path):
    opts = dict(world_size=2, mode="coordinator", schedule="one_step_off", stage_timeout_s=30)
    with lab.session(_groups_dag(), **opts) as s:
        undisturbed = [_data(s.step().metrics) for _ in range(7)]
    s = lab.session(_groups_dag(), **opts, fresh_workers=True)  # it kills a process
    try:
        for _ in range(3):
            s.step()
        ckpt = s.save_checkpoint(tmp_path / "step000003")
        state = json.loads((ckpt / "state.json").read_text())["schedule"]
        # the policy version, the batch generated ahead (from version 2) and that version's policy, kept
        assert state["policy_version"] == 3 and state["next_batch"] == 3
        assert state["in_flight"] == [{"batch_id": 3, "version": 2, "version_min": 2, "how": "replayed"}]
        assert (ckpt / "board" / "v000002.pt").is_file()
        s.step()
        faults.inject(s, "worker", 1, batch_id=4, stage="actor_update")  # the trainer dies in update 4
        with pytest.raises(WorkerLost, match="worker 1 died"):
            s.step()
        assert s.resume() == 3
        resumed = [_data(s.step().metrics) for _ in range(4)]
        assert resumed == undisturbed[3:]
        assert [m["schedule/rollout_version"] for m in resumed] == [2.0, 3.0, 4.0, 5.0]
    finally:
        s.close()


@pytest.mark.timeout(240)
def test_a_checkpoint_write_killed_halfway_never_loads_and_resume_takes_the_newest_complete(ray_cluster, tmp_path):
    dag = lambda: synthetic_grpo(batch_size=8, n=4, max_prompt_len=32, max_response_len=32, rollout_tp=2)  # noqa: E731
    with lab.session(dag(), world_size=2, mode="distributed") as s:
        undisturbed = [s.step().metrics for _ in range(4)]
    s = lab.session(dag(), world_size=2, mode="distributed", stage_timeout_s=30, fresh_workers=True)  # it kills
    try:
        root = tmp_path / "checkpoints"
        s.step()
        s.save_checkpoint(root / "step000001")
        s.step()
        faults.inject(s, "checkpoint", 1, batch_id=2)  # worker 1 exits after its engines, before its loader state
        with pytest.raises(WorkerLost, match="worker 1 died during stage 'save_checkpoint'"):
            s.save_checkpoint(root / "step000002")
        assert not (root / "step000002").exists()
        (partial,) = root.glob(".step000002.partial-*")  # what the write left: half a checkpoint
        assert any(p.is_file() for p in partial.rglob("*")) and not (partial / "manifest.json").exists()
        with pytest.raises(CheckpointError, match="no state.json|no manifest.json"):
            verify_checkpoint(partial)
        with pytest.raises(SessionBroken, match="resume"):
            s.step()  # broken until resume()
        assert latest_checkpoint(root) == root / "step000001"
        assert s.resume(latest_checkpoint(root)) == 1
        assert [s.step().metrics for _ in range(3)] == undisturbed[1:]
    finally:
        s.close()
