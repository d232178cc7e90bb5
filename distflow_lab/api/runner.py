"""An RL run from a RunConfig: prepare model and data (offline, cached), open a
session on Ray, train, write what happened. `distflow-lab run` and the notebooks
use the same functions (`lab.rl_session`, `lab.rl_dag`, `lab.run_config` are here).

Where outputs go: `out` when given (refused if it already holds a run, unless
`overwrite`), else a new numbered folder `runs/<config name>/run-NNN` under the
working directory (`trainer.out_dir` replaces `runs/<config name>`). A run never
silently replaces an earlier run's outputs.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from distflow_lab.algos.registry import build_dag, load_run_config, with_defaults  # noqa: F401 (re-exported)
from distflow_lab.algos.sft import warm_start
from distflow_lab.api.run_dirs import run_dir
from distflow_lab.api.session import Session
from distflow_lab.core.config import ConfigError, RunConfig, cache_root
from distflow_lab.datasets.registry import prepare_dataset
from distflow_lab.graph.dag import DAG
from distflow_lab.models.model_dir import ensure_tiny_model, has_model
from distflow_lab.models.pretrained import PRETRAINED, ensure_pretrained
from distflow_lab.observe.report import write_report
from distflow_lab.observe.trace import to_chrome_trace
from distflow_lab.observe.trackers import close_all, log_step, make_loggers
from distflow_lab.runtime.checkpoint_files import latest_checkpoint


def prepare_data(cfg: RunConfig) -> str:
    """The training parquet: the registered dataset's rows written once (datasets/registry.py) or a
    given path, checked against the verl schema before any worker starts."""
    path = prepare_dataset(cfg.data, cfg.session.seed, cfg)  # schema checked; errors name the file
    rows = pq.ParquetFile(path).metadata.num_rows
    dp = cfg.session.cluster.world_size // cfg.rollout.tp
    if rows < cfg.data.prompts_per_step:
        raise ConfigError(f"{path} has {rows} rows, fewer than data.prompts_per_step={cfg.data.prompts_per_step}")
    if rows // dp < cfg.data.prompts_per_step // dp:
        raise ConfigError(f"{path}: {rows} rows over {dp} ranks leave shards smaller than a step's batch")
    return str(path)


def prepare_model(cfg: RunConfig, data_path: str, progress: bool = True) -> RunConfig:
    """Build the tiny model if asked and absent, run the SFT warm-up (cached), and
    check that prompt + response fit the model's context. Returns the config the
    workers get (model.path pointing at the warm-started model)."""
    path = Path(cfg.model.path)
    if (name := pretrained_name(cfg.model.path)) is not None:
        if cfg.model.tiny is not None:
            raise ConfigError(f"model.path {name!r} names a pretrained model, but model.tiny is set (it would build a "
                              f"random tiny model there): set model.tiny=null")
        path = ensure_pretrained(name, cache_root(), progress)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path)})})
    elif cfg.model.tiny is not None:  # built here if absent; one built with another spec is an error
        try:
            ensure_tiny_model(path, cfg.model.tiny, seed=cfg.session.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif not has_model(path):
        raise ConfigError(f"model.path {path} holds no model (config.json + weights) and model.tiny is null")
    context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    need = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    if context and need > context:
        raise ConfigError(f"data.max_prompt_len + rollout.max_response_len = {need} exceeds the model's context "
                          f"({context} positions, {path}/config.json)")
    tuned = warm_start(cfg, data_path, progress)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tuned)})})


def pretrained_name(path: str) -> str | None:
    """The named pretrained model `model.path` asks for (`models/pretrained.py`), if it names one:
    the bare name, or that name resolved under the cache root."""
    p = Path(path)
    if path in PRETRAINED or (p.name in PRETRAINED and p.parent == cache_root()):
        return p.name
    return None


def prepare(cfg: RunConfig, progress: bool = True) -> tuple[RunConfig, str]:
    """(the config the workers get, the training parquet), ready to start a session."""
    cfg = with_defaults(cfg)
    data_path = prepare_data(cfg)
    return prepare_model(cfg, data_path, progress), data_path


def open_session(cfg: RunConfig, progress: bool = True, dag: DAG | None = None, **options: Any) -> Session:
    """Prepare data and model, then start the workers (engines built on each). `options` are
    session options over the config's (`lab.OPTIONS`: mode, switches, ...)."""
    cfg, data_path = prepare(cfg, progress)
    return Session(dag or build_dag(cfg, data_path), cfg, **options)


def rl_session(config: str | RunConfig = "tiny-cpu-grpo", overrides: list[str] | None = None,
               dag: DAG | None = None, progress: bool = True, resume: bool | str | Path = False,
               **options: Any) -> Session:
    """A GRPO/PPO session from a preset or YAML (plus overrides): prepares the model
    (SFT warm start, cached) and data, then starts the workers. Pass `dag` to run a
    modified DAG (e.g. `lab.rl_dag(cfg).replace("advantage", fn=my_fn)`). `resume`: continue
    from a checkpoint (a checkpoint folder, or a folder of them: the newest complete one; True:
    the newest run of this config with one, as `distflow-lab run --resume` finds it), e.g. after
    the notebook kernel died."""
    cfg = config if isinstance(config, RunConfig) else load_run_config(config, overrides)
    ckpt = resume_checkpoint(cfg, resume) if resume is not False else None  # a missing one fails before any work
    s = open_session(cfg, progress, dag, **options)
    if ckpt is not None:
        try:
            s.load_checkpoint(ckpt)
        except BaseException:
            s.close()
            raise
    return s


def resume_checkpoint(cfg: RunConfig, resume: bool | str | Path) -> Path:
    """The checkpoint `rl_session(..., resume=...)` continues from (see there)."""
    if resume is True:
        where = run_dir(cfg, None, resume=True) / "checkpoints"
    else:
        where = Path(resume)
        if (where / "state.json").is_file():
            return where
        if (where / "checkpoints").is_dir():
            where = where / "checkpoints"
    ckpt = latest_checkpoint(where)
    if ckpt is None:
        raise ConfigError(f"no complete checkpoint under {where} to resume from")
    return ckpt


def rl_dag(cfg: RunConfig | str, overrides: list[str] | None = None) -> DAG:
    """The built-in DAG of a run config (GRPO, PPO, ...), for editing before `rl_session`."""
    cfg = cfg if isinstance(cfg, RunConfig) else load_run_config(cfg, overrides)
    return build_dag(cfg, prepare_data(cfg))


def run_config(preset: str = "tiny-cpu-grpo", overrides: list[str] | None = None) -> RunConfig:
    """`load_run_config` with the tiny GRPO preset as the default (`lab.run_config`)."""
    return load_run_config(preset, overrides)


def write_outputs(session: Session, out: str | Path) -> dict[str, Path]:
    """metrics.parquet, spans.parquet, trace.json (Perfetto) and report.html."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"metrics": out / "metrics.parquet", "spans": out / "spans.parquet", "items": out / "items.parquet",
             "trace": out / "trace.json"}
    session.metrics.to_parquet(paths["metrics"])
    spans, items = session.spans, session.items()
    spans.assign(cache_hit=spans["cache_hit"].astype("boolean")).to_parquet(paths["spans"])
    items.to_parquet(paths["items"])  # lab.replay(run_dir) reads it
    to_chrome_trace(spans, paths["trace"], items=items)
    paths["report"] = write_report(session, out / "report.html")
    return paths


def train(cfg: RunConfig, steps: int | None = None, out: str | Path | None = None, progress: bool = True,
          echo: bool = True, overwrite: bool = False, resume: bool = False) -> pd.DataFrame:
    """Run RL steps (up to `steps`, default trainer.steps; after a checkpoint with `resume`)
    and write the outputs; returns the metrics table."""
    steps = cfg.trainer.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    out = run_dir(cfg, out, overwrite, resume)
    if cfg.trainer.profile is not None and not Path(cfg.trainer.profile.directory).is_absolute():
        profile = cfg.trainer.profile.model_copy(update={"directory": str(out.resolve() / cfg.trainer.profile.directory)})
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"profile": profile})})
    loggers = make_loggers(cfg.trainer.loggers, out, cfg.model_dump(mode="json"))  # a missing package fails here
    with open_session(cfg, progress) as s, closing_all(loggers):
        start = 0
        if resume:
            ckpt = latest_checkpoint(out / "checkpoints")
            if ckpt is None:
                raise ConfigError(f"no complete checkpoint under {out / 'checkpoints'} to resume from")
            start = s.load_checkpoint(ckpt)
            if echo:
                print(f"resumed from {ckpt} at step {start}")
        warned = False
        for _ in range(start, steps):
            rep = s.step()
            log_step(loggers, rep)
            m = rep.metrics
            if echo and m.get("rollout/prompts_truncated", 0) > 0 and not warned:
                warned = True
                print(f"note: prompts longer than data.max_prompt_len={cfg.data.max_prompt_len} tokens were "
                      "truncated to their last tokens (metric rollout/prompts_truncated counts them per rank)")
            if echo:
                print(f"update {rep.update:4d}  reward {m.get('reward/mean', float('nan')):.3f}  "
                      f"resp_len {m.get('response_length/mean', float('nan')):.2f}  "
                      f"kl {m.get('actor/kl', float('nan')):.4f}  {rep.wall_seconds:.2f}s", flush=True)
            if cfg.trainer.checkpoint_every and (rep.update + 1) % cfg.trainer.checkpoint_every == 0:
                s.save_checkpoint(out / "checkpoints" / f"step{rep.update + 1:06d}")
        paths = write_outputs(s, out)
        if echo:
            print("wrote " + ", ".join(str(p) for p in paths.values()))
        return s.metrics


@contextlib.contextmanager
def closing_all(loggers: list):
    try:
        yield loggers
    finally:
        close_all(loggers)
