"""The learning study's summary: intervals over seeds and the files it writes, from run folders."""
import json

import pandas as pd
import pytest

from distflow_lab.experiments.learning_study import interval, parse_args, summarize


def test_interval_is_a_t_interval_and_one_seed_has_none():
    v = interval([0.75, 0.531, 0.641])
    assert v["mean"] == pytest.approx(0.6407, abs=1e-4) and v["n"] == 3
    assert (v["lo"], v["hi"]) == pytest.approx((0.3686, 0.9127), abs=1e-3)  # t(0.975, 2) = 4.303
    one = interval([0.5])
    assert one["mean"] == 0.5 and one["lo"] != one["lo"]  # NaN: no interval from one seed


def test_summary_reads_every_seed_and_writes_json_and_curves(tmp_path, capsys):
    scores = {"accuracy": 0.2, "format_rate": 0.5, "mean_response_tokens": 40.0, "preset": "p", "rows": 8}
    (tmp_path / "base.json").write_text(json.dumps(scores))
    for seed, acc in ((0, 0.6), (1, 0.8)):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        (run / "eval.json").write_text(json.dumps({**scores, "accuracy": acc}))
        pd.DataFrame({"step": [0, 1, 2], "wall_s": [9.0, 2.0, 4.0], "reward/mean": [0.1, 0.2, 0.3 + seed],
                      "response_length/mean": [40.0, 30.0, 20.0]}).to_parquet(run / "metrics.parquet")
    (tmp_path / "seed9").mkdir()  # a run without its eval is not counted
    s = summarize(tmp_path)
    assert s["seeds"] == ["seed0", "seed1"] and s["steps"] == 3 and s["base"]["accuracy"] == 0.2
    assert s["trained"]["accuracy"]["mean"] == pytest.approx(0.7)
    assert s["reward_per_step"]["seed1"] == [0.1, 0.2, 1.3] and s["step_seconds_median"] == 3.0  # first step left out
    assert json.loads((tmp_path / "study.json").read_text()) == s and (tmp_path / "curves.html").stat().st_size > 0
    assert "trained, mean [95% CI] over 2 seeds" in capsys.readouterr().out


def test_overrides_may_follow_the_options_as_the_readme_writes_them():
    a = parse_args(["smollm2-arith", "--seeds", "0,1", "--out", "runs/study", "rollout.engine=vllm", "seed=3"])
    assert (a.preset, a.seeds, a.out, a.overrides) == ("smollm2-arith", "0,1", "runs/study", ["rollout.engine=vllm", "seed=3"])
