"""vLLM rollout adapter with the same `generate(prompt_ids, prompt_mask, seed)` contract as HFRollout.

UNTESTED ON THIS MACHINE: vLLM needs a CUDA GPU and the `[gpu]` extra
(`pip install distflow_lab[gpu]`), neither of which the CPU development box has.
Written against vLLM's offline API as of v0.10/v0.11 (V1 engine):

  * `vllm.LLM(model=dir, ...)`, `llm.generate(prompts=[{"prompt_token_ids": ids}], sampling_params)`
    (a TokensPrompt dict, so our left-padding-free token ids go in unchanged, no re-tokenization);
  * `vllm.SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, stop_token_ids, logprobs)`;
  * weight sync through the documented `LLM.apply_model(func)` (runs `func(model)` inside
    every worker, returns one result per worker), calling the vLLM model's own
    `load_weights(weights=iterable of (name, tensor))`, which understands HF checkpoint
    names (it fuses q/k/v and gate/up itself). With the V1 multiprocess engine the
    function is pickled to the engine-core process, which vLLM refuses unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here before the engine starts, since the
    callables are our own). Older in-process (V0) engines without `apply_model` fall back
    to `llm.llm_engine.model_executor.driver_worker.model_runner.model`.

Shipping a state dict through apply_model pickles every tensor: fine for small models.
For multi-GB policies use a worker extension + NCCL broadcast or CUDA IPC (vLLM's
examples/offline_inference/rlhf*.py); the signature of `load_weights` here stays.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Iterable

import torch
from transformers import PreTrainedTokenizerBase

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.sequences import assemble_columns, response_mask_from_eos

_NEEDS_GPU = (
    "the vLLM rollout needs vLLM, which needs the `[gpu]` extra (pip install 'distflow_lab[gpu]') "
    "and a CUDA GPU; use make_rollout('hf', ...) on CPU"
)


def _load_into(weights: list[tuple[str, torch.Tensor]], model: Any) -> int:
    """Runs inside a vLLM worker: load HF-named weights into vLLM's model. Module-level so it pickles."""
    loaded = model.load_weights(weights=iter(weights))
    return len(loaded) if loaded is not None else len(weights)


class VLLMRollout:
    """Offline vLLM engine producing the same columns as `HFRollout.generate`.

    `model_path` is a local HF checkpoint directory (e.g. `save_model_dir` output);
    `llm_kwargs` go to `vllm.LLM` (gpu_memory_utilization, tensor_parallel_size, dtype...).
    """

    def __init__(self, model_path: str, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions, max_prompt_len: int,
                 **llm_kwargs: Any):
        if not torch.cuda.is_available():
            raise RuntimeError(_NEEDS_GPU + " (no CUDA device visible)")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # before the engine spawns
        try:
            import vllm  # lazy: the package must import without vLLM installed
        except ImportError as e:
            raise RuntimeError(_NEEDS_GPU + f" (import vllm failed: {e})") from e
        self._vllm = vllm
        self.tokenizer, self.cfg, self.max_prompt_len = tokenizer, opts, max_prompt_len
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        c = self.cfg
        llm_kwargs.setdefault("max_model_len", max_prompt_len + c.max_response_len)
        # Prefix caching would serve KV blocks computed with stale weights after load_weights.
        llm_kwargs.setdefault("enable_prefix_caching", False)
        self.llm = vllm.LLM(model=str(model_path), **llm_kwargs)

    def _sampling_params(self, seed: int) -> Any:
        c = self.cfg
        common: dict[str, Any] = dict(
            n=c.n, max_tokens=c.max_response_len, seed=seed, stop_token_ids=[self.eos_id],
            logprobs=0 if c.log_probs else None,  # 0 = only the sampled token's log-prob
        )
        if not c.do_sample:
            return self._vllm.SamplingParams(temperature=0.0, **common)
        # top_k: -1 disables it in every vLLM version (0 only in newer ones).
        return self._vllm.SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k if c.top_k > 0 else -1, **common
        )

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """Sample n responses per prompt; same columns and row order as `HFRollout.generate`.

        vLLM schedules the whole batch itself (cfg.micro_batch is not used). The request
        seed makes the result depend only on (inputs, seed) for a fixed vLLM build/GPU.
        """
        c, R = self.cfg, self.cfg.max_response_len
        requests = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        outputs = self.llm.generate(prompts=requests, sampling_params=self._sampling_params(seed), use_tqdm=False)
        rows = len(requests) * c.n
        responses = torch.full((rows, R), self.pad_id, dtype=torch.long)
        valid = torch.zeros((rows, R), dtype=torch.bool)
        logps = torch.zeros((rows, R), dtype=torch.float32) if c.log_probs else None
        for i, req in enumerate(outputs):  # outputs come back in request order
            # completion .index is its sample number within the request: rows i*n .. i*n+n-1
            for comp in sorted(req.outputs, key=lambda o: o.index):
                r = i * c.n + comp.index
                ids = list(comp.token_ids)[:R]  # includes the eos token when it stopped on it
                responses[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                valid[r, : len(ids)] = True
                if logps is not None and comp.logprobs is not None:
                    # NOTE: vLLM's default logprobs_mode is "raw_logprobs" (before temperature);
                    # pass LLM(logprobs_mode="processed_logprobs") to match the trainer's logits/T.
                    for t, (tok, d) in enumerate(zip(ids, comp.logprobs)):
                        logps[r, t] = d[tok].logprob
        response_mask = response_mask_from_eos(responses, self.eos_id, valid)
        responses = torch.where(response_mask.bool(), responses, self.pad_id)
        prompts = prompt_ids.long().cpu().repeat_interleave(c.n, dim=0)
        cols = assemble_columns(prompts, prompt_mask.long().cpu().repeat_interleave(c.n, dim=0), responses, response_mask)
        if logps is not None:
            cols["rollout_log_probs"] = logps * response_mask
        return cols

    def load_weights(self, state_dict: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push trainer weights (HF names, e.g. `TrainEngine.full_state_dict()`) into every vLLM worker."""
        items = list(state_dict.items()) if isinstance(state_dict, dict) else list(state_dict)
        items = [(k, v.detach().cpu()) for k, v in items]  # CPU tensors pickle without CUDA IPC
        fn = functools.partial(_load_into, items)
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(fn)
        else:  # vLLM V0 in-process engine (< 0.8)
            fn(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
