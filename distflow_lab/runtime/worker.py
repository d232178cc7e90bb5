"""DAG worker (paper §5.2): one per device slot. It binds every stage of the
plan to its function, owns its engines and its loader shard, and runs the task
chain. A stage is always the same three moves:

    batch = port.fetch(...)      # local cache, DataBuffer, coordinator or the driver's chunk
    out = fn(batch, ctx)         # the stage function
    port.publish(..., out)       # local cache, DataBuffer, coordinator or back to the driver

`port` is the worker half of the session's data plane; the worker never asks
which one it is. The class is plain Python; the controller wraps it with
`ray.remote`.
"""
from __future__ import annotations

import gc
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import ray
import torch
from ray.exceptions import RayError

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ScheduleOptions, WeightSyncOptions
from distflow_lab.core.errors import StageContractError, StageError, WeightBoardLost, WeightSyncMismatch, WeightSyncTimeout
from distflow_lab.core.registry import install
from distflow_lab.core.spans import SpanRecorder
from distflow_lab.dataplane.interface import WorkerPort, WorkerSpec
from distflow_lab.dataplane.routing import item_lengths
from distflow_lab.datasets.loader import ShardedLoader, make_loader
from distflow_lab.graph.nodes import call_stage, resolve_function
from distflow_lab.graph.planner import Plan, Stage
from distflow_lab.runtime.context import StageContext, stage_context
from distflow_lab.runtime.engines import StageState, WorkerEngines, check_engines
from distflow_lab.runtime.gather import sized
from distflow_lab.runtime.profiling import ProfileSpec, profile_stage
from distflow_lab.runtime.progress import ProgressNote
from distflow_lab.runtime.results import StageResult
from distflow_lab.runtime.samples import sample_rows
from distflow_lab.runtime.shm_slots import MAX_READERS, SlotReader, SlotRing
from distflow_lab.runtime.weight_transport import (DeltaBase, Manifest, SyncReport, apply_delta, publish, publish_state,
                                                   read_state, receive)
from distflow_lab.runtime.weights import ring_slots


@dataclass
class WorkerSetup:
    """Everything a worker needs, sent once by the driver."""

    plan: Plan
    mode: str
    seed: int
    plane: WorkerSpec  # the worker half of the data plane, bound on the worker
    session: str = ""  # names this session's progress notes
    config: Any = None  # the run config, visible to stages as ctx.config
    engines: str | Callable | None = None  # factory(ctx, config) -> engines (runtime.engines.WorkerEngines)
    keep_outputs: bool = True  # keep each stage's output of the latest batch (for peek)
    threads: int = 1
    profile: ProfileSpec | None = None  # torch.profiler traces of chosen stages and batches
    board: Any = None  # the WeightBoard actor when generation and training run on disjoint groups
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)  # visible to stages as ctx.schedule
    weight_sync: WeightSyncOptions = field(default_factory=WeightSyncOptions)  # worker groups: buckets, deadline
    extensions: dict = field(default_factory=dict)  # the driver's registry entries defined outside the library


def _timed(tensors: Iterable[tuple[str, torch.Tensor]], report: SyncReport) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, with the time the consumer spends on each (its copy into the engine) counted as
    "load" (receive() counts its own read and verify, outside the yield)."""
    for item in tensors:
        t0 = time.perf_counter()
        yield item
        report.parts["load"] += time.perf_counter() - t0


def with_item_ids(out: Batch, batch_id: int, stage: int, dp_rank: int) -> Batch:
    """Rows keep their `item_id` across stages and edges; rows a stage created get one:
    (batch, stage, dp rank, row) packed in an int64 (the same in every mode)."""
    if "item_id" in out or not len(out):
        return out
    ids = (batch_id << 36) | (stage << 28) | (dp_rank << 18) | torch.arange(len(out), dtype=torch.int64)
    return out.with_columns(item_id=ids)


class DAGWorker:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        try:
            self.node = ray.get_runtime_context().get_node_id()[:8]
        except Exception:  # not inside Ray (unit tests)
            self.node = "local"
        self.rec = SpanRecorder(rank, self.node)
        self.syncs: list[dict] = []  # SyncReport rows since the last stage result (weight_transport.py)
        self.ring: SlotRing | None = None  # a publisher's shared-memory slots (weight_sync.transport shm)
        self.delta: DeltaBase | None = None  # a publisher's copy of its last version (weight_sync.mode delta)
        self.slots = SlotReader(rank % (MAX_READERS // 2))  # its mappings of publishers' slots (marks: bottom half)
        self.port: WorkerPort | None = None
        self.outputs: dict[str, Batch] = {}
        self.engines: WorkerEngines = StageState(rank=rank)
        self.loader: ShardedLoader | None = None
        self.groups: dict[str, Any] = {}
        self.faults: list[dict] = []
        self.note: ProgressNote | None = None
        self._loader_at_batch_start: dict | None = None
        self._loader_at: dict[int, dict] = {}  # loader state at each recent batch's start (async checkpoints)
        self._version_min: int | None = None
        self._trains_by: int | None = None  # set during a generation segment (async schedules)
        self.dist_base = 0  # the DAG rank of this worker's torch.distributed rank 0 (worker groups: per group)

    # ---- lifecycle ---------------------------------------------------------------
    @sized
    def setup(self, s: WorkerSetup) -> dict:
        """(Re)configure this worker for a plan. Called again when a session reuses the
        workers for another DAG, mode or switches: everything of the last plan goes."""
        self._reset()
        install(s.extensions)  # a notebook's estimators, losses, algorithms: the same names here as in the driver
        self.s, self.plan = s, s.plan
        self.rec.mode = s.mode
        torch.set_num_threads(max(1, s.threads))
        self.fns = [resolve_function(st.fn, node=st.id) for st in self.plan.stages]
        self.groups = self._layout_groups()
        self.port = s.plane.bind(self.rank, self.rec)
        self.note = ProgressNote(s.session, self.rank)
        first = self.plan.stages[0]
        if first.type == "data_load" and first.data is not None and s.plane.loads_data and first.runs_on(self.rank):
            self.loader = make_loader(first.data, first.dp_rank(self.rank), first.dp, s.seed)
        self.mine = [st.index for st in self.plan.stages_on(self.rank)]  # the stages this worker runs
        if s.engines is not None:
            home = self.plan.stages[self.mine[0]] if self.mine else first
            made = resolve_function(s.engines, node="engines")(self._ctx(0, home), s.config)
            self.engines = check_engines(made, s.engines if isinstance(s.engines, str) else repr(s.engines))
        gc.collect()
        gc.freeze()  # start-up objects (torch, Ray) leave the GC's view: later collections stay short
        return {"rank": self.rank, "node": self.node, "pid": os.getpid(),
                "loader": self.loader.report.__dict__ if self.loader else None}

    def _layout_groups(self) -> dict[str, Any]:
        """One process group per stage layout (collective: every worker creates every
        group in the same order); each stage gets the group that holds this worker."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        base, size = self.dist_base, dist.get_world_size()
        made: dict[tuple[int, int, int, int], Any] = {}
        for st in self.plan.stages:
            key = (st.first, st.workers, st.dp, st.group_size)
            if key in made or not (base <= st.first and st.first + st.workers <= base + size):
                continue  # a stage of another worker group: not in this world
            made[key] = None
            for g in range(st.group_size):
                group = dist.new_group([st.worker_of(d, g) - base for d in range(st.dp)])
                if st.runs_on(self.rank) and st.group_rank(self.rank) == g:
                    made[key] = group
        return {st.id: made[k] for st in self.plan.stages
                if (k := (st.first, st.workers, st.dp, st.group_size)) in made and made[k] is not None}

    def _reset(self) -> None:
        self._clear_batch()
        self.engines.close()
        self.engines, self.loader, self.faults = StageState(rank=self.rank), None, []
        if self.note is not None:
            self.note.close()
            self.note = None
        self._loader_at_batch_start = None  # a reused worker must not restore the last plan's loader
        self._loader_at = {}
        self.rec.take()
        if self.ring is not None:  # a new plan's publisher starts its own slots
            self.ring.close()
            self.ring = None
        self.delta = None
        gc.unfreeze()  # setup froze the last plan's objects: let the collector free what they left in cycles
        gc.collect()
        self.slots.close()  # and the slots its rollout computed from (weight_sync.load "map"), marks with them

    def park(self) -> bool:
        """The session closed healthy: drop everything of its plan but keep the process and its
        torch.distributed world, for the next session of this shape (runtime/worker_pool.py).
        False: this process should not serve another session. Closing a vLLM engine destroys
        torch.distributed's groups, the session's world among them, and a next session's FSDP2
        groups built on a world joined again in the same process failed ("Could not resolve the
        process group"): such a worker is not parked."""
        import torch.distributed as dist

        had_world = dist.is_initialized()
        self._reset()
        self.port = None  # the closed session's data plane
        return dist.is_initialized() or not had_world

    def alive(self) -> int:
        """A parked worker's liveness check: its pid."""
        return os.getpid()

    @sized
    def init_process_group(self, master_addr: str, port: int, backend: str = "gloo", timeout_s: float = 300.0,
                           rank: int | None = None, world_size: int | None = None) -> bool:
        """Join a torch.distributed world as `rank` of `world_size` (default: every worker, by DAG
        rank); a worker group's world numbers its workers from 0 (`self.dist_base` maps back)."""
        import datetime

        import torch.distributed as dist

        self._reset()  # the last plan's engines go first: closing a vLLM engine destroys the default group
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        self.dist_base = self.rank - rank  # the DAG rank of this world's rank 0
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        if not dist.is_initialized():  # a bounded timeout: a dead peer must not hang collectives forever
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return True

    def close(self) -> None:
        self._reset()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a broken group cannot be destroyed cleanly; the process ends anyway
            pass

    # ---- running -------------------------------------------------------------------
    @sized
    def run_batch(self, batch_id: int) -> list[StageResult]:
        """Every stage of `batch_id` this worker runs, back to back (data planes where the driver moves no data)."""
        return self.run_segment(batch_id, self.mine)

    def run_segment(self, batch_id: int, stages: list[int]) -> list[StageResult]:
        """These stages of `batch_id` (those this worker runs), back to back."""
        results = []
        for i in stages:
            if i in self.mine:
                self.note.write(batch_id, self.plan.stages[i].id)  # read only to name the stage of a failure
                results.append(self._run_stage(batch_id, i)[0])
        return results

    # ---- weight sync between groups (see weights.py) ----------------------------------
    @sized
    def generate_segment(self, batch_id: int, stages: list[int], trains_by: int | None = None,
                         version: int | None = None, replayed: bool = False) -> dict:
        """A generation segment: pull policy `version` (the newest when the driver launched it,
        so the pacing, not the moment the call starts, decides; None: the newest now), then run
        the stages. `replayed`: a batch generated again after a resume, at exactly the version it
        first came from. `trains_by` is the latest update the batch will train at (the rollout
        ages out sequences that would be too stale by then). Returns the results and the policy
        version every row of its output came from (`version_min`: the oldest token's)."""
        first = self.plan.stages[stages[0]]
        self.pull_weights(batch_id, first.id, version, strict=replayed)
        self._version_min, self._trains_by = None, trains_by
        try:
            results = self.run_segment(batch_id, stages)
        finally:
            self._trains_by = None
        w = self.engines.weights
        version = w.version if w is not None else 0
        return {"results": results, "version": version, "checksum": w.checksum() if w is not None else 0.0,
                "version_min": version if self._version_min is None else self._version_min}

    @sized
    def train_segment(self, batch_id: int, stages: list[int]) -> dict:
        """A training segment, then publish the updated policy (collective export). Returns the
        results and the policy version before and after the segment (None: no weights engine;
        the driver checks that each update advanced it by one)."""
        before = self.engines.weights.version if self.engines.weights is not None else None
        results = self.run_segment(batch_id, stages)
        w = self.engines.weights
        if w is None:
            return {"results": results, "version": None, "version_before": before, "checksum": 0.0}
        checksum = self._publish(batch_id, self.plan.stages[stages[-1]])
        if results:
            results[-1].spans.extend(self.rec.take())
            results[-1].weight_syncs.extend(self._take_syncs())
        return {"results": results, "version": w.version, "version_before": before, "checksum": checksum}

    def _publish(self, batch_id: int, last: Stage) -> float:
        """Post this training group's policy at its version to the WeightBoard (a `weight_sync` span
        on `last`, the group's last stage, and a SyncReport); collective over the group: every rank
        iterates the gathered buckets, one puts them. Returns its checksum."""
        w, opts = self.engines.weights, self.s.weight_sync
        puts = last.dp_rank(self.rank) == 0 and last.group_rank(self.rank) == 0
        report = SyncReport("publish", w.version)
        with self.rec.span(batch_id, last.id, "weight_sync") as sp:
            corrupt = 0 if puts and self._maybe_fault(batch_id, last.id, "corrupt_weights") else None
            mid = (lambda b: self._maybe_fault(batch_id, last.id, "exit_mid_sync")) if puts else None
            if puts and opts.transport == "shm" and self.ring is None:
                self.ring = SlotRing(ring_slots(self.s.schedule.staleness))
            if puts and opts.mode == "delta" and self.delta is None:
                self.delta = DeltaBase()
            manifest = self._sync_errors(batch_id, last.id, lambda: publish(
                w.export_buckets(opts.bucket_mib << 20), w.version, w.aliases(), put=puts, report=report,
                corrupt=corrupt, after_put=mid, ring=self.ring, deadline_s=opts.timeout_s, mode=w.mode,
                delta=self.delta))
            if puts:
                sp.bytes, sp.items = manifest.nbytes, len(manifest.entries)
                self._board(batch_id, last.id, "post", lambda b: b.post.remote(w.version, manifest, manifest.checksum,
                                                                           manifest.nbytes))
        if puts:
            self.syncs.append(report.row())
        return manifest.checksum

    def pull_weights(self, batch_id: int, stage: str, version: int | None = None, strict: bool = False) -> int:
        """Load policy `version` if the board holds it (None, or not held: the newest published,
        if newer than ours); returns our version. `strict`: exactly `version`, or
        WeightBoardLost. A stage function calls it between decode chunks for partial rollouts.
        The sync reads and checks every tensor (WeightSyncMismatch) within weight_sync.timeout_s
        (WeightSyncTimeout)."""
        w = self.engines.weights
        if w is None or self.s.board is None:
            return 0
        held = None if version is None else self._held(batch_id, stage, version, "its replayed batch must be generated "
                                                                             "from" if strict else None)
        if held is None:
            version, manifest, _, nbytes = self._board(batch_id, stage, "latest", lambda b: b.latest.remote())
            newer = version > w.version and manifest is not None
        else:  # never back to an older one; but a replay loads even our version (a restored rollout's may differ)
            (manifest, _, nbytes), newer = held, version > w.version or strict
        if newer:
            report = SyncReport("pull", version, load="map" if w.binds else "copy")
            with self.rec.span(batch_id, stage, "weight_sync", bytes=nbytes) as sp:
                patched, why_not = self._pull_delta(batch_id, stage, manifest, report)
                if not patched:
                    tensors = receive(manifest, self.s.weight_sync.timeout_s, report, self.slots, keep=w.binds)
                    self._sync_errors(batch_id, stage, lambda: w.import_tensors(_timed(tensors, report), manifest))
                    report.mode = why_not or report.mode
                sp.bytes = report.nbytes
            self.syncs.append(report.row())
        return w.version

    def _pull_delta(self, batch_id: int, stage: str, manifest: Manifest, report: SyncReport) -> tuple[bool, str]:
        """Reach `manifest`'s version by its delta, if it has one from the version we hold and our
        engine takes deltas: (done, why not). A delta that does not check out (we did not hold its
        base after all) is not done, and the caller loads the full version: the why goes in its
        report's mode, never silently."""
        w, d = self.engines.weights, manifest.delta
        if d is None or d.base != w.version:
            return False, ""
        try:
            return self._sync_errors(batch_id, stage, lambda: w.import_delta(  # a timeout is named, not a fallback
                manifest, lambda targets: apply_delta(manifest, targets, self.s.weight_sync.timeout_s, report))), ""
        except WeightSyncMismatch as e:
            return False, f"full after a failed delta ({e.summary})"

    def _sync_errors(self, batch_id: int, stage: str, call: Callable[[], Any]) -> Any:
        """`call()`, with a weight sync's named errors re-raised naming this stage, worker and batch."""
        try:
            return call()
        except (WeightSyncMismatch, WeightSyncTimeout) as e:
            raise type(e)(f"stage {stage!r} (worker {self.rank}, batch {batch_id}): {e.summary}", batch_id=batch_id, stage=stage,
                          worker=self.rank) from None

    def _take_syncs(self) -> list[dict]:
        out, self.syncs = self.syncs, []
        return out

    def _held(self, batch_id: int, stage: str, version: int, needed_because: str | None = None) -> tuple | None:
        """(refs, checksum, bytes) of policy `version` as the WeightBoard holds it; None when it does
        not, or WeightBoardLost when `needed_because` says why it must."""
        held = self._board(batch_id, stage, f"get({version})", lambda b: b.get.remote(version))
        if held is None and needed_because:
            raise WeightBoardLost(f"stage {stage!r} (worker {self.rank}, batch {batch_id}): the WeightBoard no longer holds "
                                  f"policy version {version}, which {needed_because}", batch_id=batch_id, stage=stage,
                                  worker=self.rank)
        return held

    def _board(self, batch_id: int, stage: str, what: str, call: Callable[[Any], Any]) -> Any:
        """A call to the WeightBoard (or a read of a policy it points to), bounded; its loss is
        WeightBoardLost naming the stage, worker and batch, never a raw Ray error."""
        try:
            return ray.get(call(self.s.board), timeout=self.s.weight_sync.timeout_s)
        except RayError as e:
            raise WeightBoardLost(f"the WeightBoard or the policy it points to is lost ({what}: {type(e).__name__}) "
                                  f"in stage {stage!r} (worker {self.rank}, batch {batch_id}); call resume()", batch_id=batch_id,
                                  stage=stage, worker=self.rank) from None

    @sized
    def run_stage(self, batch_id: int, index: int, arg: Any = None) -> tuple[StageResult, Any]:
        """One stage, called by the driver (see `_run_stage`)."""
        return self._run_stage(batch_id, index, arg)

    def _run_stage(self, batch_id: int, index: int, arg: Any = None) -> tuple[StageResult, Any]:
        """One stage: fetch, compute, publish. Returns this worker's account and the
        data plane's handoff to the driver (None unless the driver moves the data)."""
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        if index == self.mine[0]:
            self._start_batch(batch_id)
        self._maybe_fault(batch_id, st.id, "kill_actor")  # before the input: the fetch meets the dead actor
        self._maybe_fault(batch_id, st.id, "kill_board")
        edge_in, edge_out = self.plan.edge_into(index), self.plan.edge_out_of(index)
        got = self.port.fetch(batch_id, st, edge_in, self.plan.stages[edge_in.src] if edge_in else None, arg)
        self._maybe_fault(batch_id, st.id, "exit")  # mid-stage: input fetched, compute not done
        out, ctx = self._compute(batch_id, st, got.batch)
        handoff = self.port.publish(batch_id, st, edge_out, self.plan.stages[edge_out.dst] if edge_out else None,
                                    out, got.batch)
        moved = got.route not in ("cache", "loader", "none")
        tokens = item_lengths(out) if len(out) else np.zeros(0, np.int64)
        first = ctx.group_rank == 0
        result = StageResult(batch_id, st.index, st.id, self.rank, ctx.dp_rank, ctx.group_rank, len(got.batch), len(out),
                             int(tokens.sum()), got.batch.nbytes if moved else 0,
                             out.nbytes, got.route, got.cache_hit, dict(ctx.metrics), self.rec.take(),
                             time.perf_counter() - t0, dict(ctx.counts), self.port.rpcs,
                             out["item_id"].numpy().copy() if first and "item_id" in out else None,
                             tokens if first else None,
                             out["version"].numpy().copy() if first and "version" in out else None,
                             out["turns"].numpy().copy() if first and "turns" in out else None,
                             self._take_syncs())
        self.port.rpcs = 0
        return result, handoff

    def _compute(self, batch_id: int, st: Stage, batch: Batch) -> tuple[Batch, StageContext]:
        ctx = self._ctx(batch_id, st)
        with self.rec.span(batch_id, st.id, "compute", items=len(batch)) as sp, \
                profile_stage(self.s.profile, batch_id, st.id, self.rank):
            try:
                out = call_stage(self.fns[st.index], batch, ctx)
            except Exception as e:
                raise StageError(f"stage {st.id!r} raised {type(e).__name__}: {e} (worker {self.rank}, batch {batch_id})",
                                 batch_id=batch_id, stage=st.id, worker=self.rank,
                                 remote_traceback=traceback.format_exc()) from None
            if not isinstance(out, Batch):
                raise StageError(f"stage {st.id!r} returned {type(out).__name__}, expected a Batch "
                                 f"(worker {self.rank}, batch {batch_id})", batch_id=batch_id, stage=st.id, worker=self.rank)
            sp.tokens = int(item_lengths(out).sum()) if len(out) else 0
        self._check_contract(batch_id, st, batch, out)
        out = with_item_ids(out, batch_id, st.index, ctx.dp_rank)
        if "version" in out and len(out):  # the policy versions the rows came from (async schedules)
            v = int(out["version"].min())
            self._version_min = v if self._version_min is None else min(self._version_min, v)
        if self.s.keep_outputs:
            self.outputs[st.id] = out
        return out, ctx

    def _check_contract(self, batch_id: int, st: Stage, batch: Batch, out: Batch) -> None:
        """A node may declare `contract.outputs` (columns that must exist after it) and
        `contract.rows: same` (it keeps the row count); break either and the error names it."""
        missing = [c for c in st.contract.outputs if c not in out]
        if missing:
            raise StageContractError(f"stage {st.id!r} did not produce column(s) {missing} (worker {self.rank}, "
                                     f"batch {batch_id}); it returned {out.columns}", batch_id=batch_id, stage=st.id,
                                     worker=self.rank)
        if st.contract.rows == "same" and len(out) != len(batch):
            raise StageContractError(f"stage {st.id!r} returned {len(out)} rows for {len(batch)} input rows "
                                     f"(worker {self.rank}, batch {batch_id}); its node declares rows: same",
                                     batch_id=batch_id, stage=st.id, worker=self.rank)

    def _ctx(self, batch_id: int, st: Stage) -> StageContext:
        return stage_context(st, batch_id=batch_id, worker=self.rank, world_size=self.world_size, session_seed=self.s.seed,
                             node=self.node, config=self.s.config, engines=self.engines, loader=self.loader,
                             recorder=self.rec, groups=self.groups, schedule=self.s.schedule,
                             refresh_policy=lambda: self.pull_weights(batch_id, st.id),
                             trains_by=self._trains_by,
                             roles=frozenset(self.plan.stages[i].role for i in self.mine))

    # ---- inspection ------------------------------------------------------------------
    def peek(self, stage_id: str, n: int = 4, columns: list[str] | None = None) -> Batch | None:
        """The first n rows of a stage's latest output (only these travel to the driver)."""
        out = self.outputs.get(stage_id)
        if out is None:
            return None
        small = out.select(np.arange(min(n, len(out))))
        return small.pick(columns) if columns else small

    def samples(self, stage_id: str, n: int = 4) -> list[dict]:
        """A few rows of a stage's latest output as plain values, decoded to text when
        this worker has a tokenizer (only these rows travel to the driver)."""
        out = self.outputs.get(stage_id)
        return [] if out is None else sample_rows(out, n, self.engines.tokenizer, self.rank)

    def lengths(self, stage_id: str) -> np.ndarray | None:
        """Token length of every item of a stage's latest output (metadata for load-balance plots)."""
        out = self.outputs.get(stage_id)
        return None if out is None else item_lengths(out)

    def memory(self) -> dict:
        import resource

        import psutil

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"rank": self.rank, "pid": os.getpid(), "rss": psutil.Process().memory_info().rss, "peak_rss": peak}

    def ping(self) -> int:
        return self.rank

    # ---- faults and retries ----------------------------------------------------------
    def _clear_batch(self) -> None:
        if self.port is not None:
            self.port.clear()
        self.outputs.clear()

    def _start_batch(self, batch_id: int) -> None:
        self._clear_batch()
        self.port.begin_batch(batch_id)
        if self.loader is not None:  # where this batch's data starts, should the batch be retried
            self._loader_at_batch_start = self.loader.state_dict()
            self._loader_at[batch_id] = self._loader_at_batch_start  # and for a checkpoint taken while it is in flight
            for old in sorted(self._loader_at)[:-16]:
                del self._loader_at[old]

    def rewind(self) -> bool:
        """Undo the current batch's data loading so the same batch can run again."""
        self._clear_batch()
        if self.loader is not None and self._loader_at_batch_start:
            self.loader.load_state_dict(self._loader_at_batch_start)
        return True

    def add_faults(self, faults: list[dict]) -> int:
        """Planned faults: {"batch", "stage", "action": "exit" | "kill_actor" | "kill_board" |
        "exit_mid_sync" | "corrupt_weights", "actor": i, "skip": n, "mark": path}. Real ones: "exit"
        ends this worker's process mid-stage (stage "save_checkpoint": halfway through writing its
        part of a checkpoint); "kill_actor" kills data-plane actor i (a DataBuffer, or the
        coordinator; Ray restarts it); "kill_board" kills the WeightBoard; "exit_mid_sync": the
        publisher's process ends after its first bucket is written; "corrupt_weights": the publisher
        damages its first bucket after fingerprinting it (what the readers' check must catch). `mark`: a file the fault writes its wall-clock time to as it strikes
        (detection latency)."""
        self.faults.extend(faults)
        return len(self.faults)

    def _maybe_fault(self, batch_id: int, stage: str, action: str) -> bool:
        """Strike a planned fault of this batch, stage and action if there is one; True if one struck
        (an action the caller carries out itself, e.g. "corrupt_weights")."""
        if not self.faults:
            return False
        for f in list(self.faults):
            if f["batch_id"] == batch_id and f["stage"] == stage and f["action"] == action:
                if f.get("skip", 0) > 0:  # e.g. skip=1: strike on the retry, not the first attempt
                    f["skip"] -= 1
                    continue
                self.faults.remove(f)
                if f.get("mark"):
                    Path(f["mark"]).write_text(repr(time.time()))
                if action in ("exit", "exit_mid_sync"):
                    os._exit(1)
                if action == "kill_board":
                    ray.kill(self.s.board)
                elif action == "kill_actor":
                    self.port.kill_actor(f.get("actor", 0))
                return True
        return False

    # ---- checkpoints -----------------------------------------------------------------
    @sized
    def save_checkpoint(self, directory: str, batch_id: int = 0, resume_batch: int | None = None,
                        board_versions: tuple[int, ...] = ()) -> list[str]:
        """Trainable engines (collective: every worker calls), this rank's loader position and,
        on the generation group's first worker, the policies of `board_versions` (those the
        batches in flight came from). `resume_batch`: the first batch not yet trained;
        the loader is saved where that batch's data started, so a resumed run reads it again."""
        d = Path(directory)
        saved = []
        for name, e in self.engines.checkpointed().items():
            e.save(d / name)
            saved.append(name)
        self._maybe_fault(batch_id, "save_checkpoint", "exit")  # halfway: engines written, the rest not
        if self.loader is not None and self.plan.stages[0].group_rank(self.rank) == 0:
            d.mkdir(parents=True, exist_ok=True)
            state = self._loader_at.get(resume_batch, self.loader.state_dict()) if resume_batch is not None \
                else self.loader.state_dict()
            (d / f"loader_dp{self.loader.dp_rank}.json").write_text(json.dumps(state))
        if board_versions and self.rank == self.plan.stages[0].ranks[0]:
            (d / "board").mkdir(parents=True, exist_ok=True)
            for v in board_versions:
                manifest, checksum, nbytes = self._held(batch_id, "save_checkpoint", v, "a batch in flight came from")
                state = self._sync_errors(batch_id, "save_checkpoint",
                                          lambda: read_state(manifest, self.s.weight_sync.timeout_s, self.slots))
                torch.save({"version": v, "state": state, "checksum": checksum, "nbytes": nbytes},
                           d / "board" / f"v{v:06d}.pt")
            saved.append("board")
        return saved

    @sized
    def load_checkpoint(self, directory: str) -> list[str]:
        d = Path(directory)
        loaded = []
        for name, e in self.engines.checkpointed().items():
            if (d / name).is_dir():
                e.load(d / name)
                loaded.append(name)
        self.engines.after_load()
        w = self.engines.weights
        trains = bool(self.mine) and self.plan.stages[self.mine[-1]].type == "train"
        if w is not None and self.s.board is not None and w.version > 0 and trains:
            self._publish(w.version, self.plan.stages[self.mine[-1]])  # the rollout group pulls the loaded policy
            self.rec.take()
        if self.s.board is not None and (d / "board").is_dir() and self.rank == self.plan.stages[0].ranks[0]:
            for f in sorted((d / "board").glob("v*.pt")):  # the policies the batches in flight are replayed at
                b = torch.load(f, weights_only=True)
                m = publish_state(b["state"], b["version"], self.s.weight_sync.bucket_mib << 20)
                self._board(0, "load_checkpoint", f"restore v{b['version']}",
                            lambda board: board.restore.remote(b["version"], m, m.checksum, m.nbytes))
            loaded.append("board")
        if self.loader is not None:
            f = d / f"loader_dp{self.loader.dp_rank}.json"
            if not f.exists():
                raise FileNotFoundError(f"checkpoint {d} has no loader state for data-parallel rank "
                                        f"{self.loader.dp_rank} ({f.name})")
            self.loader.load_state_dict(json.loads(f.read_text()))
        return loaded

