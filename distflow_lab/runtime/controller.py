"""The controller: one per session, for every data plane and every schedule.

It holds a data plane (`dataplane.interface.DataPlane`) and a schedule
(`runtime.schedule.Schedule`, named by `schedule.kind`) and asks neither which one it is.
It owns the cursor (the updates done), places and starts the workers, builds the
schedule's `Dispatch` (calls to workers, the one gather of runtime/gather.py, the data
plane's batch ends, recovery), records every finished update in one place (`_record`:
history, metrics, ledger), turns a failure into the session's state by the schedule's
own rule (`Schedule.failed`), and writes and loads checkpoints (the schedule's part is
`Schedule.state()`).

    step():  schedule.step() -> UpdateReport -> _record
             (sync, runtime/schedule_sync.py: plane.begin_batch, the stages, plane.end_batch;
              one_step_off / async, runtime/schedule_lanes.py: Lanes on two worker groups)
    failure: schedule.failed(err) -> None (the same update can run again) or why the session is broken

The driver keeps only metadata: update reports (timings, counts, metrics). It
counts the pickled bytes of everything workers send it (`bytes_to_driver`, as each worker
measured its own answer), so a test can show which modes move payloads through it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import ray
from ray.exceptions import RayError
from tqdm.auto import tqdm

from distflow_lab.core.config import SessionConfig, WeightSyncOptions, check_groups, check_schedule
from distflow_lab.core.errors import CheckpointError, PlaneLost, SessionBroken, StageError
from distflow_lab.core.spans import spans_to_frame
from distflow_lab.core.registry import user_entries
from distflow_lab.dataplane.interface import DataPlane, PlaneSetup, Routing
from distflow_lab.datasets.loader import check_data_node
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.planner import Plan, Stage
from distflow_lab.runtime.checkpoint_files import verify_checkpoint, write_manifest
from distflow_lab.runtime.context import stage_context
from distflow_lab.runtime.profiling import ProfileSpec
from distflow_lab.runtime.progress import stage_reached
from distflow_lab.runtime.placement import Placement, default_threads, free_port, node_ip, place_workers, release
from distflow_lab.runtime.gather import StageName, any_failed, gather, settle, wait
from distflow_lab.runtime.results import LEDGER_COLUMNS, StageReport, UpdateReport
from distflow_lab.runtime.schedule import Dispatch, Schedule, ScheduleSetup, open_schedule
from distflow_lab.runtime import schedule_lanes, schedule_sync  # noqa: F401  (they register their schedules)
from distflow_lab.runtime.weights import WeightBoard, board_keep
from distflow_lab.runtime.worker import WorkerSetup
from distflow_lab.runtime.worker_pool import POOL, PoolKey, current_cluster

SETUP_STAGES = 4  # engine set-up (model loading) may take this many stage timeouts
PARK_TIMEOUT_S = 10.0  # a closing session's workers must reset within this to be parked for the next one


def torch_worlds(plan: Plan) -> list[tuple[int, int]]:
    """(first worker, workers) of each torch.distributed world: one per worker group, else one."""
    return [(first, n) for _, first, n in plan.groups] or [(0, plan.world_size)]


class Controller:
    def __init__(self, dag: DAG, config: SessionConfig, plane: DataPlane, engines: str | Callable | None = None,
                 reuse: "Controller | None" = None, routing: Routing | None = None) -> None:
        self.config, self.dag, self.plane, self.engines = config, dag, plane, engines
        self.routing = routing or Routing(config.switches.balance)
        self.plan: Plan = dag.plan(config.cluster.world_size)
        self.mode = plane.mode
        self.updates = 0  # training updates done: the cursor
        self.history: deque[UpdateReport] = deque(maxlen=config.history_steps)
        self.metric_rows: list[dict] = []
        self.ledger_rows: list[dict] = []  # kept by the driver: they survive a data-plane actor's restart
        self.retries: list[dict] = []  # batches re-run after a data-plane actor died
        self.metadata_bytes = 0
        self.driver_calls = 0  # stage and batch calls to workers, cumulative
        self.broken: str | None = None  # why the workers cannot run another update (until resume())
        self.last_checkpoint: Path | None = None
        self.placement: Placement | None = None
        self.board = None  # the WeightBoard, when generation and training run on disjoint groups
        self.schedule: Schedule | None = None
        self.session_id = uuid.uuid4().hex[:12]
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
                                schedule=self.config.schedule, weight_sync=self._weight_sync(),
                                extensions=user_entries())
            self.worker_info = self._gather([w.setup.remote(setup) for w in self.workers], -1, "setup",
                                            SETUP_STAGES * c.stage_timeout_s)
            self.plane.ready()
            self.schedule = self._open_schedule()
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
    @property
    def next_stage(self) -> int:
        """The next stage of the current update (0 between updates)."""
        return self.schedule.position if self.schedule is not None else 0

    def step_stage(self) -> StageReport:
        """Run the next stage on every worker; return what happened."""
        self._check_usable()
        try:
            report, done = self.schedule.step_stage()
        except StageError as e:
            self._failed(e)
            raise
        if done is not None:
            self._record(done)
        return report

    def step(self) -> UpdateReport:
        """Run the schedule until one more training update has finished (the rest of it, after
        step_stage calls); its report."""
        self._check_usable()
        try:
            report = self.schedule.step()
        except StageError as e:
            self._failed(e)
            raise
        return self._record(report)

    def run(self, steps: int, progress: bool = True) -> list[UpdateReport]:
        out = []
        bar = tqdm(range(steps), desc=f"{self.mode} updates", disable=not progress, leave=False)
        for _ in bar:
            out.append(self.step())
            bar.set_postfix({k: round(v, 4) for k, v in list(out[-1].metrics.items())[:4]})
        bar.close()
        return out

    def _record(self, report: UpdateReport) -> UpdateReport:
        """The one place a finished update is recorded (history, metrics, the schedule's ledger
        rows); the cursor moves past it."""
        self.ledger_rows.extend(self.schedule.take_ledger())
        self.history.append(report)
        self.metric_rows.append({"update": report.update, "wall_s": report.wall_seconds, **report.metrics})
        self.updates = report.update + 1
        return report

    def _failed(self, err: StageError) -> None:
        """After a failed update: the batches the schedule ended still count; by the schedule's own
        rule, the same update runs again on the next call or the session is broken until resume()."""
        self.ledger_rows.extend(self.schedule.take_ledger())
        self.broken = self.schedule.failed(err)

    # ---- the schedule's view of the cluster ------------------------------------------------
    def _open_schedule(self, state: dict | None = None) -> Schedule:
        """The session's schedule, after the updates done so far (or as a checkpoint's `schedule`
        state left it). It reaches the workers and the data plane through this Dispatch only."""
        dispatch = Dispatch(call=self._call, gather=self._gather, wait=wait, failed=any_failed, now=time.monotonic,
                            abort=self._abort, end_batch=self.plane.end_batch, timeout=self._timeout,
                            rpcs=lambda: self.driver_calls + self.plane.rpcs, recover=self._recover,
                            reached=self._reached, retried=self.retries.append)
        return open_schedule(ScheduleSetup(self.plan, self.mode, self.config.schedule, dispatch, self.plane,
                                           self.updates, state))

    def _timeout(self, stage: Stage) -> float:
        return stage.timeout_s or self.config.cluster.stage_timeout_s

    def _call(self, method: str, workers: list[int], args: tuple) -> list:
        """Start `method(*args)` on each of `workers`; their refs, for `_gather`."""
        return [getattr(self.workers[w], method).remote(*args) for w in workers]

    def _reached(self, worker: int) -> str | None:
        """The stage `worker` last reached (its progress board), e.g. inside a whole-batch call."""
        return stage_reached(self.session_id, worker, self.placement.worker_nodes[worker])

    def _gather(self, refs: list, batch_id: int, stage: StageName, limit_s: float, workers: list[int] | None = None) -> list:
        """Every answer of `refs` (the calls to `workers`, default all in rank order) within `limit_s`,
        or the named error (runtime/gather.py) with the batch aborted in the data plane."""
        self._inflight = list(refs)
        self.driver_calls += len(refs)
        return gather(refs, workers if workers is not None else list(range(len(refs))), batch_id, stage, limit_s,
                      self._abort, received=self._received)

    def _received(self, nbytes: int) -> None:
        """What the driver received from workers, as they measured it (runtime/gather.py: `sized`)."""
        self.metadata_bytes += nbytes

    def _abort(self, batch_id: int, reason: str) -> None:
        """Unblock workers waiting on this batch inside the data plane."""
        try:
            self.plane.abort(batch_id, reason)
        except RayError:  # an actor that is gone has no waiters
            pass

    def _recover(self, batch_id: int, grace_s: float | None = None) -> bool:
        """Make `batch_id` runnable again: every worker out of it, the data plane's state of
        it gone, every loader back at its start. False if that is not possible."""
        grace = min(60.0, self.config.cluster.stage_timeout_s) if grace_s is None else grace_s
        if not settle(self._inflight, grace):
            return False
        try:
            self.ledger_rows.extend(self.plane.reset_batch(batch_id))
            ray.get([w.rewind.remote() for w in self.workers], timeout=30)
        except (PlaneLost, RayError):
            return False
        return True

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
        frames = [r.spans for r in self.history] + [s.spans for s in self._in_progress()]
        return pd.concat(frames, ignore_index=True) if frames else spans_to_frame([])

    def _in_progress(self) -> list[StageReport]:
        return list(self.schedule.current) if self.schedule is not None else []

    def _reports(self) -> list[UpdateReport]:
        """Every update report kept, and the stages run so far of the update in progress."""
        now = self._in_progress()
        return [*self.history, *([UpdateReport(self.updates, self.mode, now, 0.0)] if now else [])]

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame(self.metric_rows)

    def weight_syncs(self) -> pd.DataFrame:
        """One row per weight sync: worker groups' SyncReports (side publish / pull; mode full, lora or
        delta; transport shm or object_store; a pull's load, copy or map; bytes; the parts gather,
        write, read, load, verify, delta) and colocated syncs' weight_sync spans (side colocated,
        total seconds only)."""
        rows = []
        for rep in self._reports():
            for st in rep.stages:
                for r in st.results:
                    rows += [{"batch_id": r.batch_id, "stage": r.stage_id, "worker": r.worker, **row} for row in r.weight_syncs]
                    if not r.weight_syncs:
                        rows += [{"batch_id": r.batch_id, "stage": r.stage_id, "worker": r.worker, "side": "colocated",
                                  "bytes": sp.bytes, "tensors": sp.items, "seconds": sp.seconds,
                                  "gbps": sp.bytes / sp.seconds / 1e9 if sp.seconds > 0 else float("nan")}
                                 for sp in r.spans if sp.phase == "weight_sync" and sp.bytes]
        return pd.DataFrame(rows)

    def items(self) -> pd.DataFrame:
        """One row per (batch, stage, item) the driver kept: the item's id, token length,
        policy version and model turns (when its rows carry them; else -1), the worker and data-parallel rank that
        produced it, how its input arrived, and the training update it belongs to (`update`;
        the same as `batch_id`, the data key, except in the async schedules)."""
        frames = []
        for rep in self._reports():
            for st in rep.stages:
                for r in st.results:
                    if r.item_ids is not None and len(r.item_ids):
                        frames.append(pd.DataFrame({
                            "batch_id": r.batch_id, "update": rep.update, "stage": r.stage_id, "stage_index": r.stage,
                            "worker": r.worker, "dp_rank": r.dp_rank, "route_in": r.route_in, "item_id": r.item_ids,
                            "tokens": r.item_tokens,
                            "version": r.item_versions if r.item_versions is not None else -1,
                            "turns": r.item_turns if r.item_turns is not None else -1}))
        cols = ["batch_id", "update", "stage", "stage_index", "worker", "dp_rank", "route_in", "item_id", "tokens",
                "version", "turns"]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)

    def ledger(self) -> pd.DataFrame:
        """Items in and out of the data plane per (batch, edge): nothing lost, nothing duplicated.
        Collected by the driver at every batch end, so it survives an actor restart."""
        if not self.ledger_rows:
            return pd.DataFrame(columns=["batch_id", "edge", *LEDGER_COLUMNS])
        df = pd.DataFrame(self.ledger_rows).reindex(columns=["batch_id", "edge", *LEDGER_COLUMNS]).fillna(0)
        return df.groupby(["batch_id", "edge"], as_index=False)[list(LEDGER_COLUMNS)].sum().astype(
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
        emitted in the latest batch (global order) and the consumers' dp size."""
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

    def driver_context(self, batch_id: int, stage: Stage, dp_rank: int, loader: Any) -> Any:
        """The context the driver runs a stage with (centralized data loading)."""
        return stage_context(stage, batch_id=batch_id, worker=dp_rank * stage.group_size, world_size=len(self.workers),
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
        """Trainable engines, optimizer state, loader positions and the update count, between updates.
        On worker groups also the schedule's state: the policy version, the batches generated
        but not yet trained (with the versions they came from, whose policies the WeightBoard
        holds and the checkpoint keeps) and the batch to read next; a resumed run replays them.
        Atomic: written to a temporary folder, checksummed in manifest.json, then renamed;
        a write killed halfway never leaves a folder that loads."""
        self._check_usable()
        if self.next_stage != 0:
            raise RuntimeError(f"checkpoint between updates only: update {self.updates} is at stage "
                               f"{self.next_stage}; call step() to finish it first")
        d = Path(directory)
        tmp = d.with_name(f".{d.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            schedule = self._schedule_state()
            resume_batch, versions = schedule["next_batch"], tuple(schedule["keep_versions"])
            self._gather([w.save_checkpoint.remote(str(tmp), self.updates, resume_batch, versions)
                          for w in self.workers], self.updates, "save_checkpoint",
                         SETUP_STAGES * self.config.cluster.stage_timeout_s)
        except StageError as e:  # a worker died or failed mid-write: the partial folder never loads
            self.broken = (f"checkpoint {d} failed ({type(e).__name__}): call resume() to restart from the last "
                           "complete checkpoint")
            raise
        self.plane.save(tmp)
        (tmp / "state.json").write_text(json.dumps({"next_update": self.updates, "mode": self.mode,
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

    def _schedule_state(self) -> dict:
        """The schedule's part of a checkpoint (it may settle work in flight first: see Schedule.state)."""
        try:
            return self.schedule.state()
        except StageError as e:  # whatever was in flight was aborted
            self.ledger_rows.extend(self.schedule.take_ledger())
            self.broken = f"{type(e).__name__} while the schedule settled for a checkpoint: call resume()"
            raise

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
        next_update = state.get("next_update", state.get("next_step"))  # "next_step": before the rename
        for batch_id in self.schedule.discard():  # batches generated ahead of the loaded update are never trained
            self.ledger_rows.extend(self.plane.reset_batch(batch_id))
        self._gather([w.load_checkpoint.remote(str(d)) for w in self.workers], next_update, "load_checkpoint",
                     SETUP_STAGES * self.config.cluster.stage_timeout_s)
        self.plane.load(d)
        self.updates = next_update
        self.schedule = self._open_schedule(state.get("schedule"))  # after the loaded update, replaying what was in flight
        self.last_checkpoint = d
        return self.updates

    def resume(self, directory: str | Path | None = None) -> int:
        """After a failure (a worker died, a stage timed out): restart every worker and
        data-plane actor, then load `directory` or the last checkpoint this session saved
        or loaded. The next step() continues after it."""
        ckpt = Path(directory) if directory else self.last_checkpoint
        if ckpt is None:
            raise CheckpointError("no checkpoint to resume from: call save_checkpoint() during the run "
                                  "(or trainer.checkpoint_every), or pass a directory")
        self.close()
        self.broken = None
        self._start()
        return self.load_checkpoint(ckpt)
