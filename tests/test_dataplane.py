"""The data planes on a real Ray cluster: local-cache hits with equal layouts,
DataBuffer or coordinator redistribution when layouts change (counts
conserved, every item exactly once), load balancing, all three modes giving
identical stage outputs, and which modes move payloads through the driver."""
from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

import distflow_lab as lab
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ConfigError
from distflow_lab.dataplane.partition import load_stats
from distflow_lab.experiments.synthetic import synthetic_grpo

W = 4
MODES = ("distributed", "coordinator", "centralized")


def dag(max_len: int = 64, batch: int = 8, tp: int = 2):
    return synthetic_grpo(batch_size=batch, n=4, max_prompt_len=max_len, max_response_len=max_len, rollout_tp=tp,
                          response_len_sigma=1.0)


@pytest.fixture(scope="class")
def sessions(ray_cluster):
    """One session per mode over the same DAG, 2 steps each."""
    opened = {m: lab.session(dag(), world_size=W, mode=m, cpus_per_worker=0.5) for m in MODES}  # 12 workers, 8 CPUs
    reports = {m: s.controller.run(2, progress=False) for m, s in opened.items()}
    yield opened, reports
    for s in opened.values():
        s.close()


def all_rows(session, stage: str) -> list[Batch]:
    """Every worker's full output of `stage` (tests only: payloads travel)."""
    return [session.output(stage, worker=w) for w in range(W)]


class TestSharedSessions:
    """Tests that share one session per mode."""

    def test_routes_cache_hits_and_one_redistribution(self, sessions):
        opened, reports = sessions
        for mode, plane_route in (("distributed", "buffer"), ("coordinator", "coordinator")):
            step = reports[mode][-1]
            routes = {s.stage_id: {r.route_in for r in s.results} for s in step.stages}
            assert routes == {"data": {"loader"}, "rollout": {"cache"}, "reward": {"cache"}, "advantage": {"cache"},
                              "old_log_prob": {plane_route}, "ref_log_prob": {"cache"}, "actor_update": {"cache"}}
            assert sum(r.cache_hit is True for s in step.stages for r in s.results) == 5 * W
            assert set(opened[mode].ledger()["edge"]) == {"advantage->old_log_prob"}  # local edges stay local
        central = reports["centralized"][-1]
        assert {r.route_in for s in central.stages[1:] for r in s.results} == {"driver"}

    @pytest.mark.parametrize("mode", MODES)
    def test_counts_conserved_and_items_exactly_once(self, sessions, mode):
        s = sessions[0][mode]
        ledger = s.ledger()
        rows = 8 * 4  # prompts x responses
        moved = ledger[ledger["edge"] == "advantage->old_log_prob"]
        assert len(moved) == 2 and (moved["items_reported"] == rows).all()
        assert (moved["items_in"] == rows).all() and (moved["items_out"] == rows).all()
        # every (uid, response) row that left advantage arrives at old_log_prob exactly once
        before = [b for w, b in enumerate(all_rows(s, "advantage")) if w % 2 == 0]  # tp rank 0 of each group
        after = all_rows(s, "old_log_prob")
        key = lambda b: sorted(zip(b["uid"].tolist(), b["responses"][:, :8].tolist()))  # noqa: E731
        assert sorted(sum((key(b) for b in before), [])) == sorted(sum((key(b) for b in after), []))
        assert sum(len(b) for b in after) == rows

    def test_modes_give_identical_stage_outputs(self, sessions):
        opened, reports = sessions
        metrics = {m: [r.metrics for r in reps] for m, reps in reports.items()}
        assert metrics["distributed"] == metrics["coordinator"] == metrics["centralized"]
        for stage in ("rollout", "advantage", "old_log_prob", "actor_update"):
            rows = {m: all_rows(opened[m], stage) for m in MODES}
            for bd, bo, bc in zip(rows["distributed"], rows["coordinator"], rows["centralized"]):
                assert set(bd.columns) == set(bo.columns) == set(bc.columns)
                for k in bd.tensors:
                    assert torch.equal(bd[k], bc[k]) and torch.equal(bd[k], bo[k]), (stage, k)
                assert bd["uid"].tolist() == bc["uid"].tolist() == bo["uid"].tolist()

    def test_stage_report_has_real_numbers(self, sessions):
        d = sessions[0]["distributed"]
        rep = d.step_stage()  # data
        assert rep.stage_id == "data" and all(r.items_out == 4 for r in rep.results)
        rep = d.step_stage()  # rollout
        s = rep.summary()
        assert s["items"] == 32 and s["tokens"] > 0 and s["cache_hits"] == W and rep.wall_seconds > 0
        df = rep.per_worker()
        assert {"compute", "cache_hit"} <= set(df.columns) and len(df) == W
        assert "<table" in rep._repr_html_()
        finished = d.step()  # the rest of this step
        assert [s.stage_id for s in finished.stages] == [s.id for s in d.plan.stages]


@pytest.mark.full  # stepping one stage at a time: tests/test_lab.py::test_step_stage_reports_real_numbers
@pytest.mark.parametrize("mode", ["coordinator"])
def test_stepping_stage_by_stage_matches_whole_steps(ray_cluster, mode):
    a = lab.session(dag(), world_size=W, mode=mode)
    b = lab.session(dag(), world_size=W, mode=mode)
    try:
        whole = [a.step().metrics for _ in range(2)]
        staged = []
        for _ in range(2):
            for _ in range(len(b.plan.stages)):
                b.step_stage()
            staged.append(b.history[-1].metrics)
        assert whole == staged
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode,route,options", [("distributed", "buffer", {"num_buffers": 1}),
                                                 ("coordinator", "coordinator", {})])
def test_local_cache_off_routes_every_edge_through_the_data_plane(ray_cluster, mode, route, options):
    s = lab.session(dag(), world_size=W, mode=mode, local_cache=False, **options)
    try:
        rep = s.step()
        assert {r.route_in for st in rep.stages[1:] for r in st.results} == {route}
        ledger = s.ledger()
        assert len(ledger) == len(s.plan.edges)
        assert (ledger["items_in"] == ledger["items_out"]).all()
        assert (ledger["items_in"] == ledger["items_reported"]).all()
    finally:
        s.close()


def test_lpt_balances_token_load(ray_cluster):
    loads = {}
    s = lab.session(dag(batch=16), world_size=W, mode="coordinator", balance="lpt", double_buffer=False)
    try:
        for policy in ("lpt", "none"):
            if policy != "lpt":
                s.reopen(balance=policy)  # same worker processes, same data and seeds
            rep = s.step()
            stage = next(st for st in rep.stages if st.stage_id == "old_log_prob")
            loads[policy] = sorted(r.tokens_out for r in stage.results)
            lengths = np.concatenate([b["attention_mask"].sum(1).numpy() for b in all_rows(s, "old_log_prob")])
            assert len(lengths) == 64 and all(r.items_out == 16 for r in stage.results)  # equal counts
            if policy == "lpt":
                parts = np.split(np.arange(len(lengths)), W)
                assert load_stats(lengths, parts).ratio <= 1.05  # within 5 % of max(mean, largest item)
    finally:
        s.close()
    assert max(loads["lpt"]) < max(loads["none"])  # same data, better balance
    assert sum(loads["lpt"]) == sum(loads["none"])


def test_payloads_never_reach_the_driver_or_the_coordinator(ray_cluster):
    """Bytes reaching the driver per step do not grow with context length in the
    distributed and coordinator modes, nor do the bytes the coordinator handles
    (lengths and row indices only); in centralized mode the driver's grow with the payload."""
    got, coord = {}, {}
    s = None
    try:
        for mode in MODES:
            for max_len in (64, 512):
                if s is None:
                    s = lab.session(dag(max_len=max_len), world_size=W, mode=mode, keep_outputs=False)
                else:
                    s.reopen(mode=mode, dag=dag(max_len=max_len))
                s.step()
                before = s.bytes_to_driver
                s.step()
                got[mode, max_len] = s.bytes_to_driver - before
                if mode == "coordinator":
                    coord[max_len] = ray.get(s.controller.plane.coordinator.stats.remote())["meta_bytes"]
    finally:
        s.close()
    for mode in ("distributed", "coordinator"):
        assert got[mode, 512] < 1.2 * got[mode, 64] and got[mode, 512] < 200_000, mode
        assert got["centralized", 512] > 20 * got[mode, 512]
    assert got["centralized", 512] > 4 * got["centralized", 64]
    payload = 32 * 1024 * 8 * 4  # rows x tokens x bytes x (ids, masks, positions, responses), roughly
    assert coord[512] == coord[64] and coord[512] < 0.01 * payload  # metadata only: the same at 8x the context


@pytest.mark.parametrize("mode", ["distributed", "coordinator"])
def test_double_buffer_releases_each_step(ray_cluster, mode):
    s = lab.session(dag(), world_size=W, mode=mode, double_buffer=True)
    try:
        for enabled in (True, False):
            if not enabled:
                s.reopen(double_buffer=False)
            s.run(3, progress=False)
            actors = s.controller.plane.actors()
            stats = ray.get([a.stats.remote() for a in actors])
            ray.get([a.drain.remote() for a in actors])
            assert all(st["open_batches"] == [] for st in stats)
            assert all(st["releases"] == 3 and st["double_buffer"] is enabled for st in stats)
    finally:
        s.close()


def test_a_switch_with_no_meaning_in_a_mode_is_an_error(ray_cluster):
    with pytest.raises(ConfigError, match=r"switch 'num_buffers' has no meaning in mode 'coordinator'"):
        lab.session(dag(), world_size=W, mode="coordinator", num_buffers=1)
    with pytest.raises(ConfigError, match=r"switch 'local_cache' has no meaning in mode 'centralized'"):
        lab.session(dag(), world_size=W, mode="centralized", local_cache=False)
    with pytest.raises(ConfigError, match=r"unknown session option 'world_sise'"):
        lab.session(dag(), world_sise=4)


def test_a_failing_stage_names_stage_worker_and_step(ray_cluster):
    from distflow_lab.core.errors import StageError

    from distflow_lab.experiments.synthetic import reward

    def broken_reward(batch, ctx):
        if ctx.dp_rank == 1:
            raise ValueError("reward model exploded")
        return reward(batch, ctx)

    d = dag().replace("reward", fn=broken_reward)
    s = lab.session(d, world_size=W, buffer_wait_timeout_s=30)
    try:
        with pytest.raises(StageError, match=r"stage 'reward' raised ValueError: reward model exploded \(worker [23], batch 0\)") as e:
            s.step()
        assert "broken_reward" in e.value.remote_traceback
        # the session survives: the same step (same data) runs again — and fails the same way
        with pytest.raises(StageError, match="batch 0"):
            s.step()
        assert s.cursor[0] == 0
    finally:
        s.close()


def test_a_stage_breaking_its_contract_is_named(ray_cluster):
    """A node that declares `outputs` and `rows: same` is checked on every worker:
    a missing column or a changed row count names the stage, worker and step."""
    from distflow_lab.core.errors import StageContractError
    from distflow_lab.experiments.synthetic import reward

    def forgets_scores(batch, ctx):
        return batch

    def drops_a_row(batch, ctx):
        return reward(batch, ctx).select(slice(1, None))

    contract = {"outputs": ["scores"], "rows": "same"}
    for fn, message in ((forgets_scores, r"stage 'reward' did not produce column\(s\) \['scores'\] \(worker \d, batch 0\)"),
                        (drops_a_row, r"stage 'reward' returned \d+ rows for \d+ input rows \(worker \d, batch 0\)")):
        d = dag().replace("reward", fn=fn, contract=contract)
        s = lab.session(d, world_size=W)
        try:
            with pytest.raises(StageContractError, match=message):
                s.step()
            assert s.cursor[0] == 0  # nothing half-done is counted as a step
        finally:
            s.close()


def test_one_process_group_per_stage_layout(ray_cluster):
    """With torch.distributed on, each stage sees the group of its layout holding this worker:
    the tensor-parallel replicas of the rollout layout are in different groups."""
    import torch.distributed as dist

    def probe(batch, ctx):
        g = ctx.process_group
        ranks = dist.get_process_group_ranks(g)
        t = torch.ones(1)
        dist.all_reduce(t, group=g)  # a real collective over the layout's group
        ctx.log(**{f"group_size/{ctx.stage.id}": len(ranks), f"sum/{ctx.stage.id}": float(t)})
        return batch

    d = dag(tp=2).replace("reward", fn=_probe_then_reward(probe)).replace("ref_log_prob", fn=probe)
    s = lab.session(d, world_size=W, torch_distributed=True)
    try:
        m = s.step().metrics
        assert m["group_size/reward"] == 2 and m["sum/reward"] == 2  # dp=2 ranks per tp rank
        assert m["group_size/ref_log_prob"] == 4 and m["sum/ref_log_prob"] == 4
    finally:
        s.close()


def _probe_then_reward(probe):
    from distflow_lab.experiments.synthetic import reward

    def probe_reward(batch, ctx):
        return reward(probe(batch, ctx), ctx)

    return probe_reward


@pytest.mark.full
def test_group_balance_keeps_a_prompts_responses_on_one_rank_in_every_mode(ray_cluster):
    """balance="group" routes by the `uid` column the producers send with the lengths:
    every mode puts a prompt's n responses on one rank, and the same ranks."""
    by_mode = {}
    s = lab.session(dag(batch=8), world_size=W, balance="group")
    try:
        for mode in MODES:
            if mode != s.mode:
                s.reopen(mode=mode)
            s.step()
            uids = [set(b["uid"].tolist()) for b in all_rows(s, "old_log_prob")]
            assert all(not (a & b) for i, a in enumerate(uids) for b in uids[i + 1:]), mode  # disjoint groups
            assert sum(len(u) for u in uids) == 8  # every prompt once
            by_mode[mode] = uids
    finally:
        s.close()
    assert by_mode["distributed"] == by_mode["coordinator"] == by_mode["centralized"]


def test_coordinator_objects_per_sample_or_per_output_give_the_same_rows(ray_cluster):
    """rows_per_object=1 (one object per sample, siiRL's layout) and 0 (one per producer output)
    route the same rows to the same ranks; per sample, a consumer reads only objects it uses."""
    s = lab.session(dag(), world_size=W, mode="coordinator", rows_per_object=1)
    try:
        per_sample = [s.step().metrics for _ in range(2)]
        rows = [b["uid"].tolist() for b in all_rows(s, "old_log_prob")]
        moved = s.history[-1].rpcs
        s.reopen(rows_per_object=0)
        assert [s.step().metrics for _ in range(2)] == per_sample
        assert [b["uid"].tolist() for b in all_rows(s, "old_log_prob")] == rows
        assert s.history[-1].rpcs < moved  # one put per producer instead of one per sample
    finally:
        s.close()


def test_ledger_rows_have_one_shape():
    from distflow_lab.dataplane.interface import LEDGER_COLUMNS, ledger_row

    row = ledger_row(3, "advantage->old_log_prob", items_in=32, items_dropped=32)
    assert list(row) == ["batch_id", "edge", *LEDGER_COLUMNS]
    assert row["items_in"] == 32 and row["items_dropped"] == 32 and row["items_out"] == 0
    with pytest.raises(ValueError, match=r"unknown count\(s\) \['items_lost'\]"):
        ledger_row(3, "advantage->old_log_prob", items_lost=1)
