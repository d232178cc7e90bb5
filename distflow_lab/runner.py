"""An RL run from a RunConfig: prepare model and data (offline), open a session
on Ray, train, write what happened. `distflow-lab run` and the notebooks use
the same functions.

    distflow-lab run tiny-cpu-grpo --steps 20 --out runs/grpo trainer.steps=20 actor.lr=1e-3
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from . import controller
from .config import ConfigError, RunConfig, load_run_config
from .controller.base import Controller
from .dag import DAG

ENGINES = "distflow_lab.algos.engines:setup_engines"


def prepare_data(cfg: RunConfig) -> str:
    """The training parquet: generated (arithmetic), converted (GSM8K) or a given
    path, checked against the verl schema before any worker starts."""
    from .data.schema import read_table, validate_table

    root = Path(cfg.data.cache_dir)
    if cfg.data.train == "arithmetic":
        from .tasks.arithmetic import write_arithmetic_parquet

        path = root / f"arithmetic-{cfg.data.arithmetic_rows}-max{cfg.data.arithmetic_max_operand}-s{cfg.seed}.parquet"
        if not path.exists():
            root.mkdir(parents=True, exist_ok=True)
            write_arithmetic_parquet(path, cfg.data.arithmetic_rows, cfg.seed, max_operand=cfg.data.arithmetic_max_operand)
    elif cfg.data.train == "gsm8k":
        from .data.gsm8k import convert_gsm8k, default_gsm8k_dir

        path = root / "gsm8k-train.parquet"
        if not path.exists():
            root.mkdir(parents=True, exist_ok=True)
            convert_gsm8k(default_gsm8k_dir() / "train.jsonl", path, split="train")
    else:
        path = Path(cfg.data.train)
    validate_table(read_table(path), path)  # names the file and the missing column
    rows = pq.ParquetFile(path).metadata.num_rows
    dp = cfg.cluster.world_size // cfg.rollout.tp
    if rows < cfg.data.prompts_per_step:
        raise ConfigError(f"{path} has {rows} rows, fewer than data.prompts_per_step={cfg.data.prompts_per_step}")
    if rows // dp < cfg.data.prompts_per_step // dp:
        raise ConfigError(f"{path}: {rows} rows over {dp} ranks leave shards smaller than a step's batch")
    return str(path)


def prepare_model(cfg: RunConfig, data_path: str, progress: bool = True) -> RunConfig:
    """Build the tiny model if asked and absent, run the SFT warm-up (cached), and
    check that prompt + response fit the model's context. Returns the config the
    workers get (model.path pointing at the warm-started model)."""
    from .algos.sft import warm_start
    from .engines.model import TinyModelSpec, ensure_tiny_model, has_model

    path = Path(cfg.model.path)
    if not has_model(path):
        if cfg.model.tiny is None:
            raise ConfigError(f"model.path {path} holds no model (config.json + weights) and model.tiny is null")
        ensure_tiny_model(path, TinyModelSpec(**cfg.model.tiny.model_dump()), seed=cfg.seed)
    context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    need = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    if context and need > context:
        raise ConfigError(f"data.max_prompt_len + rollout.max_response_len = {need} exceeds the model's context "
                          f"({context} positions, {path}/config.json)")
    tuned = warm_start(cfg, data_path, progress)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tuned)})})


def build_dag(cfg: RunConfig, data_path: str) -> DAG:
    if cfg.algorithm.name == "ppo":
        from .algos.ppo import ppo_dag

        return ppo_dag(cfg, data_path)
    from .algos.grpo import grpo_dag

    return grpo_dag(cfg, data_path)


def open_session(cfg: RunConfig, progress: bool = True, dag: DAG | None = None) -> Controller:
    """Prepare data and model, then start the workers (engines built on each)."""
    cfg.check_sizes()
    data_path = prepare_data(cfg)
    cfg = prepare_model(cfg, data_path, progress)
    return controller.create(dag or build_dag(cfg, data_path), cfg.session_config(), engines=ENGINES)


def write_outputs(session: Controller, out: str | Path) -> dict[str, Path]:
    """metrics.parquet, spans.parquet, trace.json (Perfetto) and report.html."""
    from .telemetry import to_chrome_trace

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"metrics": out / "metrics.parquet", "spans": out / "spans.parquet", "trace": out / "trace.json"}
    session.metrics.to_parquet(paths["metrics"])
    spans = session.spans
    spans.assign(cache_hit=spans["cache_hit"].astype("boolean")).to_parquet(paths["spans"])
    to_chrome_trace(spans, paths["trace"])
    try:
        from .report import write_report

        paths["report"] = write_report(session, out / "report.html")
    except ImportError:
        pass
    return paths


def train(cfg: RunConfig, steps: int | None = None, out: str | Path | None = None, progress: bool = True,
          echo: bool = True) -> pd.DataFrame:
    """Run `steps` RL steps and write outputs; returns the metrics table."""
    steps = cfg.trainer.steps if steps is None else steps
    out = Path(out or cfg.trainer.out_dir)
    with open_session(cfg, progress) as s:
        warned = False
        for _ in range(steps):
            rep = s.step()
            m = rep.metrics
            if echo and m.get("rollout/prompts_truncated", 0) > 0 and not warned:
                warned = True
                print(f"note: prompts longer than data.max_prompt_len={cfg.data.max_prompt_len} tokens were "
                      "truncated to their last tokens (metric rollout/prompts_truncated counts them per rank)")
            if echo:
                print(f"step {rep.step:4d}  reward {m.get('reward/mean', float('nan')):.3f}  "
                      f"resp_len {m.get('response_length/mean', float('nan')):.2f}  "
                      f"kl {m.get('actor/kl', float('nan')):.4f}  {rep.wall_seconds:.2f}s", flush=True)
            if cfg.trainer.checkpoint_every and (rep.step + 1) % cfg.trainer.checkpoint_every == 0:
                s.save_checkpoint(out / "checkpoints" / f"step{rep.step + 1:06d}")
        paths = write_outputs(s, out)
        if echo:
            print("wrote " + ", ".join(str(p) for p in paths.values()))
        return s.metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="distflow-lab run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a YAML file or a preset name (tiny-cpu-grpo, tiny-cpu-ppo, gpu-qwen2.5-grpo)")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. actor.lr=1e-3")
    ap.add_argument("--mode", choices=["distributed", "centralized"])
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    a = ap.parse_intermixed_args(argv)  # overrides may come before or after options
    overrides = list(a.overrides) + ([f"mode={a.mode}"] if a.mode else [])
    try:
        cfg = load_run_config(a.config, overrides)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    if a.resume:
        return _resume(cfg, a.steps, a.out)
    train(cfg, a.steps, a.out)
    return 0


def latest_checkpoint(out: str | Path) -> Path | None:
    ckpts = sorted((Path(out) / "checkpoints").glob("step*"))
    return ckpts[-1] if ckpts else None


def _resume(cfg: RunConfig, steps: int | None, out: Any) -> int:
    out = Path(out or cfg.trainer.out_dir)
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        print(f"error: no checkpoint under {out / 'checkpoints'} to resume from")
        return 2
    with open_session(cfg) as s:
        start = s.load_checkpoint(ckpt)
        print(f"resumed from {ckpt} at step {start}")
        for _ in range((cfg.trainer.steps if steps is None else steps) - start):
            rep = s.step()
            print(f"step {rep.step:4d}  reward {rep.metrics.get('reward/mean', float('nan')):.3f}", flush=True)
        write_outputs(s, out)
    return 0
