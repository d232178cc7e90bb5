"""The notebook API: open a session over a DAG, step through it one stage at a
time, look at what happened. A `Session` is the one type a notebook, the CLI
and the benchmarks hold; underneath it is one `Controller` with one data plane.

    import distflow_lab as lab
    lab.connect()                                    # embedded local cluster, loopback only
    s = lab.session(lab.synthetic_grpo(), world_size=4, mode="coordinator")
    s.step_stage()                                   # one stage on every worker: a StageReport
    s.step(); s.run(10)                              # finish the step; ten more with a progress bar
    s.peek("advantage")                              # a few decoded samples, only they travel
    s.timeline(); s.breakdown(); s.report("run.html")
"""
from __future__ import annotations

import functools
import html
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import pandas as pd
import torch

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import (MODES, SWITCHES_BY_MODE, Balance, ClusterOptions, ConfigError, Mode,
                                      engine_overrides,
                                      ProfileOptions, RunConfig, ScheduleName, ScheduleOptions, SessionConfig, Switches,
                                      check_schedule, check_switches, load_model)
from distflow_lab.dataplane.centralized import CentralizedPlane
from distflow_lab.dataplane.coordinator import CoordinatorPlane
from distflow_lab.dataplane.distributed import DistributedPlane
from distflow_lab.dataplane.interface import DataPlane, Routing
from distflow_lab.dataplane.partition import workload_coeffs
from distflow_lab.graph.dag import DAG
from distflow_lab.runtime.controller import Controller
from distflow_lab.runtime.schedule_lanes import segments

PLANES: dict[str, Callable[[], DataPlane]] = {p.mode: p for p in (CentralizedPlane, CoordinatorPlane, DistributedPlane)}
assert tuple(sorted(PLANES)) == tuple(sorted(MODES)), "one data plane per mode"


def session_config(base: SessionConfig | dict | None = None, *,
                   mode: Mode | None = None,
                   seed: int | None = None, keep_outputs: bool | None = None, history_steps: int | None = None,
                   # cluster
                   world_size: int | None = None, cpus_per_worker: float | None = None,
                   gpus_per_worker: float | None = None, placement: str | None = None,
                   threads_per_worker: int | None = None, stage_timeout_s: float | None = None,
                   buffer_wait_timeout_s: float | None = None, torch_distributed: bool | None = None,
                   fresh_workers: bool | None = None,
                   # switches
                   local_cache: bool | None = None, double_buffer: bool | None = None,
                   balance: Balance | str | None = None, num_buffers: int | str | None = None,
                   rows_per_object: int | None = None,
                   # schedule
                   schedule: ScheduleName | None = None,
                   max_staleness: int | None = None, partial_rollout: bool | None = None,
                   on_stale: Literal["drop", "regenerate"] | None = None,
                   # observation
                   profile: ProfileOptions | dict | list[str] | None = None) -> SessionConfig:
    """`base` with the given options changed (None: unchanged); checked as a whole,
    including that every switch set means something in the mode."""
    base = base if isinstance(base, SessionConfig) else load_model(SessionConfig, dict(base or {}))
    given = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731
    cluster = {**base.cluster.model_dump(), **given(
        world_size=world_size, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker, placement=placement,
        threads_per_worker=threads_per_worker, stage_timeout_s=stage_timeout_s,
        buffer_wait_timeout_s=buffer_wait_timeout_s, torch_distributed=torch_distributed,
        fresh_workers=fresh_workers)}
    switches = {**base.switches.model_dump(exclude_unset=True), **given(
        local_cache=local_cache, double_buffer=double_buffer, balance=balance, num_buffers=num_buffers,
        rows_per_object=rows_per_object)}
    sched = {**base.schedule.model_dump(exclude_unset=True), **given(
        kind=schedule, max_staleness=max_staleness, partial_rollout=partial_rollout, on_stale=on_stale)}
    if schedule is not None and schedule != base.schedule.kind:  # a new schedule starts from its own defaults
        sched = given(kind=schedule, max_staleness=max_staleness, partial_rollout=partial_rollout, on_stale=on_stale)
    if isinstance(profile, list):
        profile = {"stages": profile}
    top = {**base.model_dump(exclude={"algo", "cluster", "switches", "schedule"}),
           **given(mode=mode, seed=seed, keep_outputs=keep_outputs, history_steps=history_steps, profile=profile)}
    cfg = SessionConfig(**{**top, "cluster": load_model(ClusterOptions, cluster, "cluster options"),
                           "switches": load_model(Switches, switches, "switches"),
                           "schedule": load_model(ScheduleOptions, sched, "schedule")}, algo=base.algo)
    check_switches(cfg.mode, cfg.switches)
    check_schedule(cfg.mode, cfg.schedule)
    return cfg


OPTIONS = [p for p in inspect.signature(session_config).parameters if p != "base"]


def check_profile(config: SessionConfig, dag: DAG) -> None:
    unknown = [s for s in (config.profile.stages if config.profile else []) if s not in dag.ids]
    if unknown:
        raise ConfigError(f"profile: no stage {unknown[0]!r} in DAG {dag.name!r}; stages: {dag.ids}")


def routing_for(config: SessionConfig) -> Routing:
    """The balance policy, plus what the built-in algorithms know: the workload cost of
    their model (from its config.json) and the optimizer's mini-batch count."""
    algo = config.algo
    if not isinstance(algo, RunConfig):
        return Routing(config.switches.balance)
    model_cfg = Path(algo.model.path) / "config.json"
    cost = workload_coeffs(json.loads(model_cfg.read_text())) if model_cfg.exists() else None
    return Routing(config.switches.balance, cost, algo.actor.mini_batches)


def _configure(base: SessionConfig | dict | None, options: dict[str, Any]) -> SessionConfig:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown session option {unknown[0]!r}; options: {OPTIONS}")
    return session_config(base, **options)


def _from_controller(name: str) -> Callable:
    """A Session method that is the controller's own, as it is: its signature and docstring are
    the controller's (one definition, in runtime/controller.py), and it calls the session's
    current controller (`reopen` replaces it)."""
    @functools.wraps(getattr(Controller, name))
    def method(self: "Session", *args: Any, **kwargs: Any) -> Any:
        return getattr(self.controller, name)(*args, **kwargs)

    method.__module__, method.__qualname__ = __name__, f"Session.{name}"
    return method


def _controller_value(name: str, doc: str | None = None) -> property:
    """A read-only Session attribute that is the current controller's (documented there when it
    is a property there)."""
    return property(lambda self: getattr(self.controller, name),
                    doc=doc or getattr(getattr(Controller, name, None), "__doc__", None))


class Session:
    """A running DAG on Ray workers. What the controller (`self.controller`) has, the session
    has as it is (the table below); a figure comes from a function in `observe`."""

    def __init__(self, dag: DAG, config: SessionConfig | RunConfig | dict | None = None,
                 engines: str | Callable | None = None, **options: Any) -> None:
        if isinstance(config, RunConfig):
            from distflow_lab.algos.engine_setup import setup_engines
            from distflow_lab.algos.registry import check_run_config

            check_run_config(config)
            engines = engines or setup_engines
            config = config.session_config()
        self.dag, self._engines = dag, engines
        self._config = _configure(config, options)
        check_profile(self._config, dag)
        self.controller = Controller(dag, self._config, PLANES[self._config.mode](), engines,
                                     routing=routing_for(self._config))
        self.previous: dict[str, pd.DataFrame] = {}  # spans of earlier modes (reopen), for side-by-side figures
        self.previous_metrics: dict[str, pd.DataFrame] = {}

    # ---- the controller's own, as they are ------------------------------------------
    step_stage = _from_controller("step_stage")
    step = _from_controller("step")
    resume = _from_controller("resume")
    close = _from_controller("close")
    items = _from_controller("items")
    ledger = _from_controller("ledger")
    redistribution_lengths = _from_controller("redistribution_lengths")
    save_checkpoint = _from_controller("save_checkpoint")
    load_checkpoint = _from_controller("load_checkpoint")
    mode = _controller_value("mode", "The data plane: centralized, coordinator or distributed.")
    plan = _controller_value("plan", "The linearized plan: stages with their layouts, edges local or redistribute.")
    config = _controller_value("config", "The SessionConfig running now (the algorithm's config is `.algo`).")
    workers = _controller_value("workers", "The DAG worker actors, in rank order.")
    spans = _controller_value("spans", "Every span so far: batch_id, stage, worker (-1: the driver), node, phase, start, "
                                       "end, bytes, items, tokens, cache_hit.")
    metrics = _controller_value("metrics", "One row per update: every metric the stages logged (column `update`).")
    history = _controller_value("history", "The latest UpdateReports (up to `history_steps`).")
    retries = _controller_value("retries", "Steps run again after a data-plane actor was lost.")
    bytes_to_driver = _controller_value("bytes_to_driver")

    # ---- running ------------------------------------------------------------------
    def run(self, steps: int, progress: bool = True) -> pd.DataFrame:
        """Run `steps` steps with a progress bar; returns their metrics."""
        if steps < 1:
            raise ConfigError(f"steps must be at least 1, got {steps}")
        reports = self.controller.run(steps, progress=progress)
        return pd.DataFrame([{"update": r.update, "wall_s": r.wall_seconds, **r.metrics} for r in reports])

    def reopen(self, mode: str | None = None, dag: DAG | None = None, overrides: list[str] | None = None,
               **options: Any) -> "Session":
        """Reconfigure with another mode, switches or DAG, on the same worker processes
        when the placement allows (fresh engines, loaders, data plane, step 0); the spans
        and metrics so far are kept for side-by-side figures. Switches set earlier that
        mean nothing in the new mode are dropped; ones given here must apply. `overrides`
        (`a.b=value`, a session opened from a run config): what its engines are built with,
        e.g. `["actor.micro_token_budget=512"]` (the keys in `config.ENGINE_KEYS`); they stay."""
        new_mode = mode or self.mode
        update: dict[str, Any] = {"switches": Switches(**{
            k: v for k, v in self._config.switches.model_dump(exclude_unset=True).items()
            if k in SWITCHES_BY_MODE.get(new_mode, ())})}
        if overrides:
            update["algo"] = engine_overrides(self._config.algo, overrides)
        config = _configure(self._config.model_copy(update=update), {**options, "mode": new_mode})
        self.previous[self.mode] = self.spans
        self.previous_metrics[self.mode] = self.metrics
        self.dag = dag or self.dag
        old = self.controller
        if not old.can_hand_over(config, self.dag):
            old.close()  # nothing to take over: free its slots first, or a full cluster cannot place the new workers
        self.controller = Controller(self.dag, config, PLANES[config.mode](), self._engines, reuse=old,
                                     routing=routing_for(config))
        old.close()  # frees what was not taken over (its data plane; its workers if not handed over)
        self._config = config
        return self

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- what happened -----------------------------------------------------------------
    @property
    def cursor(self) -> tuple[int, str]:
        """(updates done, next stage id)."""
        c = self.controller
        return c.updates, self.plan.stages[c.next_stage].id

    def peek(self, stage: str, worker: int = 0, n: int = 4) -> pd.DataFrame:
        """A few samples of `stage`'s latest output on `worker`, decoded (prompt,
        response, reward, advantage); only these rows travel to the driver."""
        rows = self.controller.samples(stage, worker, n)
        if not rows:
            raise KeyError(f"worker {worker} holds no output of stage {stage!r} yet: run it first")
        return pd.DataFrame(rows)

    def output(self, stage: str, worker: int = 0, n: int | None = None) -> Batch:
        """The raw Batch of `stage`'s latest output on `worker` (its first `n` rows; all by default)."""
        return self.controller.peek(stage, worker, n=10**12 if n is None else n)

    def weight_sync(self) -> pd.DataFrame:
        """Every weight sync so far, one row per worker and sync: side (publish / pull on worker
        groups, colocated), version, transport (shm / object_store on worker groups), bytes,
        tensors, buckets, seconds and its parts (gather, write,
        read, load, verify; colocated syncs: the total only), GB/s, and `x_memcpy`: GB/s against
        this machine's memcpy, measured once in this process (`observe.bandwidth.memcpy_gbps`)."""
        from distflow_lab.observe.bandwidth import memcpy_gbps

        df = self.controller.weight_syncs()
        if len(df):
            df["x_memcpy"] = df["gbps"] / memcpy_gbps()
        return df

    # ---- pictures --------------------------------------------------------------------------
    def timeline(self, batches: list[int] | None = None, last: int = 2):
        """Spans of `batches` (default: the `last` ones) as a Gantt chart, one row per worker."""
        from distflow_lab.observe.timeline import last_batches, timeline

        spans = self.spans
        batches = last_batches(spans, last) if batches is None else batches
        return timeline(spans, batches=batches, title=f"{self.mode}: batches {batches}")

    def breakdown(self, skip: int = 0):
        """Paper Table 1, this session's mode beside any earlier one (reopen): a `Breakdown`
        that shows the figure and the table (`.figure`, `.table`; `fig, table = ...` works);
        `skip` drops each mode's first batches (warm-up)."""
        from distflow_lab.observe.breakdown import breakdown

        spans = {m: df[df["batch_id"] >= df["batch_id"].min() + skip] if len(df) else df
                 for m, df in {**self.previous, self.mode: self.spans}.items()}
        return breakdown(spans, [s.id for s in self.plan.stages])

    def cache_hits(self):
        from distflow_lab.observe.breakdown import cache_hits

        return cache_hits(self.spans)

    def load_balance(self, edge: str | None = None):
        from distflow_lab.observe.load_balance import load_balance

        lengths = self.redistribution_lengths()
        if not lengths:
            raise ValueError("no redistribute edge with data yet (the plan has none, or no step ran)")
        name = edge or next(iter(lengths))
        values, k = lengths[name]
        return load_balance(values, k, title=f"token load per worker at {name}")

    def curves(self, columns: list[str] | None = None):
        from distflow_lab.observe.curves import metric_curves

        return metric_curves(self.metrics, columns)

    def bubbles(self, skip: int = 0):
        """Idle time by cause per worker and step (compute, imbalance, rollout_tail, data_plane,
        control, weight_sync, staleness), summing to each step's wall: a `Bubbles` (.table,
        .summary, .figure; `table, fig = s.bubbles()` unpacks). `skip`: warm-up batches left out."""
        from distflow_lab.observe.bubbles import bubbles

        spans = self.spans
        if skip and len(spans):
            spans = spans[spans["batch_id"] >= spans["batch_id"].min() + skip]
        m = self.metrics
        walls = m.set_index("update")["wall_s"] if len(m) and "wall_s" in m else None
        return bubbles(spans, {st.id: st.type for st in self.plan.stages}, walls,
                       title=f"{self.mode}: idle time by cause (mean seconds per step)")

    def lineage(self, item: int | str) -> pd.DataFrame:
        """The path of one item (its `item_id`, or every item of a `uid` prompt): stage, worker,
        node, how it arrived (local cache, buffer, coordinator, driver), its bytes and policy version
        (`observe.lineage`)."""
        from distflow_lab.observe.lineage import lineage, uid_item_ids

        ids = uid_item_ids(self._kept_outputs(), item) if isinstance(item, str) else {item}
        placement = self.controller.placement
        nodes = dict(enumerate(placement.worker_nodes)) if placement else {}
        return lineage(self.items(), self.spans, ids, nodes, label=item)

    def _kept_outputs(self) -> Iterator[Batch]:
        """Each stage's latest output on each of its writing workers (those that hold one)."""
        for st in self.plan.stages:
            for w in st.ranks:
                if st.group_rank(w) != 0:
                    continue
                try:
                    yield self.output(st.id, worker=w)
                except KeyError:
                    continue

    def sankey(self, edge: str | None = None, batches: int | list[int] | None = None):
        """Bytes between workers on `edge` (a name like "advantage->old_log_prob"; None: every
        edge) over `batches` (None: every batch): a Sankey, producers to consumers (the driver in
        between in centralized mode). The numbers: `observe.flows.byte_flows`."""
        from distflow_lab.observe.flows import byte_flows, sankey_figure

        flows = byte_flows(self.spans, self.items(), self.plan, edge, batches)
        which = "every batch" if batches is None else f"batch {batches}"
        return sankey_figure(flows, [st.id for st in self.plan.stages],
                             title=f"{self.mode}: bytes between workers, {edge or 'every edge'}, {which} "
                                   f"({flows['bytes'].sum() / 2**20:.2f} MiB)")

    def staleness(self):
        """Per training update: the trained samples by how many policy versions they lagged."""
        from distflow_lab.observe.schedule_figures import staleness_figure

        first = self.plan.stages[segments(self.plan, self.config.schedule.kind)[1][0]].id if self.plan.groups \
            else self.plan.stages[-1].id  # the first training stage
        return staleness_figure(self.items(), first, self.config.schedule.staleness)

    def trajectories(self):
        """Multi-turn rollouts: the latest step's trajectories on every rollout worker, one row each (turns,
        the model's tokens per turn, the environment's tokens, seconds in generation and in the
        environment, reward) and a figure (`observe.trajectories`)."""
        from distflow_lab.observe.trajectories import NEEDS, trajectories

        if "rollout" not in self.dag.ids:
            raise ValueError("this DAG has no `rollout` stage")
        st, parts = self.plan.stage("rollout"), []
        for w in st.ranks:
            if st.group_rank(w) == 0:
                try:
                    parts.append(self.controller.peek("rollout", w, n=1 << 30, columns=[*NEEDS, "uid", "item_id"]))
                except KeyError:  # not run yet on this worker
                    continue
        if not parts:
            raise KeyError(f"no multi-turn rollout output yet: run a step first (rollout.multi_turn writes {NEEDS})")
        cols = {k: torch.cat([p[k] for p in parts]) for k in NEEDS}
        uids = [u for p in parts for u in p["uid"]]
        items = [int(i) for p in parts for i in p["item_id"]]
        return trajectories(cols, uids, items, title=f"{self.mode}: trajectories of the latest rollout")

    def mismatch(self):
        """How far the rollout engine's log-probs are from the trainer's on the same tokens: per step
        (rollout/logprob_diff_mean, _max, rollout/logprob_kl) and over the latest step's tokens on
        the first worker that computed them (needs rollout.log_probs=true; with
        actor.old_log_prob=from_update the update logs the per-step series and no stage keeps the
        trainer's per-token log-probs, so the token histogram is left out)."""
        from distflow_lab.observe.mismatch import mismatch_figure, token_diffs

        diffs = None
        if "old_log_prob" in self.dag.ids and self.config.keep_outputs:
            worker = self.plan.stage("old_log_prob").ranks[0]
            cols = ["rollout_log_probs", "old_log_probs", "response_mask"]
            try:
                rows = self.controller.peek("old_log_prob", worker, n=1 << 30, columns=cols)
                diffs = token_diffs(rows["rollout_log_probs"], rows["old_log_probs"], rows["response_mask"])
            except (KeyError, ValueError):  # nothing run yet, or no rollout log-probs in the rows
                diffs = None
        return mismatch_figure(self.metrics, diffs)

    def idle(self):
        """Per training update: the trainer's and the rollout group's idle share, and the wall time."""
        from distflow_lab.observe.schedule_figures import idle_figure

        return idle_figure(self.metrics)

    def dag_figure(self):
        from distflow_lab.observe.dag_figure import dag_figure

        return dag_figure(self.plan)

    # ---- export -------------------------------------------------------------------------------
    def trace(self, path: str | Path) -> Path:
        """Chrome trace JSON of all spans, data-plane counter tracks and lineage flows (open it in
        https://ui.perfetto.dev; merge with ray.timeline() via observe.trace.merge_with_ray_timeline)."""
        from distflow_lab.observe.trace import to_chrome_trace

        to_chrome_trace(self.spans, path, items=self.items())
        return Path(path)

    def report(self, path: str | Path) -> Path:
        """One self-contained HTML file with every figure and the run's config."""
        from distflow_lab.observe.report import write_report

        return write_report(self, path, extra_spans=self.previous or None)

    def __repr__(self) -> str:
        c = self.controller
        return (f"Session({self.dag.name!r}, mode={self.mode}, workers={len(c.workers)}, updates={c.updates}, "
                f"next stage={self.cursor[1]!r}, switches={self.config.switches.model_dump(mode='json')})")

    def _repr_html_(self) -> str:
        last = self.metrics.tail(1).to_dict("records")
        shown = ", ".join(f"{k}={v:.4g}" for k, v in (last[0] if last else {}).items() if isinstance(v, float))
        return (f"<b>Session</b> {html.escape(self.dag.name)} · {self.mode} · "
                f"{len(self.controller.workers)} workers · update {self.controller.updates} · "
                f"next stage <code>{html.escape(self.cursor[1])}</code><br><small>{html.escape(shown)}</small>"
                + self.plan._repr_html_())


def session(dag: DAG, config: SessionConfig | RunConfig | dict | None = None, engines: str | Callable | None = None,
            **options: Any) -> Session:
    """Start workers for `dag`. `config` is a SessionConfig (or dict) for custom
    stages, or a RunConfig for the built-in RL algorithms. `options`: mode, seed,
    cluster options (world_size, stage_timeout_s, ...) and switches (local_cache,
    double_buffer, balance, num_buffers); see `OPTIONS`. An unknown one is an error."""
    return Session(dag, config, engines, **options)


__all__ = ["Session", "session", "session_config", "OPTIONS", "PLANES"]
