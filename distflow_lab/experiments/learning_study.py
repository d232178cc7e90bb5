"""Does RL teach the model anything? Several seeds of one preset, each scored on the fixed held-out
set before and after training, with intervals over seeds:

    python -m distflow_lab.experiments.learning_study smollm2-arith --seeds 0,1,2 --steps 12 \\
        --out runs/study-smollm2-arith rollout.engine=vllm

Layout of `--out`: `base.json` (the base model's held-out scores), `seed<S>/` (each run: metrics,
spans, checkpoints) with `seed<S>/eval.json`, and the summary `study.json` plus `curves.html` (reward
and response length per step, one line per seed). `--summarize` only rebuilds the summary from the
folders already there. The interval is a Student-t 95 % interval over seeds (n = 3 gives wide ones:
that is the point of reporting it).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from distflow_lab.api.runner import load_run_config, train
from distflow_lab.core.run_columns import read_saved
from distflow_lab.experiments.base_eval import evaluate

KEYS = ("accuracy", "format_rate", "mean_response_tokens")
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # Student t, 97.5 %


def interval(values: list[float]) -> dict:
    """Mean and a Student-t 95 % interval over seeds."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return {"mean": float(v.mean()), "lo": float("nan"), "hi": float("nan"), "n": len(v)}
    half = T975.get(len(v) - 1, 1.96) * v.std(ddof=1) / np.sqrt(len(v))
    return {"mean": float(v.mean()), "lo": float(v.mean() - half), "hi": float(v.mean() + half), "n": len(v)}


def run_study(preset: str, seeds: list[int], steps: int, overrides: list[str], out: Path, rows: int = 64) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "base.json").exists():
        base = evaluate(preset, overrides, rows=rows)
        (out / "base.json").write_text(json.dumps(base.__dict__, indent=1))
    for seed in seeds:
        run = out / f"seed{seed}"
        if not (run / "eval.json").exists():
            cfg = load_run_config(preset, overrides + [f"seed={seed}", f"trainer.checkpoint_every={steps}"])
            train(cfg, steps, run, overwrite=True)
            result = evaluate(preset, overrides + [f"seed={seed}"], rows=rows, checkpoint=run)
            (run / "eval.json").write_text(json.dumps(result.__dict__, indent=1))
    return summarize(out)


def summarize(out: Path) -> dict:
    """study.json and curves.html from the folders under `out`; prints the table."""
    base = json.loads((out / "base.json").read_text())
    runs = sorted(p for p in out.glob("seed*") if (p / "eval.json").exists())
    if not runs:
        raise FileNotFoundError(f"{out}: no seed*/eval.json yet")
    after = {p.name: json.loads((p / "eval.json").read_text()) for p in runs}
    curves = {p.name: read_saved(p / "metrics.parquet", "metrics") for p in runs}
    summary = {
        "preset": base["preset"], "rows": base["rows"], "seeds": [p.name for p in runs],
        "steps": int(min(len(c) for c in curves.values())),
        "base": {k: base[k] for k in KEYS},
        "trained": {k: interval([a[k] for a in after.values()]) for k in KEYS},
        "per_seed": {name: {k: a[k] for k in KEYS} for name, a in after.items()},
        "reward_per_step": {name: c["reward/mean"].round(4).tolist() for name, c in curves.items()},
        "response_length_per_step": {name: c["response_length/mean"].round(2).tolist() for name, c in curves.items()},
        "step_seconds_median": float(np.median(np.concatenate([c["wall_s"].to_numpy()[1:] for c in curves.values()]))),
    }
    (out / "study.json").write_text(json.dumps(summary, indent=1))
    from distflow_lab.observe.curves import metric_curves

    metric_curves(curves, ["reward/mean", "response_length/mean"]).write_html(out / "curves.html",
                                                                              include_plotlyjs="cdn")
    rows = [{"": "base model", **summary["base"]}]
    rows += [{"": name, **v} for name, v in summary["per_seed"].items()]
    rows.append({"": f"trained, mean [95% CI] over {len(runs)} seeds",
                 **{k: f"{v['mean']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]" for k, v in summary["trained"].items()}})
    print(pd.DataFrame(rows).set_index("").to_string(float_format=lambda x: f"{x:.3f}"))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", action="store_true", help="only rebuild the summary from --out")
    return ap.parse_intermixed_args(argv)  # overrides may follow the options, as in the module's example


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.summarize:
        summarize(Path(a.out))
    else:
        run_study(a.preset, [int(s) for s in a.seeds.split(",")], a.steps, list(a.overrides), Path(a.out), a.rows)


if __name__ == "__main__":
    main()
