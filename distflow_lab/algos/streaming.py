"""Partial rollouts: the rollout stage's path for the async schedule with
`schedule.partial_rollout`. The hf engine decodes in models/rollout_stream.py, vLLM in
models/rollout_vllm_stream.py; both take the same calls.

One streamer per rollout engine (so per worker) lives across steps around the engine's
own module or vLLM engine: the weights a pull loads are the weights it decodes with. A
call admits this step's prompts, ages out what it will never train (StaleRule), tops up
from the loader with later prompts until every slot has a sequence (top_up), and returns `len(batch)` whole prompts (n rows each), which may be
prompts admitted by earlier calls: each sequence carries its prompt's `PromptInfo` (prompt_rows.py).
The policy is refreshed (`ctx.refresh_policy`) every REFRESH_EVERY decode iterations.
"""
from __future__ import annotations

import math

from distflow_lab.algos.prompt_rows import prompt_infos, response_objects
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import check_partial_rollout
from distflow_lab.models.rollout_stream import HFStreamingRollout, StaleRule
from distflow_lab.models.rollout_vllm import VLLMRollout
from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.runtime.context import StageContext

REFRESH_EVERY = 8  # decode iterations between policy pulls (a pull is one RPC when nothing is new)
SLOTS_PER_ROW = 2  # sequences decoding at once per row a call returns: the long tail's slots are refilled


def partial_rollouts(ctx: StageContext) -> bool:
    """The streaming path applies: partial rollouts asked for (a session reopened with partial
    rollouts where the run config would refuse them is refused here too)."""
    if ctx.schedule.partial_rollout:
        check_partial_rollout(True, ctx.config.rollout.engine, ctx.config.rollout.tp)

    return ctx.schedule.partial_rollout


def stream_rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n responses for each of `len(batch)` prompts, decoded by continuous batching (see the module doc)."""
    cfg, e = ctx.config, ctx.engines
    stream = stream_of(ctx, rows=len(batch) * cfg.rollout.n)
    truncated = [admit(stream, batch, ctx)]
    # later steps' prompts keep the slots busy: the engine tops up once it has aged out this call's stale ones
    refill = (lambda: truncated.append(admit(stream, ctx.loader.next_batch(), ctx))) if ctx.loader is not None \
        else None
    refresh = ctx.refresh_policy if e.weights is not None else None  # colocated: the actor's module, nothing to pull
    rule = StaleRule(ctx.schedule.max_staleness, ctx.trains_by, ctx.schedule.on_stale)
    out = stream.run(len(batch), version=e.policy.version, seed=ctx.seed, refresh=refresh, stale=rule, refill=refill)
    cols, c = out.columns, out.counts
    rows = len(out.prompts)
    ctx.count(**{k: v for k, v in {"rollout/stale_dropped": c.stale_dropped,
                                   "rollout/stale_regenerated": c.stale_regenerated,
                                   "rollout/partial": c.partial, "rollout/resumed": c.resumed,
                                   "rollout/decode_iterations": c.iterations}.items() if v})
    lengths = cols["response_mask"].sum(1).float()
    ctx.log(**{"rollout/prompts_truncated": sum(truncated), "rollout/partial_frac": c.partial / rows if rows else 0.0,
               "response_length/mean": lengths.mean().item() if rows else 0.0,
               "rollout/len_max_over_median": (lengths.max() / lengths.median().clamp(min=1)).item() if rows else 0.0,
               "response_length/clip_frac": (lengths == cfg.rollout.max_response_len).float().mean().item()
               if rows else 0.0})
    return Batch(cols, response_objects(out.prompts))  # one PromptInfo per row


def stream_of(ctx: StageContext, rows: int) -> HFStreamingRollout | VLLMStreamingRollout:
    """This worker's streaming engine, built on first use around the rollout's module or vLLM engine."""
    cfg, e = ctx.config, ctx.engines
    if e.stream is None:
        slots = min(cfg.rollout.micro_batch, math.ceil(SLOTS_PER_ROW * rows))
        model = getattr(e.rollout, "model", None)
        if isinstance(e.rollout, VLLMRollout):
            e.stream = VLLMStreamingRollout(e.rollout, cfg.data.max_prompt_len, slots, REFRESH_EVERY)
        elif model is not None:
            e.stream = HFStreamingRollout(model, e.tokenizer, cfg.rollout, cfg.data.max_prompt_len, slots,
                                          REFRESH_EVERY)
        else:
            raise TypeError(f"partial rollouts need the hf rollout's module or a vLLM engine; "
                            f"{type(e.rollout).__name__} has neither")
    return e.stream


def admit(stream: HFStreamingRollout, batch: Batch, ctx: StageContext) -> int:
    """Queue a loader batch's prompts; returns how many were truncated to max_prompt_len."""
    cfg = ctx.config
    ids, mask, truncated = tokenize_prompts(ctx.engines.tokenizer, list(batch["prompt"]), cfg.data.max_prompt_len)
    stream.add(ids, mask, prompt_infos(batch))
    return truncated
