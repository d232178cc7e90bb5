"""Multi-controller (DistFlow) mode: the driver sends the plan once, then
"run step k" or "run stage s of step k", and receives only metadata. Data
moves worker to worker: local cache, or DataBuffers when the layout changes."""
from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..errors import BufferLost
from ..reports import StageReport
from ..worker import WorkerSetup
from .base import Controller
from .workers import place_buffers


class DistributedController(Controller):
    mode = "distributed"

    def _start(self) -> None:
        p = self._place()
        sw, c = self.config.switches, self.config.cluster
        p.buffers, p.buffer_nodes, p.buffer_of_worker = place_buffers(
            p.worker_nodes, sw.num_buffers, sw.double_buffer, c.buffer_wait_timeout_s)
        ray.get([b.ping.remote() for b in p.buffers])
        self._init_torch_distributed()
        setup = WorkerSetup(self.plan, self.mode, self.config.seed, sw.local_cache, sw.balance, p.buffers,
                            p.buffer_of_worker, self.config.algo, self.engines, self.config.keep_outputs,
                            self._threads())
        self.worker_info = self._gather([w.setup.remote(setup) for w in self.workers], step=-1, stage="setup")

    def _run_stage(self, step: int, index: int) -> StageReport:
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        results = self._gather([w.run_stage.remote(step, index) for w in self.workers], step, st.id)
        return StageReport(step, index, st.id, self.mode, results, wall_seconds=time.perf_counter() - t0)

    def _run_whole_step(self, step: int) -> list[StageReport]:
        try:
            return self._run_whole_step_once(step)
        except BufferLost as e:
            if not self._can_retry(step, e):
                raise
            self._prepare_retry(step, e)
            return self._run_whole_step_once(step)

    def _can_retry(self, step: int, err: BufferLost) -> bool:
        """Once per step, and only before any training stage could have changed the model."""
        train = [s.index for s in self.plan.stages if s.type == "train"]
        failed = self.plan.stage(err.stage).index
        return not any(r["step"] == step for r in self.retries) and (not train or failed < min(train))

    def _prepare_retry(self, step: int, err: BufferLost) -> None:
        deadline = time.monotonic() + self.config.cluster.buffer_wait_timeout_s
        for b in self.placement.buffers:  # Ray restarts a killed buffer; wait until it answers
            while True:
                try:
                    ray.get(b.ping.remote(), timeout=10)
                    break
                except (RayActorError, GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        if not self._settle():
            raise err
        self._reset_step(step)
        ray.get([w.rewind.remote() for w in self.workers])
        self.retries.append({"step": step, "stage": err.stage, "worker": err.worker, "reason": err.summary})

    def _run_whole_step_once(self, step: int) -> list[StageReport]:
        per_worker = self._gather([w.run_step.remote(step) for w in self.workers], step, "(whole step)")
        reports = []
        for i, st in enumerate(self.plan.stages):
            results = [rs[i] for rs in per_worker]
            spans = [s for r in results for s in r.spans]
            wall = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
            reports.append(StageReport(step, i, st.id, self.mode, results, wall_seconds=wall))
        return reports

    def _end_step(self, step: int) -> float:
        t0 = time.perf_counter()
        ray.get([b.end_step.remote(step) for b in self.placement.buffers])
        return time.perf_counter() - t0

    def _abort(self, step: int, reason: str) -> None:
        if self.placement:
            for b in self.placement.buffers:
                b.abort.remote(step, reason)

    def _reset_step(self, step: int) -> None:
        """Forget the failed attempt in every buffer (after all workers left it), so the step can run again."""
        ray.get([b.reset_step.remote(step) for b in self.placement.buffers], timeout=30)

    def ledger(self):
        """Items in and out of every DataBuffer, per (step, edge): nothing lost, nothing duplicated."""
        import pandas as pd

        rows = [r for b in self.placement.buffers for r in ray.get(b.ledger.remote())]
        if not rows:
            return pd.DataFrame(columns=["step", "edge", "items_reported", "items_in", "items_out"])
        df = pd.DataFrame(rows)
        return df.groupby(["step", "edge"], as_index=False)[
            ["items_reported", "items_in", "items_out", "pieces_in", "pieces_out"]].sum()
