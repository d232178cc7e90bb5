"""The worker pool (runtime/worker_pool.py): a session that closes healthy parks its workers, the
next session of the same shape runs on those very processes (same PIDs) and computes the same
thing as on new ones; a killed worker, a broken session or `fresh_workers=True` never hands
processes on."""
from __future__ import annotations

import os
import signal

import pytest
import ray

import distflow_lab as lab
from distflow_lab.core.errors import StageError
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.runtime.worker_pool import POOL


def _dag():
    return synthetic_grpo(batch_size=8, n=2, max_prompt_len=32, max_response_len=32, rollout_tp=1)


def _pids(s) -> list[int]:
    return [m["pid"] for m in ray.get([w.memory.remote() for w in s.controller.workers])]


@pytest.fixture
def pool(ray_cluster):
    POOL.drain()
    yield POOL
    POOL.drain()


def test_a_second_session_runs_on_the_parked_workers_and_computes_the_same(pool):
    with lab.session(_dag(), world_size=2, fresh_workers=True) as s:
        fresh = [s.step().metrics for _ in range(2)]
    assert not pool.idle  # fresh_workers: killed at close, never parked
    with lab.session(_dag(), world_size=2) as s:
        first_pids = _pids(s)
        first = [s.step().metrics for _ in range(2)]
    assert len(pool.idle) == 1
    taken = pool.stats.taken
    with lab.session(_dag(), world_size=2, mode="coordinator") as s:  # another plane: the same shape of workers
        assert _pids(s) == first_pids
        again = [s.step().metrics for _ in range(2)]
    assert pool.stats.taken == taken + 1
    assert first == fresh and again == fresh  # parked workers start clean: the same steps as new ones
    with lab.session(_dag(), world_size=2, fresh_workers=True) as s:
        assert not set(_pids(s)) & set(first_pids)  # opting out takes nothing from the pool
    assert "idle placement" in repr(lab.worker_pool())


@pytest.mark.full
def test_a_session_of_another_shape_starts_new_workers(pool):
    with lab.session(_dag(), world_size=2) as s:
        two = _pids(s)
    with lab.session(_dag(), world_size=1) as s:
        assert not set(_pids(s)) & set(two)
        s.step()
    assert len(pool.idle) == 2  # both shapes parked (capacity 2)


def test_a_broken_session_and_a_worker_killed_while_parked_never_hand_on_processes(pool):
    s = lab.session(_dag(), world_size=2)
    s.step()
    os.kill(_pids(s)[1], signal.SIGKILL)
    with pytest.raises(StageError):
        s.step()
    assert s.controller.broken
    dead = _pids_of(s)
    s.close()
    assert not pool.idle  # broken: killed, not parked
    with lab.session(_dag(), world_size=2) as s:
        parked = _pids(s)
        assert not set(parked) & set(dead)
        s.step()
    os.kill(parked[0], signal.SIGKILL)  # dies while parked
    refused = pool.stats.refused
    with lab.session(_dag(), world_size=2) as s:
        assert not set(_pids(s)) & set(parked)  # the whole placement is replaced
        s.step()
    assert pool.stats.refused == refused + 1


def _pids_of(s) -> list[int]:
    """The pids of a session's workers that still answer."""
    out = []
    for w in s.controller.workers:
        try:
            out.append(ray.get(w.memory.remote(), timeout=5)["pid"])
        except Exception:
            pass
    return out


@pytest.mark.full  # the default tier keeps the property on the synthetic DAG (the test above); this is its RL twin
@pytest.mark.budget(60, reason="two real GRPO sessions (FSDP2 over gloo): a cold and a pooled open")
def test_an_rl_session_on_parked_workers_equals_one_on_new_workers(pool, grpo_model):
    import time

    overrides = ["data.prompts_per_step=8"]
    t0 = time.perf_counter()
    with lab.rl_session("tiny-cpu-grpo", overrides, progress=False) as s:
        cold_s = time.perf_counter() - t0
        pids, first = _pids(s), [s.step().metrics for _ in range(2)]
    t0 = time.perf_counter()
    with lab.rl_session("tiny-cpu-grpo", overrides, progress=False) as s:
        pooled_s = time.perf_counter() - t0
        assert _pids(s) == pids
        again = [s.step().metrics for _ in range(2)]
    assert again == first, {k: (a[k], b.get(k)) for a, b in zip(first, again) for k in a if a[k] != b.get(k)}
    print(f"rl_session open: cold {cold_s:.2f} s, pooled {pooled_s:.2f} s")


