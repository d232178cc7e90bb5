"""The notebook API: connect to Ray, open a session over a DAG, step through it
one stage at a time, look at what happened. The same controllers run
underneath as in the CLI and at scale.

    import distflow_lab as lab
    lab.connect()                                    # embedded local cluster, loopback only
    s = lab.session(lab.synthetic_grpo(), world_size=4, mode="distributed")
    s.step_stage()                                   # one stage on every worker: a StageReport
    s.step(); s.run(10)                              # finish the step; ten more with a progress bar
    s.peek("advantage")                              # a few decoded samples, only they travel
    s.timeline(); s.breakdown(); s.report("run.html")
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import ray

from . import controller
from .config import RunConfig, SessionConfig, load_run_config
from .dag import DAG
from .reports import StageReport, StepReport


class Session:
    """A running DAG on Ray workers. Thin: every method delegates to the
    controller (`self.controller`) or to a figure function in `viz`."""

    def __init__(self, dag: DAG, config: SessionConfig | RunConfig | dict | None = None,
                 mode: str | None = None, engines: str | Callable | None = None, **options: Any) -> None:
        if isinstance(config, RunConfig):
            config.check_sizes()
            engines = engines or "distflow_lab.algos.engines:setup_engines"
            config = config.session_config()
        self.dag, self._config, self._engines, self._options = dag, config, engines, dict(options)
        self.controller = controller.create(dag, config, mode=mode, engines=engines, **options)
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
        reports = self.controller.run(steps, progress=progress)
        return pd.DataFrame([{"step": r.step, "wall_s": r.wall_seconds, **r.metrics} for r in reports])

    def reopen(self, mode: str | None = None, dag: DAG | None = None, **options: Any) -> "Session":
        """Reconfigure with another mode, switches or DAG, on the same worker processes
        when the placement allows (fresh engines, loaders, buffers, step 0); the spans
        and metrics so far are kept for side-by-side figures."""
        self.previous[self.mode] = self.spans
        self.previous_metrics[self.mode] = self.metrics
        self._options.update(options)
        self.dag = dag or self.dag
        self.controller = controller.create(self.dag, self._config, mode=mode or self.mode,
                                            engines=self._engines, reuse=self.controller, **self._options)
        return self

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
    def spans(self) -> pd.DataFrame:
        return self.controller.spans

    @property
    def metrics(self) -> pd.DataFrame:
        return self.controller.metrics

    @property
    def cursor(self) -> tuple[int, str]:
        """(step, next stage id)."""
        c = self.controller
        return c.step_index, self.plan.stages[c.next_stage].id

    def peek(self, stage: str, worker: int = 0, n: int = 4) -> pd.DataFrame:
        """A few samples of `stage`'s latest output on `worker`, decoded (prompt,
        response, reward, advantage); only these rows travel to the driver."""
        self.plan.stage(stage)
        rows = ray.get(self.controller.workers[worker].samples.remote(stage, n))
        if not rows:
            raise KeyError(f"worker {worker} holds no output of stage {stage!r} yet: run it first")
        return pd.DataFrame(rows)

    def redistribution_lengths(self) -> dict[str, tuple[np.ndarray, int]]:
        """For each redistribute edge: (item token lengths of the latest step, consumers' dp size)."""
        return self.controller.redistribution_lengths()

    def ledger(self) -> pd.DataFrame:
        """Items in/out of the DataBuffers per (step, edge) (distributed mode; empty otherwise)."""
        return self.controller.ledger()

    # ---- pictures --------------------------------------------------------------------------
    def timeline(self, steps: list[int] | None = None, last: int = 2):
        from .viz.timeline import last_steps, timeline

        spans = self.spans
        steps = last_steps(spans, last) if steps is None else steps
        return timeline(spans, steps=steps, title=f"{self.mode}: steps {steps}")

    def breakdown(self, skip: int = 0):
        """Paper Table 1: (figure, table), this session's mode beside any earlier one (reopen);
        `skip` drops each mode's first steps (warm-up)."""
        from .viz.breakdown import breakdown

        spans = {m: df[df["step"] >= df["step"].min() + skip] if len(df) else df
                 for m, df in {**self.previous, self.mode: self.spans}.items()}
        return breakdown(spans, [s.id for s in self.plan.stages])

    def cache_hits(self):
        from .viz.breakdown import cache_hits

        return cache_hits(self.spans)

    def load_balance(self, edge: str | None = None):
        from .viz.balance import load_balance

        lengths = self.redistribution_lengths()
        if not lengths:
            raise ValueError("no redistribute edge with data yet (the plan has none, or no step ran)")
        name = edge or next(iter(lengths))
        values, k = lengths[name]
        return load_balance(values, k, title=f"token load per worker at {name}")

    def curves(self, columns: list[str] | None = None):
        from .viz.curves import metric_curves

        return metric_curves(self.metrics, columns)

    def dag_figure(self):
        from .viz.dag import dag_figure

        return dag_figure(self.plan)

    # ---- export -------------------------------------------------------------------------------
    def trace(self, path: str | Path) -> Path:
        """Chrome trace JSON of all spans (open it in https://ui.perfetto.dev)."""
        from .telemetry import to_chrome_trace

        to_chrome_trace(self.spans, path)
        return Path(path)

    def report(self, path: str | Path) -> Path:
        """One self-contained HTML file with every figure and the run's config."""
        from .report import write_report

        return write_report(self, path, extra_spans=self.previous or None)

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, directory: str | Path) -> Path:
        return self.controller.save_checkpoint(directory)

    def load_checkpoint(self, directory: str | Path) -> int:
        return self.controller.load_checkpoint(directory)

    def __repr__(self) -> str:
        c = self.controller
        return (f"Session({self.dag.name!r}, mode={self.mode}, workers={len(c.workers)}, step={c.step_index}, "
                f"next stage={self.plan.stages[c.next_stage].id!r}, switches={self.config.switches.model_dump()})")

    def _repr_html_(self) -> str:
        last = self.metrics.tail(1).to_dict("records")
        shown = ", ".join(f"{k}={v:.4g}" for k, v in (last[0] if last else {}).items() if isinstance(v, float))
        return (f"<b>Session</b> {html.escape(self.dag.name)} · {self.mode} · "
                f"{len(self.controller.workers)} workers · step {self.controller.step_index} · "
                f"next stage <code>{html.escape(self.cursor[1])}</code><br><small>{html.escape(shown)}</small>"
                + self.plan._repr_html_())


def session(dag: DAG, config: SessionConfig | RunConfig | dict | None = None, mode: str | None = None,
            engines: str | Callable | None = None, **options: Any) -> Session:
    """Start workers for `dag`. `config` is a SessionConfig (or dict) for custom
    stages, or a RunConfig for the built-in RL algorithms; `options` are switches
    (local_cache, double_buffer, balance, num_buffers) or cluster options (world_size, ...)."""
    return Session(dag, config, mode, engines, **options)


def rl_session(config: str | RunConfig = "tiny-cpu-grpo", overrides: list[str] | None = None,
               dag: DAG | None = None, progress: bool = True) -> Session:
    """A GRPO/PPO session from a preset or YAML (plus overrides): prepares the model
    (SFT warm start, cached) and data, then starts the workers. Pass `dag` to run a
    modified DAG (e.g. `lab.rl_dag(cfg).replace("advantage", fn=my_fn)`)."""
    from .runner import prepare_data, prepare_model

    cfg = config if isinstance(config, RunConfig) else load_run_config(config, overrides)
    data_path = prepare_data(cfg)
    cfg = prepare_model(cfg, data_path, progress)
    return Session(dag or rl_dag(cfg), cfg)


def rl_dag(cfg: RunConfig | str, overrides: list[str] | None = None) -> DAG:
    """The built-in DAG of a run config (GRPO or PPO), for editing before `rl_session`."""
    from .runner import build_dag, prepare_data

    cfg = cfg if isinstance(cfg, RunConfig) else load_run_config(cfg, overrides)
    return build_dag(cfg, prepare_data(cfg))


def run_config(preset: str = "tiny-cpu-grpo", overrides: list[str] | None = None) -> RunConfig:
    return load_run_config(preset, overrides)


__all__ = ["Session", "session", "rl_session", "rl_dag", "run_config"]
