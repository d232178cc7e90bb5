"""How long the CLI takes to reject bad input: every entry of the bad-input table
(README), each run `repeats` times as a fresh `distflow-lab` process; median,
min and max seconds per entry. Target: under 1 s each (argument and config
errors are checked before torch, Ray or transformers are imported).

    distflow-lab bench cli-latency --repeats 5 [--json out.json]

`BAD_INPUTS` is the table itself: the arguments, the message the user sees
(a fragment of stderr) and what it is about. `tests/test_cli_errors.py` walks
the same table (exit status 2, that message, no traceback, no Ray started).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distflow_lab.experiments.bench.common import print_table, write_json

TARGET_S = 1.0


@dataclass(frozen=True)
class BadInput:
    name: str
    args: tuple[str, ...]  # after `distflow-lab`; "{dir}" is the scratch folder that `make_files` filled
    message: str  # what stderr says (a fragment of it: paths and lists may vary)
    about: str  # the bad input, in words


BAD_INPUTS: tuple[BadInput, ...] = (
    BadInput("steps-negative", ("run", "tiny-cpu-grpo", "--steps", "-5"),
             "argument --steps: must be at least 1, got -5", "a negative step count"),
    BadInput("steps-zero", ("run", "tiny-cpu-grpo", "--steps", "0"),
             "argument --steps: must be at least 1, got 0", "a zero step count"),
    BadInput("mode-unknown", ("run", "tiny-cpu-grpo", "--mode", "fast"),
             "argument --mode: invalid choice: 'fast'", "an unknown data plane"),
    BadInput("override-unknown-key", ("run", "tiny-cpu-grpo", "actor.lrr=1"),
             "actor.lrr: unknown key (not a field of this section) (from the override 'actor.lrr=1')",
             "a misspelt override key"),
    BadInput("override-bad-value", ("run", "tiny-cpu-grpo", "actor.lr=abc"),
             "actor.lr: Input should be a valid number, unable to parse string as a number "
             "(from the override 'actor.lr=abc')", "an override value of the wrong type"),
    BadInput("override-not-key-value", ("run", "tiny-cpu-grpo", "actor.lr"),
             "override 'actor.lr' must look like key.path=value", "an override without `=`"),
    BadInput("override-layout", ("run", "tiny-cpu-grpo", "rollout.tp=3"),
             "rollout.tp=3 does not divide cluster.world_size 2 workers", "a layout the workers cannot hold"),
    BadInput("override-estimator", ("run", "tiny-cpu-grpo", "algorithm.name=ppo", "algorithm.adv_estimator=rloo"),
             "algorithm.adv_estimator: ppo does not support 'rloo'", "an estimator the algorithm ignores"),
    BadInput("switch-wrong-mode", ("run", "tiny-cpu-grpo", "--mode", "coordinator", "switches.num_buffers=2"),
             "switch 'num_buffers' has no meaning in mode 'coordinator'", "a Fig. 10 switch the mode has not got"),
    BadInput("preset-missing", ("run", "no-such-preset"),
             "config 'no-such-preset' is neither a file nor a preset; presets: [", "a preset that does not exist"),
    BadInput("config-typo", ("run", "{dir}/typo.yaml"),
             "typo.yaml: invalid configuration\n  actor.lrr: unknown key", "a YAML config with a misspelt key"),
    BadInput("config-not-yaml", ("run", "{dir}/broken.yaml"),
             "config file {dir}/broken.yaml is not valid YAML", "a config file that does not parse"),
    BadInput("out-holds-run", ("run", "tiny-cpu-grpo", "--out", "{dir}/held"),
             "{dir}/held already holds a run (metrics.parquet); pass --overwrite to replace it",
             "`--out` holding an earlier run, without `--overwrite`"),
    BadInput("resume-no-checkpoint", ("run", "tiny-cpu-grpo", "--resume", "--out", "{dir}/fresh"),
             "no complete checkpoint under {dir}/fresh/checkpoints to resume from",
             "`--resume` where no checkpoint was written"),
    BadInput("data-missing", ("run", "tiny-cpu-grpo", "data.train={dir}/none.parquet", "--out", "{dir}/o1"),
             "data.train: '{dir}/none.parquet' is neither a registered dataset", "`data.train` naming no file"),
    BadInput("data-corrupt", ("run", "tiny-cpu-grpo", "data.train={dir}/corrupt.parquet", "--out", "{dir}/o2"),
             "{dir}/corrupt.parquet: not a readable parquet file (corrupt or wrong format)",
             "`data.train` naming a file that is not parquet"),
    BadInput("data-missing-column", ("run", "tiny-cpu-grpo", "data.train={dir}/nocolumn.parquet", "--out", "{dir}/o3"),
             "{dir}/nocolumn.parquet: missing required column(s) ['data_source', 'ability', 'reward_model', "
             "'extra_info']", "a parquet file without verl's columns"),
    BadInput("env-unknown", ("run", "tiny-cpu-calculator", "rollout.multi_turn.env=calc", "--out", "{dir}/o4"),
             "rollout.multi_turn: unknown environment 'calc'; registered: ['calculator', 'guess_number'] (or pass "
             "the class)", "a multi-turn run naming no registered environment"),
    BadInput("env-option", ("run", "tiny-cpu-calculator", "rollout.multi_turn.options={{max_call: 1}}", "--out",
                            "{dir}/o5"),
             "rollout.multi_turn: environment 'calculator': option 'max_call': unknown key (its options: ['latency', "
             "'max_calls', 'seed'])", "an environment option it does not have"),
    BadInput("bench-workers", ("bench", "dataplane", "--workers", "3"),
             "--workers 3 cannot share --batch 64: its 16 prompts (batch / n) do not split over 3 data-parallel "
             "rollout ranks; workers that fit this batch: [1, 2, 4, 8, 16, 32]", "a worker count the batch cannot split over"),
    BadInput("bench-modes", ("bench", "dataplane", "--modes", "centralized,fast"),
             "argument --modes: unknown mode 'fast'", "an unknown mode in `--modes`"),
    BadInput("bench-async-schedules", ("bench", "async", "--schedules", "one_step_off,async:k=2"),
             "argument --schedules: the first schedule must be 'sync' (the baseline), got 'one_step_off,async:k=2'",
             "`bench async --schedules` without the sync baseline first"),
    BadInput("bench-json-exists", ("bench", "balance", "--json", "{dir}/exists.json"),
             "--json {dir}/exists.json already exists; pass --overwrite to replace it or choose another path",
             "`bench ... --json` naming an existing file, without `--overwrite`"),
    BadInput("soak-override-synthetic", ("soak", "--override", "actor.lr=1"),
             "--override applies to the tiny GRPO; pass --engine hf or vllm",
             "`soak --override` on the synthetic DAG, which has no config to override"),
    BadInput("soak-override-unknown-key", ("soak", "--engine", "hf", "--override", "actor.lrr=1"),
             "actor.lrr: unknown key (not a field of this section) (from the override 'actor.lrr=1')",
             "`soak --override` with a misspelt key"),
    BadInput("ablate-out-exists", ("ablate", "--out", "{dir}/ablation"),
             "--out {dir}/ablation/ablation.json already exists; pass --overwrite to replace it",
             "`ablate --out` holding an earlier ablation, without `--overwrite`"),
)


def make_files(folder: Path) -> Path:
    """The files the table's entries point at, under `folder` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "typo.yaml").write_text("mode: distributed\nactor:\n  lrr: 1\n")
    (folder / "broken.yaml").write_text("actor: [1, 2\n")
    (folder / "held").mkdir(exist_ok=True)
    (folder / "held" / "metrics.parquet").write_bytes(b"")  # an earlier run's output
    (folder / "fresh").mkdir(exist_ok=True)
    (folder / "corrupt.parquet").write_text("not a parquet file\n")
    import pyarrow as pa  # light: no torch
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), folder / "nocolumn.parquet")
    (folder / "exists.json").write_text("[]\n")
    (folder / "ablation").mkdir(exist_ok=True)
    (folder / "ablation" / "ablation.json").write_text("[]\n")
    return folder


def cli_command() -> list[str]:
    """The `distflow-lab` console script of this environment (else `python -m distflow_lab.cli`)."""
    script = Path(sys.executable).with_name("distflow-lab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "distflow_lab.cli"]


def expand(entry: BadInput, folder: Path) -> tuple[list[str], str]:
    """(argv after the command, expected message) with `{dir}` filled in."""
    return [a.format(dir=folder) for a in entry.args], entry.message.format(dir=folder)


def call(entry: BadInput, folder: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """Run one entry as a fresh process; (the finished process, its wall seconds)."""
    args, _ = expand(entry, folder)
    env = {**os.environ, "DISTFLOW_HOME": str(folder / "home"), **(env or {})}
    t0 = time.perf_counter()
    out = subprocess.run([*cli_command(), *args], capture_output=True, text=True, cwd=folder, env=env,
                         timeout=timeout)
    return out, time.perf_counter() - t0


def run(repeats: int = 5, json_path: str | None = None, names: list[str] | None = None) -> list[dict]:
    """Time every entry (or those in `names`) `repeats` times; print and return one record each."""
    entries = [e for e in BAD_INPUTS if names is None or e.name in names]
    records = []
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        folder = make_files(Path(tmp))
        for e in entries:
            seconds, ok = [], True
            for _ in range(repeats):
                out, s = call(e, folder)
                seconds.append(s)
                ok = ok and out.returncode == 2 and expand(e, folder)[1] in out.stderr
            t = np.asarray(seconds)
            records.append({"input": e.name, "command": "distflow-lab " + " ".join(e.args),
                            "median_s": float(np.median(t)), "min_s": float(t.min()), "max_s": float(t.max()),
                            "under_1s": bool(np.median(t) < TARGET_S), "message_ok": ok, "repeats": repeats})
    print_table(records, ["input", "median_s", "min_s", "max_s", "under_1s", "message_ok"],
                title=f"CLI error latency: seconds per bad-input call (median/min/max of {repeats}; "
                      f"target < {TARGET_S:g} s)")
    slow = [r["input"] for r in records if not r["under_1s"]]
    print(f"{len(records) - len(slow)} of {len(records)} under {TARGET_S:g} s" + (f"; slower: {slow}" if slow else ""))
    write_json(records, json_path)
    return records
