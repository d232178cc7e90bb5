"""Critic (value model) built from a causal LM: same backbone, a zero-initialised scalar head."""
from __future__ import annotations

import copy
import os

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel


def build_critic_from(model_or_dir: PreTrainedModel | str | os.PathLike, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A `*ForTokenClassification(num_labels=1)` (Qwen2ForTokenClassification for Qwen2) whose
    backbone is a copy of the causal LM's and whose value head is zero, so V = 0 at init.

    `model_or_dir`: a causal LM object (left untouched) or a local HF checkpoint directory.
    Classifier dropout is forced to 0: value targets must not be noisy in train mode.
    Values for response token t are read at input position P+t-1 (verl's shift; see
    `TrainEngine.forward_values`). Returned in eval mode, float32 by default.
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        lm = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=dtype, local_files_only=True)
    else:
        lm = model_or_dir
    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = None  # let the class set it on save
    critic = AutoModelForTokenClassification.from_config(config, dtype=dtype)
    prefix = lm.base_model_prefix  # "model" for Qwen2/Llama: the decoder stack without lm_head
    getattr(critic, prefix).load_state_dict(getattr(lm, prefix).state_dict(), strict=True)
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic.to(dtype).eval()
