"""`distflow-lab` command line: the same code paths as the notebook API.

    distflow-lab run CONFIG|PRESET [--mode M] [--steps N] [--out DIR] [--overwrite] [--resume] [key=value ...]
    distflow-lab ablate [--batches 64,128] [--repeats R] [--out DIR] [--overwrite]
    distflow-lab bench dataplane|balance|serialization|memory|e2e|session-open|matrix|weight-sync [...]
    distflow-lab bench peer --against trl [--preset P] [--steps N] [--engine E] [--rows N] [--prompts N] [--n N] [--max-tokens N] [--json F]
    distflow-lab soak [--mode M,..] [--schedule S,..] [--engine E,..] [--steps N] [--fault-every F] [--seed S] [--json F] [--override K=V ..]
    distflow-lab data gsm8k|arithmetic [...]
    distflow-lab eval CONFIG|PRESET [--rows N] [--samples N] [--temperature T] [--checkpoint DIR] [--json F] [key=value ...]

Arguments and configs are parsed and checked first, with light imports only:
a bad argument or config fails in well under a second, before torch, Ray or
transformers are imported and before any worker starts. Errors print one line
(`error: ...`), never a traceback, and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from distflow_lab.core.config import MODES, SCHEDULES
from distflow_lab.core.errors import FriendlyError


class UsageError(FriendlyError, ValueError):
    """A command-line argument that cannot work; names it."""


# ---- argument types ------------------------------------------------------------------------


def positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def modes_list(allowed: tuple[str, ...], what: str = "mode") -> Callable[[str], tuple[str, ...]]:
    def parse(s: str) -> tuple[str, ...]:
        got = tuple(m.strip() for m in s.split(",") if m.strip())
        bad = [m for m in got if m not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0] if bad else s!r}; choose from {list(allowed)}")
        return got
    return parse


def tool_latency(text: str) -> tuple[float, float]:
    """--tool-latency 50:1.0 -> (median ms, log-sd), both >= 0."""
    try:
        median, sigma = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MEDIAN_MS:SIGMA, e.g. 50:1.0") from None
    if median < 0 or sigma < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the median and sigma must be >= 0")
    return median, sigma


def schedule_list(text: str) -> list[tuple[str, dict]]:
    """--schedules sync,one_step_off,async:k=2:partial -> (kind, options), sync first (the baseline)."""
    from distflow_lab.core.errors import ConfigError
    from distflow_lab.experiments.schedule_replay import parse_schedule

    try:
        specs = [parse_schedule(x) for x in text.split(",") if x.strip()]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not specs or specs[0].kind != "sync":
        raise argparse.ArgumentTypeError(f"the first schedule must be 'sync' (the baseline), got {text!r}")
    return [(o.pop("schedule"), o) for o in (dict(sp.options) for sp in specs)]


def fresh_file(path: str | None, overwrite: bool, flag: str = "--json") -> None:
    """An output file that exists is replaced only with --overwrite."""
    if path and Path(path).exists() and not overwrite:
        raise UsageError(f"{flag} {path} already exists; pass --overwrite to replace it or choose another path")


def check_bench_shape(workers: list[int], batch: int, n: int, rollout_tp: int) -> None:
    from distflow_lab.experiments.bench.shape import shape_problem  # plain Python, no torch

    for w in workers:
        problem = shape_problem(w, batch, n, rollout_tp)
        if problem:
            raise UsageError(problem)


def check_peer(a: argparse.Namespace) -> None:
    """`bench peer`: the peer installed and a config both systems can run, before the heavy imports."""
    import importlib.util

    if a.n is not None and a.n < 2:
        raise UsageError(f"--n {a.n}: GRPO needs at least 2 responses per prompt (TRL's GRPOTrainer refuses fewer)")
    if importlib.util.find_spec(a.against) is None:
        raise UsageError(f"bench peer --against {a.against} needs {a.against}: pip install 'distflow_lab[bench]'")
    from distflow_lab.algos.registry import load_run_config
    from distflow_lab.experiments.bench.peer_trl import PEER_ALGORITHMS, overrides_for

    cfg = load_run_config(a.preset, overrides_for(a.engine, a.prompts, a.n, a.max_tokens))
    if cfg.algorithm.name not in PEER_ALGORITHMS:
        raise UsageError(f"--preset {a.preset} runs {cfg.algorithm.name}; the peer comparison maps "
                         f"{list(PEER_ALGORITHMS)} onto TRL")
    if cfg.rollout.n < 2:
        raise UsageError(f"--preset {a.preset} has rollout.n={cfg.rollout.n}; GRPO against TRL needs --n 2 or more")
    if cfg.actor.mini_batches != 1:
        raise UsageError(f"--preset {a.preset} has actor.mini_batches={cfg.actor.mini_batches}; the peer comparison "
                         "maps one optimizer step per RL step")
    from distflow_lab.datasets.registry import is_dataset

    if not is_dataset(cfg.data.train):
        raise UsageError(f"the held-out accuracy draws the test split of a registered dataset; data.train is the file "
                         f"{cfg.data.train!r}")


# ---- commands ---------------------------------------------------------------------------------


def cmd_run(a: argparse.Namespace) -> int:
    from distflow_lab.algos.registry import check_multi_turn, with_defaults
    from distflow_lab.api.run_dirs import run_dir
    from distflow_lab.core.config import parse_run_config
    from distflow_lab.datasets.registry import check_data, is_dataset
    from distflow_lab.datasets.schema import read_table, validate_table

    overrides = list(a.overrides) + ([f"mode={a.mode}"] if a.mode else [])
    # the checks that need no torch first, so their errors come in well under a second
    cfg = parse_run_config(a.config, overrides)
    run_dir(cfg, a.out, a.overwrite, a.resume)  # refuse to replace a run before anything starts
    check_data(cfg.data)
    if not is_dataset(cfg.data.train):  # a given file: read it now, not after the imports
        validate_table(read_table(cfg.data.train), cfg.data.train)
    check_multi_turn(cfg)
    cfg = with_defaults(cfg)  # the algorithm registry: its estimators and losses (torch)
    from distflow_lab.api.runner import train  # the heavy part: torch, Ray, transformers

    train(cfg, a.steps, a.out, overwrite=a.overwrite, resume=a.resume)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from distflow_lab.algos.registry import load_run_config

    fresh_file(a.json, a.overwrite)
    cfg = load_run_config(a.config, list(a.overrides))  # a bad config or override fails before the model loads
    from distflow_lab.datasets.registry import is_dataset

    if not is_dataset(cfg.data.train):
        raise UsageError(f"eval draws its held-out set from a registered dataset's test split; data.train is the "
                         f"file {cfg.data.train!r}")
    from distflow_lab.experiments.base_eval import run

    if a.checkpoint and not Path(a.checkpoint).exists():
        raise UsageError(f"--checkpoint {a.checkpoint} does not exist")
    run(a.config, list(a.overrides), a.rows, a.samples, a.temperature, a.json, a.checkpoint)
    return 0


def cmd_ablate(a: argparse.Namespace) -> int:
    check_bench_shape([a.workers], min(a.batches), 4, 2)
    for b in a.batches:
        check_bench_shape([a.workers], b, 4, 2)
    fresh_file(str(Path(a.out) / "ablation.json") if a.out else None, a.overwrite, "--out")
    from distflow_lab.experiments.ablation import run

    run(a.batches, a.repeats, a.workers, a.nodes, a.context, a.us_per_token, a.out)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    fresh_file(getattr(a, "json", None), a.overwrite)
    if a.which == "dataplane":
        check_bench_shape(a.workers, a.batch, a.n, a.rollout_tp)
        from distflow_lab.experiments.bench import dataplane

        dataplane.run(a.workers, a.context, a.batch, a.repeats, a.n, a.rollout_tp, modes=a.modes, json_path=a.json,
                      control=not a.no_control, nodes=a.nodes)
    elif a.which == "balance":
        from distflow_lab.experiments.bench import balance

        balance.run(ks=a.ks, ns=a.ns, dists=a.dists, repeats=a.repeats, seed=a.seed, json_path=a.json,
                    kk_budget_s=a.kk_budget, costs=a.costs, verl=not a.no_verl)
    elif a.which == "serialization":
        from distflow_lab.experiments.bench import serialization

        serialization.run(a.mib, a.repeats, a.json)
    elif a.which == "memory":
        for b in a.sweep_batch or [a.batch]:
            check_bench_shape([a.workers], b, 4, 2)
        fresh_file(a.html, a.overwrite, "--html")
        from distflow_lab.experiments.bench import memory

        if a.sweep_batch:
            df = memory.sweep_batch(a.sweep_batch, a.modes, a.context, a.workers, steps=3, json_path=a.json)
            if a.html:
                from distflow_lab.observe.curves import driver_memory_figure

                driver_memory_figure(df).write_html(a.html, include_plotlyjs="inline")
        else:
            memory.report(a.steps, a.mode, a.batch, a.context, a.workers, a.every, a.json, a.html)
    elif a.which == "async":
        from distflow_lab.experiments.bench import async_schedules

        async_schedules.run(a.steps, a.warmup, a.modes, a.workers, a.decode_us, a.json, schedules=a.schedules,
                            engines=a.engine, overrides=a.override, workload=a.workload,
                            tool_latency=a.tool_latency)
    elif a.which == "coordinator":
        from distflow_lab.experiments.bench import coordinator

        coordinator.run(a.sizes, a.items, a.steps, a.json)
    elif a.which == "e2e":
        from distflow_lab.experiments.bench import e2e

        e2e.run(a.context, a.workers, a.prompts, a.n, a.steps, a.json, modes=a.modes, engines=a.engine)
    elif a.which == "cli-latency":
        from distflow_lab.experiments.bench import cli_latency
        cli_latency.run(a.repeats, a.json)
    elif a.which == "session-open":
        from distflow_lab.experiments.bench import session_open

        session_open.run(a.engine, a.repeats, a.json)
    elif a.which == "peer":
        check_peer(a)
        from distflow_lab.experiments.bench import peer_trl

        peer_trl.run(a.preset, a.steps, a.rows, a.engine, a.prompts, a.n, a.max_tokens, a.json)
    elif a.which == "matrix":
        from distflow_lab.experiments.bench import matrix

        matrix.run(a.preset, a.cells or matrix.DEFAULT_CELLS, a.steps, a.override, a.json)
    elif a.which == "weight-sync":
        from distflow_lab.experiments.bench import weight_sync

        weight_sync.run(list(a.models), list(a.dtypes), list(a.paths), a.repeats, a.bucket_mib, a.json, a.engine,
                        tuple(a.loads))
    elif a.which == "microbatch":
        from distflow_lab.experiments.bench import microbatch

        microbatch.run(rows=a.rows, fixed_rows=a.fixed_rows, budget=a.budget, repeats=a.repeats, threads=a.threads,
                       gsm8k_dir=a.gsm8k, json_path=a.json)
    return 0


def cmd_soak(a: argparse.Namespace) -> int:
    fresh_file(a.json, a.overwrite)
    if all(m == "centralized" for m in a.mode) and all(SCHEDULES[x].needs_groups for x in a.schedule):
        raise UsageError(f"--schedule {','.join(a.schedule)} needs the coordinator or distributed data plane; "
                         "--mode centralized runs sync only")
    if a.override:
        if a.engine == ("synthetic",):
            raise UsageError("--override applies to the tiny GRPO; pass --engine hf or vllm")
        from distflow_lab.algos.registry import load_run_config

        load_run_config("tiny-cpu-grpo", a.override)  # a bad key fails here, before Ray starts
    from distflow_lab.experiments import soak  # the heavy part: torch, Ray

    reports = soak.run(list(a.mode), list(a.schedule), list(a.engine), a.steps, a.fault_every, a.seed, a.json,
                       a.max_staleness, a.override)
    return 0 if all(r["ok"] for r in reports) else 1


def cmd_data(a: argparse.Namespace) -> int:
    from distflow_lab.core.config import RunConfig, load_model, parse_overrides
    from distflow_lab.datasets.registry import dataset_rows, is_dataset
    from distflow_lab.datasets.schema import write_parquet

    if not is_dataset(a.name):
        raise UsageError(f"no registered dataset {a.name!r}; registered: {sorted(dataset_names_for_cli())}")
    cfg = load_model(RunConfig, {"data": {"train": a.name, "options": {a.name: parse_overrides(a.options)}}},
                     "distflow-lab data")
    out = Path(a.out or f"runs/data/{a.name}")
    for split, seed in (("train", a.seed), ("test", a.seed + 1)):  # generated tasks: another seed held out
        rows = dataset_rows(cfg.data, seed, split, cfg)
        path = write_parquet(rows, out / f"{split}.parquet")
        print(f"{path}: {len(rows)} rows")
    return 0


def dataset_names_for_cli() -> list[str]:
    from distflow_lab.datasets.registry import dataset_names

    return dataset_names()


# ---- the parser -----------------------------------------------------------------------------


def add_run_args(r: argparse.ArgumentParser) -> argparse.ArgumentParser:
    r.add_argument("config", help="a YAML file or a preset name (tiny-cpu-grpo, tiny-cpu-ppo, gpu-qwen2.5-grpo)")
    r.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. actor.lr=1e-3")
    r.add_argument("--mode", choices=MODES, help="data plane (default: the config's)")
    r.add_argument("--steps", type=positive, help="RL steps (default: trainer.steps)")
    r.add_argument("--out", help="output folder (default: a new runs/<config>/run-NNN)")
    r.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in --out")
    r.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of the run")
    r.set_defaults(fn=cmd_run)
    return r


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="distflow-lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{run,eval,ablate,bench,soak,data}")

    add_run_args(sub.add_parser("run", help="an RL run (GRPO/PPO) from a preset or YAML"))

    ev = sub.add_parser("eval", help="a preset's model on a fixed held-out set: accuracy, format rate, pass@n")
    ev.add_argument("config", help="a YAML file or a preset name (smollm2-arith, smollm2-gsm8k, ...)")
    ev.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. model.path=/my/checkpoint")
    ev.add_argument("--rows", type=positive, default=64, help="held-out prompts")
    ev.add_argument("--samples", type=positive, default=1, help="answers per prompt (1: greedy; n: sampled, pass@n)")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature when --samples > 1")
    ev.add_argument("--checkpoint", help="a run's trained policy: its folder, or one checkpoint folder in it")
    ev.add_argument("--json", help="write the result here")
    ev.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    ev.set_defaults(fn=cmd_eval)

    b = sub.add_parser("ablate", help="the paper's Fig. 10 ablation ladder")
    b.add_argument("--batches", type=int_list, default=[64, 128, 256], help="responses per step")
    b.add_argument("--repeats", type=positive, default=8, help="measured steps per rung and batch")
    b.add_argument("--workers", type=positive, default=4)
    b.add_argument("--nodes", type=positive, default=2, help="simulated Ray nodes (O5 needs more than one)")
    b.add_argument("--context", type=positive, default=2048)
    b.add_argument("--us-per-token", type=float, default=1.0, help="simulated compute per token (microseconds)")
    b.add_argument("--out", default="runs/ablation")
    b.add_argument("--overwrite", action="store_true")
    b.set_defaults(fn=cmd_ablate)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bsub = bench.add_subparsers(dest="which", required=True)
    d = bsub.add_parser("dataplane", help="every data plane on the same workers and DAG")
    d.add_argument("--workers", type=int_list, default=[2, 4, 8])
    d.add_argument("--context", type=int_list, default=[1024, 4096, 8192])
    d.add_argument("--batch", type=positive, default=64, help="responses per step (prompts x n)")
    d.add_argument("--n", type=positive, default=4, help="responses per prompt")
    d.add_argument("--repeats", type=positive, default=5, help="measured steps per mode and configuration")
    d.add_argument("--rollout-tp", type=positive, default=2)
    d.add_argument("--nodes", type=positive, default=1, help="simulate this many Ray nodes")
    d.add_argument("--modes", type=modes_list((*MODES, "verl")), default=None,
                   help=f"comma-separated: {','.join(MODES)},verl (default: all available)")
    d.add_argument("--no-control", action="store_true", help="skip the control-plane overhead measurement")
    bl = bsub.add_parser("balance", help="partitioner quality and speed")
    bl.add_argument("--repeats", type=positive, default=5)
    bl.add_argument("--ks", type=int_list, default=[8, 16, 32, 64, 128, 256, 512])
    bl.add_argument("--ns", type=int_list, default=[1024, 4096, 16384, 65536])
    bl.add_argument("--dists", type=lambda s: tuple(s.split(",")), default=("lognormal", "bimodal"))
    bl.add_argument("--seed", type=int, default=0)
    bl.add_argument("--costs", type=lambda s: tuple(s.split(",")), default=("tokens", "workload"),
                    help="item costs to balance: tokens, workload (24576·L + L², verl's calculate_workload)")
    bl.add_argument("--kk-budget", type=float, default=2.0, help="skip Karmarkar-Karp where predicted over this (s)")
    bl.add_argument("--no-verl", action="store_true", help="skip verl's Karmarkar-Karp even when installed")
    s = bsub.add_parser("serialization", help="object-store round trips of a Batch vs torch pickling")
    s.add_argument("--mib", type=int_list, default=[16, 64, 256])
    s.add_argument("--repeats", type=positive, default=7)
    m = bsub.add_parser("memory", help="RSS and object store over a long run")
    m.add_argument("--steps", type=positive, default=200)
    m.add_argument("--mode", default="distributed", choices=MODES)
    m.add_argument("--batch", type=positive, default=64)
    m.add_argument("--context", type=positive, default=1024)
    m.add_argument("--workers", type=positive, default=4)
    m.add_argument("--every", type=positive, default=5)
    m.add_argument("--html")
    m.add_argument("--sweep-batch", type=int_list, default=None,
                   help="responses per step to sweep (e.g. 16,64,256): bytes through the driver and its peak RSS "
                        "for every data plane, instead of the long run")
    m.add_argument("--modes", type=modes_list(MODES), default=MODES)
    e = bsub.add_parser("e2e", help="real GRPO tokens/s in every mode")
    e.add_argument("--context", type=int_list, default=[32, 1024],
                   help="prompt + response tokens; <= 64 uses the arithmetic task, longer uses GSM8K prompts")
    e.add_argument("--workers", type=positive, default=2)
    e.add_argument("--prompts", type=positive, default=16, help="prompts per step")
    e.add_argument("--n", type=positive, default=4, help="responses per prompt")
    e.add_argument("--steps", type=positive, default=4, help="measured steps per mode (after one warm-up step)")
    e.add_argument("--modes", type=modes_list(MODES), default=MODES)
    e.add_argument("--engine", type=modes_list(("hf", "vllm"), "engine"), default=("hf",),
                   help="rollout engines side by side, e.g. hf,vllm (vllm: the CPU build setup.sh installs)")
    asy = bsub.add_parser("async", help="sync vs one-step-off vs async on a long-tail workload, against the ideal")
    asy.add_argument("--steps", type=positive, default=12, help="measured training updates per schedule")
    asy.add_argument("--warmup", type=positive, default=3)
    asy.add_argument("--modes", type=modes_list(("coordinator", "distributed")), default=("coordinator",))
    asy.add_argument("--workers", type=positive, default=4, help="half generate, half train")
    asy.add_argument("--decode-us", type=float, default=1000.0, help="simulated seconds per decode iteration, in us")
    asy.add_argument("--engine", type=modes_list(("synthetic", "hf", "vllm"), "engine"), default=("synthetic",),
                     help="synthetic (simulated decoding) and/or real engines on the tiny-cpu-longtail preset")
    asy.add_argument("--schedules", type=schedule_list, default=None,
                     help="e.g. sync,one_step_off,async:k=2:partial (first: sync, the baseline); default: all eight")
    asy.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                     help="a config override for the real engines' preset (repeatable)")
    asy.add_argument("--workload", choices=("longtail", "calculator", "smollm2-arith"), default="longtail",
                     help="the real engines' task: long-tail answers, multi-turn calls to a calculator tool, or "
                          "the pretrained SmolLM2-135M-Instruct on arithmetic (its own answer lengths)")
    asy.add_argument("--tool-latency", type=tool_latency, default=(50.0, 1.0), metavar="MEDIAN_MS:SIGMA",
                     help="calculator workload: each tool call's delay, lognormal (default 50:1.0)")
    co = bsub.add_parser("coordinator", help="the coordinator actor alone: metadata handling per step")
    co.add_argument("--sizes", type=int_list, default=[8, 16, 32, 64], help="producers = consumers")
    co.add_argument("--items", type=int_list, default=[16, 64], help="items per producer (two or more: see sim)")
    co.add_argument("--steps", type=positive, default=20)
    cl = bsub.add_parser("cli-latency", help="seconds per bad-input CLI call (README's table; target < 1 s)")
    cl.add_argument("--repeats", type=positive, default=5)
    mb = bsub.add_parser("microbatch", help="token-budget micro-batches vs fixed rows: padding and step time")
    mb.add_argument("--rows", type=positive, default=64)
    mb.add_argument("--fixed-rows", type=positive, default=4, help="rows per micro-batch of the fixed baseline")
    mb.add_argument("--budget", type=positive, default=None, help="tokens per micro-batch (default: as fixed)")
    mb.add_argument("--repeats", type=positive, default=3)
    mb.add_argument("--threads", type=positive, default=1, help="torch threads (1 on a shared CPU)")
    mb.add_argument("--gsm8k", default=None, help="GSM8K parquet folder (default: ../shared/datasets/gsm8k)")
    so = bsub.add_parser("session-open", help="seconds to open a session: new worker processes vs the worker pool")
    so.add_argument("--engine", type=modes_list(("hf", "vllm"), "engine"), default=("hf",))
    so.add_argument("--repeats", type=positive, default=3)
    pe = bsub.add_parser("peer", help="the lab's GRPO against TRL's GRPOTrainer: same preset, checkpoint and prompts")
    pe.add_argument("--against", choices=("trl",), default="trl", help="the peer system")
    pe.add_argument("--preset", default="smollm2-arith", help="a GRPO preset or YAML file both systems run")
    pe.add_argument("--steps", type=positive, default=4, help="RL steps per system (the first counts as warm-up)")
    pe.add_argument("--engine", choices=("hf", "vllm"), default="vllm", help="the lab's rollout engine")
    pe.add_argument("--rows", type=positive, default=64, help="held-out prompts scored after training")
    pe.add_argument("--prompts", type=positive, default=None, help="prompts per step (default: the preset's)")
    pe.add_argument("--n", type=positive, default=None, help="responses per prompt (default: the preset's)")
    pe.add_argument("--max-tokens", type=positive, default=None, help="response length (default: the preset's)")
    mx = bsub.add_parser("matrix", help="every algorithm x schedule x engine on one preset's model: runs or refused")
    mx.add_argument("--preset", default="smollm2-arith", help="a preset or YAML file")
    mx.add_argument("--cells", type=lambda v: tuple(v.split(",")), default=None,
                    help="comma-separated algorithm/schedule/engine[/dtype][+tis] (default: the module's twelve)")
    mx.add_argument("--steps", type=positive, default=2, help="steps per cell (async cells one more)")
    mx.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every cell (repeatable)")
    ws = bsub.add_parser("weight-sync", help="the weight sync part by part (write, read, verify, load) against memcpy")
    ws.add_argument("--models", type=modes_list(("135m", "59m", "tiny"), "model"), default=("135m", "59m"))
    ws.add_argument("--dtypes", type=modes_list(("float32", "bfloat16"), "dtype"), default=("float32", "bfloat16"))
    ws.add_argument("--paths", type=modes_list(("shm", "groups", "colocated", "pickled"), "path"),
                    default=("shm", "groups", "colocated", "pickled"),
                    help="shm / groups: worker groups through shared memory / the object store")
    ws.add_argument("--engine", type=modes_list(("hf", "vllm"), "engine"), default=("hf",),
                    help="the reader's rollout engine(s); vllm: the shm and groups paths")
    ws.add_argument("--loads", type=modes_list(("copy", "map", "delta"), "load"), default=("copy", "map", "delta"),
                    help="HF reader, shm and groups: copy into its weights, map them (weight_sync.load), or "
                         "patch them (weight_sync.mode delta)")
    ws.add_argument("--repeats", type=positive, default=3, help="syncs per cell after one warm-up")
    ws.add_argument("--bucket-mib", type=positive, default=256, help="worker groups' bucket size")
    for p in (d, bl, s, m, e, co, cl, asy, mb, so, pe, mx, ws):
        p.add_argument("--json", help="write the records here")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --json/--html file")
    bench.set_defaults(fn=cmd_bench)

    sk = sub.add_parser("soak", help="chaos soak: random real faults over a long run, recovered, books checked")
    sk.add_argument("--mode", type=modes_list(MODES), default=("distributed",), help="data plane(s), comma-separated")
    sk.add_argument("--schedule", type=modes_list(tuple(SCHEDULES), "schedule"), default=("sync",),
                    help="schedule(s), comma-separated (centralized runs sync only; others are skipped for it)")
    sk.add_argument("--engine", type=modes_list(("synthetic", "hf", "vllm"), "engine"), default=("synthetic",),
                    help="the synthetic DAG, or the tiny GRPO on the HF or vLLM engine")
    sk.add_argument("--steps", type=positive, default=40)
    sk.add_argument("--fault-every", type=float, default=10.0, help="mean steps between faults (0: none)")
    sk.add_argument("--max-staleness", type=int, default=2, help="k of the async schedule")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--json", help="write the reports here")
    sk.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    sk.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the tiny GRPO, engines hf and vllm (repeatable)")
    sk.set_defaults(fn=cmd_soak)

    dt = sub.add_parser("data", help="write a registered dataset's train and test splits as verl-schema parquet")
    dt.add_argument("name", help="a registered dataset: arithmetic, gsm8k, long_tail, guess_number")
    dt.add_argument("options", nargs="*", help="its options as key=value, e.g. rows=2048 max_operand=99 "
                                               "(gsm8k: dir=FOLDER with train.jsonl and test.jsonl)")
    dt.add_argument("--out", default=None, help="folder for train.parquet and test.parquet (runs/data/NAME)")
    dt.add_argument("--seed", type=int, default=0)
    dt.set_defaults(fn=cmd_data)
    return ap


def main(argv: list[str] | None = None) -> int:
    # The embedded cluster binds loopback only (must be set before Ray starts).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.getcwd() not in sys.path:  # a config's "module:name" resolves against the current folder, as `python -m` does
        sys.path.insert(0, os.getcwd())
    args = list(sys.argv[1:] if argv is None else argv)
    try:  # `run` lets overrides and options mix: its own parser, which argparse supports that way
        a = (add_run_args(argparse.ArgumentParser(prog="distflow-lab run")).parse_intermixed_args(args[1:])
             if args[:1] == ["run"] else parser().parse_args(args))
    except SystemExit as e:  # argparse printed its usage line and message
        return int(e.code or 0)
    try:
        return a.fn(a)
    except FriendlyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
