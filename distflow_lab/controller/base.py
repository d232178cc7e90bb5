"""What both controllers share: the step/stage cursor, waiting for workers with
a timeout, turning remote failures into readable errors, history, shutdown.

The driver keeps only metadata: step reports (timings, counts, metrics). It
counts the pickled bytes of everything workers send it (`bytes_to_driver`), so
a test can show that distributed mode moves no tensor payloads through it.
"""
from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from collections import deque
from typing import Any, Callable

import pandas as pd
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from tqdm.auto import tqdm

from ..dag import DAG
from ..errors import StageError, StageTimeout, WorkerLost
from ..planner import Plan
from ..reports import StageReport, StepReport
from ..telemetry import spans_to_frame
from .workers import Placement, default_threads, free_port, place_workers


class Controller:
    mode = "base"

    def __init__(self, dag: DAG, config: Any, engines: str | Callable | None = None,
                 reuse: "Controller | None" = None) -> None:
        from ..config import SessionConfig

        self.config: SessionConfig = config
        self.dag = dag
        self.plan: Plan = dag.plan(config.cluster.world_size)
        self.engines = engines
        self.step_index, self.next_stage = 0, 0
        self.history: deque[StepReport] = deque(maxlen=config.history_steps)
        self.metric_rows: list[dict] = []
        self.bytes_to_driver = 0
        self._current: list[StageReport] = []
        self._step_t0 = 0.0
        self.placement: Placement | None = None
        self.last_checkpoint: Path | None = None
        self.retries: list[dict] = []  # steps re-run after a DataBuffer died
        self.broken: str | None = None  # why the workers cannot run another step (until resume())
        self._inflight: list = []  # the refs of the last gather, awaited by _settle after a failure
        self._reuse = reuse if reuse is not None and self._can_reuse(config, reuse) else None
        first = self.plan.stages[0]
        if first.type == "data_load":  # bad data fails here, before any worker starts
            from ..data.loader import check_data_node

            check_data_node(first.config, first.dp)
        if not ray.is_initialized():
            from ..cluster import connect

            connect()
        self._start()

    # ---- to be provided by a mode ---------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _run_stage(self, step: int, index: int) -> StageReport:
        raise NotImplementedError

    def _run_whole_step(self, step: int) -> list[StageReport]:
        return [self._run_stage(step, i) for i in range(len(self.plan.stages))]

    def _end_step(self, step: int) -> float:
        return 0.0

    # ---- workers ------------------------------------------------------------------------
    def _place(self) -> Placement:
        if self._reuse is not None:  # take over the running workers: no process start-up
            self.placement, self._reuse.placement = self._reuse.placement, None
            for b in self.placement.buffers:
                ray.kill(b)
            self.placement.buffers, self.placement.buffer_nodes = [], []
            self._reuse = None
            return self.placement
        c = self.config.cluster
        workers, nodes, pg = place_workers(c.world_size, c.cpus_per_worker, c.gpus_per_worker, c.placement)
        self.placement = Placement(workers, nodes, [], [], [0] * len(workers), pg)
        return self.placement

    @staticmethod
    def _can_reuse(config: Any, other: "Controller") -> bool:
        """Same placement request and healthy workers: a new plan can run on them.
        Static: `create` decides before placing anything (config only)."""
        a, b = config.cluster, other.config.cluster
        same = (a.world_size, a.cpus_per_worker, a.gpus_per_worker, a.placement) == \
               (b.world_size, b.cpus_per_worker, b.gpus_per_worker, b.placement)
        return same and other.placement is not None and not other.broken

    @property
    def workers(self) -> list:
        return self.placement.workers if self.placement else []

    def _threads(self) -> int:
        return self.config.cluster.threads_per_worker or default_threads(self.config.cluster.world_size)

    def _init_torch_distributed(self) -> None:
        if not self.config.cluster.torch_distributed:
            return
        backend = "nccl" if self.config.cluster.gpus_per_worker > 0 else "gloo"
        port = free_port()
        addr = "127.0.0.1" if len(set(self.placement.worker_nodes)) == 1 else _node_ip(self.placement.worker_nodes[0])
        # collectives may wait for a peer that is one stage behind: allow more than a stage
        timeout = 2 * self.config.cluster.stage_timeout_s + 60
        self._gather([w.init_process_group.remote(addr, port, backend, timeout) for w in self.workers],
                     step=-1, stage="init_process_group", stages=4)

    def _gather(self, refs: list, step: int, stage: str, workers: list[int] | None = None,
                stages: int = 1) -> list:
        """Wait for every ref (bounded by the stage timeout, times `stages` for a whole
        step); on the first failure abort the step everywhere and raise an error
        naming stage, worker and step."""
        workers = workers if workers is not None else list(range(len(refs)))
        index = {r: i for i, r in enumerate(refs)}
        self._inflight = list(refs)
        limit = self.config.cluster.stage_timeout_s * stages
        pending, deadline = list(refs), time.monotonic() + limit
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(workers[index[r]] for r in pending)
                self._abort(step, f"stage {stage!r} timed out on workers {late}")
                raise StageTimeout(f"stage {stage!r} of step {step} did not finish within "
                                   f"{limit:.0f}s on workers {late} (cluster.stage_timeout_s)",
                                   step=step, stage=stage, worker=late[0])
            self._check(ready[0], step, stage, workers[index[ready[0]]])
        out = ray.get(refs)
        self.bytes_to_driver += sum(len(pickle.dumps(o)) for o in out)
        return out

    def _check(self, ref, step: int, stage: str, worker: int) -> None:
        try:
            ray.get(ref, timeout=0)
        except GetTimeoutError:
            return
        except RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
            self._abort(step, f"stage {stage!r} failed on worker {worker}")
            if isinstance(cause, StageError):  # keep the subclass (BufferLost, StageContractError, ...)
                raise type(cause)(cause.summary, step=cause.step, stage=cause.stage, worker=cause.worker,
                                  remote_traceback=cause.remote_traceback) from None
            raise StageError(f"stage {stage!r} failed on worker {worker} (step {step}): "
                             f"{type(cause or e).__name__}: {cause or e}", step=step, stage=stage, worker=worker,
                             remote_traceback=str(e)) from None
        except RayActorError as e:
            self._abort(step, f"worker {worker} died during stage {stage!r}")
            raise WorkerLost(f"worker {worker} died during stage {stage!r} of step {step}: {e.__class__.__name__}",
                             step=step, stage=stage, worker=worker, remote_traceback=str(e)) from None

    def _abort(self, step: int, reason: str) -> None:
        """Unblock workers waiting on this step (distributed mode: buffers fail their waiters)."""

    def _settle(self) -> bool:
        """Wait (bounded) until every worker has left the failed call; False if some
        are stuck (e.g. in a collective with a failed peer) or dead."""
        inflight = self._inflight
        done, pending = ray.wait(inflight, num_returns=len(inflight), timeout=min(60.0, self.config.cluster.stage_timeout_s))
        dead = False
        for r in done:
            try:
                ray.get(r)
            except RayActorError:
                dead = True
            except Exception:
                pass
        return not pending and not dead

    def _rewind(self, step: int) -> None:
        """After a failed step: put every loader back where the step started, so the
        next step() runs the same step on the same data (nothing skipped)."""
        self._current, self.next_stage = [], 0
        if not self._recover(step):
            self.broken = (f"step {step} failed and some workers are dead or still busy in it "
                           "(a collective waiting for a failed peer?): call resume() to restart them "
                           "from the last checkpoint")

    def _recover(self, step: int) -> bool:
        """Make `step` runnable again: every worker out of it, its buffer state gone,
        every loader back at its start. False if some workers are stuck or dead."""
        if not self._settle():
            return False
        self._reset_step(step)
        ray.get([w.rewind.remote() for w in self.workers], timeout=30)
        return True

    def _reset_step(self, step: int) -> None:
        pass

    def _check_usable(self) -> None:
        if self.broken:
            raise RuntimeError(self.broken)

    # ---- the cursor ---------------------------------------------------------------------
    def step_stage(self) -> StageReport:
        """Run the next stage on every worker; return what happened."""
        self._check_usable()
        if self.next_stage == 0:
            self._current, self._step_t0 = [], time.time()
        try:
            report = self._run_stage(self.step_index, self.next_stage)
        except StageError:
            self._rewind(self.step_index)
            raise
        self._current.append(report)
        self.next_stage += 1
        if self.next_stage == len(self.plan.stages):
            self._finish_step()
        return report

    def step(self) -> StepReport:
        """Finish the current step (all of it, or what is left after step_stage calls)."""
        self._check_usable()
        if self.next_stage == 0:
            try:
                self._current, self._step_t0 = self._run_whole_step_timed()
            except StageError:
                self._rewind(self.step_index)
                raise
            self.next_stage = len(self.plan.stages)
            return self._finish_step()
        while self.next_stage:
            self.step_stage()
        return self.history[-1]

    def _run_whole_step_timed(self) -> tuple[list[StageReport], float]:
        t0 = time.time()
        return self._run_whole_step(self.step_index), t0

    def run(self, steps: int, progress: bool = True) -> list[StepReport]:
        out = []
        bar = tqdm(range(steps), desc=f"{self.mode} steps", disable=not progress, leave=False)
        for _ in bar:
            out.append(self.step())
            shown = {k: round(v, 4) for k, v in list(out[-1].metrics.items())[:4]}
            bar.set_postfix(shown)
        return out

    def _finish_step(self) -> StepReport:
        step = self.step_index
        end_s = self._end_step(step)
        wall = time.time() - self._step_t0
        report = StepReport(step, self.mode, self._current, wall, end_s)
        self.history.append(report)
        self.metric_rows.append({"step": step, "wall_s": wall, **report.metrics})
        self.step_index, self.next_stage, self._current = step + 1, 0, []
        return report

    # ---- inspection ---------------------------------------------------------------------
    def peek(self, stage: str, worker: int = 0, n: int = 4, columns: list[str] | None = None):
        """The first `n` rows of `stage`'s latest output on `worker` (only those rows travel)."""
        self.plan.stage(stage)
        out = ray.get(self.workers[worker].peek.remote(stage, n, columns))
        if out is None:
            raise KeyError(f"worker {worker} holds no output of stage {stage!r} yet (run it first; "
                           "keep_outputs must be on)")
        return out

    def redistribution_lengths(self) -> dict:
        """For each redistribute edge: the token length of every item its producers
        emitted in the latest step (global order) and the consumers' dp size."""
        import numpy as np

        out = {}
        for e in self.plan.edges:
            if e.kind != "redistribute":
                continue
            src, dst = self.plan.stages[e.src], self.plan.stages[e.dst]
            writers = [w for w in range(len(self.workers)) if src.group_rank(w) == 0]
            parts = ray.get([self.workers[w].lengths.remote(src.id) for w in writers])
            if all(p is not None for p in parts):
                out[e.name] = (np.concatenate(parts), dst.dp)
        return out

    def ledger(self) -> pd.DataFrame:
        """DataBuffer items in/out per (step, edge); none here (distributed mode has buffers)."""
        return pd.DataFrame()

    # ---- checkpoints ------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """What a checkpoint must match to be loaded into this session."""
        algo = self.config.algo
        fp = {"dag": self.dag.name, "stages": [s.id for s in self.plan.stages],
              "world_size": self.config.cluster.world_size, "seed": self.config.seed}
        if hasattr(algo, "model"):
            fp.update(model=algo.model.path, algorithm=algo.algorithm.name, data=algo.data.train)
        return fp

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Trainable engines, optimizer state, loader positions and the step, between steps."""
        if self.next_stage != 0:
            raise RuntimeError(f"checkpoint between steps only: step {self.step_index} is at stage "
                               f"{self.next_stage}; call step() to finish it first")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._gather([w.save_checkpoint.remote(str(d)) for w in self.workers], self.step_index, "save_checkpoint")
        self._save_driver_state(d)
        (d / "state.json").write_text(json.dumps({"next_step": self.step_index, "mode": self.mode,
                                                  "fingerprint": self.fingerprint()}, indent=1))
        self.last_checkpoint = d
        return d

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore a checkpoint of this configuration; the next step() continues after it."""
        d = Path(directory)
        if not (d / "state.json").is_file():
            raise FileNotFoundError(f"{d} is not a distflow_lab checkpoint (no state.json)")
        state = json.loads((d / "state.json").read_text())
        mine = self.fingerprint()
        diff = {k: (state["fingerprint"].get(k), v) for k, v in mine.items() if state["fingerprint"].get(k) != v}
        if diff:
            raise ValueError(f"checkpoint {d} is from another configuration: "
                             + "; ".join(f"{k}: checkpoint {a!r} vs session {b!r}" for k, (a, b) in diff.items()))
        self._gather([w.load_checkpoint.remote(str(d)) for w in self.workers], state["next_step"], "load_checkpoint")
        self._load_driver_state(d)
        self.step_index, self.next_stage = state["next_step"], 0
        self.last_checkpoint = d
        return self.step_index

    def resume(self, directory: str | Path | None = None) -> int:
        """After a failure (a worker died, a stage timed out): restart every worker
        and buffer, then load `directory` or the last checkpoint this session saved
        or loaded. The next step() continues after it."""
        ckpt = Path(directory) if directory else self.last_checkpoint
        if ckpt is None:
            raise RuntimeError("no checkpoint to resume from: call save_checkpoint() during the run "
                               "(or trainer.checkpoint_every), or pass a directory")
        self.close()
        self._current, self.next_stage, self.broken = [], 0, None
        self._start()
        return self.load_checkpoint(ckpt)

    def _save_driver_state(self, d: Path) -> None:
        pass

    def _load_driver_state(self, d: Path) -> None:
        pass

    # ---- results ------------------------------------------------------------------------
    @property
    def spans(self) -> pd.DataFrame:
        frames = [r.spans for r in self.history] + ([s.spans for s in self._current] if self._current else [])
        return pd.concat(frames, ignore_index=True) if frames else spans_to_frame([])

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame(self.metric_rows)

    def close(self) -> None:
        if self.placement is None:
            return
        try:  # a graceful close frees engines and process groups; a hung or dead worker is just killed
            ray.get([w.close.remote() for w in self.workers], timeout=10)
        except Exception:
            pass
        for a in [*self.placement.workers, *self.placement.buffers]:
            try:
                ray.kill(a)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement.pg)
        except Exception:
            pass
        self.placement = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _node_ip(node_id: str) -> str:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return n["NodeManagerAddress"]
    return "127.0.0.1"
