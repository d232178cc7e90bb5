"""`distflow-lab bench peer --against trl`, the cheap parts (no model runs): the CLI refuses what
cannot run before anything starts, and TRL's GRPOConfig carries every setting the lab's run config
has a counterpart for (experiments/bench/peer_trl.py names the ones it has not)."""
from __future__ import annotations

import pytest

from distflow_lab.algos.registry import load_run_config
from distflow_lab.cli import main
from distflow_lab.experiments.bench.peer_trl import overrides_for, trl_config


def test_the_cli_refuses_an_unknown_peer(capsys):
    assert main(["bench", "peer", "--against", "verl"]) == 2
    assert "invalid choice: 'verl'" in capsys.readouterr().err


def test_the_cli_refuses_a_group_of_one(capsys):
    assert main(["bench", "peer", "--against", "trl", "--n", "1", "--engine", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --n 1") and "Traceback" not in err


def test_overrides_keep_the_presets_sizes_unless_given():
    assert overrides_for("vllm") == ["rollout.engine=vllm"]
    assert overrides_for("hf", prompts=2, n=4, max_tokens=16) == [
        "rollout.engine=hf", "data.prompts_per_step=2", "rollout.n=4", "rollout.max_response_len=16"]


@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl-loss"])
def test_trl_config_maps_the_labs_settings(kl, tmp_path):
    more = ["actor.lr=3e-6", "seed=7", "rollout.temperature=0.7", "actor.clip_ratio_low=0.1",
            "actor.clip_ratio_high=0.28", "actor.grad_clip=0.5", "actor.betas=[0.8,0.95]", "actor.eps=1e-6",
            f"actor.use_kl_loss={str(kl).lower()}", "actor.kl_loss_coef=0.05", f"actor.gradient_checkpointing={kl}"]
    cfg = load_run_config("smollm2-arith", overrides_for("hf", prompts=2, n=4, max_tokens=16) + more)
    c = trl_config(cfg, 3, tmp_path)
    assert c.learning_rate == 3e-6 and str(c.lr_scheduler_type.value) == "constant" and c.warmup_steps == 0
    assert str(c.optim.value) == "adamw_torch"  # torch AdamW, as the lab's actor
    assert (c.adam_beta1, c.adam_beta2, c.adam_epsilon, c.max_grad_norm, c.weight_decay) == (0.8, 0.95, 1e-6, 0.5, 0.0)
    assert c.beta == (0.05 if kl else 0.0)
    assert (c.epsilon, c.epsilon_high) == (0.1, 0.28)
    assert c.num_generations == 4 and c.per_device_train_batch_size == 2 * 4  # prompts x n completions per step
    assert (c.gradient_accumulation_steps, c.steps_per_generation, c.num_iterations) == (1, 1, 1)
    assert c.generation_batch_size == 8  # one generation per optimizer step
    assert c.max_completion_length == 16 and c.temperature == 0.7 and c.top_p == 1.0 and c.top_k == 0
    assert c.seed == 7 and c.max_steps == 3 and c.shuffle_dataset is False
    assert c.gradient_checkpointing is kl
    assert c.use_cpu is True and c.bf16 is False and c.model_init_kwargs == {"dtype": "float32"}
    assert c.scale_rewards == "group" and c.loss_type == "dapo"
    assert c.report_to == [] and str(c.save_strategy.value) == "no" and c.logging_steps == 1


def test_trl_config_refuses_several_updates_per_step(tmp_path):
    cfg = load_run_config("smollm2-arith", ["actor.mini_batches=2", "actor.old_log_prob=recompute"])
    with pytest.raises(ValueError, match="mini_batches=2"):
        trl_config(cfg, 1, tmp_path)
