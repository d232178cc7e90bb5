"""Experiment trackers: every step's metrics to the console, TensorBoard, MLflow and
Weights & Biases, through each tool's own client (optional extra:
`pip install 'distflow_lab[trackers]'`).

    loggers = make_loggers(["console", "tensorboard", "mlflow", "wandb"], run_dir, config_dict)
    for rep in reports:                      # UpdateReports
        log_step(loggers, rep)               # = for l in loggers: l.log(rep.update, step_metrics(rep))
    close_all(loggers)

Key conventions (what `step_metrics` adds to the stages' own `ctx.log` metrics, which
keep their names: `reward/mean`, `actor/kl`, `actor/loss`, `response_length/mean`, ...):

    timing_s/step                  the driver's wall seconds of the step
    timing_s/<stage>               each stage's wall seconds (stage by stage: the driver's call;
                                   whole-step planes: first span start to last span end)
    timing_s/end_batch             the data plane's end-of-batch work (ledger, frees)
    perf/total_tokens              tokens (attention-mask sum) of the batch the last stage put out
    perf/tokens_per_s              perf/total_tokens / timing_s/step
    perf/tokens_per_s_per_worker   the same per worker (verl's perf/throughput)
    perf/rpcs                      Ray calls of the step (driver + every worker's data-plane port)

Where each tool writes, under `run_dir`:
    tensorboard   run_dir/tensorboard/events.out.tfevents.*   (`tensorboard --logdir run_dir/tensorboard`)
    mlflow        run_dir/mlruns (a local file store; MLflow 3 wants MLFLOW_ALLOW_FILE_STORE=true,
                  set here when unset), or `tracking_uri` (e.g. sqlite:///mlflow.db or a server)
    wandb         run_dir/wandb/offline-run-*/run-*.wandb; offline unless WANDB_MODE says otherwise
                  (`wandb sync run_dir/wandb/offline-run-*` uploads it later)
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable, Protocol

import pandas as pd

from distflow_lab.core.errors import ConfigError

TRACKERS = ("console", "tensorboard", "mlflow", "wandb")
CONSOLE_KEYS = ("reward/mean", "response_length/mean", "actor/kl", "actor/loss", "timing_s/step",
                "perf/tokens_per_s")


class Logger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# ---- the metrics of a step ----------------------------------------------------------------

def step_metrics(report: Any) -> dict[str, float]:
    """A UpdateReport's metrics plus timing_s/* and perf/* (see the module docstring)."""
    out: dict[str, float] = {k: float(v) for k, v in report.metrics.items()}
    wall = float(report.wall_seconds)
    out["timing_s/step"] = wall
    for st in report.stages:
        out[f"timing_s/{st.stage_id}"] = float(st.wall_seconds)
    out["timing_s/end_batch"] = float(getattr(report, "end_batch_seconds", 0.0))
    last = report.stages[-1] if report.stages else None
    tokens = float(sum(r.tokens_out for r in last.results if r.group_rank == 0)) if last else 0.0
    workers = len({r.worker for st in report.stages for r in st.results}) or 1
    out["perf/total_tokens"] = tokens
    out["perf/tokens_per_s"] = tokens / wall if wall > 0 else 0.0
    out["perf/tokens_per_s_per_worker"] = out["perf/tokens_per_s"] / workers
    out["perf/rpcs"] = float(report.rpcs)
    return out


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def flatten(config: dict | None, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and other values as they are."""
    out: dict[str, Any] = {}
    for k, v in (config or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ---- the loggers ---------------------------------------------------------------------------

class ConsoleLogger:
    """One line per step with a few keys (`keys`; default CONSOLE_KEYS present, else the first six)."""

    def __init__(self, keys: Iterable[str] | None = None, print_fn=print) -> None:
        self.keys, self.print = list(keys) if keys else None, print_fn

    def log(self, step: int, metrics: dict[str, float]) -> None:
        m = _finite(metrics)
        keys = self.keys or [k for k in CONSOLE_KEYS if k in m] or list(m)[:6]
        self.print(f"step {step:4d}  " + "  ".join(f"{k}={m[k]:.4g}" for k in keys if k in m), flush=True)

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """`torch.utils.tensorboard.SummaryWriter` into run_dir/tensorboard: one scalar per key per step."""

    def __init__(self, run_dir: str | Path, config: dict | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # the tensorboard package is missing
            raise ConfigError(f"tensorboard logger: {e}; pip install 'distflow_lab[trackers]'") from None
        self.dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in _finite(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /:]")


def mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, _ - . space / (and :): anything else becomes _."""
    return _MLFLOW_BAD.sub("_", key)


class MlflowLogger:
    """`mlflow.tracking.MlflowClient` (no global state): one run in experiment `experiment`,
    the config as params, each step's metrics as one batch."""

    def __init__(self, run_dir: str | Path, config: dict | None = None, tracking_uri: str | None = None,
                 experiment: str = "distflow_lab", run_name: str | None = None) -> None:
        uri = tracking_uri or "file:" + str((Path(run_dir) / "mlruns").resolve())
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores otherwise
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ConfigError(f"mlflow logger: {e}; pip install 'distflow_lab[trackers]'") from None
        self._Metric, self.uri = Metric, uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name or Path(run_dir).name).info.run_id
        params = [Param(mlflow_key(k)[:250], str(v)[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        ts = int(time.time() * 1000)
        batch = [self._Metric(mlflow_key(k), v, ts, int(step)) for k, v in _finite(metrics).items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbLogger:
    """`wandb.init(dir=run_dir)`, offline unless WANDB_MODE is set; `run.log(metrics, step=step)`."""

    def __init__(self, run_dir: str | Path, config: dict | None = None, project: str = "distflow_lab",
                 mode: str | None = None, run_name: str | None = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"wandb logger: {e}; pip install 'distflow_lab[trackers]'") from None
        d = Path(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(d), config=config or {}, name=run_name or d.name,
                              mode=mode or os.environ.get("WANDB_MODE") or "offline", reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=int(step))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb's service has written the last records of an offline run (seen on a
        # loaded 2-core machine: a history read right after close found none); teardown waits for it to exit
        wandb.teardown()


def make_loggers(names: Iterable[str], run_dir: str | Path, config_dict: dict | None = None,
                 **options: Any) -> list[Logger]:
    """Loggers by name (`console`, `tensorboard`, `mlflow`, `wandb`), writing under `run_dir`.
    `options`: `mlflow_tracking_uri`, `mlflow_experiment`, `wandb_project`, `wandb_mode`, `console_keys`."""
    names = list(names)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"unknown logger {unknown[0]!r}; loggers: {list(TRACKERS)}")
    out: list[Logger] = []
    try:
        for n in names:
            if n == "console":
                out.append(ConsoleLogger(options.get("console_keys")))
            elif n == "tensorboard":
                out.append(TensorBoardLogger(run_dir, config_dict))
            elif n == "mlflow":
                out.append(MlflowLogger(run_dir, config_dict, options.get("mlflow_tracking_uri"),
                                        options.get("mlflow_experiment", "distflow_lab")))
            else:
                out.append(WandbLogger(run_dir, config_dict, options.get("wandb_project", "distflow_lab"),
                                       options.get("wandb_mode")))
    except BaseException:
        close_all(out)
        raise
    return out


def log_step(loggers: Iterable[Logger], report: Any) -> dict[str, float]:
    """Log one UpdateReport to every logger; returns the metrics logged."""
    metrics = step_metrics(report)
    for lg in loggers:
        lg.log(report.update, metrics)
    return metrics


def close_all(loggers: Iterable[Logger]) -> None:
    for lg in loggers:
        lg.close()


# ---- reading W&B offline runs ----------------------------------------------------------------

_BLOCK, _HEADER = 32768, 7  # the .wandb file: LevelDB log blocks of protobuf `Record`s after a 7-byte header


def _wandb_records(path: Path) -> Iterable[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, buf = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: corrupt record at byte {pos}")
        pos += _HEADER + length
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            buf = chunk
        elif kind == 3:  # MIDDLE
            buf += chunk
        elif kind == 4:  # LAST
            yield buf + chunk
            buf = b""


def read_wandb_offline(run_dir: str | Path) -> pd.DataFrame:
    """The history (one row per logged step, columns = keys, `_step`) of an offline W&B
    run: `run_dir` is an offline-run-* folder, a .wandb file, or a folder holding one
    (newest first). Parsed with wandb's own protobuf schema (`wandb_internal_pb2.Record`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    p = Path(run_dir)
    if p.is_dir():
        files = sorted(p.rglob("run-*.wandb"), key=lambda f: f.stat().st_mtime, reverse=True)
        if not files:
            raise FileNotFoundError(f"no run-*.wandb file under {p}")
        p = files[0]
    rows = []
    for raw in _wandb_records(p):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return pd.DataFrame(rows)
