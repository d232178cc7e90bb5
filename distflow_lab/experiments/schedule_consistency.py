"""Do the schedules agree where they must? `async` with k = 0 is the `sync` schedule, and
`async` with k = 1 is `one_step_off`: same seeds, same policy versions pulled, so the same
metrics to the bit. One session on worker groups, reopened under each schedule.

    python -m distflow_lab.experiments.schedule_consistency --engine vllm    # hf: in the suite
"""
from __future__ import annotations

import argparse
import tempfile

import pandas as pd

from distflow_lab.api.runner import load_run_config, open_session
from distflow_lab.core.config import RunConfig

PAIRS = [(("sync", {}), ("async", {"max_staleness": 0})),
         (("one_step_off", {}), ("async", {"max_staleness": 1}))]
METRICS = ["reward/mean", "actor/loss", "actor/grad_norm", "schedule/staleness", "schedule/rollout_version",
           "rollout/logprob_diff_max"]


def compare(cfg: RunConfig, steps: int = 3) -> pd.DataFrame:
    """One row per pair: the schedules, whether every metric of every step is equal, and the
    largest difference (0.0 when equal)."""
    runs: dict[str, pd.DataFrame] = {}
    with open_session(cfg, progress=False) as s:
        for pair in PAIRS:
            for kind, opts in pair:
                s.reopen(schedule=kind, **opts)
                runs[_name(kind, opts)] = s.run(steps, progress=False)[METRICS].reset_index(drop=True)
    rows = []
    for a, b in PAIRS:
        x, y = runs[_name(*a)], runs[_name(*b)]
        rows.append({"schedule": _name(*a), "against": _name(*b), "equal": x.equals(y),
                     "max_abs_diff": float((x - y).abs().max().max()), "steps": steps,
                     "staleness_max": float(y["schedule/staleness"].max())})
    return pd.DataFrame(rows)


def _name(kind: str, opts: dict) -> str:
    return f"{kind} k={opts['max_staleness']}" if "max_staleness" in opts else kind


def tiny_config(engine: str, root: str) -> RunConfig:
    """The tiny GRPO on 1 rollout + 1 train worker, untrained (no warm start), TIS on."""
    return load_run_config("tiny-cpu-grpo", [
        f"model.path={root}/tiny-qwen2", f"data.cache_dir={root}/data", f"trainer.out_dir={root}/out",
        "model.warm_start.steps=0", "cluster.world_size=2", "data.prompts_per_step=2", "rollout.n=4",
        "rollout.log_probs=true", "actor.entropy_coeff=0.01", "groups={rollout: 1, train: 1}", "mode=coordinator",
        f"rollout.engine={engine}", "actor.off_policy=tis"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    from distflow_lab.runtime.cluster import connect

    connect()
    with tempfile.TemporaryDirectory() as root:
        print(compare(tiny_config(a.engine, root), a.steps).to_string(index=False))


if __name__ == "__main__":
    main()
