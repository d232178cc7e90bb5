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

import html
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pandas as pd

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import (SWITCHES_BY_MODE, Balance, ClusterOptions, ConfigError, RunConfig,
                                      ProfileOptions, ScheduleOptions, SessionConfig, Switches, check_schedule,
                                      check_switches, load_model)
from distflow_lab.dataplane.centralized import CentralizedPlane
from distflow_lab.dataplane.coordinator import CoordinatorPlane
from distflow_lab.dataplane.distributed import DistributedPlane
from distflow_lab.dataplane.interface import DataPlane, Routing
from distflow_lab.dataplane.partition import workload_coeffs
from distflow_lab.graph.dag import DAG
from distflow_lab.runtime.controller import Controller
from distflow_lab.runtime.results import StageReport, StepReport

PLANES: dict[str, Callable[[], DataPlane]] = {
    "centralized": CentralizedPlane, "coordinator": CoordinatorPlane, "distributed": DistributedPlane,
}


def session_config(base: SessionConfig | dict | None = None, *,
                   mode: Literal["centralized", "coordinator", "distributed"] | None = None,
                   seed: int | None = None, keep_outputs: bool | None = None, history_steps: int | None = None,
                   # cluster
                   world_size: int | None = None, cpus_per_worker: float | None = None,
                   gpus_per_worker: float | None = None, placement: str | None = None,
                   threads_per_worker: int | None = None, stage_timeout_s: float | None = None,
                   buffer_wait_timeout_s: float | None = None, torch_distributed: bool | None = None,
                   # switches
                   local_cache: bool | None = None, double_buffer: bool | None = None,
                   balance: Balance | str | None = None, num_buffers: int | str | None = None,
                   rows_per_object: int | None = None,
                   # schedule
                   schedule: Literal["sync", "one_step_off", "async"] | None = None,
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
        buffer_wait_timeout_s=buffer_wait_timeout_s, torch_distributed=torch_distributed)}
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


class Session:
    """A running DAG on Ray workers. Every method delegates to the controller
    (`self.controller`) or to a figure function in `observe`."""

    def __init__(self, dag: DAG, config: SessionConfig | RunConfig | dict | None = None,
                 engines: str | Callable | None = None, **options: Any) -> None:
        if isinstance(config, RunConfig):
            from distflow_lab.algos.registry import check_run_config

            check_run_config(config)
            engines = engines or "distflow_lab.algos.engine_setup:setup_engines"
            config = config.session_config()
        self.dag, self._engines = dag, engines
        self._config = _configure(config, options)
        check_profile(self._config, dag)
        self.controller = Controller(dag, self._config, PLANES[self._config.mode](), engines,
                                     routing=routing_for(self._config))
        self.previous: dict[str, pd.DataFrame] = {}  # spans of earlier modes (reopen), for side-by-side figures
        self.previous_metrics: dict[str, pd.DataFrame] = {}

    # ---- running ------------------------------------------------------------------
    def step_stage(self) -> StageReport:
        """Run the next stage on every worker."""
        return self.controller.step_stage()

    def step(self) -> StepReport:
        """Finish the current step."""
        return self.controller.step()

    def run(self, steps: int, progress: bool = True) -> pd.DataFrame:
        """Run `steps` steps with a progress bar; returns their metrics."""
        if steps < 1:
            raise ConfigError(f"steps must be at least 1, got {steps}")
        reports = self.controller.run(steps, progress=progress)
        return pd.DataFrame([{"step": r.step, "wall_s": r.wall_seconds, **r.metrics} for r in reports])

    def reopen(self, mode: str | None = None, dag: DAG | None = None, **options: Any) -> "Session":
        """Reconfigure with another mode, switches or DAG, on the same worker processes
        when the placement allows (fresh engines, loaders, data plane, step 0); the spans
        and metrics so far are kept for side-by-side figures. Switches set earlier that
        mean nothing in the new mode are dropped; ones given here must apply."""
        self.previous[self.mode] = self.spans
        self.previous_metrics[self.mode] = self.metrics
        new_mode = mode or self.mode
        carried = self._config.model_copy(update={"switches": Switches(**{
            k: v for k, v in self._config.switches.model_dump(exclude_unset=True).items()
            if k in SWITCHES_BY_MODE.get(new_mode, ())})})
        config = _configure(carried, {**options, "mode": new_mode})
        self.dag = dag or self.dag
        old = self.controller
        if not old.can_hand_over(config):
            old.close()  # nothing to take over: free its slots first, or a full cluster cannot place the new workers
        self.controller = Controller(self.dag, config, PLANES[config.mode](), self._engines, reuse=old,
                                     routing=routing_for(config))
        old.close()  # frees what was not taken over (its data plane; its workers if not handed over)
        self._config = config
        return self

    def resume(self, directory: str | Path | None = None) -> int:
        """Restart the workers and data-plane actors and load a checkpoint (the last one by default)."""
        return self.controller.resume(directory)

    def close(self) -> None:
        self.controller.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- what happened -----------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.controller.mode

    @property
    def plan(self):
        return self.controller.plan

    @property
    def config(self) -> SessionConfig:
        return self.controller.config

    @property
    def workers(self) -> list:
        return self.controller.workers

    @property
    def spans(self) -> pd.DataFrame:
        return self.controller.spans

    @property
    def metrics(self) -> pd.DataFrame:
        return self.controller.metrics

    @property
    def history(self):
        return self.controller.history

    @property
    def retries(self) -> list[dict]:
        return self.controller.retries

    @property
    def bytes_to_driver(self) -> int:
        return self.controller.bytes_to_driver

    @property
    def cursor(self) -> tuple[int, str]:
        """(step, next stage id)."""
        c = self.controller
        return c.step_index, self.plan.stages[c.next_stage].id

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

    def redistribution_lengths(self) -> dict[str, tuple[np.ndarray, int]]:
        """For each redistribute edge: (item token lengths of the latest step, consumers' dp size)."""
        return self.controller.redistribution_lengths()

    def items(self) -> pd.DataFrame:
        """Per (step, stage, item): its id, token length, producing worker and input route (metadata only)."""
        return self.controller.items()

    def ledger(self) -> pd.DataFrame:
        """Items in/out of the data plane per (step, edge): nothing lost, nothing duplicated."""
        return self.controller.ledger()

    # ---- pictures --------------------------------------------------------------------------
    def timeline(self, steps: list[int] | None = None, last: int = 2):
        from distflow_lab.observe.timeline import last_steps, timeline

        spans = self.spans
        steps = last_steps(spans, last) if steps is None else steps
        return timeline(spans, steps=steps, title=f"{self.mode}: steps {steps}")

    def breakdown(self, skip: int = 0):
        """Paper Table 1, this session's mode beside any earlier one (reopen): a `Breakdown`
        that shows the figure and the table (`.figure`, `.table`; `fig, table = ...` works);
        `skip` drops each mode's first steps (warm-up)."""
        from distflow_lab.observe.breakdown import breakdown

        spans = {m: df[df["step"] >= df["step"].min() + skip] if len(df) else df
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
        .summary, .figure; `table, fig = s.bubbles()` unpacks). `skip`: warm-up steps left out."""
        from distflow_lab.observe.bubbles import bubbles

        spans = self.spans
        if skip and len(spans):
            spans = spans[spans["step"] >= spans["step"].min() + skip]
        m = self.metrics
        walls = m.set_index("step")["wall_s"] if len(m) and "wall_s" in m else None
        return bubbles(spans, {st.id: st.type for st in self.plan.stages}, walls,
                       title=f"{self.mode}: idle time by cause (mean seconds per step)")

    def lineage(self, item: int | str) -> pd.DataFrame:
        """The path of one item (its `item_id`, or every item of a `uid` prompt): stage, worker,
        node, how it arrived (local cache, buffer, coordinator, driver), its bytes and policy version."""
        items = self.items()
        if isinstance(item, str):
            ids = set()
            for st in self.plan.stages:  # the uid column lives on the batches; its rows' ids on the workers
                for w in st.ranks:
                    if st.group_rank(w) != 0:
                        continue
                    try:
                        b = self.output(st.id, worker=w)
                    except KeyError:
                        continue
                    if "uid" in b and "item_id" in b:
                        ids |= {int(i) for u, i in zip(b["uid"].tolist(), b["item_id"].tolist()) if str(u) == item}
            rows = items[items["item_id"].isin(ids)]
        else:
            rows = items[items["item_id"] == item]
        if not len(rows):
            raise KeyError(f"no recorded item {item!r} (run a step first; a uid needs keep_outputs)")
        nodes = dict(enumerate(self.controller.placement.worker_nodes)) if self.controller.placement else {}
        spans = self.spans
        per_item = (spans[spans.phase.isin(["get", "dispatch", "cache_hit"])]
                    .groupby(["step", "stage", "worker"])[["bytes", "items"]].sum())
        out = rows.assign(node=rows["worker"].map(lambda w: str(nodes.get(w, "?"))[:8]))
        hop = {"cache": "local cache", "buffer": "DataBuffer", "coordinator": "coordinator", "driver": "driver",
               "loader": "loader", "none": "-"}
        out = out.assign(hop=out["route_in"].map(hop))
        key = list(zip(out["step"], out["stage"], out["worker"]))
        moved = per_item.reindex(key)
        out = out.assign(bytes=(moved["bytes"] / moved["items"].clip(lower=1)).fillna(0).astype(int).to_numpy())
        return out.sort_values(["item_id", "step", "stage_index"])[
            ["item_id", "step", "update", "stage", "worker", "node", "hop", "bytes", "tokens", "version"]
        ].reset_index(drop=True)

    def sankey(self, edge: str | None = None, step: int | list[int] | None = None):
        """Bytes between workers on `edge` (a name like "advantage->old_log_prob"; None: every
        edge) over `step` (None: every step): a Sankey, producers to consumers (the driver in
        between in centralized mode). The numbers: `observe.flows.byte_flows`."""
        from distflow_lab.observe.flows import byte_flows, sankey_figure

        flows = byte_flows(self.spans, self.items(), self.plan, edge, step)
        steps = "every step" if step is None else f"step {step}"
        return sankey_figure(flows, [st.id for st in self.plan.stages],
                             title=f"{self.mode}: bytes between workers, {edge or 'every edge'}, {steps} "
                                   f"({flows['bytes'].sum() / 2**20:.2f} MiB)")

    def staleness(self):
        """Per training update: the trained samples by how many policy versions they lagged."""
        from distflow_lab.observe.schedule_figures import staleness_figure

        lanes = self.controller.lanes
        first = self.plan.stages[lanes.train_stages[0]].id if lanes else self.plan.stages[-1].id
        return staleness_figure(self.items(), first, self.config.schedule.staleness)

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

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, directory: str | Path) -> Path:
        return self.controller.save_checkpoint(directory)

    def load_checkpoint(self, directory: str | Path) -> int:
        return self.controller.load_checkpoint(directory)

    def __repr__(self) -> str:
        c = self.controller
        return (f"Session({self.dag.name!r}, mode={self.mode}, workers={len(c.workers)}, step={c.step_index}, "
                f"next stage={self.cursor[1]!r}, switches={self.config.switches.model_dump(mode='json')})")

    def _repr_html_(self) -> str:
        last = self.metrics.tail(1).to_dict("records")
        shown = ", ".join(f"{k}={v:.4g}" for k, v in (last[0] if last else {}).items() if isinstance(v, float))
        return (f"<b>Session</b> {html.escape(self.dag.name)} · {self.mode} · "
                f"{len(self.controller.workers)} workers · step {self.controller.step_index} · "
                f"next stage <code>{html.escape(self.cursor[1])}</code><br><small>{html.escape(shown)}</small>"
                + self.plan._repr_html_())


def session(dag: DAG, config: SessionConfig | RunConfig | dict | None = None, engines: str | Callable | None = None,
            **options: Any) -> Session:
    """Start workers for `dag`. `config` is a SessionConfig (or dict) for custom
    stages, or a RunConfig for the built-in RL algorithms. `options`: mode, seed,
    cluster options (world_size, stage_timeout_s, ...) and switches (local_cache,
    double_buffer, balance, num_buffers); see `OPTIONS`. An unknown one is an error."""
    return Session(dag, config, engines, **options)


def rl_session(config: str | RunConfig = "tiny-cpu-grpo", overrides: list[str] | None = None,
               dag: DAG | None = None, progress: bool = True, **options: Any) -> Session:
    """A GRPO/PPO session from a preset or YAML (plus overrides): prepares the model
    (SFT warm start, cached) and data, then starts the workers. Pass `dag` to run a
    modified DAG (e.g. `lab.rl_dag(cfg).replace("advantage", fn=my_fn)`)."""
    from distflow_lab.algos.registry import build_dag
    from distflow_lab.api.runner import load_run_config, prepare

    cfg = config if isinstance(config, RunConfig) else load_run_config(config, overrides)
    cfg, data_path = prepare(cfg, progress)
    return Session(dag or build_dag(cfg, data_path), cfg, **options)


def rl_dag(cfg: RunConfig | str, overrides: list[str] | None = None) -> DAG:
    """The built-in DAG of a run config (GRPO, PPO, ...), for editing before `rl_session`."""
    from distflow_lab.algos.registry import build_dag
    from distflow_lab.api.runner import load_run_config, prepare_data

    cfg = cfg if isinstance(cfg, RunConfig) else load_run_config(cfg, overrides)
    return build_dag(cfg, prepare_data(cfg))


def run_config(preset: str = "tiny-cpu-grpo", overrides: list[str] | None = None) -> RunConfig:
    from distflow_lab.api.runner import load_run_config

    return load_run_config(preset, overrides)


__all__ = ["Session", "session", "rl_session", "rl_dag", "run_config", "session_config", "OPTIONS", "PLANES"]
