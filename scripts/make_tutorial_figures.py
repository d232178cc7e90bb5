"""Regenerate the figures in tutorials/figures/ from real runs on this machine.

    pip install -e '.[docs]'          # kaleido (static export; it drives a Chromium: apt install chromium)
    python scripts/make_tutorial_figures.py [--quick]

Runs the Fig. 10 ablation on a simulated 2-node cluster, then one synthetic GRPO
session in both modes on a local cluster, and writes PNGs. A few minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")  # kaleido's Chromium

import distflow_lab as lab  # noqa: E402
from distflow_lab.experiments import ablation  # noqa: E402
from distflow_lab.observe.curves import ablation_figure  # noqa: E402
from distflow_lab.observe.dag_figure import dag_figure  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tutorials" / "figures"


def save(fig, name: str, width: int = 1000, height: int = 450) -> None:
    fig.write_image(OUT / name, width=width, height=height, scale=1)
    print("wrote", OUT / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    df = ablation.run(batches=[64, 256], repeats=3 if a.quick else 8, workers=4, nodes=2, out=None)
    save(ablation_figure(df, value="median"), "ablation.png")

    dag = lab.synthetic_grpo(batch_size=32, n=4, max_prompt_len=512, max_response_len=512, rollout_tp=2,
                             us_per_token=1.0, response_len_sigma=1.0)
    save(dag_figure(dag.plan(4)), "dag_plan.png", height=520)
    lab.connect(num_cpus=8, log_to_driver=False)
    with lab.session(dag, world_size=4, mode="distributed") as s:
        s.run(4, progress=False)
        save(s.timeline(last=1), "timeline_distributed.png", height=380)
        save(s.load_balance(), "load_balance.png", height=400)
        s.reopen(mode="centralized")
        s.run(4, progress=False)
        save(s.timeline(last=1), "timeline_centralized.png", height=420)
        fig, _ = s.breakdown()
        save(fig, "breakdown.png", height=480)
    lab.shutdown()


if __name__ == "__main__":
    main()
