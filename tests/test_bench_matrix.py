"""`distflow-lab bench matrix`: cells are named algorithm/schedule/engine[/dtype][+tis], a bad name is
refused before anything starts, every default cell is a config the lab accepts on the real model's
preset, and a run records a refused cell by its error while the others still run."""
from __future__ import annotations

import pytest

from distflow_lab.cli import main
from distflow_lab.core.errors import ConfigError
from distflow_lab.experiments.bench.matrix import DEFAULT_CELLS, Cell, run


def test_cells_parse_and_bad_names_are_refused_by_name(capsys):
    c = Cell.parse("grpo/sync/vllm/bf16+tis")
    assert (c.algorithm, c.schedule, c.engine, c.dtype, c.tis) == ("grpo", "sync", "vllm", "bf16", True)
    assert "actor.off_policy=tis" in Cell.parse("grpo/async2p/hf").overrides(2)  # async always corrects
    for bad, named in [("grpo/sync", "algorithm/schedule/engine"), ("grpo/later/hf", "schedule 'later'"),
                       ("grpo/sync/tgi", "engine 'tgi'"), ("grpo/sync/hf/fp8", "dtype 'fp8'")]:
        with pytest.raises(ConfigError, match=named):
            Cell.parse(bad)
    assert main(["bench", "matrix", "--cells", "grpo/later/hf"]) == 2
    assert "matrix cell 'grpo/later/hf'" in capsys.readouterr().err


@pytest.mark.parametrize("name", DEFAULT_CELLS)
def test_every_default_cell_is_a_config_the_lab_accepts(name):
    cell = Cell.parse(name)
    cfg = cell.config("smollm2-arith", None, 2)
    assert (cfg.algorithm.name, cfg.rollout.engine) == (cell.algorithm, cell.engine)
    assert bool(cfg.groups) == (cell.schedule != "sync")


@pytest.mark.full  # two real sessions; the default tier checks every default cell's config above
def test_a_refused_cell_is_recorded_and_the_others_run(ray_cluster, grpo_model):
    records = run("tiny-cpu-grpo", ("grpo/sync/hf", "dapo/sync/hf"), steps=1,  # DAPO's clip-higher refuses high < low
                  overrides=["actor.clip_ratio_high=0.1", "data.prompts_per_step=4", "rollout.n=2"])
    ran, refused = records
    assert ran["status"] == "ran" and ran["step_s"] > 0 and ran["peak_rss_mib_max"] > 0
    assert ran["stale_token_frac"] == 0.0 and ran["logprob_diff_max"] < 1e-4  # colocated: the trainer's weights
    assert refused["status"] == "refused" and "clip_ratio_high=0.1" in refused["error"]
