"""What asynchrony buys on a long-tail workload: the synchronous schedule, one-step
off-policy and bounded-staleness async (with and without partial rollouts) on the
same synthetic GRPO DAG, the same worker groups and the same data plane.

The workload: response lengths lognormal (sigma 1.6, max/median >= 20 per batch),
generation modelled as batched decoding at `decode_us` per decode iteration (a
simulated wait, so 2 cores do not decide the result; see `synthetic.rollout`),
training at `us_per_token` per token.

Ideal speedup, from the synchronous run's own measurements: a synchronous step is
its generation G (the batch waits for its longest response) plus its training T;
with continuous batching and partial rollouts generation produces B samples in
about mean_len x decode_us x B / slots, overlapped with training:

    ideal = median(G + T) / max(median(T), mean_len * decode_us / slots_per_row)

On the real engines (`--engine hf,vllm`) the workload is the `tiny-cpu-longtail` preset: the
tiny Qwen2 answers "L<N>=" with N digits, N lognormal per prompt, so the lengths come from the
model's own sampling. Their ideal is the perfect overlap of the sync run's own generation G and
training T: median(G + T) / max(median(G), median(T)).

    distflow-lab bench async --steps 12 --json benchmarks/results/async.json
    distflow-lab bench async --engine synthetic,hf,vllm --steps 8 --json benchmarks/results/async_engines.json

The multi-turn workload (`--workload calculator`, real engines only) is the `tiny-cpu-calculator`
preset: GRPO learning to call a calculator, each call sleeping a lognormal tool latency
(`--tool-latency MEDIAN_MS:SIGMA`, default 50:1.0) on the environment actors. Its default
schedules are the five without partial rollouts (`--schedules ...:partial` adds them).

    distflow-lab bench async --engine hf,vllm --workload calculator --steps 8 --json benchmarks/results/async_multiturn.json

`--schedules sync,one_step_off,async:k=2:partial` picks schedules (the first must be sync);
`--override KEY=VALUE` changes the real engines' preset, e.g. a >= 50M-parameter model to see
the weight sync bandwidth-bound rather than latency-bound.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from distflow_lab.api.runner import load_run_config, open_session
from distflow_lab.api.session import Session
from distflow_lab.core.errors import ConfigError
from distflow_lab.observe.bandwidth import memcpy_gbps
from distflow_lab.experiments.bench.common import print_table, write_json
from distflow_lab.experiments.synthetic import synthetic_grpo
from distflow_lab.runtime.cluster import connect

SCHEDULES: list[tuple[str, dict]] = [
    ("sync", {}),
    ("one_step_off", {}),
    ("async", {"max_staleness": 1, "partial_rollout": False}),
    ("async", {"max_staleness": 2, "partial_rollout": False}),
    ("async", {"max_staleness": 2, "partial_rollout": True}),
    ("async", {"max_staleness": 4, "partial_rollout": True}),
    ("async", {"max_staleness": 1, "partial_rollout": True}),
    ("async", {"max_staleness": 4, "partial_rollout": False}),
]
GEN, TRAIN = ["data", "rollout", "reward", "advantage"], ["old_log_prob", "ref_log_prob", "actor_update"]
WORKLOADS = {"longtail": "tiny-cpu-longtail", "calculator": "tiny-cpu-calculator",  # real engines' presets
             "smollm2-arith": "smollm2-arith"}  # the real pretrained model (its own answer lengths)


def long_tail_dag(batch: int = 16, n: int = 4, workers: int = 4, decode_us: float = 1000.0,
                  us_per_token: float = 60.0, sigma: float = 1.6, mean_len: float = 12.0):
    half = workers // 2
    return synthetic_grpo(batch_size=batch, n=n, max_prompt_len=32, max_response_len=1024,
                          groups={"rollout": half, "train": workers - half}, decode_us=decode_us,
                          us_per_token=us_per_token, response_len_mean=mean_len, response_len_sigma=sigma)


def _segment_seconds(spans: pd.DataFrame, stages: list[str]) -> pd.Series:
    """Per step: the critical path of these stages (slowest worker's compute, summed)."""
    s = spans[spans.stage.isin(stages) & (spans.phase == "compute")]
    return s.groupby(["batch_id", "stage"])["seconds"].max().groupby("batch_id").sum()


def measure(s: Session, steps: int, warmup: int) -> dict:
    s.run(warmup, progress=False)
    first = len(s.metrics)
    m = s.run(steps, progress=False)
    items = s.items()
    trained = items[(items["stage"] == "actor_update") & items["update"].isin(m["update"])]
    return {"tokens_per_s": float(trained.tokens.sum() / m.wall_s.sum()), "step_s": float(m.wall_s.median()),
            "trainer_idle": float(m["schedule/trainer_idle"].mean()),
            "rollout_idle": float(m["schedule/rollout_idle"].mean()),
            "staleness_mean": float(m["schedule/staleness"].mean()),
            "partial_frac": float(m.get("rollout/partial_frac", pd.Series([0.0])).mean()),
            "dropped_batches": float(m["schedule/dropped_batches"].iloc[-1]),
            "stale_seq_frac": _stale_fraction(m, trained),
            "len_max_over_median": float(m.get("rollout/len_max_over_median", pd.Series([float("nan")])).median()),
            **weight_sync_per_update(s.spans, m["update"]), **_turns(s.spans, m), "spans": s.spans, "steps": list(range(first, first + steps))}


def _turns(spans: pd.DataFrame, m: pd.DataFrame) -> dict:
    """Multi-turn runs: model turns per trajectory, and the rollout's seconds per step waiting for its
    environments with no turn to decode (`env_wait` spans, summed over the rollout workers)."""
    if "multi_turn/turns_mean" not in m:
        return {}
    waits = spans[(spans.phase == "env_wait") & spans.batch_id.isin(m["update"])].groupby("batch_id")["seconds"].sum()
    return {"turns_mean": float(m["multi_turn/turns_mean"].mean()),
            "env_wait_s": float(waits.reindex(m["update"], fill_value=0.0).median())}


def weight_sync_per_update(spans: pd.DataFrame, steps: pd.Series) -> dict:
    """Per training update: the policy's trip from trainer to rollout group (`weight_sync` spans:
    the trainer's export and post, the rollout's pull and load), seconds summed, bytes of one copy of the policy."""
    ws = spans[(spans.phase == "weight_sync") & spans.batch_id.isin(steps)]
    if not len(ws):
        return {"weight_sync_ms": 0.0, "weight_sync_mib": 0.0}
    per = ws.groupby("batch_id").agg(seconds=("seconds", "sum"), bytes=("bytes", "max"))  # posted = pulled
    return {"weight_sync_ms": float(per.seconds.median() * 1e3), "weight_sync_mib": float(per.bytes.median() / 2**20)}


def _stale_fraction(m: pd.DataFrame, trained: pd.DataFrame) -> float:
    """Sequences the rollout dropped or restarted as too stale, per sequence trained: the
    generation asynchrony wasted."""
    stale = sum(float(m[c].fillna(0).sum()) for c in ("rollout/stale_dropped", "rollout/stale_regenerated")
                if c in m)
    return stale / max(1, len(trained))


def ideal_speedup(sync: dict, decode_us: float, slots_per_row: float, items: pd.DataFrame) -> tuple[float, dict]:
    spans = sync["spans"]
    spans = spans[spans.batch_id.isin(sync["steps"])]
    g, t = _segment_seconds(spans, GEN[1:2]), _segment_seconds(spans, TRAIN)
    lengths = items[items.stage == "rollout"]["tokens"] - 32  # response tokens (prompts are 32 long)
    stream = float(lengths[lengths > 0].mean()) * decode_us * 1e-6 / slots_per_row
    ideal = float(np.median(g + t) / max(np.median(t), stream))
    return ideal, {"sync_generation_s": float(np.median(g)), "sync_training_s": float(np.median(t)),
                   "streaming_generation_s": stream}


ENGINES = ("synthetic", "hf", "vllm")


def real_session(engine: str, mode: str, workers: int, overrides: list[str] | None = None,
                 workload: str = "longtail", tool_latency: tuple[float, float] = (50.0, 1.0)) -> Session:
    """The workload's preset on a real rollout engine, half the workers generating, half training;
    truncated IS corrects the off-policy batches of the async schedules. `overrides` go last."""
    half = workers // 2
    tools = ([f"rollout.multi_turn.options={{max_calls: 2, latency: {{median_ms: {tool_latency[0]}, "
              f"sigma: {tool_latency[1]}}}}}"] if workload == "calculator" else [])
    cfg = load_run_config(WORKLOADS[workload], [*tools,
        f"rollout.engine={engine}", f"mode={mode}", f"cluster.world_size={workers}",
        f"groups={{rollout: {half}, train: {workers - half}}}", "rollout.log_probs=true", "actor.off_policy=tis",
        *(overrides or [])])
    return open_session(cfg, progress=False)


def overlap_ideal(sync: dict) -> tuple[float, dict]:
    """A real engine's ideal: generation and training of the sync run overlapped perfectly."""
    spans = sync["spans"]
    spans = spans[spans.batch_id.isin(sync["steps"])]
    g, t = _segment_seconds(spans, GEN[1:2]), _segment_seconds(spans, TRAIN)
    ideal = float(np.median(g + t) / max(np.median(g), np.median(t)))
    return ideal, {"sync_generation_s": float(np.median(g)), "sync_training_s": float(np.median(t))}


def run(steps: int = 12, warmup: int = 3, modes: tuple[str, ...] = ("coordinator",), workers: int = 4,
        decode_us: float = 1000.0, json_path: str | None = None,
        schedules: list[tuple[str, dict]] | None = None, engines: tuple[str, ...] = ("synthetic",),
        overrides: list[str] | None = None, workload: str = "longtail",
        tool_latency: tuple[float, float] = (50.0, 1.0)) -> list[dict]:
    """Each schedule (default `SCHEDULES`; the first must be sync: it is the baseline and gives
    the ideal) on one session per engine and data plane; prints a table, writes the records as JSON.
    `overrides` change the real engines' preset (e.g. a shorter warm start); `workload`: the real
    engines' task (see the module doc)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; workloads: {list(WORKLOADS)}")
    if workload == "calculator" and "synthetic" in engines:
        raise ConfigError("the calculator workload runs on the real engines (--engine hf,vllm), not the synthetic one")
    multi_turn = workload == "calculator"
    schedules = schedules or ([x for x in SCHEDULES if not x[1].get("partial_rollout")] if multi_turn else SCHEDULES)
    if schedules[0][0] != "sync":
        raise ConfigError(f"the first schedule must be 'sync' (the baseline), got {schedules[0][0]!r}")
    if unknown := [e for e in engines if e not in ENGINES]:
        raise ValueError(f"unknown engine {unknown[0]!r}; engines: {ENGINES}")
    connect()
    memcpy = memcpy_gbps()
    records = []
    for engine in engines:
        for mode in modes:
            s = (Session(long_tail_dag(workers=workers, decode_us=decode_us), world_size=workers, mode=mode,
                         keep_outputs=False) if engine == "synthetic"
                 else real_session(engine, mode, workers, overrides, workload, tool_latency))
            try:
                records += _schedules(s, engine, mode, schedules, steps, warmup, decode_us)
            finally:
                s.close()
    for r in records:
        r["of_ideal"] = r["speedup_vs_sync"] / r["ideal_speedup"]
        mib, ms = r["weight_sync_mib"], r["weight_sync_ms"]
        r["weight_sync_gbps"] = mib * 2**20 / (ms * 1e-3) / 1e9 if ms else 0.0
        r["memcpy_gbps"] = memcpy
        r["workload"] = workload if r["engine"] != "synthetic" else "synthetic"
        if multi_turn:
            r["tool_latency"] = f"lognormal(median {tool_latency[0]:g} ms, sigma {tool_latency[1]:g})"
    extra = ["turns_mean", "env_wait_s"] if multi_turn else []
    what = (f"the calculator workload (tool latency lognormal, median {tool_latency[0]:g} ms, sigma {tool_latency[1]:g})"
            if multi_turn else "a long-tail workload")
    print_table(records, ["engine", "schedule", "max_staleness", "partial_rollout", "mode", "tokens_per_s", "step_s",
                          "trainer_idle", "rollout_idle", "staleness_mean", "partial_frac", "stale_seq_frac",
                          "weight_sync_ms", "weight_sync_mib", "weight_sync_gbps", "speedup_vs_sync",
                          "ideal_speedup", "of_ideal", "max_over_median_len", *extra],
                title=f"schedules on {what} ({steps} measured steps each; ideal from the sync run; "
                      f"memcpy {memcpy:.1f} GB/s)")
    write_json(records, json_path)
    return records


def _schedules(s: Session, engine: str, mode: str, schedules: list[tuple[str, dict]], steps: int, warmup: int,
               decode_us: float) -> list[dict]:
    records, base, ideal, parts, tail = [], None, None, {}, float("nan")
    for kind, opts in tqdm(schedules, desc=f"schedules ({engine}, {mode})"):
        s.reopen(schedule=kind, **opts)
        r = measure(s, steps, warmup)
        if kind == "sync":
            base = r
            ideal, parts = (ideal_speedup(r, decode_us, 2.0, s.items()) if engine == "synthetic"
                            else overlap_ideal(r))
            tail = r["len_max_over_median"]  # per rollout batch, the median over steps
        records.append({"engine": engine, "schedule": kind,
                        "max_staleness": opts.get("max_staleness", {"sync": 0}.get(kind, 1)),
                        "partial_rollout": opts.get("partial_rollout", False), "mode": mode,
                        **{k: v for k, v in r.items() if k not in ("spans", "steps", "len_max_over_median")},
                        "ideal_speedup": ideal, "speedup_vs_sync": r["tokens_per_s"] / base["tokens_per_s"],
                        "max_over_median_len": tail, **parts})
    return records
