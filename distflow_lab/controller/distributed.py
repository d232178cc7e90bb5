"""Multi-controller (DistFlow) mode: the driver sends the plan once, then
"run step k" or "run stage s of step k", and receives only metadata. Data
moves worker to worker: local cache, or DataBuffers when the layout changes."""
from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..errors import BufferLost, StageError
from ..reports import StageReport
from ..worker import WorkerSetup
from .base import Controller
from .workers import place_buffers


class DistributedController(Controller):
    mode = "distributed"

    def __init__(self, *args, **kwargs) -> None:
        self.ledger_rows: list[dict] = []  # before _start (called by the base): resume() keeps them
        super().__init__(*args, **kwargs)

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
        self.worker_info = self._gather([w.setup.remote(setup) for w in self.workers], step=-1, stage="setup",
                                        stages=4)  # engine set-up (model loading) may take longer than a stage

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

    def _wait_alive(self, buffer) -> None:
        """Ray restarts a killed buffer; wait (bounded) until it answers."""
        deadline = time.monotonic() + self.config.cluster.buffer_wait_timeout_s
        while True:
            try:
                ray.get(buffer.ping.remote(), timeout=10)
                return
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _prepare_retry(self, step: int, err: BufferLost) -> None:
        for b in self.placement.buffers:
            self._wait_alive(b)
        if not self._recover(step):
            raise err
        self.retries.append({"step": step, "stage": err.stage, "worker": err.worker, "reason": err.summary})

    def _run_whole_step_once(self, step: int) -> list[StageReport]:
        try:
            per_worker = self._gather([w.run_step.remote(step) for w in self.workers], step, "(whole step)",
                                      stages=len(self.plan.stages))
        except StageError as e:
            if e.stage == "(whole step)":  # a worker died or hung: ask the buffers where it was
                where = self._where(e.worker)
                raise type(e)(e.summary.replace("'(whole step)'", repr(where)), step=step, stage=where,
                              worker=e.worker, remote_traceback=e.remote_traceback) from None
            raise
        reports = []
        for i, st in enumerate(self.plan.stages):
            results = [rs[i] for rs in per_worker]
            spans = [s for r in results for s in r.spans]
            wall = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
            reports.append(StageReport(step, i, st.id, self.mode, results, wall_seconds=wall))
        return reports

    def _where(self, worker: int | None) -> str:
        """The stage `worker` last started, from the progress notes its node's buffer holds."""
        try:
            notes = ray.get(self.placement.buffers[self.placement.buffer_of_worker[worker]].progress.remote(), timeout=10)
            return notes[worker][1]
        except Exception:
            return "(whole step)"

    def _end_step(self, step: int) -> float:
        t0 = time.perf_counter()
        for b, ref in [(b, b.end_step.remote(step)) for b in self.placement.buffers]:
            try:
                self.ledger_rows.extend(ray.get(ref)[1])
            except RayActorError:  # restarted after this step's data was delivered: let it serve the next
                self._wait_alive(b)
                ray.get(b.reset_step.remote(step))
        return time.perf_counter() - t0

    def _abort(self, step: int, reason: str) -> None:
        if self.placement:
            for b in self.placement.buffers:
                b.abort.remote(step, reason)

    def _reset_step(self, step: int) -> None:
        """Forget the failed attempt in every buffer (after all workers left it), so the step can run again."""
        for rows in ray.get([b.reset_step.remote(step) for b in self.placement.buffers], timeout=30):
            self.ledger_rows.extend(rows)

    def ledger(self):
        """Items in and out of every DataBuffer, per (step, edge): nothing lost, nothing duplicated.
        Collected by the driver at every step end, so it survives a buffer restart."""
        import pandas as pd

        rows = self.ledger_rows
        if not rows:
            return pd.DataFrame(columns=["step", "edge", "items_reported", "items_in", "items_out"])
        df = pd.DataFrame(rows)
        return df.groupby(["step", "edge"], as_index=False)[
            ["items_reported", "items_in", "items_out", "pieces_in", "pieces_out"]].sum()
