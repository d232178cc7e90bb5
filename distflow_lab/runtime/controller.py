"""The controller: one per session, for every data plane.

It owns the cursor (step, next stage), stage dispatch, turning remote failures
into named errors, retry and rewind, checkpoints, spans and the ledger. It
holds a data plane (`dataplane.interface.DataPlane`) and never asks which one:

    step():  plane.begin_step
             whole step on every worker (the driver moves no data), or stage by stage:
                 args = plane.stage_args -> workers run the stage -> plane.stage_done
             plane.end_step -> StepReport, recorded (history, metrics, ledger) by _record
    on worker groups: Lanes (runtime/schedules.py) runs the schedule through a Dispatch
             (start calls, gather, abort, end a step) and returns each update's StepReport,
             recorded by the same _record
    failure: abort the step everywhere -> wait (bounded) for the workers to leave it
             -> plane.reset_step + workers rewind -> retry once (a lost data-plane actor,
             before any training stage), or raise the named error

The driver keeps only metadata: step reports (timings, counts, metrics). It
counts the pickled bytes of everything workers send it (`bytes_to_driver`), so a
test can show which modes move payloads through it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from tqdm.auto import tqdm

from distflow_lab.core.config import SessionConfig, WeightSyncOptions, check_groups, check_schedule
from distflow_lab.core.errors import (CheckpointError, PlaneLost, SessionBroken, StageError,
                                      StageTimeout, WorkerLost)
from distflow_lab.core.spans import spans_to_frame
from distflow_lab.dataplane.interface import DataPlane, PlaneSetup, Routing
from distflow_lab.datasets.loader import check_data_node
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.planner import Plan, Stage
from distflow_lab.runtime.checkpoint_files import verify_checkpoint, write_manifest
from distflow_lab.runtime.context import stage_context
from distflow_lab.runtime.profiling import ProfileSpec
from distflow_lab.runtime.progress import stage_reached
from distflow_lab.runtime.placement import Placement, default_threads, free_port, node_ip, place_workers, release
from distflow_lab.runtime.results import LEDGER_COLUMNS, StageReport, StepReport, stage_reports
from distflow_lab.runtime.schedules import Dispatch, InFlight, Lanes
from distflow_lab.runtime.weights import WeightBoard, board_keep
from distflow_lab.runtime.worker import WorkerSetup
from distflow_lab.runtime.worker_pool import POOL, PoolKey, current_cluster

SETUP_STAGES = 4  # engine set-up (model loading) may take this many stage timeouts
PARK_TIMEOUT_S = 10.0  # a closing session's workers must reset within this to be parked for the next one


def torch_worlds(plan: Plan) -> list[tuple[int, int]]:
    """(first worker, workers) of each torch.distributed world: one per worker group, else one."""
    return [(first, n) for _, first, n in plan.groups] or [(0, plan.world_size)]


# A collective's error on a surviving rank when a peer process died (gloo, NCCL): the peer's death is the cause.
PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|NCCL communicator was aborted")
PEER_GRACE_S = 3.0  # how long Ray may take to report the dead peer's actor


def _dead_peer(pending: list, index: dict) -> tuple[int, Exception] | None:
    """(worker, error) of a pending call whose actor died, within PEER_GRACE_S; else None."""
    if not pending:
        return None
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_GRACE_S)
    for r in done:
        try:
            ray.get(r, timeout=0)
        except RayTaskError:
            continue  # another rank's own error, not a death
        except RayError as e:
            return index.get(r, -1), e
    return None


class Controller:
    def __init__(self, dag: DAG, config: SessionConfig, plane: DataPlane, engines: str | Callable | None = None,
                 reuse: "Controller | None" = None, routing: Routing | None = None) -> None:
        self.config, self.dag, self.plane, self.engines = config, dag, plane, engines
        self.routing = routing or Routing(config.switches.balance)
        self.plan: Plan = dag.plan(config.cluster.world_size)
        self.mode = plane.mode
        self.step_index, self.next_stage = 0, 0
        self.history: deque[StepReport] = deque(maxlen=config.history_steps)
        self.metric_rows: list[dict] = []
        self.ledger_rows: list[dict] = []  # kept by the driver: they survive a data-plane actor's restart
        self.retries: list[dict] = []  # steps re-run after a data-plane actor died
        self.metadata_bytes = 0
        self.driver_calls = 0  # stage and step calls to workers, cumulative
        self.broken: str | None = None  # why the workers cannot run another step (until resume())
        self.last_checkpoint: Path | None = None
        self.placement: Placement | None = None
        self.board = None  # the WeightBoard, when generation and training run on disjoint groups
        self.lanes: Lanes | None = None
        self.session_id = uuid.uuid4().hex[:12]
        self._current: list[StageReport] = []
        self._step_t0 = 0.0
        self._rpcs_at_start = 0
        self._inflight: list = []  # the refs of the last gather, awaited (bounded) after a failure
        check_groups(dag.groups, schedule=config.schedule.kind, where=f"DAG {dag.name!r}")
        check_schedule(plane.mode, config.schedule, dag.groups)  # both before any worker starts
        first = self.plan.stages[0]
        if first.type == "data_load" and first.data is not None:  # bad data fails here, before any worker starts
            check_data_node(first.data, first.dp)
        if not ray.is_initialized():
            from distflow_lab.runtime.cluster import connect

            connect()
        self._start(reuse)

    # ---- start and stop ------------------------------------------------------------
    def _start(self, reuse: "Controller | None" = None) -> None:
        c = self.config.cluster
        if reuse is not None and reuse.can_hand_over(self.config, self.dag):
            self.placement, reuse.placement = reuse.placement, None  # the running processes: no start-up
        else:
            self.placement = self._place()
        try:
            spec = self.plane.start(PlaneSetup(self.plan, self.config.switches, self.config.seed,
                                               self.placement.worker_nodes, c.buffer_wait_timeout_s,
                                               self.driver_context, self.routing))
            self._init_torch_distributed()
            threads = c.threads_per_worker or default_threads(c.world_size)
            if self.plan.groups:  # generation and training on disjoint workers: weights travel between them
                self.board = WeightBoard.remote(keep=board_keep(self.config.schedule.staleness))
            p = self.config.profile
            profile = ProfileSpec(p.stages, p.steps, p.directory) if p is not None else None  # absolute here
            setup = WorkerSetup(self.plan, self.mode, self.config.seed, spec, self.session_id, self.config.algo,
                                self.engines, self.config.keep_outputs, threads, profile=profile, board=self.board,
                                schedule=self.config.schedule, weight_sync=self._weight_sync())
            self.worker_info = self._gather([w.setup.remote(setup) for w in self.workers], -1, "setup",
                                            SETUP_STAGES * c.stage_timeout_s)
            self.plane.ready()
            self.lanes = self._lanes() if self.plan.groups else None
        except BaseException:
            self.broken = self.broken or "set-up failed"  # workers half set up are never parked for reuse
            self.close()
            raise

    def _pool_key(self) -> PoolKey:
        c = self.config.cluster
        return PoolKey(current_cluster(), c.world_size, c.cpus_per_worker, c.gpus_per_worker, c.placement,
                       c.torch_distributed, tuple(torch_worlds(self.plan)))

    def _place(self) -> Placement:
        """Parked workers of this shape from the worker pool (runtime/worker_pool.py), else new ones."""
        c = self.config.cluster
        if not c.fresh_workers and (parked := POOL.take(self._pool_key())) is not None:
            return parked
        if POOL.idle and ray.available_resources().get("CPU", 0) < c.world_size * c.cpus_per_worker:
            POOL.drain()  # parked workers of another shape hold the logical CPUs this session needs
        workers, nodes, pg = place_workers(c.world_size, c.cpus_per_worker, c.gpus_per_worker, c.placement)
        return Placement(workers, nodes, pg)

    def can_hand_over(self, config: SessionConfig, dag: DAG | None = None) -> bool:
        """Same placement request, the same torch.distributed worlds and healthy workers: a new
        session (of `dag`, default this one's) can take them over."""
        a, b = config.cluster, self.config.cluster
        same = (a.world_size, a.cpus_per_worker, a.gpus_per_worker, a.placement, a.torch_distributed) == \
               (b.world_size, b.cpus_per_worker, b.gpus_per_worker, b.placement, b.torch_distributed)
        worlds = torch_worlds((dag or self.dag).plan(a.world_size)) if same else None
        return same and worlds == torch_worlds(self.plan) and self.placement is not None and not self.broken

    def _init_torch_distributed(self) -> None:
        """One torch.distributed world per worker group (no collective crosses groups: weights
        travel through the object store; and vLLM on a generation group builds its groups over
        the world, which a training group that never builds an engine would never join), or one
        over every worker."""
        c = self.config.cluster
        if not c.torch_distributed:
            return
        backend = "nccl" if c.gpus_per_worker > 0 else "gloo"
        nodes = self.placement.worker_nodes
        # collectives may wait for a peer that is one stage behind: allow more than a stage
        timeout, calls, ranks, ports = 2 * c.stage_timeout_s + 60, [], [], set()
        for first, n in torch_worlds(self.plan):
            port = free_port()
            while port in ports:
                port = free_port()
            ports.add(port)
            addr = "127.0.0.1" if len(set(nodes[first:first + n])) == 1 else node_ip(nodes[first])
            for r in range(n):
                calls.append(self.workers[first + r].init_process_group.remote(addr, port, backend, timeout, r, n))
                ranks.append(first + r)
        self._gather(calls, -1, "init_process_group", SETUP_STAGES * c.stage_timeout_s, workers=ranks)

    @property
    def workers(self) -> list:
        return self.placement.workers if self.placement else []

    def _weight_sync(self) -> WeightSyncOptions:
        """The options with transport "auto" resolved: shared memory when every worker is on one node."""
        opts = self.config.weight_sync
        if opts.transport == "auto":
            one_node = len(set(self.placement.worker_nodes)) == 1
            opts = opts.model_copy(update={"transport": "shm" if one_node else "object_store"})
        return opts

    def close(self) -> None:
        """End the session: its workers go back to the worker pool if it is healthy (and the
        pool is on), else they are closed and killed; the data plane and WeightBoard end."""
        if self.placement is not None:
            placement, self.placement = self.placement, None
            if not self._park(placement):
                try:  # a graceful close frees engines and process groups; a hung or dead worker is just killed
                    ray.get([w.close.remote() for w in placement.workers], timeout=10)
                except Exception:  # dead or hung workers are killed below
                    pass
                release(placement)
        if self.board is not None:
            ray.kill(self.board)
            self.board = None
        self.plane.close()

    def _park(self, placement: Placement) -> bool:
        """Healthy workers, reset, go to the worker pool for the next session of this shape. False:
        they are not parked (the pool is off, fresh_workers, or this session is broken); True: done
        with them (parked, or a worker failed to reset and all were killed)."""
        if self.config.cluster.fresh_workers or POOL.capacity < 1 or not ray.is_initialized():
            return False
        if self.broken:
            POOL.stats.refused += 1
            return False
        try:
            reusable = ray.get([w.park.remote() for w in placement.workers], timeout=PARK_TIMEOUT_S)
        except Exception:  # a worker dead, hung or failing to reset: none of them is reused
            reusable = [False]
        if all(reusable):
            POOL.give(self._pool_key(), placement)
        else:  # see DAGWorker.park (a vLLM engine's shutdown ends the torch.distributed world)
            POOL.refuse(placement)
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the cursor ----------------------------------------------------------------------
    def step_stage(self) -> StageReport:
        """Run the next stage on every worker; return what happened."""
        self._check_usable()
        if self.lanes is not None:
            raise SessionBroken(f"step_stage() steps one stage of a colocated synchronous step; this session runs "
                                f"schedule {self.config.schedule.kind!r} on worker groups {self.plan.groups}: use step()")
        step = self.step_index
        if self.next_stage == 0:
            self._begin_step()
        try:
            report = self._run_stage(step, self.next_stage)
        except StageError as e:
            self._fail(step, e)
            raise
        self._current.append(report)
        self.next_stage += 1
        if self.next_stage == len(self.plan.stages):
            self._finish_step()
        return report

    def step(self) -> StepReport:
        """Finish the current step (all of it, or what is left after step_stage calls)."""
        self._check_usable()
        if self.lanes is not None:
            return self._step_on_groups()
        if self.next_stage:
            while self.next_stage:
                self.step_stage()
            return self.history[-1]
        step = self.step_index
        self._begin_step()
        try:
            self._current = self._run_step_or_retry(step)
        except StageError as e:
            self._fail(step, e)
            raise
        self.next_stage = len(self.plan.stages)
        return self._finish_step()

    def run(self, steps: int, progress: bool = True) -> list[StepReport]:
        out = []
        bar = tqdm(range(steps), desc=f"{self.mode} steps", disable=not progress, leave=False)
        for _ in bar:
            out.append(self.step())
            bar.set_postfix({k: round(v, 4) for k, v in list(out[-1].metrics.items())[:4]})
        bar.close()
        return out

    def _begin_step(self) -> None:
        self._current, self._step_t0 = [], time.time()
        self._rpcs_at_start = self.driver_calls + self.plane.rpcs
        self.plane.begin_step(self.step_index)

    def _finish_step(self) -> StepReport:
        step = self.step_index
        end = self.plane.end_step(step)
        report = StepReport(step, self.mode, self._current, time.time() - self._step_t0, end.seconds,
                            self.driver_calls + self.plane.rpcs - self._rpcs_at_start)
        return self._record(report, end.ledger)

    def _record(self, report: StepReport, ledger: list[dict]) -> StepReport:
        """The one place a finished step is recorded (history, metrics, ledger rows); the
        cursor moves past it."""
        self.ledger_rows.extend(ledger)
        self.history.append(report)
        self.metric_rows.append({"step": report.step, "wall_s": report.wall_seconds, **report.metrics})
        self.step_index, self.next_stage, self._current = report.step + 1, 0, []
        return report

    # ---- schedules on worker groups (runtime/schedules.py) -------------------------------
    def _lanes(self, resumed: dict | None = None) -> Lanes:
        """The schedule on worker groups, after the updates done so far (or as a checkpoint's
        `schedule` state left it). It reaches the workers and the data plane through these calls only."""
        dispatch = Dispatch(call=self._call, gather=self._gather, abort=self._abort, end_step=self.plane.end_step,
                            timeout=self._timeout)
        at = {} if resumed is None else {"first_batch": resumed["next_batch"], "dropped": resumed["dropped_batches"],
                                         "replay": [InFlight(**f) for f in resumed["in_flight"]]}
        return Lanes(self.plan, self.mode, self.config.schedule, dispatch, start=self.step_index, **at)

    def _step_on_groups(self) -> StepReport:
        """One training update: Lanes runs until one finishes (or raises a named error, with
        everything in flight aborted: the workers need resume())."""
        try:
            report = self.lanes.step()
        except StageError as e:
            self.ledger_rows.extend(self.lanes.take_ledger())  # batches ended before the failure still count
            self.broken = (f"{type(e).__name__} in stage {e.stage!r} of schedule {self.config.schedule.kind!r}: "
                           "call resume() to restart from the last checkpoint")
            raise
        return self._record(report, self.lanes.take_ledger())

    # ---- dispatch ------------------------------------------------------------------------
    def _timeout(self, stage: Stage) -> float:
        return stage.timeout_s or self.config.cluster.stage_timeout_s

    def _call(self, method: str, workers: list[int], args: tuple) -> list:
        """Start `method(*args)` on each of `workers`; their refs, for `_gather`."""
        return [getattr(self.workers[w], method).remote(*args) for w in workers]

    def _run_stage(self, step: int, index: int) -> StageReport:
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        driver_spans = self.plane.run_on_driver(step, st)
        if driver_spans is not None:  # the driver ran it (centralized data loading)
            return StageReport(step, index, st.id, self.mode, [], driver_spans, time.perf_counter() - t0)
        args = self.plane.stage_args(step, st)  # one per worker of the stage, in rank order
        answers = self._gather([self.workers[w].run_stage.remote(step, index, a) for w, a in zip(st.ranks, args)],
                               step, st.id, self._timeout(st), workers=list(st.ranks))
        driver_spans = self.plane.stage_done(step, st, [h for _, h in answers])
        return StageReport(step, index, st.id, self.mode, [r for r, _ in answers], driver_spans,
                           time.perf_counter() - t0)

    def _run_step(self, step: int) -> list[StageReport]:
        if self.plane.driver_moves_data:
            return [self._run_stage(step, i) for i in range(len(self.plan.stages))]
        limit = sum(self._timeout(st) for st in self.plan.stages)
        try:
            per_worker = self._gather([w.run_step.remote(step) for w in self.workers], step, "(whole step)", limit)
        except StageError as e:
            if e.stage != "(whole step)":
                raise
            where = (stage_reached(self.session_id, e.worker, self.placement.worker_nodes[e.worker])
                     or "(whole step)")  # the stage the worker had reached
            raise type(e)(e.summary.replace("'(whole step)'", repr(where)), step=step, stage=where,
                          worker=e.worker, remote_traceback=e.remote_traceback) from None
        return stage_reports(step, self.plan.stages, self.mode, per_worker)

    def _run_step_or_retry(self, step: int) -> list[StageReport]:
        """A data-plane actor lost mid-step: the step runs again once, from its start,
        if no training stage could have changed a model yet."""
        try:
            return self._run_step(step)
        except PlaneLost as e:
            detected = time.time()
            if not self._retryable(step, e):
                raise
            if not self._recover(step):
                raise
            self.retries.append({"step": step, "stage": e.stage, "worker": e.worker, "reason": e.summary,
                                 "detected_at": detected})
            self._begin_step()
            return self._run_step(step)

    def _retryable(self, step: int, err: PlaneLost) -> bool:
        train = [s.index for s in self.plan.stages if s.type == "train"]
        try:
            failed = self.plan.stage(err.stage).index
        except KeyError:
            return False
        return not any(r["step"] == step for r in self.retries) and (not train or failed < min(train))

    # ---- waiting and failures --------------------------------------------------------------
    def _gather(self, refs: list, step: int, stage: str, limit_s: float, workers: list[int] | None = None) -> list:
        """Wait for every ref (the calls to `workers`, default all in rank order) within
        `limit_s`; on the first failure abort the step everywhere and raise an error naming
        stage, worker and step."""
        ranks = workers if workers is not None else list(range(len(refs)))
        index = {r: ranks[i] for i, r in enumerate(refs)}
        self._inflight = list(refs)
        self.driver_calls += len(refs)
        pending, deadline = list(refs), time.monotonic() + limit_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(index[r] for r in pending)
                self._abort(step, f"stage {stage!r} timed out on workers {late}")
                raise StageTimeout(f"stage {stage!r} of step {step} did not finish within {limit_s:.0f}s on workers "
                                   f"{late} (the node's timeout_s, or cluster.stage_timeout_s)", step=step,
                                   stage=stage, worker=late[0])
            self._check(ready[0], step, stage, index[ready[0]], pending, index)
        out = ray.get(refs, timeout=60)
        # what the driver received, counted as pickled bytes (a data plane's handoff is object refs, never pickled
        # here: pickling a ref out of band pins its object for good)
        self.metadata_bytes += sum(len(pickle.dumps(o[0] if isinstance(o, tuple) else o)) for o in out)
        return out

    def _check(self, ref, step: int, stage: str, worker: int, pending: list = (), index: dict | None = None) -> None:
        try:
            ray.get(ref, timeout=0)
        except GetTimeoutError:
            return
        except RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
            if PEER_LOST.search(str(cause or e)) and (dead := _dead_peer(pending, index or {})) is not None:
                worker, e = dead  # a collective broke because a peer died: the death is the error to name
                self._abort(step, f"worker {worker} died during stage {stage!r}")
                raise WorkerLost(f"worker {worker} died during stage {stage!r} of step {step}: {type(e).__name__}",
                                 step=step, stage=stage, worker=worker, remote_traceback=str(e)) from None
            self._abort(step, f"stage {stage!r} failed on worker {worker}")
            if isinstance(cause, StageError):  # keep the subclass (BufferLost, StageContractError, ...)
                raise type(cause)(cause.summary, step=cause.step, stage=cause.stage, worker=cause.worker,
                                  remote_traceback=cause.remote_traceback) from None
            raise StageError(f"stage {stage!r} failed on worker {worker} (step {step}): "
                             f"{type(cause or e).__name__}: {cause or e}", step=step, stage=stage, worker=worker,
                             remote_traceback=str(e)) from None
        except RayError as e:  # the actor died (RayActorError) or is unreachable (ActorUnavailableError)
            self._abort(step, f"worker {worker} died during stage {stage!r}")
            raise WorkerLost(f"worker {worker} died during stage {stage!r} of step {step}: {type(e).__name__}",
                             step=step, stage=stage, worker=worker, remote_traceback=str(e)) from None

    def _abort(self, step: int, reason: str) -> None:
        """Unblock workers waiting on this step inside the data plane."""
        try:
            self.plane.abort(step, reason)
        except RayError:  # an actor that is gone has no waiters
            pass

    def _settle(self, grace_s: float) -> bool:
        """Wait (at most `grace_s`) until every worker has left the failed call; False if
        some are stuck (a hung stage, a collective with a failed peer) or dead."""
        inflight = self._inflight
        if not inflight:
            return True
        done, pending = ray.wait(inflight, num_returns=len(inflight), timeout=grace_s)
        dead = False
        for r in done:
            try:
                ray.get(r, timeout=0)
            except RayActorError:
                dead = True
            except RayError:  # the failure itself, already reported
                pass
        return not pending and not dead

    def _recover(self, step: int, grace_s: float | None = None) -> bool:
        """Make `step` runnable again: every worker out of it, the data plane's state of
        it gone, every loader back at its start. False if that is not possible."""
        grace = min(60.0, self.config.cluster.stage_timeout_s) if grace_s is None else grace_s
        if not self._settle(grace):
            return False
        try:
            self.ledger_rows.extend(self.plane.reset_step(step))
            ray.get([w.rewind.remote() for w in self.workers], timeout=30)
        except (PlaneLost, RayError):
            return False
        return True

    def _fail(self, step: int, err: StageError) -> None:
        """After a failed step: the same step runs again on the next call, or (if the
        workers cannot) the session is broken until resume()."""
        self._current, self.next_stage = [], 0
        # a stage that timed out is hung: waiting longer for it only delays the error
        if not self._recover(step, grace_s=1.0 if isinstance(err, StageTimeout) else None):
            self.broken = (f"step {step} failed ({type(err).__name__}) and some workers or data-plane actors are "
                           "dead or still busy in it: call resume() to restart them from the last checkpoint")

    def _check_usable(self) -> None:
        if self.broken:
            raise SessionBroken(self.broken)
        if self.placement is None:
            raise SessionBroken("this session is closed")

    # ---- inspection ----------------------------------------------------------------------
    @property
    def bytes_to_driver(self) -> int:
        """Pickled bytes of every worker answer, plus payload bytes the data plane collected on the driver."""
        return self.metadata_bytes + self.plane.bytes_to_driver

    @property
    def spans(self) -> pd.DataFrame:
        frames = [r.spans for r in self.history] + [s.spans for s in self._current]
        return pd.concat(frames, ignore_index=True) if frames else spans_to_frame([])

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame(self.metric_rows)

    def weight_syncs(self) -> pd.DataFrame:
        """One row per weight sync: worker groups' SyncReports (side publish / pull; mode full, lora or
        delta; transport shm or object_store; a pull's load, copy or map; bytes; the parts gather,
        write, read, load, verify, delta) and colocated syncs' weight_sync spans (side colocated,
        total seconds only)."""
        rows = []
        for rep in [*self.history, *([StepReport(self.step_index, self.mode, self._current, 0.0)]
                                     if self._current else [])]:
            for st in rep.stages:
                for r in st.results:
                    rows += [{"step": r.step, "stage": r.stage_id, "worker": r.worker, **row} for row in r.weight_syncs]
                    if not r.weight_syncs:
                        rows += [{"step": r.step, "stage": r.stage_id, "worker": r.worker, "side": "colocated",
                                  "bytes": sp.bytes, "tensors": sp.items, "seconds": sp.seconds,
                                  "gbps": sp.bytes / sp.seconds / 1e9 if sp.seconds > 0 else float("nan")}
                                 for sp in r.spans if sp.phase == "weight_sync" and sp.bytes]
        return pd.DataFrame(rows)

    def items(self) -> pd.DataFrame:
        """One row per (step, stage, item) the driver kept: the item's id, token length,
        policy version and model turns (when its rows carry them; else -1), the worker and data-parallel rank that
        produced it, how its input arrived, and the training update it belongs to (`update`;
        the same as `step`, the data key, except in the async schedules)."""
        frames = []
        for rep in [*self.history, *([StepReport(self.step_index, self.mode, self._current, 0.0)]
                                     if self._current else [])]:
            for st in rep.stages:
                for r in st.results:
                    if r.item_ids is not None and len(r.item_ids):
                        frames.append(pd.DataFrame({
                            "step": r.step, "update": rep.step, "stage": r.stage_id, "stage_index": r.stage,
                            "worker": r.worker, "dp_rank": r.dp_rank, "route_in": r.route_in, "item_id": r.item_ids,
                            "tokens": r.item_tokens,
                            "version": r.item_versions if r.item_versions is not None else -1,
                            "turns": r.item_turns if r.item_turns is not None else -1}))
        cols = ["step", "update", "stage", "stage_index", "worker", "dp_rank", "route_in", "item_id", "tokens",
                "version", "turns"]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)

    def ledger(self) -> pd.DataFrame:
        """Items in and out of the data plane per (step, edge): nothing lost, nothing duplicated.
        Collected by the driver at every step end, so it survives an actor restart."""
        if not self.ledger_rows:
            return pd.DataFrame(columns=["step", "edge", *LEDGER_COLUMNS])
        df = pd.DataFrame(self.ledger_rows).reindex(columns=["step", "edge", *LEDGER_COLUMNS]).fillna(0)
        return df.groupby(["step", "edge"], as_index=False)[list(LEDGER_COLUMNS)].sum().astype(
            {c: "int64" for c in LEDGER_COLUMNS})

    def peek(self, stage: str, worker: int = 0, n: int = 4, columns: list[str] | None = None):
        """The first `n` rows of `stage`'s latest output on `worker` (only those rows travel)."""
        self.plan.stage(stage)
        out = ray.get(self.workers[worker].peek.remote(stage, n, columns), timeout=60)
        if out is None:
            raise KeyError(f"worker {worker} holds no output of stage {stage!r} yet (run it first; "
                           "keep_outputs must be on)")
        return out

    def samples(self, stage: str, worker: int = 0, n: int = 4) -> list[dict]:
        self.plan.stage(stage)
        return ray.get(self.workers[worker].samples.remote(stage, n), timeout=60)

    def redistribution_lengths(self) -> dict[str, tuple[np.ndarray, int]]:
        """For each redistribute edge: the token length of every item its producers
        emitted in the latest step (global order) and the consumers' dp size."""
        out = {}
        for e in self.plan.edges:
            if e.kind != "redistribute":
                continue
            src, dst = self.plan.stages[e.src], self.plan.stages[e.dst]
            writers = [w for w in range(len(self.workers)) if src.group_rank(w) == 0]
            parts = ray.get([self.workers[w].lengths.remote(src.id) for w in writers], timeout=60)
            if all(p is not None for p in parts):
                out[e.name] = (np.concatenate(parts), dst.dp)
        return out

    def driver_context(self, step: int, stage: Stage, dp_rank: int, loader: Any) -> Any:
        """The context the driver runs a stage with (centralized data loading)."""
        return stage_context(stage, step=step, worker=dp_rank * stage.group_size, world_size=len(self.workers),
                             session_seed=self.config.seed, dp_rank=dp_rank, config=self.config.algo, loader=loader)

    # ---- checkpoints ---------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """What a checkpoint must match to be loaded into this session."""
        algo = self.config.algo
        fp = {"dag": self.dag.name, "stages": [s.id for s in self.plan.stages],
              "world_size": self.config.cluster.world_size, "seed": self.config.seed}
        if hasattr(algo, "model"):
            fp.update(algorithm=algo.algorithm.name, data=algo.data.train)
        return fp

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Trainable engines, optimizer state, loader positions and the step, between steps.
        On worker groups also the schedule's state: the policy version, the batches generated
        but not yet trained (with the versions they came from, whose policies the WeightBoard
        holds and the checkpoint keeps) and the batch to read next; a resumed run replays them.
        Atomic: written to a temporary folder, checksummed in manifest.json, then renamed;
        a write killed halfway never leaves a folder that loads."""
        self._check_usable()
        if self.next_stage != 0:
            raise RuntimeError(f"checkpoint between steps only: step {self.step_index} is at stage "
                               f"{self.next_stage}; call step() to finish it first")
        d = Path(directory)
        tmp = d.with_name(f".{d.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            schedule = self._schedule_state()
            resume_step = schedule["next_batch"] if schedule else self.step_index
            versions = tuple(sorted({f["version"] for f in schedule["in_flight"] if f["how"] == "replayed"})) \
                if schedule else ()
            self._gather([w.save_checkpoint.remote(str(tmp), self.step_index, resume_step, versions)
                          for w in self.workers], self.step_index, "save_checkpoint",
                         SETUP_STAGES * self.config.cluster.stage_timeout_s)
        except StageError as e:  # a worker died or failed mid-write: the partial folder never loads
            self.broken = (f"checkpoint {d} failed ({type(e).__name__}): call resume() to restart from the last "
                           "complete checkpoint")
            raise
        self.plane.save(tmp)
        (tmp / "state.json").write_text(json.dumps({"next_step": self.step_index, "mode": self.mode,
                                                    "fingerprint": self.fingerprint(), "schedule": schedule},
                                                   indent=1))
        write_manifest(tmp)
        if d.exists():
            old = d.with_name(f".{d.name}.old-{os.getpid()}")
            d.rename(old)
            tmp.rename(d)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(d)
        self.last_checkpoint = d
        return d

    def _schedule_state(self) -> dict | None:
        """On worker groups: what a resumed schedule needs (see save_checkpoint); None otherwise."""
        if self.lanes is None:
            return None
        try:
            held = self.lanes.settle()
        except StageError as e:
            self.ledger_rows.extend(self.lanes.take_ledger())
            self.broken = f"{type(e).__name__} while the schedule settled for a checkpoint: call resume()"
            raise
        return {"kind": self.config.schedule.kind, "max_staleness": self.config.schedule.staleness,
                "policy_version": self.step_index, "next_batch": held[0].batch if held else self.lanes.next_batch,
                "dropped_batches": self.lanes.stats.dropped, "in_flight": [dataclasses.asdict(f) for f in held]}

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore a checkpoint of this configuration; the next step() continues after it."""
        d = Path(directory)
        verify_checkpoint(d)
        state = json.loads((d / "state.json").read_text())
        mine = self.fingerprint()
        diff = {k: (state["fingerprint"].get(k), v) for k, v in mine.items() if state["fingerprint"].get(k) != v}
        if diff:
            raise CheckpointError(f"checkpoint {d} is from another configuration: "
                                  + "; ".join(f"{k}: checkpoint {a!r} vs session {b!r}" for k, (a, b) in diff.items()))
        if self.lanes is not None:  # batches generated ahead of the loaded step are never trained
            for batch in self.lanes.discard():
                self.ledger_rows.extend(self.plane.reset_step(batch))
        self._gather([w.load_checkpoint.remote(str(d)) for w in self.workers], state["next_step"], "load_checkpoint",
                     SETUP_STAGES * self.config.cluster.stage_timeout_s)
        self.plane.load(d)
        self.step_index, self.next_stage = state["next_step"], 0
        if self.lanes is not None:  # the schedule continues after the loaded step, replaying what was in flight
            self.lanes = self._lanes(state.get("schedule"))
        self.last_checkpoint = d
        return self.step_index

    def resume(self, directory: str | Path | None = None) -> int:
        """After a failure (a worker died, a stage timed out): restart every worker and
        data-plane actor, then load `directory` or the last checkpoint this session saved
        or loaded. The next step() continues after it."""
        ckpt = Path(directory) if directory else self.last_checkpoint
        if ckpt is None:
            raise CheckpointError("no checkpoint to resume from: call save_checkpoint() during the run "
                                  "(or trainer.checkpoint_every), or pass a directory")
        self.close()
        self._current, self.next_stage, self.broken = [], 0, None
        self._start()
        return self.load_checkpoint(ckpt)
