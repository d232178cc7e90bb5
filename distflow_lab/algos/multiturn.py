"""Multi-turn rollouts: the rollout stage's path when `rollout.multi_turn` names an environment
(models/rollout_multiturn.py plays the trajectories, models/environment_pool.py runs the
environments on Ray actors of their own).

One pool and one turn stream per rollout worker, built on first use and kept across steps
(the pool is shut down with the engines). The rows carry `loss_mask` (the model's tokens)
and `env_reward`, which the reward stage takes as the score.
"""
from __future__ import annotations

import numpy as np
import torch

from distflow_lab.core.batch import Batch
from distflow_lab.core.config import RunConfig
from distflow_lab.core.errors import ConfigError
from distflow_lab.models.environment import env_class, parse_options
from distflow_lab.models.environment_pool import EnvPool
from distflow_lab.models.rollout_multiturn import MultiTurnRollout
from distflow_lab.models.rollout_stream import HFStreamingRollout
from distflow_lab.models.sequences import tokenize_prompts
from distflow_lab.runtime.context import StageContext

POLL_EVERY = 4  # decode iterations between collecting environment answers


def check_multi_turn(cfg: RunConfig) -> None:
    """Before any worker starts: the environment exists, its options parse, the algorithm can run it."""
    mt = cfg.rollout.multi_turn
    if mt is None:
        return
    try:
        parse_options(mt.env, mt.options)  # names the environment and the key
    except ConfigError as e:
        raise ConfigError(f"rollout.multi_turn: {e}") from None
    if cfg.algorithm.name == "dapo":
        raise ConfigError("rollout.multi_turn: DAPO's dynamic sampling generates again with single-turn rollouts; "
                          "multi-turn DAPO is not built yet (use grpo, gspo or ppo)")
    if mt.max_turn_tokens > cfg.rollout.max_response_len:
        raise ConfigError(f"rollout.multi_turn.max_turn_tokens={mt.max_turn_tokens} is more than the trajectory's "
                          f"budget rollout.max_response_len={cfg.rollout.max_response_len}")


def multi_turn_rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n trajectories per prompt of the batch (see the module doc)."""
    cfg, e = ctx.config, ctx.engines
    mt = engine_of(ctx)
    ids, mask, truncated = tokenize_prompts(e.tokenizer, list(batch["prompt"]), cfg.data.max_prompt_len)
    rows = [{"prompt": p, "reward_model": rm, "data_source": src}
            for p, rm, src in zip(batch["prompt"], batch["reward_model"], batch["data_source"])]
    cols = mt.generate(ids, mask, rows, n=cfg.rollout.n, seed=ctx.seed, version=e.policy.version)
    n = cfg.rollout.n
    per_prompt = {"uid": [str(i) for i in batch["row_id"].tolist()],
                  "ground_truth": [rm["ground_truth"] for rm in batch["reward_model"]],
                  "data_source": list(batch["data_source"])}
    objects = {k: np.repeat(np.asarray(v, dtype=object), n) for k, v in per_prompt.items()}
    s, model = mt.stats, cols["loss_mask"].sum(1).float()
    ctx.log(**{"rollout/prompts_truncated": truncated, "multi_turn/turns_mean": cols["turns"].float().mean().item(),
               "multi_turn/model_tokens_mean": model.mean().item(),
               "multi_turn/env_tokens_mean": (cols["response_mask"].sum(1).float() - model).mean().item(),
               "multi_turn/env_s": s.env_s, "multi_turn/done_by_env": s.done_by_env / max(1, s.trajectories),
               "response_length/mean": cols["response_mask"].sum(1).float().mean().item()})
    ctx.count(**{k: v for k, v in {"multi_turn/env_calls": s.env_calls,
                                   "multi_turn/truncated_tokens": s.truncated_tokens}.items() if v})
    return Batch(cols, objects)


def engine_of(ctx: StageContext) -> MultiTurnRollout:
    cfg, e = ctx.config, ctx.engines
    if e.multi_turn is None:
        mt, model = cfg.rollout.multi_turn, getattr(e.rollout, "model", None)
        if model is None:
            raise TypeError(f"multi-turn rollouts need the hf rollout's module; {type(e.rollout).__name__} has none")
        stops = [t for s in getattr(env_class(mt.env), "stop_strings", ())
                 for t in e.tokenizer(s, add_special_tokens=False)["input_ids"]]
        pool = EnvPool(mt.env, e.tokenizer, mt.options, size=mt.pool_size, timeout_s=mt.timeout_s)
        stream = HFStreamingRollout(model, e.tokenizer, cfg.rollout.model_copy(update={"n": 1}),
                                    cfg.data.max_prompt_len + cfg.rollout.max_response_len,
                                    slots=min(cfg.rollout.micro_batch, cfg.data.prompts_per_step * cfg.rollout.n),
                                    stop_ids=stops)
        e.multi_turn = MultiTurnRollout(stream, pool, mt.max_turns, mt.max_turn_tokens, cfg.rollout.max_response_len,
                                        POLL_EVERY)
    return e.multi_turn


def env_scores(batch: Batch) -> torch.Tensor:
    return batch["env_reward"].float()
