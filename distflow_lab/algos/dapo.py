"""DAPO (Yu et al., 2025, arXiv:2503.14476) on distflow_lab, top to bottom.

    data (over-sampled) -> rollout -> reward (+ overlong penalty) -> dynamic_sampling
         -> advantage -> old_log_prob -> ref_log_prob -> actor_update (clip-higher, token-level loss)

GRPO with four changes, each a switch in `algorithm.options` (DAPOOptions below):

  clip_higher       clip the ratio to [1 - eps_low, 1 + eps_high] with eps_high > eps_low (Eq. 10):
                    unlikely tokens may grow, so the policy's entropy does not collapse
  dynamic_sampling  a stage that drops the prompt groups whose accuracies are all equal (their
                    group-relative advantage is 0) and samples again until the batch is full (Eq. 11)
  token_level_loss  token-mean aggregation (Eq. 12): every token weighs the same, whatever its length
  overlong_shaping  a soft penalty over the last L_cache tokens before the length limit (Eq. 13)

Rollout, advantage, the log-prob stages and the actor update are GRPO's. DAPO drops the KL term
(actor.use_kl_loss=false in its preset), and then the reference pass too.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from pydantic import Field

from distflow_lab.algos.grpo import CONTRACTS, fit_kl
from distflow_lab.algos.registry import algorithm_options, loss_agg_is, register_algorithm
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ActorOptions, ConfigError, DataSpec, RunConfig
from distflow_lab.core.registry import Options
from distflow_lab.datasets.loader import load_batch
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape
from distflow_lab.models.sequences import decode_responses
from distflow_lab.runtime.context import StageContext

GRPO_STAGES = ("rollout", "advantage", "old_log_prob", "ref_log_prob", "actor_update")


class DAPOOptions(Options):
    """DAPO's four parts, each a switch (algorithm.options; an unknown key is an error naming it)."""

    clip_higher: bool = True
    """Decoupled clip: ratio in [1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high] (needs high >= low); off: [1 - low, 1 + low]."""
    dynamic_sampling: bool = True
    """Drop prompt groups whose accuracies are all equal (zero advantage) and sample again until the batch is full."""
    oversample: float = Field(default=1.5, ge=1)
    """Dynamic sampling: prompts generated in the first round = data.prompts_per_step x this (rounded up to the rollout's dp)."""
    max_rounds: int = Field(default=3, ge=1)
    """Dynamic sampling: generation rounds at most, the first included; a rank still short then trains on fewer groups."""
    token_level_loss: bool = True
    """Token-level loss (token-mean: every token weighs the same); off: seq-mean-token-mean (GRPO's per-sample mean)."""
    overlong_shaping: bool = True
    """Soft overlong penalty: 0 down to -overlong_penalty_factor over the last overlong_buffer_len tokens before rollout.max_response_len."""
    overlong_buffer_len: int | None = Field(default=None, ge=1)
    """Overlong shaping: the length window L_cache (None: a quarter of rollout.max_response_len, at least 1); must be < rollout.max_response_len."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0)
    """Overlong shaping: the penalty at (and past) rollout.max_response_len."""

    def buffer_len(self, max_response_len: int) -> int:
        """The overlong window L_cache in tokens."""
        return self.overlong_buffer_len if self.overlong_buffer_len is not None else max(1, max_response_len // 4)


def dapo_dag(cfg: RunConfig, data_path: str) -> DAG:
    data = DataSpec(source=data_path, batch_size=pool_size(cfg), shuffle=cfg.data.shuffle)
    fns = {"data": load_batch, **{n: f"distflow_lab.algos.grpo:{n}" for n in GRPO_STAGES},
           "reward": f"{__name__}:reward"}
    contracts = {**CONTRACTS, "reward": {"contract": {"outputs": ["acc", "scores"], "rows": "same"}}}
    dag = grpo_shape(fns, data, rollout_tp=cfg.rollout.tp, extras=contracts, name=cfg.algorithm.name,
                     groups=cfg.groups)
    if dapo_options(cfg).dynamic_sampling:  # one more stage, in the rollout's layout; its row count varies
        dag.node("dynamic_sampling", f"{__name__}:dynamic_sampling", role="rollout", type="generate",
                 deps=["reward"], layout=dag["rollout"].layout,
                 contract={"outputs": ["acc", "scores", "uid"], "rows": "any"})
        dag.replace("advantage", deps=["dynamic_sampling"])
    return fit_kl(dag, cfg)  # DAPO drops the KL term (its preset): then the reference pass goes too


def dapo_options(cfg: RunConfig) -> DAPOOptions:
    """DAPO's switches: the algorithm's options where it declares DAPO's (dapo, or a variant declared with
    options=DAPOOptions), else DAPO's defaults (its stages reused under another algorithm, as notebook 02 does)."""
    opts = algorithm_options(cfg)
    return opts if isinstance(opts, DAPOOptions) else DAPOOptions()


def pool_size(cfg: RunConfig) -> int:
    """Prompts loaded and generated per step: prompts_per_step x oversample with dynamic sampling,
    rounded up to a multiple of the rollout's data-parallel size."""
    d, dp = dapo_options(cfg), cfg.cluster.world_size // cfg.rollout.tp
    if not d.dynamic_sampling:
        return cfg.data.prompts_per_step
    return dp * math.ceil(round(cfg.data.prompts_per_step * d.oversample / dp, 6))


# ---- 1. reward: task accuracy + the soft overlong penalty ------------------------------
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Eq. 13), L_max = max_len, L_cache = buffer_len:

        R_length(y) = 0                                    |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                      -1                                   L_max < |y|

    times `factor` (verl's overlong_penalty_factor); added to the task reward.
    """
    over = (lengths.float() - (max_len - buffer_len)) / buffer_len
    return -factor * over.clamp(0.0, 1.0)


def score(batch: Batch, ctx: StageContext) -> Batch:
    """acc: the task reward of each response; scores: acc plus the overlong penalty (if on)."""
    cfg, e = ctx.config, ctx.engines
    if "env_reward" in batch:  # multi-turn: the environment scored each trajectory
        acc = batch["env_reward"].float()
    else:
        texts = decode_responses(e.tokenizer, batch["responses"], batch["response_mask"])
        acc = torch.tensor([e.reward_fn(src, text, truth) for src, text, truth in
                            zip(batch["data_source"], texts, batch["ground_truth"])], dtype=torch.float32)
    d, R = dapo_options(cfg), cfg.rollout.max_response_len
    penalty = torch.zeros_like(acc)
    if d.overlong_shaping:
        penalty = overlong_penalty(batch["response_mask"].sum(-1), R, d.buffer_len(R), d.overlong_penalty_factor)
    return batch.with_columns(acc=acc, scores=acc + penalty)


def reward(batch: Batch, ctx: StageContext) -> Batch:
    out = score(batch, ctx)
    acc, shaped = out["acc"], out["scores"]
    ctx.log(**{"reward/mean": acc.mean().item(), "reward/shaped_mean": shaped.mean().item(),
               "reward/overlong_frac": (shaped < acc).float().mean().item()})
    return out


# ---- 2. dynamic sampling: keep groups with a learning signal, sample again until full ----
def dynamic_sampling(batch: Batch, ctx: StageContext) -> Batch:
    """Keep the groups (same uid) whose accuracies differ; sample the dropped prompts again
    (new seed each round) until this rank has its share T = prompts_per_step / dp of groups,
    for at most `max_rounds` rounds (the rollout's was the first).

    Output, deterministic given the seeds: the first T kept groups (round order, then row
    order; surplus groups are trimmed), so n*T rows when full and n*g rows (1 <= g < T) when
    the cap leaves it short. With no group kept at all it emits the first dropped group
    (zero advantage: only its KL term acts), so no rank is ever empty and the update never
    meets an empty global batch. verl draws fresh prompts from its dataloader; here the
    over-sampled first round brings the fresh prompts and later rounds re-sample the dropped
    ones, so every data plane (the centralized one loads data in the driver) gives the same.
    """
    cfg, n = ctx.config, ctx.config.rollout.n
    target = cfg.data.prompts_per_step // ctx.dp_size
    kept: list[Batch] = []
    todo, rounds, generated, dropped = batch, 0, num_groups(batch), 0
    while True:
        rounds += 1
        mixed = mixed_groups(todo["uid"], todo["acc"])
        kept.append(todo.select(np.flatnonzero(mixed)))
        todo = todo.select(np.flatnonzero(~mixed))
        dropped += num_groups(todo)
        have = sum(num_groups(k) for k in kept)
        if have >= target or not len(todo) or rounds >= dapo_options(cfg).max_rounds:
            break
        todo = regenerate(todo, ctx, seed=ctx.seed + rounds)
        generated += num_groups(todo)
    out = first_groups(Batch.concat(kept), target)
    fallback = len(out) == 0
    if fallback:
        out = first_groups(todo, 1)
    ctx.count(**{"dynamic_sampling/groups_generated": generated, "dynamic_sampling/groups_dropped": dropped,
                 "dynamic_sampling/groups_trimmed": max(0, have - target),
                 "dynamic_sampling/groups_short": max(0, target - have), "dynamic_sampling/fallback": int(fallback),
                 "dynamic_sampling/rows_out": len(out)})
    ctx.log(**{"dynamic_sampling/rounds": rounds, "dynamic_sampling/fill": len(out) / max(1, n * target)})
    return out


def mixed_groups(uid, acc: torch.Tensor) -> np.ndarray:
    """Per row: does its group hold two different accuracies (Eq. 11: 0 < #correct < G)?"""
    _, gid = np.unique(np.asarray(uid).astype(str), return_inverse=True)
    if not len(gid):
        return np.zeros(0, dtype=bool)
    a = acc.double().numpy()
    lo, hi = np.full(gid.max() + 1, np.inf), np.full(gid.max() + 1, -np.inf)
    np.minimum.at(lo, gid, a)
    np.maximum.at(hi, gid, a)
    return (hi > lo)[gid]


def num_groups(batch: Batch) -> int:
    return len(set(np.asarray(batch["uid"]).astype(str).tolist())) if len(batch) else 0


def first_groups(batch: Batch, k: int) -> Batch:
    """The rows of the first k groups (in order of first appearance), row order kept."""
    if not len(batch):
        return batch
    _, first, gid = np.unique(np.asarray(batch["uid"]).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # a group's rank by first appearance
    return batch.select(np.flatnonzero(order[gid] < k))


def regenerate(batch: Batch, ctx: StageContext, seed: int) -> Batch:
    """n new responses, scored, for each group's prompt (its first row's prompt tokens)."""
    _, first = np.unique(np.asarray(batch["uid"]).astype(str), return_index=True)
    heads = batch.select(np.sort(first))
    P = heads["input_ids"].shape[1] - heads["responses"].shape[1]  # left-padded prompt width
    if ctx.config.rollout.multi_turn is not None:  # trajectories with the environment again
        from distflow_lab.algos.multiturn import multi_turn_again  # the engines, only where a stage runs (grpo.rollout)

        cols = multi_turn_again(heads, ctx, seed)
    else:
        cols = ctx.engines.rollout.generate(heads["input_ids"][:, :P], heads["attention_mask"][:, :P], seed=seed)
    objects = {k: np.repeat(v, ctx.config.rollout.n) for k, v in heads.objects.items()}
    version = ctx.engines.policy.version  # whole responses from the current policy
    if "version" in batch:  # the rows to concat with carry the generating policy's version
        cols["version"] = torch.full((len(cols["responses"]),), version, dtype=torch.int64)
    if "token_versions" in batch:  # ... and, from a streaming rollout, each token's
        cols["token_versions"] = cols.get("loss_mask", cols["response_mask"]).long() * version  # 0: environment
    if "item_id" in batch:  # the new responses take the dropped rows' slots (same groups, n rows each)
        cols["item_id"] = batch["item_id"].clone()
    return score(Batch(cols, objects), ctx)


# ---- 3. actor update: GRPO's stage, with the actor options DAPO's switches imply ------------
def dapo_actor(cfg: RunConfig) -> ActorOptions:
    """The actor options the switches imply: clip-higher off = the symmetric clip
    [1 - low, 1 + low]; token-level loss = token-mean, off = seq-mean-token-mean."""
    a, d = cfg.actor, dapo_options(cfg)
    return a.model_copy(update={"clip_ratio_high": a.clip_ratio_high if d.clip_higher else a.clip_ratio_low,
                                "loss_agg_mode": "token-mean" if d.token_level_loss else "seq-mean-token-mean"})


def check(cfg: RunConfig) -> None:
    """DAPO's switches against the actor and rollout options; errors name the fields."""
    d, a = dapo_options(cfg), cfg.actor
    if d.clip_higher and a.clip_ratio_high < a.clip_ratio_low:
        raise ConfigError(f"actor.clip_ratio_high={a.clip_ratio_high} < actor.clip_ratio_low={a.clip_ratio_low}: "
                          "DAPO's clip-higher (algorithm.options.clip_higher) needs clip_ratio_high >= clip_ratio_low")
    loss_agg_is(cfg, "token-mean" if d.token_level_loss else "seq-mean-token-mean",
                f"algorithm.options.token_level_loss={str(d.token_level_loss).lower()}")
    r = cfg.rollout.max_response_len
    if d.overlong_shaping and d.buffer_len(r) >= r:
        raise ConfigError(f"algorithm.options.overlong_buffer_len={d.buffer_len(r)} must be < "
                          f"rollout.max_response_len={r} (the penalty window ends at the longest response)")


# ---- the declaration: its own DAG (dynamic sampling), options, and the paper's clip-higher ----
# the paper's eps_high 0.28, and verl's recipe's dual clip c = 10 (the paper has none)
register_algorithm("dapo", dag=dapo_dag, estimator="grpo", estimator_kinds=("outcome",), policy_loss="ppo_clip",
                   options=DAPOOptions, actor={"clip_ratio_high": 0.28, "clip_ratio_c": 10.0}, check=check,
                   actor_options=dapo_actor)
