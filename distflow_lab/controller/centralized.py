"""Centralized (verl-style single controller) mode — the baseline.

The same stage functions run on the same workers, but the driver loads the
data and, at every stage, splits the global batch, dispatches the chunks,
collects the outputs and concatenates them, as verl's trainer does. It is the
best honest version of that pattern: the same zero-copy serialization as the
distributed mode, chunks put into the object store in parallel threads (as
verl's newer dispatch does), and workers return only the columns a stage
changed (verl's `union` of new keys), not the whole batch.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray

from ..dag import call_stage, resolve_function
from ..data.batch import Batch
from ..data.loader import make_loader
from ..data.routing import assign, item_lengths
from ..reports import StageReport
from ..telemetry import DRIVER, SpanRecorder
from ..worker import StageContext, WorkerSetup, stage_seed
from .base import Controller


class CentralizedController(Controller):
    mode = "centralized"

    def _start(self) -> None:
        self._place()
        self._init_torch_distributed()
        setup = WorkerSetup(self.plan, self.mode, self.config.seed, balance=self.config.switches.balance,
                            config=self.config.algo, engines=self.engines, keep_outputs=self.config.keep_outputs,
                            threads=self._threads())
        self.worker_info = self._gather([w.setup.remote(setup) for w in self.workers], step=-1, stage="setup",
                                        stages=4)  # engine set-up (model loading) may take longer than a stage
        self.rec = SpanRecorder(DRIVER, ray.get_runtime_context().get_node_id()[:8], self.mode)
        self.pool = ThreadPoolExecutor(max_workers=min(16, len(self.workers)), thread_name_prefix="dispatch")
        first = self.plan.stages[0]
        self.loaders = ([make_loader(first.config, r, first.dp, self.config.seed) for r in range(first.dp)]
                        if first.type == "data_load" else [])
        self.batch = Batch.empty()  # the global batch lives on the driver between stages
        self.rank_sizes: list[int] = []
        self._loaders_at_step_start: list[dict] = []  # where the loaders stood when this step began

    def _run_stage(self, step: int, index: int) -> StageReport:
        st = self.plan.stages[index]
        t0 = time.perf_counter()
        if index == 0 and st.type == "data_load":
            self._load_on_driver(step, st)
            return StageReport(step, index, st.id, self.mode, [], self.rec.take(), time.perf_counter() - t0)
        chunks = self._split(step, st) if index > 0 else [None] * st.dp
        refs = self._dispatch(step, st, chunks)
        calls = [w.run_stage_centralized.remote(step, index, [refs[st.dp_rank(r)]] if refs[st.dp_rank(r)] else [])
                 for r, w in enumerate(self.workers)]
        answers = self._gather(calls, step, st.id)
        self._collect(step, st, answers)
        results = [a[2] for a in answers]
        return StageReport(step, index, st.id, self.mode, results, self.rec.take(), time.perf_counter() - t0)

    def _load_on_driver(self, step: int, st) -> None:
        fn = resolve_function(st.fn, node=st.id)
        self._loaders_at_step_start = [ld.state_dict() for ld in self.loaders]
        with self.rec.span(step, st.id, "load") as sp:
            parts = []
            for r, loader in enumerate(self.loaders):
                ctx = StageContext(step, st, DRIVER, len(self.workers), r, st.dp, 0,
                                   stage_seed(self.config.seed, step, st.index, r), self.rec.node,
                                   self.config.algo, {}, loader)
                parts.append(call_stage(fn, Batch.empty(), ctx))
            self.batch = Batch.concat(parts)
            self.rank_sizes = [len(p) for p in parts]
            sp.items, sp.bytes = len(self.batch), self.batch.nbytes

    def _split(self, step: int, st) -> list[Batch]:
        edge = self.plan.edge_into(st.index)
        with self.rec.span(step, st.id, "split") as sp:
            if edge.kind == "redistribute":
                parts = assign(item_lengths(self.batch), st.dp, self.config.switches.balance)
                self.batch = self.batch.select(np.concatenate(parts))  # global order = rank order from here
                self.rank_sizes = [len(p) for p in parts]
            chunks = self.batch.split(self.rank_sizes)
            sp.items, sp.bytes = len(self.batch), self.batch.nbytes
        return chunks

    def _dispatch(self, step: int, st, chunks: list) -> list:
        with self.rec.span(step, st.id, "dispatch") as sp:
            refs = list(self.pool.map(lambda c: ray.put(c) if c is not None else None, chunks))
            sp.bytes = sum(c.nbytes for c in chunks if c is not None)
        return refs

    def _collect(self, step: int, st, answers: list) -> None:
        writers = [a for r, a in enumerate(answers) if st.group_rank(r) == 0]  # dp-rank order
        with self.rec.span(step, st.id, "collect") as sp:
            outs = ray.get([a[0][0] for a in writers])
            sp.bytes = sum(o.nbytes for o in outs)
            self.bytes_to_driver += sp.bytes
        with self.rec.span(step, st.id, "concat") as sp:
            merged = Batch.concat(outs)
            if all(a[1] for a in writers):
                self.batch = self.batch.update(merged)  # only changed columns came back
            else:
                self.batch = merged
                self.rank_sizes = [len(o) for o in outs]
            sp.items, sp.bytes = len(self.batch), merged.nbytes

    def _rewind(self, step: int) -> None:
        for ld, state in zip(self.loaders, self._loaders_at_step_start):
            ld.load_state_dict(state)
        super()._rewind(step)

    def _save_driver_state(self, d) -> None:
        import json

        for r, loader in enumerate(self.loaders):  # same files the workers write in distributed mode
            (d / f"loader_dp{r}.json").write_text(json.dumps(loader.state_dict()))

    def _load_driver_state(self, d) -> None:
        import json

        for r, loader in enumerate(self.loaders):
            loader.load_state_dict(json.loads((d / f"loader_dp{r}.json").read_text()))

    def close(self) -> None:
        if getattr(self, "pool", None):
            self.pool.shutdown(wait=False)
        self.batch = Batch.empty()
        super().close()
