"""DAG worker (paper §5.2): one per device slot. It binds every stage of the
plan to its function, owns its engines and its loader shard, and runs the task
chain. Between stages the batch stays in its local cache (same data-parallel
layout) or goes through the DataBuffers (layout changes).

The class is plain Python; controllers wrap it with `ray.remote`. In
centralized mode the same worker runs the same stage functions on chunks the
driver sends (`run_stage_centralized`).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import ray
import torch

from .dag import call_stage, resolve_function
from .data.batch import Batch
from .data.cache import LocalCache
from .data.exchange import BufferClient
from .data.loader import ShardedLoader, make_loader
from .data.samples import sample_rows
from .data.routing import item_lengths
from .errors import StageContractError, StageError
from .planner import Edge, Plan, Stage
from .reports import StageResult
from .telemetry import SpanRecorder


@dataclass
class WorkerSetup:
    """Everything a worker needs, sent once by the driver."""

    plan: Plan
    mode: str  # "distributed" | "centralized"
    seed: int = 0
    local_cache: bool = True
    balance: str = "lpt"  # "lpt" | "kk" | "none"
    buffers: list = field(default_factory=list)  # DataBuffer handles
    buffer_of_worker: list[int] = field(default_factory=list)
    config: Any = None  # the run config, visible to stages as ctx.config
    engines: str | Callable | None = None  # factory(ctx, config) -> dict of engines
    keep_outputs: bool = True  # keep each stage's output of the latest step (for peek)
    threads: int = 1


@dataclass
class StageContext:
    """What a stage function sees besides its batch."""

    step: int
    stage: Stage
    worker: int
    world_size: int
    dp_rank: int
    dp_size: int
    group_rank: int
    seed: int
    node: str
    config: Any = None
    engines: dict[str, Any] = field(default_factory=dict)
    loader: ShardedLoader | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    recorder: SpanRecorder | None = None
    groups: dict[str, Any] = field(default_factory=dict)  # stage id -> this worker's dp process group
    _rng: torch.Generator | None = None

    @property
    def process_group(self) -> Any:
        """The torch.distributed group of this stage's layout that holds this worker:
        the ranks with the same tensor-parallel rank (None without torch.distributed)."""
        return self.groups.get(self.stage.id)

    def span(self, phase: str, **counts):
        """Time a part of this stage as its own span (e.g. "weight_sync")."""
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(self.step, self.stage.id, phase, **counts)

    @property
    def rng(self) -> torch.Generator:
        """Seeded by (seed, step, stage, dp rank): the same rows see the same randomness in both modes."""
        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        return self._rng

    def log(self, **metrics: float) -> None:
        """Record metrics; the driver averages them over data-parallel ranks (weighted by rows)."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def count(self, **counts: float) -> None:
        """Record counts (rows kept, items dropped, ...); the driver sums them over data-parallel ranks."""
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + float(v)


def local_context(plan: Plan, stage: str, step: int = 0, dp_rank: int = 0, seed: int = 0, config: Any = None,
                  engines: dict[str, Any] | None = None) -> StageContext:
    """A context for calling a stage function by hand, outside Ray (tests, notebooks):
    `fn(batch, local_context(dag.plan(4), "advantage"))`."""
    st = plan.stage(stage)
    worker = dp_rank * st.group_size
    return StageContext(step, st, worker, plan.world_size, dp_rank, st.dp, 0, stage_seed(seed, step, st.index, dp_rank),
                        "local", config, dict(engines or {}))


def stage_seed(seed: int, step: int, stage: int, dp_rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, stage, dp_rank]).generate_state(1)[0])


class DAGWorker:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        try:
            self.node = ray.get_runtime_context().get_node_id()[:8]
        except Exception:  # not inside Ray (unit tests)
            self.node = "local"
        self.rec = SpanRecorder(rank, self.node)
        self.cache = LocalCache()
        self.outputs: dict[str, Batch] = {}
        self.engines: dict[str, Any] = {}
        self.loader: ShardedLoader | None = None
        self.groups: dict[str, Any] = {}
        self.faults: list[dict] = []
        self._loader_at_step_start: dict | None = None

    # ---- lifecycle ---------------------------------------------------------------
    def setup(self, s: WorkerSetup) -> dict:
        """(Re)configure this worker for a plan. Called again when a session reuses the
        workers for another DAG, mode or switches: everything of the last plan goes."""
        self._reset()
        self.s, self.plan = s, s.plan
        self.rec.mode = s.mode
        torch.set_num_threads(max(1, s.threads))
        self.fns = [resolve_function(st.fn, node=st.id) for st in self.plan.stages]
        self.groups = self._layout_groups()
        self.client = BufferClient(s.buffers, s.buffer_of_worker, self.rank, self.rec)
        first = self.plan.stages[0]
        if first.type == "data_load" and s.mode == "distributed":
            self.loader = make_loader(first.config, first.dp_rank(self.rank), first.dp, s.seed)
        if s.engines is not None:
            self.engines = resolve_function(s.engines, node="engines")(self._ctx(0, first), s.config) or {}
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
        made: dict[tuple[int, int], Any] = {}
        for st in self.plan.stages:
            key = (st.dp, st.group_size)
            if key not in made:
                for g in range(st.group_size):
                    group = dist.new_group([d * st.group_size + g for d in range(st.dp)])
                    if st.group_rank(self.rank) == g:
                        made[key] = group
        return {st.id: made[(st.dp, st.group_size)] for st in self.plan.stages}

    def _reset(self) -> None:
        self._clear_step()
        for e in self.engines.values():
            if hasattr(e, "close"):
                e.close()
        self.engines, self.loader, self.faults = {}, None, []
        self._loader_at_step_start = None  # a reused worker must not restore the last plan's loader
        self.rec.take()

    def init_process_group(self, master_addr: str, port: int, backend: str = "gloo",
                           timeout_s: float = 300.0) -> bool:
        import datetime

        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        if not dist.is_initialized():  # a bounded timeout: a dead peer must not hang collectives forever
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return True

    def close(self) -> None:
        self._reset()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass

    # ---- distributed mode --------------------------------------------------------
    def run_step(self, step: int) -> list[StageResult]:
        results = []
        for i, st in enumerate(self.plan.stages):
            self.client.note_progress(step, st.id)  # read only to name the stage of a "(whole step)" failure
            results.append(self.run_stage(step, i))
        return results

    def run_stage(self, step: int, index: int) -> StageResult:
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        if index == 0:
            self._start_step()
        self._maybe_fault(step, st, "kill_buffer")  # before the input: the fetch meets the dead buffer
        batch, route, hit = self._input(step, st)
        self._maybe_fault(step, st, "exit")  # mid-stage: input fetched, compute not done
        out, ctx = self._compute(step, st, batch)
        self._output(step, st, out)
        return self._result(step, st, batch, out, route, hit, ctx, time.perf_counter() - t0)

    def _input(self, step: int, st: Stage) -> tuple[Batch, str, bool | None]:
        edge = self.plan.edge_into(st.index)
        if edge is None:
            return Batch.empty(), ("loader" if st.type == "data_load" else "none"), None
        if self._is_local(edge):
            with self.rec.span(step, st.id, "cache_hit", cache_hit=True) as sp:
                batch = self.cache.take(edge.name)
                sp.items = len(batch)
            return batch, "cache", True
        return self.client.fetch(step, edge, self.plan.stages[edge.src], st), "buffer", False

    def _is_local(self, edge: Edge) -> bool:
        return edge.kind == "local" and self.s.local_cache

    def _compute(self, step: int, st: Stage, batch: Batch) -> tuple[Batch, StageContext]:
        ctx = self._ctx(step, st)
        with self.rec.span(step, st.id, "compute", items=len(batch)) as sp:
            try:
                out = call_stage(self.fns[st.index], batch, ctx)
            except Exception as e:
                raise StageError(f"stage {st.id!r} raised {type(e).__name__}: {e} (worker {self.rank}, step {step})",
                                 step=step, stage=st.id, worker=self.rank,
                                 remote_traceback=traceback.format_exc()) from None
            if not isinstance(out, Batch):
                raise StageError(f"stage {st.id!r} returned {type(out).__name__}, expected a Batch "
                                 f"(worker {self.rank}, step {step})", step=step, stage=st.id, worker=self.rank)
            sp.tokens = int(item_lengths(out).sum()) if len(out) else 0
        self._check_contract(step, st, batch, out)
        if self.s.keep_outputs:
            self.outputs[st.id] = out
        return out, ctx

    def _check_contract(self, step: int, st: Stage, batch: Batch, out: Batch) -> None:
        """A node may declare `outputs` (columns that must exist after it) and
        `rows: same` (it keeps the row count); break either and the error names it."""
        missing = [c for c in st.config.get("outputs", []) if c not in out]
        if missing:
            raise StageContractError(f"stage {st.id!r} did not produce column(s) {missing} (worker {self.rank}, "
                                     f"step {step}); it returned {out.columns}", step=step, stage=st.id,
                                     worker=self.rank)
        if st.config.get("rows") == "same" and len(out) != len(batch):
            raise StageContractError(f"stage {st.id!r} returned {len(out)} rows for {len(batch)} input rows "
                                     f"(worker {self.rank}, step {step}); its node declares rows: same",
                                     step=step, stage=st.id, worker=self.rank)

    def _output(self, step: int, st: Stage, out: Batch) -> None:
        edge = self.plan.edge_out_of(st.index)
        if edge is None:
            return
        if self._is_local(edge):
            self.cache.put(edge.name, out)
        elif st.group_rank(self.rank) == 0:  # only tensor-parallel rank 0 writes: no duplicates
            policy = self.s.balance if edge.kind == "redistribute" else "identity"
            self.client.publish(step, edge, st, self.plan.stages[edge.dst], out, policy)

    def _ctx(self, step: int, st: Stage) -> StageContext:
        dp_rank = st.dp_rank(self.rank)
        return StageContext(step, st, self.rank, self.world_size, dp_rank, st.dp, st.group_rank(self.rank),
                            stage_seed(self.s.seed, step, st.index, dp_rank), self.node, self.s.config,
                            self.engines, self.loader, recorder=self.rec, groups=self.groups)

    # ---- centralized mode ----------------------------------------------------------
    def run_stage_centralized(self, step: int, index: int, chunk: list) -> tuple[list, bool, StageResult]:
        """Compute on a chunk the driver dispatched; return the output (only the
        columns the stage changed when rows are unchanged) as an object ref."""
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        with self.rec.span(step, st.id, "dispatch") as sp:
            batch = ray.get(chunk[0]) if chunk else Batch.empty()
            sp.items, sp.bytes = len(batch), batch.nbytes
        self._maybe_fault(step, st, "exit")
        out, ctx = self._compute(step, st, batch)
        delta = len(out) == len(batch) and len(batch) > 0 and len(out.changed_columns(batch)) < len(out.columns)
        refs: list = []
        if st.group_rank(self.rank) == 0:
            with self.rec.span(step, st.id, "collect") as sp:
                payload = out.pick(out.changed_columns(batch)) if delta else out
                sp.items, sp.bytes = len(payload), payload.nbytes
                refs = [ray.put(payload)]
        result = self._result(step, st, batch, out, "driver" if chunk else "none", None, ctx, time.perf_counter() - t0)
        return refs, delta, result

    # ---- metadata ----------------------------------------------------------------
    def _result(self, step: int, st: Stage, batch: Batch, out: Batch, route: str, hit: bool | None,
                ctx: StageContext, seconds: float) -> StageResult:
        moved = route in ("buffer", "driver")
        return StageResult(step, st.index, st.id, self.rank, ctx.dp_rank, ctx.group_rank, len(batch), len(out),
                           int(item_lengths(out).sum()) if len(out) else 0, batch.nbytes if moved else 0,
                           out.nbytes, route, hit, dict(ctx.metrics), self.rec.take(), seconds, dict(ctx.counts))

    def peek(self, stage_id: str, n: int = 4, columns: list[str] | None = None) -> Batch | None:
        """The first n rows of a stage's latest output (only these travel to the driver)."""
        out = self.outputs.get(stage_id)
        if out is None:
            return None
        small = out.select(np.arange(min(n, len(out))))
        return small.pick(columns) if columns else small

    # ---- faults and retries ----------------------------------------------------------
    def _clear_step(self) -> None:
        self.cache.clear()
        self.outputs.clear()

    def _start_step(self) -> None:
        self._clear_step()
        if self.loader is not None:  # where this step's data starts, should the step be retried
            self._loader_at_step_start = self.loader.state_dict()

    def rewind(self) -> bool:
        """Undo the current step's data loading so the same step can run again."""
        self._clear_step()
        if self.loader is not None and self._loader_at_step_start:
            self.loader.load_state_dict(self._loader_at_step_start)
        return True

    def set_faults(self, faults: list[dict]) -> int:
        """Planned faults: {"step", "stage", "action": "exit" | "kill_buffer", "buffer": i, "skip": n}.
        Real ones: "exit" ends this worker's process mid-stage; "kill_buffer" kills a
        DataBuffer actor (Ray restarts it)."""
        self.faults = list(faults)
        return len(self.faults)

    def _maybe_fault(self, step: int, st: Stage, action: str) -> None:
        if not self.faults:
            return
        for f in list(self.faults):
            if f["step"] == step and f["stage"] == st.id and f["action"] == action:
                if f.get("skip", 0) > 0:  # e.g. skip=1: strike on the retry, not the first attempt
                    f["skip"] -= 1
                    continue
                self.faults.remove(f)
                if f["action"] == "exit":
                    self.client.flush_progress()
                    os._exit(1)
                if f["action"] == "kill_buffer":
                    ray.kill(self.s.buffers[f.get("buffer", 0)], no_restart=False)

    # ---- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> list[str]:
        """Trainable engines (collective: every worker calls) and this rank's loader position."""
        import json
        from pathlib import Path

        d = Path(directory)
        saved = []
        for name, e in self.engines.items():
            if callable(getattr(e, "save", None)) and getattr(e, "optimizer", None) is not None:
                e.save(d / name)
                saved.append(name)
        if self.loader is not None and self.plan.stages[0].group_rank(self.rank) == 0:
            d.mkdir(parents=True, exist_ok=True)
            (d / f"loader_dp{self.loader.dp_rank}.json").write_text(json.dumps(self.loader.state_dict()))
        return saved

    def load_checkpoint(self, directory: str) -> list[str]:
        import json
        from pathlib import Path

        d = Path(directory)
        loaded = []
        for name, e in self.engines.items():
            if callable(getattr(e, "load", None)) and (d / name).is_dir():
                e.load(d / name)
                loaded.append(name)
        for e in self.engines.values():
            if callable(getattr(e, "after_load", None)):
                e.after_load()
        if self.loader is not None:
            f = d / f"loader_dp{self.loader.dp_rank}.json"
            if not f.exists():
                raise FileNotFoundError(f"checkpoint {d} has no loader state for data-parallel rank "
                                        f"{self.loader.dp_rank} ({f.name})")
            self.loader.load_state_dict(json.loads(f.read_text()))
        return loaded

    def samples(self, stage_id: str, n: int = 4) -> list[dict]:
        """A few rows of a stage's latest output as plain values, decoded to text when
        this worker has a tokenizer (only these rows travel to the driver)."""
        out = self.outputs.get(stage_id)
        return [] if out is None else sample_rows(out, n, self.engines.get("tokenizer"), self.rank)

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
