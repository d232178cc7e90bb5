"""The train-inference mismatch, measured: the rollout engine's log-probs of the tokens it
sampled against the trainer's on the same tokens (`grpo.mismatch`, logged by old_log_prob
as rollout/logprob_diff_mean, _max and rollout/logprob_kl). The HF engine in the trainer's
dtype gives ~0; a bfloat16 rollout against the float32 trainer gives a real gap."""
from __future__ import annotations

import copy

import pytest
import torch

from distflow_lab.algos.grpo import mismatch
from distflow_lab.core.config import Optim, RolloutOptions
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_hf import HFRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.models.tokenizer import build_char_tokenizer

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def test_mismatch_hand_computed():
    roll = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    train = torch.tensor([[-1.1, -2.0, 9.0], [-0.2, 0.0, 0.0]])  # 9.0 sits on padding: must not count
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    m = mismatch(roll, train, mask)
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.3)
    # k3 with x = train - rollout per token: exp(x) - x - 1 -> (e^-0.1 + 0.1 - 1), 0, (e^0.3 - 0.3 - 1)
    k3 = [torch.exp(torch.tensor(-0.1)) + 0.1 - 1, 0.0, torch.exp(torch.tensor(0.3)) - 0.3 - 1]
    assert m["rollout/logprob_kl"] == pytest.approx(float(sum(k3)) / 3, abs=1e-6)


@pytest.mark.parametrize("dtype, lo, hi", [(torch.float32, 0.0, 1e-5), (torch.bfloat16, 1e-4, 1.0)])
def test_a_bf16_rollout_against_the_fp32_trainer_shows_a_real_gap(dtype, lo, hi):
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, seed=1)
    trainer = TrainEngine(model, Optim(), device="cpu")
    opts = RolloutOptions(n=4, max_response_len=6, log_probs=True)
    rollout = HFRollout(copy.deepcopy(model).to(dtype).eval(), tok, opts, max_prompt_len=8)
    ids, mask, _ = tokenize_prompts(tok, ["1+2=", "7+5=", "3+3="], 8)
    cols = rollout.generate(ids, mask, seed=0)
    lp, _ = trainer.forward_log_probs(*(cols[k] for k in MODEL_INPUTS))
    m = mismatch(cols["rollout_log_probs"], lp, cols["response_mask"])
    assert lo <= m["rollout/logprob_diff_mean"] <= hi, m
    assert m["rollout/logprob_diff_max"] >= m["rollout/logprob_diff_mean"]
