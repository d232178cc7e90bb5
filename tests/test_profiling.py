"""torch.profiler traces of chosen stages and steps: one valid Chrome trace per rank,
stage and step, nothing for the others, also from inside a Ray worker process."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from distflow_lab.runtime.profiling import ProfileSpec, profile_stage


def _work(n: int = 32) -> float:
    x = torch.randn(n, n, requires_grad=True)
    (x @ x).sum().backward()
    return float(x.grad.sum())


def _check_trace(path) -> dict:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::mm") for n in names), sorted(names)[:20]  # the matmul, recorded
    assert all("ph" in e and "pid" in e for e in events)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    return trace


def test_only_the_chosen_stages_and_steps_are_profiled(tmp_path):
    spec = ProfileSpec(stages=["actor_update"], batches=[1], directory=str(tmp_path / "profiles"))
    for rank in range(2):
        for step in range(3):
            for stage in ("rollout", "actor_update"):
                with profile_stage(spec, step, stage, rank):
                    _work()
    files = sorted(p.relative_to(tmp_path / "profiles").as_posix() for p in (tmp_path / "profiles").rglob("*.json"))
    assert files == ["batch1/actor_update-rank0.json", "batch1/actor_update-rank1.json"]
    for rank in range(2):
        trace = _check_trace(tmp_path / "profiles" / f"batch1/actor_update-rank{rank}.json")
        assert trace["distributedInfo"] == {"rank": rank}  # what Holistic Trace Analysis reads
        label = f"actor_update (batch 1, rank {rank})"
        assert any(e.get("name") == label and e["ph"] == "X" for e in trace["traceEvents"])


def test_no_spec_or_empty_spec(tmp_path):
    with profile_stage(None, 0, "rollout", 0):
        _work()
    spec = ProfileSpec(directory=str(tmp_path))  # no stages, no steps: everything
    assert spec.wants(7, "anything")
    with profile_stage(spec, 7, "anything", 3):
        _work()
    _check_trace(tmp_path / "batch7" / "anything-rank3.json")
    assert ProfileSpec(directory="rel/dir").directory.startswith("/")  # made absolute where it is built


def test_a_failing_stage_still_writes_its_trace(tmp_path):
    spec = ProfileSpec(stages=["x"], directory=str(tmp_path))
    with pytest.raises(RuntimeError):
        with profile_stage(spec, 0, "x", 0):
            _work()
            raise RuntimeError("stage failed")
    _check_trace(tmp_path / "batch0" / "x-rank0.json")


def test_profiles_from_a_ray_worker(ray_cluster, tmp_path):
    spec = ProfileSpec(stages=["ref_log_prob"], directory=str(tmp_path / "p"))
    pickle.loads(pickle.dumps(spec))  # travels to the workers as it is

    @ray_cluster.remote(num_cpus=0)
    def stage_on_worker(spec, rank):
        with profile_stage(spec, 4, "ref_log_prob", rank):
            _work(16)
        return rank

    assert ray_cluster.get([stage_on_worker.remote(spec, r) for r in range(2)], timeout=120) == [0, 1]
    for r in range(2):
        _check_trace(tmp_path / "p" / "batch4" / f"ref_log_prob-rank{r}.json")
