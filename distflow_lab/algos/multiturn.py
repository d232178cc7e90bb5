"""Multi-turn rollouts: the rollout stage's path when `rollout.multi_turn` names an environment
(models/rollout_multiturn.py plays the trajectories, models/environment_pool.py runs the
environments on Ray actors of their own).

One pool and one turn stream per rollout worker, built on first use and kept across steps
(the pool is shut down with the engines). The rows carry `loss_mask` (the model's tokens)
and `env_reward`, which the reward stage takes as the score.

With partial rollouts (async, `schedule.partial_rollout`), trajectories stay open across
calls and weight updates as sequences do in streaming.py: a call admits this step's prompts,
prefetches later ones from the loader so that trajectories waiting on tools do not leave the
engine idle, pulls the policy while decoding, and returns `len(batch)` whole prompt groups.
"""
from __future__ import annotations

import torch

from distflow_lab.algos.prompt_rows import prompt_infos, response_objects
from distflow_lab.algos.streaming import partial_rollouts
from distflow_lab.core.batch import Batch
from distflow_lab.models.environment import env_class
from distflow_lab.models.environment_pool import EnvPool
from distflow_lab.models.rollout_multiturn import MultiTurnRollout
from distflow_lab.models.rollout_stream import HFStreamingRollout, StaleRule
from distflow_lab.models.rollout_vllm import VLLMRollout
from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.runtime.context import StageContext

POLL_EVERY = 4  # decode iterations between collecting environment answers


def multi_turn_rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n trajectories per prompt of the batch (see the module doc)."""
    if partial_rollouts(ctx):
        return multi_turn_stream(batch, ctx)
    cfg, e = ctx.config, ctx.engines
    mt = engine_of(ctx)
    ids, mask, truncated = tokenize_prompts(e.tokenizer, list(batch["prompt"]), cfg.data.max_prompt_len)
    cols = mt.generate(ids, mask, env_rows(batch), n=cfg.rollout.n, seed=ctx.seed, version=e.policy.version)
    n = cfg.rollout.n
    objects = {**response_objects(prompt_infos(batch), n),  # DAPO's later rounds reset environments from the prompt
               "prompt": [p for p in batch["prompt"] for _ in range(n)]}
    log_turns(cols, mt, ctx, truncated)
    return Batch(cols, objects)


def multi_turn_stream(batch: Batch, ctx: StageContext) -> Batch:
    """Partial rollouts: `len(batch)` whole prompt groups, trajectories carried across calls (module doc)."""
    cfg, e = ctx.config, ctx.engines
    mt = engine_of(ctx)
    truncated = admit(mt, batch, ctx)
    while ctx.loader is not None and mt.in_flight < 2 * len(batch) * cfg.rollout.n:  # tools wait off the engine
        truncated += admit(mt, ctx.loader.next_batch(), ctx)
    refill = (lambda: admit(mt, ctx.loader.next_batch(), ctx)) if ctx.loader is not None else None
    refresh = ctx.refresh_policy if e.weights is not None else None  # colocated: the actor's module, nothing to pull
    rule = StaleRule(ctx.schedule.max_staleness, ctx.trains_by, ctx.schedule.on_stale)
    cols, metas = mt.run(len(batch), version=e.policy.version, seed=ctx.seed, refresh=refresh, stale=rule,
                         refill=refill)
    s = mt.stats
    ctx.count(**{k: v for k, v in {"rollout/stale_dropped": s.stale_dropped,
                                   "rollout/stale_regenerated": s.stale_regenerated,
                                   "rollout/partial": s.partial}.items() if v})
    ctx.log(**{"rollout/partial_frac": s.partial / max(1, s.trajectories)})
    objects = {**response_objects([info for info, _ in metas]), "prompt": [prompt for _, prompt in metas]}
    log_turns(cols, mt, ctx, truncated)
    return Batch(cols, objects)


def admit(mt: MultiTurnRollout, batch: Batch, ctx: StageContext) -> int:
    """Admit a loader batch's prompts; returns how many were truncated to max_prompt_len."""
    ids, mask, truncated = tokenize_prompts(ctx.engines.tokenizer, list(batch["prompt"]), ctx.config.data.max_prompt_len)
    metas = list(zip(prompt_infos(batch), batch["prompt"]))
    mt.add(ids, mask, env_rows(batch), metas, n=ctx.config.rollout.n)
    return truncated


def env_rows(batch: Batch) -> list[dict]:
    """What each prompt's environment reset reads: its prompt, reward model (ground truth) and data source."""
    return [{"prompt": p, "reward_model": rm, "data_source": src}
            for p, rm, src in zip(batch["prompt"], batch["reward_model"], batch["data_source"])]


def multi_turn_again(heads: Batch, ctx: StageContext, seed: int) -> dict[str, torch.Tensor]:
    """n new trajectories for each row's prompt (DAPO's later rounds): the rows of a multi-turn batch
    carry their prompt, the environment's reset reads it with the ground truth and data source."""
    mt, P = engine_of(ctx), heads["input_ids"].shape[1] - heads["responses"].shape[1]
    rows = [{"prompt": p, "reward_model": {"ground_truth": gt}, "data_source": src}
            for p, gt, src in zip(heads["prompt"], heads["ground_truth"], heads["data_source"])]
    cols = mt.generate(heads["input_ids"][:, :P], heads["attention_mask"][:, :P], rows, n=ctx.config.rollout.n,
                       seed=seed, version=ctx.engines.policy.version)
    log_turns(cols, mt, ctx, 0)
    return cols


def log_turns(cols: dict[str, torch.Tensor], mt: MultiTurnRollout, ctx: StageContext, truncated: int) -> None:
    """Metrics and counts of one generate call, and its waits for the environments as `env_wait` spans."""
    s, model = mt.stats, cols["loss_mask"].sum(1).float()
    for start, end in s.waits:
        ctx.record("env_wait", start, end)
    ctx.log(**{"rollout/prompts_truncated": truncated, "multi_turn/turns_mean": cols["turns"].float().mean().item(),
               "multi_turn/model_tokens_mean": model.mean().item(),
               "multi_turn/env_tokens_mean": (cols["response_mask"].sum(1).float() - model).mean().item(),
               "multi_turn/env_s": s.env_s, "multi_turn/env_wait_s": sum(b - a for a, b in s.waits),
               "multi_turn/done_by_env": s.done_by_env / max(1, s.trajectories),
               **({"multi_turn/prefix_cache_hit": s.cached_tokens / s.prompt_tokens} if s.prompt_tokens else {}),
               "response_length/mean": cols["response_mask"].sum(1).float().mean().item()})
    ctx.count(**{k: v for k, v in {"multi_turn/env_calls": s.env_calls,
                                   "multi_turn/truncated_tokens": s.truncated_tokens}.items() if v})


def engine_of(ctx: StageContext) -> MultiTurnRollout:
    cfg, e = ctx.config, ctx.engines
    if e.multi_turn is None:
        mt, model = cfg.rollout.multi_turn, getattr(e.rollout, "model", None)
        stops = [t for s in getattr(env_class(mt.env), "stop_strings", ())
                 for t in e.tokenizer(s, add_special_tokens=False)["input_ids"]]
        context = cfg.data.max_prompt_len + cfg.rollout.max_response_len  # a turn's prompt: everything so far
        slots = min(cfg.rollout.micro_batch, cfg.data.prompts_per_step * cfg.rollout.n)
        if isinstance(e.rollout, VLLMRollout):
            stream = VLLMStreamingRollout(e.rollout, context, slots, POLL_EVERY, n=1, stop_ids=stops)
        elif model is not None:
            stream = HFStreamingRollout(model, e.tokenizer, cfg.rollout.model_copy(update={"n": 1}), context,
                                        slots=slots, stop_ids=stops)
        else:
            raise TypeError(f"multi-turn rollouts need the hf rollout's module or a vLLM engine; "
                            f"{type(e.rollout).__name__} has neither")
        pool = EnvPool(mt.env, e.tokenizer, mt.options, size=mt.pool_size, timeout_s=mt.timeout_s,
                       concurrency=mt.concurrency)
        e.multi_turn = MultiTurnRollout(stream, pool, mt.max_turns, mt.max_turn_tokens, cfg.rollout.max_response_len,
                                        POLL_EVERY)
    return e.multi_turn


