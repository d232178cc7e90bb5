"""The schedules on worker groups, with real Ray workers: async with k=0 is the
synchronous schedule, no trained sample is staler than k, the published and the
pulled weights are the same, every generated sample is trained once or dropped
and counted, one-step-off learns, and a killed rollout worker is a named error.
Nothing hangs: a segment's deadline is the sum of its stages' timeouts, and a policy
that never advances is a named error (on Lanes alone, then on real workers)."""
from __future__ import annotations

import time

import pytest

import distflow_lab as lab
from distflow_lab.api.runner import load_run_config, train
from distflow_lab.core.config import SCHEDULES, ScheduleOptions
from distflow_lab.core.errors import ConfigError, PolicyNotPublished, SessionBroken, StaleBatches, WorkerLost
from distflow_lab.dataplane.interface import EndOfBatch
from distflow_lab.runtime import faults
from distflow_lab.runtime.schedule import Dispatch, ScheduleSetup
from distflow_lab.runtime.schedule_lanes import Lanes

GROUPS = {"rollout": 2, "train": 2}


def dag(**kw):
    """Long-tailed responses, batched decoding at 200 us per token, training at 10 us per token."""
    return lab.synthetic_grpo(batch_size=8, n=4, max_prompt_len=32, max_response_len=256, groups=GROUPS,
                              decode_us=200, us_per_token=10, response_len_mean=16, response_len_sigma=1.0, **kw)


def test_async_with_k0_is_the_synchronous_schedule(ray_cluster):
    runs = {}
    s = lab.session(dag(), world_size=4, mode="coordinator")
    try:
        runs["sync"] = s.run(4, progress=False)
        s.reopen(schedule="async", max_staleness=0)
        runs["async0"] = s.run(4, progress=False)
    finally:
        s.close()
    same = ["reward/mean", "actor/tokens", "actor/adv_mean", "schedule/staleness", "schedule/policy_version"]
    assert runs["sync"][same].equals(runs["async0"][same])
    assert (runs["async0"]["schedule/staleness"] == 0).all()


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_no_trained_sample_is_staler_than_k(ray_cluster, partial):
    # With partial rollouts k = 2: at k = 1 a sequence a call leaves over is too old for the next call
    # (dropped); at k = 2 the next call returns it, one version older than its own.
    k = 2 if partial else 1
    s = lab.session(dag(), world_size=4, mode="distributed", schedule="async", max_staleness=k,
                    partial_rollout=partial)
    try:
        m = s.run(8, progress=False)
        items = s.items()
    finally:
        s.close()
    trained = items[items["stage"] == "old_log_prob"]  # every row that entered training, with its version tag
    assert len(trained) and (trained["version"] >= 0).all()
    assert ((trained["update"] - trained["version"]) <= k).all()
    assert (m["schedule/staleness"] <= k).all() and m["schedule/staleness"].max() >= 1  # it did run ahead
    if partial:  # a call leaves half its slots' sequences over; later calls return them, k versions old
        assert ((trained["update"] - trained["version"]) == k).any()


def test_the_version_a_sync_claims_is_the_version_the_rollout_holds(ray_cluster):
    s = lab.session(dag(weight_mib=2.0), world_size=4, mode="coordinator", schedule="one_step_off")
    try:
        m = s.run(6, progress=False)
        spans = s.spans
        syncs = s.weight_sync()
    finally:
        s.close()
    published = dict(zip(m["schedule/policy_version"], m["schedule/published_checksum"]))
    pulled = m[m["schedule/rollout_version"] >= 1]
    assert len(pulled) >= 4
    for v, checksum in zip(pulled["schedule/rollout_version"], pulled["schedule/rollout_checksum"]):
        assert checksum == pytest.approx(published[v]), v  # the rollout holds what was published as v
    sync = spans[spans.phase == "weight_sync"]
    assert set(sync.worker) == {0, 1, 2, 3}  # both training ranks export (a collective), both rollout ranks pull
    moved = sync[sync.bytes > 0]
    assert set(moved.worker) == {0, 1, 2} and (moved.bytes == 2 * 2**20).all()  # one rank publishes 2 MiB
    # s.weight_sync(): one row per sync and side, its parts timed, against this machine's memcpy
    pub, pull = syncs[syncs.side == "publish"], syncs[syncs.side == "pull"]
    assert set(pub.worker) == {2} and set(pull.worker) == {0, 1} and (syncs.bytes == 2 * 2**20).all()
    assert len(pub) == 6 and (pub.write_s > 0).all() and (pull.read_s > 0).all() and (pull.load_s > 0).all()
    assert set(pull.version) <= set(pub.version) and (syncs.x_memcpy > 0).all()


def test_every_sample_is_trained_once_or_dropped_and_counted(ray_cluster):
    """k=0 with partial rollouts: sequences still decoding when the policy moves on are too stale;
    whole batches that carry such tokens are dropped at the gate, and counted."""
    s = lab.session(dag(), world_size=4, mode="coordinator", schedule="async", max_staleness=0,
                    partial_rollout=True)
    try:
        m = s.run(6, progress=False)
        ledger = s.ledger()
    finally:
        s.close()
    moved = ledger[ledger["edge"] == "advantage->old_log_prob"]
    assert (moved["items_in"] == moved["items_out"] + moved["items_dropped"]).all()  # nothing lost
    assert ((moved["items_out"] == 0) | (moved["items_dropped"] == 0)).all()  # never both
    assert moved["items_out"].sum() == 6 * 32  # six updates of 32 rows
    dropped = m["rollout/stale_dropped"].sum() if "rollout/stale_dropped" in m else 0
    assert dropped + moved["items_dropped"].sum() > 0  # the partial rollouts did go stale, and were counted


def test_schedule_errors_name_the_schedule_and_the_mode(ray_cluster):
    with pytest.raises(ConfigError, match=r"schedule 'async' needs the coordinator or distributed data plane; "
                                          r"mode 'centralized'"):
        lab.session(dag(), world_size=4, mode="centralized", schedule="async")
    with pytest.raises(ConfigError, match=r"schedule 'one_step_off' needs a DAG on two worker groups"):
        lab.session(lab.synthetic_grpo(batch_size=8), world_size=4, schedule="one_step_off")
    with pytest.raises(ConfigError, match=r"max_staleness has no meaning for schedule 'one_step_off'"):
        lab.session(dag(), world_size=4, schedule="one_step_off", max_staleness=3)


@pytest.mark.timeout(240)
def test_a_killed_rollout_worker_is_a_named_error_and_nothing_hangs(ray_cluster):
    s = lab.session(dag(), world_size=4, mode="distributed", schedule="async", max_staleness=2,
                    fresh_workers=True)  # it kills a process
    try:
        s.run(2, progress=False)
        faults.inject(s, "worker", 1, batch_id=4, stage="rollout")
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker 1 died"):
            s.run(6, progress=False)
        assert time.monotonic() - t0 < 60  # detected, not waited out
        with pytest.raises(SessionBroken, match="resume"):
            s.step()
    finally:
        s.close()


@pytest.mark.full
@pytest.mark.budget(60, reason="a learning curve: 150 updates")
def test_one_step_off_learns_the_arithmetic_task(ray_cluster, tmp_path_factory, grpo_model):
    d = tmp_path_factory.mktemp("schedules")
    cfg = load_run_config("tiny-cpu-grpo", ["groups={rollout: 1, train: 1}", "schedule.kind=one_step_off",
                                            "mode=coordinator", "trainer.steps=150"])
    m = train(cfg, out=d / "out", progress=False, echo=False)
    reward = m["reward/mean"]
    assert reward[-20:].mean() >= reward[:20].mean() + 0.05, (reward[:20].mean(), reward[-20:].mean())
    assert (m["schedule/staleness"].iloc[2:] == 1).all()  # one step off, every step after the first


# ---- a schedule is one file and one row ----------------------------------------------------


def test_a_schedule_is_one_file_and_one_row(ray_cluster):
    """tests/example_schedule.py (sync with a delay: a row and a class) runs through the
    controller like the built-in ones: the same metrics as sync, its own metric, its state in a
    checkpoint, and the row's facts read by the config checks."""
    from distflow_lab.runtime.schedule import RUNNERS
    from tests import example_schedule  # noqa: F401  (its row and its class register themselves)

    try:
        runs = {}
        s = lab.session(lab.synthetic_grpo(batch_size=8, n=2, max_response_len=16), world_size=2, mode="coordinator")
        try:
            runs["sync"] = s.run(3, progress=False)
            s.reopen(schedule="sync_delayed")
            runs["delayed"] = s.run(3, progress=False)
            state = s.controller.schedule.state()
        finally:
            s.close()
        same = ["reward/mean", "actor/tokens", "actor/adv_mean"]
        assert runs["sync"][same].equals(runs["delayed"][same])
        assert runs["delayed"]["schedule/waited_s"].iloc[1:].gt(0).all()  # it did wait between updates
        assert state == {"kind": "sync_delayed", "next_batch": 3, "keep_versions": []}
        with pytest.raises(ValueError, match="partial_rollout has no meaning for schedule 'sync_delayed'"):
            ScheduleOptions(kind="sync_delayed", partial_rollout=True)
    finally:
        SCHEDULES.pop("sync_delayed"), RUNNERS.pop("sync_delayed")


# ---- nothing loops forever ---------------------------------------------------------------


class InstantWorkers:
    """A Dispatch for Lanes without workers or Ray: every segment call answers at once (a "ref" is
    its answer).
    The trainers `bump` the policy version each update (True), hold a policy they never
    advance (False), or have no weights engine (None); generation pulls what was published."""

    def __init__(self, bump: bool | None) -> None:
        self.bump, self.version, self.published, self.aborted = bump, 0, 0, []

    def call(self, method: str, workers: list[int], args: tuple) -> list:
        if method == "generate_segment":
            v = self.published
            answer = {"results": [], "version": v, "version_min": v, "checksum": 0.0}
        else:
            before = self.version if self.bump is not None else None
            self.version += bool(self.bump)
            self.published = self.version
            answer = {"results": [], "version": self.version if self.bump is not None else None,
                      "version_before": before, "checksum": 0.0}
        return [dict(answer) for _ in workers]

    def dispatch(self, timeouts: dict[str, float] | None = None) -> Dispatch:
        return Dispatch(call=self.call, gather=lambda refs, step, stage, limit, workers: refs,
                        wait=lambda refs, n, timeout: (list(refs), []), failed=lambda done: False,
                        now=time.monotonic, abort=lambda step, reason: self.aborted.append(step),
                        end_batch=lambda batch_id: EndOfBatch(0.0, []),
                        timeout=lambda st: (timeouts or {}).get(st.id, 30.0))


def lanes(workers: InstantWorkers, kind: str = "one_step_off", timeouts: dict[str, float] | None = None) -> Lanes:
    options = ScheduleOptions(kind=kind)
    return Lanes(ScheduleSetup(dag().plan(4), "coordinator", options, workers.dispatch(timeouts), None, 0))


def test_a_checkpoint_from_before_the_batch_update_rename_still_loads():
    """Lanes' state once named the in-flight batch "batch"; now "batch_id". An old checkpoint's
    batch in flight is still generated again first, at the version it came from."""
    old = {"next_batch": 3, "dropped_batches": 0, "keep_versions": [2],
           "in_flight": [{"batch": 3, "version": 2, "version_min": 2, "how": "replayed"}]}
    setup = ScheduleSetup(dag().plan(4), "coordinator", ScheduleOptions(kind="one_step_off"),
                          InstantWorkers(bump=True).dispatch(), None, 3, old)
    ln = Lanes(setup)
    assert ln.replay == {3: 2} and ln.next_batch == 3


def test_a_segment_deadline_is_the_sum_of_its_stage_timeouts():
    timeouts = {"data": 1.0, "rollout": 20.0, "reward": 3.0, "advantage": 4.0, "old_log_prob": 50.0,
                "ref_log_prob": 60.0, "actor_update": 70.0}
    ln = lanes(InstantWorkers(bump=True), timeouts=timeouts)
    ln._launch()  # nothing ready yet: one generation starts
    assert ln.gen.deadline - ln.gen.started == pytest.approx(1 + 20 + 3 + 4)  # data, rollout, reward, advantage
    ln._wait()  # it answers at once: its batch is ready
    ln._launch()
    assert ln.train.deadline - ln.train.started == pytest.approx(50 + 60 + 70)  # old_log_prob, ref_log_prob, update


def test_lanes_count_one_update_per_step_when_the_policy_advances():
    ln = lanes(InstantWorkers(bump=True))
    reports = [ln.step() for _ in range(4)]
    assert [r.update for r in reports] == [0, 1, 2, 3]
    assert [r.metrics["schedule/policy_version"] for r in reports] == [1, 2, 3, 4]
    assert all(r.metrics["schedule/staleness"] <= 1 for r in reports)


def test_lanes_raise_when_an_update_does_not_advance_the_policy():
    ln = lanes(InstantWorkers(bump=False))
    with pytest.raises(PolicyNotPublished, match=r"training update 0 \(batch 0\) left the policy at version 0 on "
                                                 r"worker 2; update 0 must leave it at version 1.*'actor_update'"):
        ln.step()
    assert ln.gen is None and ln.train is None  # nothing left in flight
    assert ln.updates == 0  # the update is not counted


def test_lanes_bound_the_batches_dropped_in_a_row():
    """No weights engine on the trainers: the version never moves, so after k updates every
    batch is too stale. Dropping them would go on for ever: it stops after max(2, k + 1)."""
    ln = lanes(InstantWorkers(bump=None), kind="one_step_off")  # k = 1
    with pytest.raises(StaleBatches, match=r"dropped 3 batches in a row as too stale.*policy version 0.*update 2.*"
                                           r"the policy version is not advancing"):
        for _ in range(10):
            ln.step()
    assert ln.updates == 2
    assert [r["batch_id"] for r in ln.take_ledger()] == [2, 3, 4]  # every dropped batch is in the ledger


@pytest.mark.timeout(180)
@pytest.mark.parametrize("publishes", ["never_advances", pytest.param("no_weights", marks=pytest.mark.full)])
def test_a_policy_that_never_advances_is_a_named_error_not_a_hang(ray_cluster, publishes):
    """An actor-update stage that forgets to advance the policy version: the first update is
    PolicyNotPublished, and with no weights engine at all the stale batches are StaleBatches;
    either way quickly, and the session is broken until resume()."""
    def never_advances(batch, ctx):
        from distflow_lab.experiments.synthetic import policy

        policy(ctx)  # the trainers hold the policy, but this update leaves its version where it was
        return batch

    def no_weights(batch, ctx):
        return batch

    fn, error = {"never_advances": (never_advances, PolicyNotPublished),
                 "no_weights": (no_weights, StaleBatches)}[publishes]
    s = lab.session(dag().replace("actor_update", fn=fn), world_size=4, mode="coordinator", schedule="async",
                    max_staleness=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(error):
            s.run(10, progress=False)
        assert time.monotonic() - t0 < 60
        with pytest.raises(SessionBroken, match=rf"{error.__name__}.*resume"):
            s.step()
        if error is StaleBatches:
            moved = s.ledger()
            assert moved["items_dropped"].sum() == 3 * 32  # the dropped batches are counted
    finally:
        s.close()
