"""GRPO (Shao et al., 2024, arXiv:2402.03300) on distflow_lab, top to bottom.

The DAG (paper Table 1 order; the one layout change, and so the one DataBuffer
redistribution, is where data enters the training stages):

    data -> rollout -> reward -> advantage -> old_log_prob -> ref_log_prob -> actor_update

Every stage is a plain function `(batch, ctx) -> batch`: it reads columns,
adds columns, and reaches its engines through `ctx.engines` (engine_setup.RLEngines:
`.actor`, `.ref`, `.rollout`, ...) and the run config through `ctx.config`. Swap any
of them from a notebook: `dag.replace("advantage", fn=my_estimator)`, or register a new
estimator or policy loss (`@lab.register_estimator`, `@lab.register_policy_loss`) and
name it in the config. The actor update is the one every algorithm shares
(actor_update.py); GRPO's declaration (the end of this file) names PPO's clipped token loss.
"""
from __future__ import annotations

import torch

from distflow_lab.algos.actor_update import MODEL_INPUTS, mismatch, update_actor
from distflow_lab.algos.estimators import outcome_to_token_rewards, run_estimator
from distflow_lab.algos.losses import apply_kl_in_reward, loss_mask_key, masked_mean
from distflow_lab.algos.prompt_rows import prompt_infos, response_objects
from distflow_lab.algos.registry import algorithm, register_algorithm
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import DataSpec, RunConfig
from distflow_lab.datasets.loader import load_batch
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape
from distflow_lab.models.sequences import decode_responses, tokenize_prompts
from distflow_lab.runtime.context import StageContext

STAGES = ("rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update")


def grpo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=cfg.data.prompts_per_step, shuffle=cfg.data.shuffle)
    fns = {"data": load_batch, **{name: f"{__name__}:{name}" for name in STAGES}}
    dag = grpo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=CONTRACTS, name=cfg.algorithm.name,
                     groups=cfg.groups)
    return fit_kl(dag, cfg)


def fit_kl(dag: DAG, cfg: RunConfig) -> DAG:
    """The KL terms decide where the reference pass and the advantage go (GRPO, DAPO, GSPO):
    - KL in the reward (algorithm.use_kl_in_reward): the advantage needs both log-probs, so it
      moves after them, into the training layout (as in PPO's DAG);
    - no KL anywhere: nothing reads the reference's log-probs, so its pass goes.
    And actor.old_log_prob=from_update: the update's own forward is the old policy, so the
    old_log_prob pass goes too (registry.check_old_log_prob says where that is allowed)."""
    uses_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    if cfg.algorithm.use_kl_in_reward:
        before = dag["advantage"].deps
        dag.replace("old_log_prob", deps=before).replace("ref_log_prob", deps=before)
        dag.replace("advantage", deps=["old_log_prob", "ref_log_prob"], layout=dag["old_log_prob"].layout)
        dag.replace("actor_update", deps=["advantage"])
    if not uses_ref:
        dag.bypass("ref_log_prob")
    if cfg.actor.old_log_prob == "from_update":  # the update's forward is the old policy: this pass goes
        dag.bypass("old_log_prob")
    return dag


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
    # imported here, not above: checking a config imports this module for its declaration, and must not
    # load the engines (transformers, vLLM, peft: seconds); a worker running this stage has them already
    from distflow_lab.algos.engine_setup import sync_weights
    from distflow_lab.algos.multiturn import multi_turn_rollout
    from distflow_lab.algos.streaming import partial_rollouts, stream_rollout

    cfg, e = ctx.config, ctx.engines
    sync_weights(ctx)  # the actor changed last step: push its weights (a span of its own)
    if cfg.rollout.multi_turn is not None:  # turns interleaved with an environment (multiturn.py; partial too)
        return multi_turn_rollout(batch, ctx)
    if partial_rollouts(ctx):  # async with partial rollouts: sequences decode on across updates (streaming.py)
        return stream_rollout(batch, ctx)
    prompt_ids, prompt_mask, truncated = tokenize_prompts(e.tokenizer, list(batch["prompt"]), cfg.data.max_prompt_len)
    cols = e.rollout.generate(prompt_ids, prompt_mask, seed=ctx.seed)
    objects = response_objects(prompt_infos(batch), cfg.rollout.n)
    cols["version"] = torch.full((len(cols["responses"]),), e.policy.version, dtype=torch.int64)
    lengths = cols["response_mask"].sum(1).float()
    ctx.log(**{"rollout/prompts_truncated": truncated, "response_length/mean": lengths.mean().item(),
               "response_length/clip_frac": (lengths == cfg.rollout.max_response_len).float().mean().item(),
               "rollout/len_max_over_median": (lengths.max() / lengths.median().clamp(min=1)).item()})
    return Batch(cols, objects)


# ---- 2. reward: a rule per data source (or any function in the config) -----------------
def reward(batch: Batch, ctx: StageContext) -> Batch:
    e = ctx.engines
    if "env_reward" in batch:  # multi-turn: the environment scored each trajectory
        scores = batch["env_reward"].float()
        ctx.log(**{"reward/mean": scores.mean().item()})
        return batch.with_columns(scores=scores)
    texts = decode_responses(e.tokenizer, batch["responses"], batch["response_mask"])
    scores = torch.tensor([e.reward_fn(src, text, truth) for src, text, truth in
                           zip(batch["data_source"], texts, batch["ground_truth"])], dtype=torch.float32)
    ctx.log(**{"reward/mean": scores.mean().item()})
    return batch.with_columns(scores=scores)


# ---- 3. advantage: the configured estimator (group-relative by default) ----------------
def advantage(batch: Batch, ctx: StageContext) -> Batch:
    """The configured estimator (algorithm.adv_estimator, else the algorithm's default) over the
    data-parallel group (batch-wide whitening), on the token rewards: the outcome score on the last
    token, minus kl_coef x KL(old || ref) per token with algorithm.use_kl_in_reward (every estimator)."""
    alg = ctx.config.algorithm
    if alg.use_kl_in_reward:
        mask = batch[loss_mask_key(batch)]
        rewards, kl = apply_kl_in_reward(outcome_to_token_rewards(batch["scores"], mask), batch["old_log_probs"],
                                         batch["ref_log_probs"], mask, alg.kl_coef, alg.kl_penalty)
        ctx.log(**{"reward/kl_penalty": kl})
        batch = batch.with_columns(token_rewards=rewards)
    name = alg.adv_estimator or algorithm(alg.name).estimator
    adv, ret = run_estimator(name, batch, alg, ctx.process_group)
    return batch.with_columns(advantages=adv.float(), returns=ret.float())


# ---- 4-5. log-probs of the sampled tokens under the current and reference policies -----
def old_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    log_probs, entropy = ctx.engines.actor.forward_log_probs(*(batch[k] for k in MODEL_INPUTS), with_entropy=True)
    mask = batch[loss_mask_key(batch)]  # the model's tokens (multi-turn: not the environment's)
    ctx.log(**{"actor/entropy": masked_mean(entropy, mask).item()})
    if "rollout_log_probs" in batch:  # the rollout engine's log-probs of the same tokens, against the trainer's
        ctx.log(**mismatch(batch["rollout_log_probs"], log_probs, mask))
    return batch.with_columns(old_log_probs=log_probs)


def ref_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    log_probs, _ = ctx.engines.ref.forward_log_probs(*(batch[k] for k in MODEL_INPUTS))
    return batch.with_columns(ref_log_probs=log_probs)


# ---- 6. actor update: the policy loss + KL to the reference - entropy bonus -------------
def actor_update(batch: Batch, ctx: StageContext) -> Batch:
    return update_actor(batch, ctx)


# ---- the declaration: GRPO's DAG, the group-relative estimator, PPO's clipped loss ------
register_algorithm("grpo", dag=grpo_dag, estimator="grpo", estimator_kinds=("outcome", "token"),
                   policy_loss="ppo_clip")


# GRPO's relatives: the same DAG and loss, another estimator (algos/estimators.py). Dr.GRPO (Liu et al., 2025,
# arXiv:2503.20783) also drops the per-response length normalisation: a token sum over a constant, as verl's recipe.
register_algorithm("dr_grpo", dag=grpo_dag, estimator="dr_grpo", estimator_kinds=("outcome",),
                   policy_loss="ppo_clip", actor={"loss_agg_mode": "seq-mean-token-sum-norm"})
register_algorithm("rloo", dag=grpo_dag, estimator="rloo", estimator_kinds=("outcome",), policy_loss="ppo_clip")
register_algorithm("reinforce_plus_plus", dag=grpo_dag, estimator="reinforce_plus_plus",
                   estimator_kinds=("outcome", "token"), policy_loss="ppo_clip")
