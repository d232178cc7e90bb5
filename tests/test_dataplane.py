"""The data plane on a real Ray cluster: local-cache hits with equal layouts,
DataBuffer redistribution when layouts change (counts conserved, every item
exactly once), load balancing, both modes giving identical stage outputs, and
a driver that receives only metadata in distributed mode."""
from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

import distflow_lab as lab
from distflow_lab.runtime import create as controller
from distflow_lab.dataplane.partition import load_stats
from distflow_lab.core.batch import Batch
from distflow_lab.experiments.synthetic import synthetic_grpo

W = 4


def dag(max_len: int = 64, batch: int = 8, tp: int = 2):
    return synthetic_grpo(batch_size=batch, n=4, max_prompt_len=max_len, max_response_len=max_len, rollout_tp=tp,
                          response_len_sigma=1.0)


@pytest.fixture(scope="class")
def both(ray_cluster):
    """One distributed and one centralized session over the same DAG, 2 steps each."""
    d = controller.create(dag(), world_size=W, mode="distributed")
    c = controller.create(dag(), world_size=W, mode="centralized")
    reports = {"distributed": d.run(2, progress=False), "centralized": c.run(2, progress=False)}
    yield d, c, reports
    d.close()
    c.close()


def all_rows(session, stage: str) -> list[Batch]:
    """Every worker's full output of `stage` (tests only: payloads travel)."""
    c = getattr(session, "controller", session)  # raw batches, not the notebook's decoded samples
    return [c.peek(stage, worker=w, n=10**6) for w in range(W)]


class TestSharedSessions:
    """Tests that share one distributed and one centralized session."""

    def test_routes_cache_hits_and_one_redistribution(self, both):
        d, _, reports = both
        step = reports["distributed"][-1]
        routes = {s.stage_id: {r.route_in for r in s.results} for s in step.stages}
        assert routes == {"data": {"loader"}, "rollout": {"cache"}, "reward": {"cache"}, "advantage": {"cache"},
                          "old_log_prob": {"buffer"}, "ref_log_prob": {"cache"}, "actor_update": {"cache"}}
        hits = sum(r.cache_hit is True for s in step.stages for r in s.results)
        assert hits == 5 * W
        ledger = d.ledger()
        assert set(ledger["edge"]) == {"advantage->old_log_prob"}  # local edges never touch a buffer


    def test_buffer_counts_conserved_and_items_exactly_once(self, both):
        d, _, _ = both
        ledger = d.ledger()
        rows = 8 * 4  # prompts x responses
        assert (ledger["items_reported"] == rows).all()
        assert (ledger["items_in"] == rows).all() and (ledger["items_out"] == rows).all()
        # every (uid, response) row that left advantage arrives at old_log_prob exactly once
        before = [b for w, b in enumerate(all_rows(d, "advantage")) if w % 2 == 0]  # tp rank 0 of each group
        after = all_rows(d, "old_log_prob")
        key = lambda b: sorted(zip(b["uid"].tolist(), b["responses"][:, :8].tolist()))  # noqa: E731
        assert sorted(sum((key(b) for b in before), [])) == sorted(sum((key(b) for b in after), []))
        assert sum(len(b) for b in after) == rows


    def test_modes_give_identical_stage_outputs(self, both):
        d, c, reports = both
        assert [r.metrics for r in reports["distributed"]] == [r.metrics for r in reports["centralized"]]
        for stage in ("rollout", "advantage", "old_log_prob", "actor_update"):
            for bd, bc in zip(all_rows(d, stage), all_rows(c, stage)):
                assert bd.columns == bc.columns or set(bd.columns) == set(bc.columns)
                for k in bd.tensors:
                    assert torch.equal(bd[k], bc[k]), (stage, k)
                assert bd["uid"].tolist() == bc["uid"].tolist()


    def test_stage_report_has_real_numbers(self, both):
        d, _, _ = both
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


def test_stepping_stage_by_stage_matches_whole_steps(ray_cluster):
    a = controller.create(dag(), world_size=W)
    b = controller.create(dag(), world_size=W)
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


def test_local_cache_off_routes_every_edge_through_the_buffer(ray_cluster):
    s = controller.create(dag(), world_size=W, local_cache=False, num_buffers=1)
    try:
        rep = s.step()
        assert {r.route_in for st in rep.stages[1:] for r in st.results} == {"buffer"}
        ledger = s.ledger()
        assert len(ledger) == len(s.plan.edges)
        assert (ledger["items_in"] == ledger["items_out"]).all()
        assert (ledger["items_in"] == ledger["items_reported"]).all()
    finally:
        s.close()


def test_lpt_balances_token_load(ray_cluster):
    loads = {}
    s = lab.session(dag(batch=16), world_size=W, balance="lpt", double_buffer=False)
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


def test_driver_receives_only_metadata_in_distributed_mode(ray_cluster):
    """Bytes reaching the driver per step do not grow with context length in
    distributed mode; in centralized mode they grow with the payload."""
    got = {}
    s = None
    try:
        for mode in ("distributed", "centralized"):
            for max_len in (64, 512):
                if s is None:
                    s = lab.session(dag(max_len=max_len), world_size=W, mode=mode, keep_outputs=False)
                else:
                    s.reopen(mode=mode, dag=dag(max_len=max_len))
                s.step()
                before = s.controller.bytes_to_driver
                s.step()
                got[mode, max_len] = s.controller.bytes_to_driver - before
    finally:
        s.close()
    assert got["distributed", 512] < 1.2 * got["distributed", 64]
    assert got["distributed", 512] < 200_000
    assert got["centralized", 512] > 4 * got["centralized", 64]
    assert got["centralized", 512] > 20 * got["distributed", 512]


def test_double_buffer_releases_each_step(ray_cluster):
    s = lab.session(dag(), world_size=W, double_buffer=True)
    try:
        for enabled in (True, False):
            if not enabled:
                s.reopen(double_buffer=False)
            s.run(3, progress=False)
            bufs = s.controller.placement.buffers
            stats = ray.get([b.stats.remote() for b in bufs])
            ray.get([b.drain.remote() for b in bufs])
            assert all(st["open_steps"] == [] for st in stats)
            assert all(st["releases"] == 3 and st["double_buffer"] is enabled for st in stats)
    finally:
        s.close()


def test_a_failing_stage_names_stage_worker_and_step(ray_cluster):
    from distflow_lab.core.errors import StageError

    from distflow_lab.experiments.synthetic import reward

    def broken_reward(batch, ctx):
        if ctx.dp_rank == 1:
            raise ValueError("reward model exploded")
        return reward(batch, ctx)

    d = dag().replace("reward", fn=broken_reward)
    s = controller.create(d, world_size=W, buffer_wait_timeout_s=30)
    try:
        with pytest.raises(StageError, match=r"stage 'reward' raised ValueError: reward model exploded \(worker [23], step 0\)") as e:
            s.step()
        assert "broken_reward" in e.value.remote_traceback
        # the session survives: the same step (same data) runs again — and fails the same way
        with pytest.raises(StageError, match="step 0"):
            s.step()
        assert s.step_index == 0
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
    for fn, message in ((forgets_scores, r"stage 'reward' did not produce column\(s\) \['scores'\] \(worker \d, step 0\)"),
                        (drops_a_row, r"stage 'reward' returned \d+ rows for \d+ input rows \(worker \d, step 0\)")):
        d = dag()
        d.replace("reward", fn=fn, config={**d["reward"].config, **contract})
        s = controller.create(d, world_size=W)
        try:
            with pytest.raises(StageContractError, match=message):
                s.step()
            assert s.step_index == 0  # nothing half-done is counted as a step
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
    s = controller.create(d, world_size=W, torch_distributed=True)
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
