"""What asynchrony buys and costs on a real task: the tiny GRPO run (a tiny Qwen2 on
the arithmetic task, `tiny-cpu-grpo`) under the synchronous schedule, one-step
off-policy and bounded-staleness async at k = 1, 2, 4, each off-policy schedule with
and without an importance-sampling correction, over several seeds.

Every run uses the same placement: one rollout worker and one training worker
(`groups={rollout: 1, train: 1}`), so the schedules differ only in how the two
overlap. On top of the preset (see `OVERRIDES`): `rollout.log_probs=true` (every
sample keeps its behaviour log-probs, so the IS ratio is measured in every run,
corrected or not) and `actor.mini_batches=4` (four optimizer steps per batch, so the
PPO clip is exercised and the clip fraction means something; with one mini-batch the
ratio to the proximal policy is exactly 1 and nothing is ever clipped).

Per training update it records: reward (`reward/mean` of the batch trained, i.e. of
the policy that generated it), trained tokens and tokens/s, staleness (versions the
oldest sample lagged), trainer and rollout idle shares, the PPO clip fraction, and the
IS ratio w = pi_prox / pi_behaviour of every valid response token (the proximal policy
is the trainer's `old_log_prob` pass, the behaviour policy the rollout's log-probs):
its mean, std, min, max and mean |log w|. The ratio is read from the batch the trainer
just updated on (`Session.output("actor_update")`, a few KiB), so it is measured the
same way whether the loss applies a correction or not. Partial rollouts do not apply
here: the HF rollout engine generates whole responses (4 tokens at most).

    python -m distflow_lab.experiments.async_study --size full --json benchmarks/results/async_grpo.json

One session per (seed, correction); the schedules run one after another on the same
worker processes (`Session.reopen`: fresh engines from the same warm start, fresh
loader, step 0), so every schedule of a seed starts from the same model and data.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from distflow_lab.api.runner import load_run_config, prepare
from distflow_lab.api.session import Session
from distflow_lab.algos.registry import build_dag
from distflow_lab.core.run_columns import current_names
from distflow_lab.runtime.cluster import connect

OVERRIDES = ["groups={rollout: 1, train: 1}", "mode=coordinator", "rollout.log_probs=true", "actor.mini_batches=4"]
KS = (1, 2, 4)
CORRECTION = "decoupled"  # the IS correction compared with none: decoupled PPO (AReaL); "tis" works the same way

# Sizes. A step takes about 0.2 s (sync) / 0.17 s (overlapped) on 2 cores; a session opens in ~8 s, a reopen
# (fresh engines) ~3 s plus a ~1.6 s first step. full: 27 runs of 200 steps, about 20 minutes; ci: under 2.
SIZES = {
    "full": dict(steps=200, seeds=(0, 1, 2), ks=KS),
    "ci": dict(steps=12, seeds=(0, 1, 2), ks=(2,)),
}
SKIP = 2  # updates left out of throughput (warm-up: the first generate and the pipeline filling)


@dataclass(frozen=True)
class Variant:
    schedule: str  # sync | one_step_off | async
    k: int  # the staleness bound (0 sync, 1 one_step_off, max_staleness async)
    off_policy: str  # none | decoupled | tis

    @property
    def name(self) -> str:
        base = {"sync": "sync", "one_step_off": "one_step_off"}.get(self.schedule, f"async k={self.k}")
        return base if self.off_policy == "none" else f"{base} + {self.off_policy}"

    @property
    def options(self) -> dict:
        return {"schedule": self.schedule, **({"max_staleness": self.k} if self.schedule == "async" else {})}


def variants(ks: tuple[int, ...] = KS, correction: str | None = CORRECTION) -> list[Variant]:
    """sync (no stale samples: nothing to correct), then one_step_off and async at each k,
    each without and (if `correction`) with the IS correction."""
    out = [Variant("sync", 0, "none")]
    for corr in ("none", *([correction] if correction and correction != "none" else [])):
        out += [Variant("one_step_off", 1, corr)] + [Variant("async", k, corr) for k in ks]
    return out


def is_stats(batch) -> dict[str, float]:
    """w = pi_prox / pi_behaviour = exp(old_log_probs - rollout_log_probs) over valid response tokens."""
    mask = batch["response_mask"].numpy().astype(bool)
    log_w = (batch["old_log_probs"].numpy() - batch["rollout_log_probs"].numpy())[mask].astype(float)
    w = np.exp(np.clip(log_w, -20, 20))
    return {"is_ratio_mean": float(w.mean()), "is_ratio_std": float(w.std()), "is_ratio_min": float(w.min()),
            "is_ratio_max": float(w.max()), "is_abs_log_ratio": float(np.abs(log_w).mean()),
            "is_outside_clip": float((np.abs(w - 1) > 0.2).mean())}  # tokens a PPO clip of 0.2 would cut


METRICS = {"reward/mean": "reward", "schedule/staleness": "staleness", "schedule/trainer_idle": "trainer_idle",
           "schedule/rollout_idle": "rollout_idle", "schedule/dropped_batches": "dropped_batches",
           "actor/clipfrac": "clipfrac", "actor/kl": "kl", "actor/entropy": "entropy",
           "actor/is_ratio_mean": "correction_weight_mean", "actor/is_ratio_max": "correction_weight_max",
           "response_length/mean": "response_length"}


def run_variant(s: Session, v: Variant, seed: int, steps: int, bar=None) -> pd.DataFrame:
    """`steps` training updates of one schedule on an open session (reopened with the
    schedule unless it is fresh and already on it); one row per update."""
    if s.controller.updates or s.config.schedule.kind != v.schedule or s.config.schedule.staleness != v.k:
        s.reopen(**v.options)
    rows = []
    for _ in range(steps):
        rep = s.step()
        rows.append({"update": rep.update, "wall_s": rep.wall_seconds,
                     **{short: rep.metrics.get(key, np.nan) for key, short in METRICS.items()},
                     **is_stats(s.output("actor_update", worker=s.plan.stages[-1].ranks[0]))})
        if bar is not None:
            bar.update(1)
    df = pd.DataFrame(rows)
    items = s.items()
    tokens = items[items["stage"] == "actor_update"].groupby("update")["tokens"].sum()
    df["tokens"] = df["update"].map(tokens).astype(float)
    df["tokens_per_s"] = df["tokens"] / df["wall_s"]
    return df.assign(variant=v.name, schedule=v.schedule, k=v.k, off_policy=v.off_policy, seed=seed)


def run(size: str = "ci", steps: int | None = None, seeds: tuple[int, ...] | None = None,
        ks: tuple[int, ...] | None = None, correction: str | None = CORRECTION, preset: str = "tiny-cpu-grpo",
        overrides: list[str] | None = None, json_path: str | Path | None = None, progress: bool = True,
        command: str | None = None) -> pd.DataFrame:
    """Run the study; one row per (variant, seed, training update). `size` picks the
    defaults (SIZES); `json_path` writes {"meta": ..., "rows": [...]} (load with `load`)."""
    spec = {**SIZES[size], **{k: v for k, v in dict(steps=steps, seeds=seeds, ks=ks).items() if v is not None}}
    steps, seeds, ks = spec["steps"], tuple(spec["seeds"]), tuple(spec["ks"])
    todo = variants(ks, correction)
    overrides = [*OVERRIDES, *(overrides or [])]
    t0 = time.time()
    connect()
    frames, timings = [], []
    bar = tqdm(total=len(todo) * len(seeds) * steps, desc="async study (training updates)", disable=not progress)
    try:
        for seed in seeds:
            for corr in dict.fromkeys(v.off_policy for v in todo):
                cfg = load_run_config(preset, [*overrides, f"seed={seed}", f"actor.off_policy={corr}"])
                cfg, data_path = prepare(cfg, progress=False)
                t = time.time()
                mine = [v for v in todo if v.off_policy == corr]
                s = Session(build_dag(cfg, data_path), cfg, **mine[0].options)
                timings.append({"what": "open", "seed": seed, "off_policy": corr, "seconds": time.time() - t})
                try:
                    for v in mine:
                        bar.set_postfix_str(f"seed {seed}, {v.name}")
                        t = time.time()
                        frames.append(run_variant(s, v, seed, steps, bar))
                        timings.append({"what": v.name, "seed": seed, "off_policy": corr, "seconds": time.time() - t})
                finally:
                    s.close()
    finally:
        bar.close()
    df = pd.concat(frames, ignore_index=True)
    meta = {"command": command, "size": size, "steps": steps, "seeds": list(seeds), "ks": list(ks),
            "correction": correction, "preset": preset, "overrides": overrides, "skip": SKIP,
            "variants": [asdict(v) | {"name": v.name} for v in todo], "wall_s": time.time() - t0,
            "timings": timings, "machine": _machine(), "git": _git()}
    df.attrs["meta"] = meta
    if json_path:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"meta": meta, "rows": df.round(6).to_dict("records")}, default=float))  # compact: 27 x 200 rows
        print(f"wrote {p}")
    return df


def load(path: str | Path) -> pd.DataFrame:
    """A study written by `run(json_path=...)`; its meta in `.attrs["meta"]`."""
    data = json.loads(Path(path).read_text())
    df = current_names(pd.DataFrame(data["rows"]), "metrics")  # one row per update ("step" in older studies)
    df.attrs["meta"] = data["meta"]
    return df


# ---- summaries ----------------------------------------------------------------------------
# Student's t, two-sided 95 %, by degrees of freedom (more than 10: the normal's 1.96 plus a little)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(x) -> tuple[float, float, float]:
    """Mean and its 95 % t-interval over seeds (lo, hi are nan with one value)."""
    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    if len(x) < 2:
        return float(x.mean()) if len(x) else np.nan, np.nan, np.nan
    half = T95.get(len(x) - 1, 1.96 + 2.5 / (len(x) - 1)) * x.std(ddof=1) / np.sqrt(len(x))
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["variant"]))


def per_run(df: pd.DataFrame, skip: int = SKIP, last: float = 0.25) -> pd.DataFrame:
    """One row per (variant, seed): throughput over the updates after `skip` (trained tokens
    / wall seconds), the mean reward of the last `last` share of updates, and means of the
    schedule and IS figures."""
    steps = int(df["update"].max()) + 1
    tail = max(1, int(round(steps * last)))
    rows = []
    for (variant, seed), g in df.groupby(["variant", "seed"], sort=False):
        m = g[g["update"] >= skip]
        rows.append({"variant": variant, "schedule": g["schedule"].iloc[0], "k": int(g["k"].iloc[0]),
                     "off_policy": g["off_policy"].iloc[0], "seed": seed,
                     "tokens_per_s": m["tokens"].sum() / m["wall_s"].sum(), "step_s": m["wall_s"].median(),
                     "final_reward": g[g["update"] >= steps - tail]["reward"].mean(),
                     "first_reward": g[g["update"] < tail]["reward"].mean(),
                     **{c: m[c].mean() for c in ("staleness", "trainer_idle", "rollout_idle", "clipfrac",
                                                 "is_ratio_mean", "is_ratio_std", "is_abs_log_ratio",
                                                 "is_outside_clip")},
                     "is_ratio_max": m["is_ratio_max"].max(), "is_ratio_min": m["is_ratio_min"].min(),
                     "dropped_batches": g["dropped_batches"].max()})
    out = pd.DataFrame(rows)
    sync = out[out["variant"] == "sync"].set_index("seed")["tokens_per_s"]
    out["speedup_vs_sync"] = out["tokens_per_s"] / out["seed"].map(sync)  # paired by seed
    return out


def summary(df: pd.DataFrame, skip: int = SKIP, last: float = 0.25) -> pd.DataFrame:
    """One row per variant: mean and 95 % t-interval over seeds of the throughput ratio
    to sync (paired by seed) and of the final reward; means of the rest."""
    runs = per_run(df, skip, last)
    rows = []
    for variant in order(df):
        g = runs[runs["variant"] == variant]
        sp, sp_lo, sp_hi = interval(g["speedup_vs_sync"])
        fr, fr_lo, fr_hi = interval(g["final_reward"])
        rows.append({"variant": variant, "seeds": len(g), "tokens_per_s": g["tokens_per_s"].mean(),
                     "speedup_vs_sync": sp, "speedup_lo": sp_lo, "speedup_hi": sp_hi,
                     "final_reward": fr, "final_reward_lo": fr_lo, "final_reward_hi": fr_hi,
                     "first_reward": g["first_reward"].mean(),
                     **{c: g[c].mean() for c in ("staleness", "trainer_idle", "rollout_idle", "clipfrac",
                                                 "is_ratio_mean", "is_ratio_std", "is_abs_log_ratio",
                                                 "is_outside_clip", "dropped_batches")},
                     "is_ratio_min": g["is_ratio_min"].min(), "is_ratio_max": g["is_ratio_max"].max()})
    return pd.DataFrame(rows).set_index("variant")


def curves(df: pd.DataFrame, column: str = "reward", window: int = 10) -> pd.DataFrame:
    """Per (variant, step): the mean over seeds of `column` (a trailing mean over `window`
    updates within each seed first) and its 95 % t-interval."""
    smooth = (df.sort_values("update").groupby(["variant", "seed"], sort=False)[column]
              .transform(lambda x: x.rolling(window, min_periods=1).mean()))
    d = df.assign(value=smooth)
    rows = [{"variant": v, "update": step, **dict(zip(("mean", "lo", "hi"), interval(g["value"])))}
            for (v, step), g in d.groupby(["variant", "update"], sort=False)]
    return pd.DataFrame(rows)


def curve_figure(df: pd.DataFrame, column: str = "reward", window: int = 10, title: str | None = None,
                 variants_shown: list[str] | None = None):
    """Mean over seeds with a shaded 95 % interval, one line per variant."""
    import plotly.graph_objects as go

    from distflow_lab.observe.style import series_color

    c = curves(df, column, window)
    fig = go.Figure()
    for i, v in enumerate(variants_shown or order(df)):
        g = c[c["variant"] == v].sort_values("update")
        color = series_color(i)
        fig.add_trace(go.Scatter(x=np.r_[g["update"], g["update"][::-1]], y=np.r_[g["hi"], g["lo"][::-1]],
                                 fill="toself", fillcolor=_alpha(color, 0.15), line=dict(width=0), hoverinfo="skip",
                                 showlegend=False, legendgroup=v))
        fig.add_trace(go.Scatter(x=g["update"], y=g["mean"], mode="lines", name=v, line=dict(color=color),
                                 legendgroup=v))
    seeds = df["seed"].nunique()
    fig.update_layout(template="plotly_white", height=420, xaxis_title="training update",
                      yaxis_title=f"{column} (trailing mean of {window})",
                      title=title or f"{column}: mean over {seeds} seeds, 95 % interval shaded")
    return fig


def throughput_figure(summary_table: pd.DataFrame, title: str | None = None):
    """Throughput ratio to sync per variant, with its 95 % interval over seeds."""
    import plotly.graph_objects as go

    t = summary_table
    fig = go.Figure(go.Bar(x=t.index, y=t["speedup_vs_sync"], marker_color="#4C78A8",
                           error_y=dict(type="data", symmetric=False, array=t["speedup_hi"] - t["speedup_vs_sync"],
                                        arrayminus=t["speedup_vs_sync"] - t["speedup_lo"]),
                           text=[f"{x:.2f}x" for x in t["speedup_vs_sync"]], textposition="outside"))
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"))
    fig.update_layout(template="plotly_white", height=400, yaxis_title="trained tokens/s ÷ sync (same seed)",
                      title=title or "throughput vs sync: mean over seeds, 95 % interval")
    return fig


def _alpha(color: str, a: float) -> str:
    h = color.lstrip("#")
    if len(h) != 6:
        return color
    return f"rgba({int(h[0:2], 16)},{int(h[2:4], 16)},{int(h[4:6], 16)},{a})"


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _git() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distflow_lab.experiments.async_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="ci")
    p.add_argument("--steps", type=int)
    p.add_argument("--seeds", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--ks", help="async staleness bounds, e.g. 1,2,4")
    p.add_argument("--correction", default=CORRECTION, choices=["decoupled", "tis", "none"])
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    ints = lambda s: tuple(int(x) for x in s.split(",")) if s else None  # noqa: E731
    df = run(a.size, a.steps, ints(a.seeds), ints(a.ks), a.correction, json_path=a.json_path,
             command=" ".join(["python -m distflow_lab.experiments.async_study", *(argv or sys.argv[1:])]))
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(summary(df)[["seeds", "tokens_per_s", "speedup_vs_sync", "speedup_lo", "speedup_hi", "final_reward",
                           "final_reward_lo", "final_reward_hi", "staleness", "trainer_idle", "rollout_idle",
                           "clipfrac", "is_ratio_mean", "is_ratio_max", "is_abs_log_ratio"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
