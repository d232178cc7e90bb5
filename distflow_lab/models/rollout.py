"""Pick a rollout engine by name: "hf" (transformers generate, CPU or GPU) or
"vllm" (GPU only; imported only when asked for)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.rollout_hf import HFRollout


class RolloutEngine(Protocol):
    """What the stages and the weight sync ask of a rollout engine (HF or vLLM)."""

    sleeps: bool  # frees its memory while the trainers compute (`sleep` is then hung on them)
    needs_weights: bool  # it discarded its weights (vLLM's level-2 sleep): the next sync must refill them
    bucket_bytes: int  # a weight sync's largest bucket (`load_weights` takes buckets, `TrainEngine.weight_buckets`)
    weight_dtype: torch.dtype  # the dtype buckets are cast to before they are sent (None: the engine converts)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable, partial: bool = False) -> Any: ...

    def sleep(self) -> None: ...

    def close(self) -> None: ...


def make_rollout(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions,
                 max_prompt_len: int, model_path: str | None = None, **engine_kwargs: Any) -> RolloutEngine:
    """The engine `opts.engine` names: "hf" wraps `model`; "vllm" loads `model_path` (a local HF
    checkpoint directory) into vLLM. `engine_kwargs` go to `VLLMRollout` (`dtype`, `seed`, and any
    `vllm.LLM` keyword over those `opts` give); the hf engine takes none."""
    if opts.engine == "hf":
        if model is None:
            raise ValueError("the hf rollout needs a model object")
        return HFRollout(model, tokenizer, opts, max_prompt_len)
    if model_path is None:
        raise ValueError("the vllm rollout needs model_path (a local HF checkpoint directory)")
    from distflow_lab.models.rollout_vllm import VLLMRollout  # CUDA-only package: import on demand

    return VLLMRollout(model_path, tokenizer, opts, max_prompt_len, **engine_kwargs)
