"""GRPO (Shao et al., 2024, arXiv:2402.03300) on distflow_lab, top to bottom.

The DAG (paper Table 1 order; the one layout change, and so the one DataBuffer
redistribution, is where data enters the training stages):

    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update

Every stage is a plain function `(batch, ctx) -> batch`: it reads columns,
adds columns, and reaches its engines through `ctx.engines` (see engines.py)
and the run config through `ctx.config`. Swap any of them from a notebook:
`dag.replace("advantage", fn=my_estimator)`. Adding an estimator is one
function in estimators.py and one entry in its ESTIMATORS (or one `replace` line).
"""
from __future__ import annotations

import numpy as np
import torch

from distflow_lab.algos.engine_setup import mark_updated, policy_version, sync_weights
from distflow_lab.algos.estimators import ESTIMATORS
from distflow_lab.algos.losses import kl_penalty, masked_mean, off_policy_weights, ppo_token_loss
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape
from distflow_lab.models.sequences import decode_responses, tokenize_prompts
from distflow_lab.runtime.context import StageContext

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def grpo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {name: f"{__name__}:{name}" for name in
           ("rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update")}
    return grpo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=CONTRACTS, name="grpo", groups=cfg.groups)


# What each stage must add and keep: a replaced stage that breaks it fails with a clear error.
CONTRACTS = {
    "rollout": {"contract": {"outputs": ["input_ids", "attention_mask", "position_ids", "responses",
                                         "response_mask", "uid"]}},
    "reward": {"contract": {"outputs": ["scores"], "rows": "same"}},
    "advantage": {"contract": {"outputs": ["advantages", "returns"], "rows": "same"}},
    "old_log_prob": {"contract": {"outputs": ["old_log_probs"], "rows": "same"}},
    "ref_log_prob": {"contract": {"outputs": ["ref_log_probs"], "rows": "same"}},
    "actor_update": {"contract": {"rows": "same"}},
}


# ---- 1. rollout: n sampled responses per prompt ------------------------------------
def rollout(batch: Batch, ctx: StageContext) -> Batch:
    cfg, e = ctx.config, ctx.engines
    sync_weights(ctx)  # the actor changed last step: push its weights (a span of its own)
    prompt_ids, prompt_mask, truncated = tokenize_prompts(e["tokenizer"], list(batch["prompt"]), cfg.data.max_prompt_len)
    cols = e["rollout"].generate(prompt_ids, prompt_mask, seed=ctx.seed)
    n = cfg.rollout.n
    per_prompt = {"uid": [str(i) for i in batch["row_id"].tolist()],
                  "ground_truth": [rm["ground_truth"] for rm in batch["reward_model"]],
                  "data_source": list(batch["data_source"])}
    objects = {k: np.repeat(np.asarray(v, dtype=object), n) for k, v in per_prompt.items()}
    cols["version"] = torch.full((len(cols["responses"]),), policy_version(ctx), dtype=torch.int64)
    lengths = cols["response_mask"].sum(1).float()
    ctx.log(**{"rollout/prompts_truncated": truncated, "response_length/mean": lengths.mean().item(),
               "response_length/clip_frac": (lengths == cfg.rollout.max_response_len).float().mean().item()})
    return Batch(cols, objects)


# ---- 2. reward: a rule per data source (or any function in the config) -----------------
def reward(batch: Batch, ctx: StageContext) -> Batch:
    texts = decode_responses(ctx.engines["tokenizer"], batch["responses"], batch["response_mask"])
    fn = ctx.engines["reward_fn"]
    scores = torch.tensor([fn(src, text, truth) for src, text, truth in
                           zip(batch["data_source"], texts, batch["ground_truth"])], dtype=torch.float32)
    ctx.log(**{"reward/mean": scores.mean().item()})
    return batch.with_columns(scores=scores)


# ---- 3. advantage: group-relative by default (any estimator of the registry) -----------
def advantage(batch: Batch, ctx: StageContext) -> Batch:
    alg = ctx.config.algorithm
    adv, ret = ESTIMATORS[alg.adv_estimator or "grpo"](batch, alg)
    return batch.with_columns(advantages=adv.float(), returns=ret.float())


# ---- 4-5. log-probs of the sampled tokens under the current and reference policies -----
def old_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    log_probs, entropy = ctx.engines["actor"].forward_log_probs(*(batch[k] for k in MODEL_INPUTS), with_entropy=True)
    ctx.log(**{"actor/entropy": masked_mean(entropy, batch["response_mask"]).item()})
    return batch.with_columns(old_log_probs=log_probs)


def ref_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    log_probs, _ = ctx.engines["ref"].forward_log_probs(*(batch[k] for k in MODEL_INPUTS))
    return batch.with_columns(ref_log_probs=log_probs)


# ---- 6. actor update: clipped surrogate + KL to the reference - entropy bonus ----------
def actor_loss(cfg: RunConfig):
    a = cfg.actor

    def loss_fn(mb: dict, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        mask = mb["response_mask"]
        loss, metrics = ppo_token_loss(mb["old_log_probs"], log_probs, mb["advantages"], mask,
                                       a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c)
        if a.off_policy != "none":  # samples from an older policy: weigh by pi_prox / pi_behaviour
            w, more = off_policy_weights(mb["old_log_probs"], mb["rollout_log_probs"], mask, a.off_policy, a.is_cap)
            loss, metrics = loss * w, {**metrics, **more}
        if a.use_kl_loss:
            kl = kl_penalty(log_probs, mb["ref_log_probs"], a.kl_loss_type)
            loss = loss + a.kl_loss_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        if a.entropy_coeff and entropy is not None:
            loss = loss - a.entropy_coeff * entropy
        return loss, mask, metrics

    return loss_fn


def actor_update(batch: Batch, ctx: StageContext) -> Batch:
    cfg, actor = ctx.config, ctx.engines["actor"]
    extra = ("rollout_log_probs",) if cfg.actor.off_policy != "none" else ()
    cols = {k: batch[k] for k in (*MODEL_INPUTS, "response_mask", "old_log_probs", "ref_log_probs", "advantages",
                                  *extra)}
    metrics: dict[str, float] = {}
    for mini in _mini_batches(cols, cfg.actor.mini_batches):
        metrics = actor.train_step(mini, actor_loss(cfg), cfg.actor.loss_agg_mode,
                                   with_entropy=cfg.actor.entropy_coeff > 0)
    ctx.engines["sync"].stale = True  # the rollout must pick up the new weights
    mark_updated(ctx)  # a new policy version (published to a separate rollout group)
    ctx.log(**{f"actor/{k}": v for k, v in metrics.items()})
    return batch


def _mini_batches(cols: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    n = len(cols["input_ids"])
    return [{name: t[i * n // k:(i + 1) * n // k] for name, t in cols.items()} for i in range(k)]
