"""Synthetic GRPO/PPO-shaped workload: the data-plane benchmark's stages.

The stages emit the tensors a real GRPO step moves (verl's layout: prompt +
response token ids, attention mask, position ids, response mask, log-probs,
values, advantages), with response lengths drawn from a lognormal and an
optional simulated compute time proportional to tokens (a sleep: on a 2-core
machine it shows stragglers and load balance without CPU contention).

Per-stage knobs are the node's `params`, typed by `SyntheticParams` (an
unknown or misspelt key is an error naming the node and the key).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from pydantic import Field, ValidationError

from distflow_lab.algos.estimators import gae_advantage, grpo_outcome_advantage, outcome_to_token_rewards
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ConfigError, DataSpec, Strict
from distflow_lab.datasets.loader import load_batch
from distflow_lab.graph.dag import DAG
from distflow_lab.graph.shapes import grpo_shape, ppo_shape
from distflow_lab.models.stream_slots import top_up
from distflow_lab.runtime.context import StageContext
from distflow_lab.runtime.weights import SyntheticWeights


class SyntheticParams(Strict):
    """The knobs of the synthetic stages (a node's `params`)."""

    n: int = Field(default=4, ge=1)
    """rollout: responses per prompt."""
    max_prompt_len: int = Field(default=256, ge=1)
    """rollout: P, prompts left-padded to it."""
    max_response_len: int = Field(default=256, ge=1)
    """rollout: R, responses right-padded to it."""
    response_len_mean: float | None = Field(default=None, gt=0)
    """rollout: median response length (lognormal; None: R / 4)."""
    response_len_sigma: float = Field(default=0.6, ge=0)
    """rollout: lognormal sigma of response lengths."""
    us_per_token: float = Field(default=0.0, ge=0)
    """every stage: simulated compute, microseconds per token (a sleep)."""
    decode_us: float = Field(default=0.0, ge=0)
    """rollout: simulated latency of one decode iteration of the whole batch (0: use us_per_token)."""
    refresh_every: int = Field(default=16, ge=1)
    """rollout with partial rollouts: decode iterations between policy refreshes."""
    slots_per_row: float = Field(default=2.0, ge=1)
    """rollout with partial rollouts: sequences decoding at once per row a call returns (continuous batching keeps
    this many in flight: a call returns when its rows have finished, the rest keep decoding into the next call)."""
    weight_mib: float = Field(default=1.0, gt=0)
    """actor_update: size of the synthetic policy that weight sync moves between groups."""
    p_correct: float = Field(default=0.5, ge=0, le=1)
    """reward: probability that a response scores 1."""


def params(ctx: StageContext) -> SyntheticParams:
    try:
        return SyntheticParams(**ctx.params)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc']))}: "
                        + ("unknown key" if err["type"] == "extra_forbidden" else err["msg"]) for err in e.errors())
        raise ConfigError(f"node {ctx.stage.id!r} params: {bad}") from None


def _simulate(batch: Batch, ctx: StageContext, tokens: int | None = None) -> None:
    us = params(ctx).us_per_token
    if us > 0 and len(batch):
        n = tokens if tokens is not None else int(batch["attention_mask"].sum())
        time.sleep(n * us * 1e-6)


def _columns(prompt_len: torch.Tensor, resp_len: torch.Tensor, uid: np.ndarray, versions: torch.Tensor,
             P: int, R: int, g: torch.Generator) -> Batch:
    """verl's layout (prompts left-padded to P, responses right-padded to R) for these rows,
    with each token's policy version (`token_versions`) and each row's oldest (`version`)."""
    cols = torch.arange(P + R)
    prompt_mask = cols[None, :P] >= (P - prompt_len)[:, None]
    response_mask = cols[None, :R] < resp_len[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).to(torch.int64)
    input_ids = torch.randint(3, 32000, (len(prompt_len), P + R), generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    token_versions = versions * response_mask
    big = torch.iinfo(torch.int64).max
    version = torch.where(response_mask, token_versions, big).min(1).values if R else versions[:, 0]
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "responses": input_ids[:, P:].clone(), "response_mask": response_mask.to(torch.int64),
                  "token_versions": token_versions.to(torch.int64), "version": version.to(torch.int64)},
                 {"uid": uid}, {"max_prompt_len": P, "max_response_len": R})


def _lengths(p: SyntheticParams, rows: int, g: torch.Generator) -> torch.Tensor:
    mean, sigma = p.response_len_mean or p.max_response_len / 4, p.response_len_sigma
    normal = torch.randn(rows, generator=g, dtype=torch.float64)
    return torch.exp(np.log(mean) + sigma * normal).round().clamp(1, p.max_response_len).to(torch.int64)


def rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n responses per prompt. Time (a simulated wait, so 2 cores do not decide it):
    `decode_us` per decode iteration, batched decoding: the batch takes as many iterations
    as its longest response (static batching), or with partial rollouts in the async
    schedule, `StreamingDecoder` (continuous batching); else `us_per_token` per token."""
    p = params(ctx)
    if ctx.schedule.partial_rollout and p.decode_us > 0:
        return _streaming(batch, ctx, p)
    n, P, R = p.n, p.max_prompt_len, p.max_response_len
    prompt_len = torch.as_tensor([min(int(x), P) for x in batch["prompt_len"]], dtype=torch.int64).repeat_interleave(n)
    resp_len = _lengths(p, len(prompt_len), ctx.rng)
    uid = np.repeat(np.asarray([f"{int(r)}" for r in batch["row_id"]], dtype=object), n)
    version = policy(ctx).version
    out = _columns(prompt_len, resp_len, uid, torch.full((len(uid), R), version), P, R, ctx.rng)
    if p.decode_us > 0 and len(resp_len):
        time.sleep(int(resp_len.max()) * p.decode_us * 1e-6)  # the batch waits for its longest response
    else:
        _simulate(out, ctx)
    ctx.log(**{"rollout/partial_frac": 0.0, "rollout/len_max_over_median":
               float(resp_len.max() / resp_len.median()) if len(resp_len) else 0.0})
    return out


class StreamingDecoder:
    """Continuous batching with partial rollouts (the async schedule): up to `slots`
    sequences decode together, one token each per iteration of `decode_us`; a finished
    sequence's slot is refilled at once from the waiting prompts; sequences still in
    flight when a call has its rows stay for the next call, and keep decoding across
    weight updates, each token stamped with the version that produced it. The policy is
    refreshed every `refresh_every` iterations. Time is a simulated wait."""

    def __init__(self) -> None:
        self.waiting: list[tuple[int, int, str]] = []  # (prompt_len, response_len, uid)
        self.active: list[dict] = []
        self.finished: list[dict] = []  # done beyond what the last call returned: the next call's first rows
        self.paused: tuple[float, int] | None = None  # (when the last call returned, the version it held)

    def _between_calls(self, decode_us: float) -> None:
        """The engine is a server: between two calls (the schedule holds generation back) the
        sequences already admitted keep decoding, with the policy the last call held; no new
        prompt is admitted. Simulated from the wall time that passed, at no cost to this call."""
        if self.paused is None or not self.active:
            return
        since, version = self.paused
        iters = int((time.monotonic() - since) / (decode_us * 1e-6))
        for s in sorted(self.active, key=lambda s: s["len"] - len(s["versions"])):  # in the order they finish
            s["versions"] += [version] * min(iters, s["len"] - len(s["versions"]))
        self.finished += [s for s in self.active if len(s["versions"]) >= s["len"]]
        self.active = [s for s in self.active if len(s["versions"]) < s["len"]]

    def add(self, prompt_len: torch.Tensor, resp_len: torch.Tensor, uid: np.ndarray) -> None:
        self.waiting += list(zip(prompt_len.tolist(), resp_len.tolist(), uid.tolist()))

    def run(self, rows: int, slots: int, decode_us: float, refresh_every: int, ctx: StageContext,
            refill: Callable[[], Any] | None = None) -> list[dict]:
        """Decode until `rows` sequences have finished; return them (oldest first). After ageing out,
        `refill()` admits later prompts until every slot has a sequence (the real engines' top_up)."""
        self._between_calls(decode_us)
        version = policy(ctx).version
        done, self.finished = self._age_out(self.finished, version, ctx), []  # carried over from the last call
        self.active = self._age_out(self.active, version, ctx)
        top_up(lambda: len(self.waiting) + len(self.active), slots, refill)
        until_refresh = refresh_every
        while len(done) < rows:
            while len(self.active) < slots and self.waiting:
                pl, rl, u = self.waiting.pop(0)
                self.active.append({"prompt_len": pl, "len": rl, "uid": u, "versions": []})
            if not self.active:
                break
            left = min(s["len"] - len(s["versions"]) for s in self.active)  # iterations to the next finish
            step = max(1, min(left, until_refresh))
            time.sleep(step * decode_us * 1e-6)
            for s in self.active:
                s["versions"] += [version] * min(step, s["len"] - len(s["versions"]))
            done += [s for s in self.active if len(s["versions"]) >= s["len"]]
            self.active = [s for s in self.active if len(s["versions"]) < s["len"]]
            until_refresh -= step
            if until_refresh <= 0 and ctx.refresh_policy is not None:
                version = ctx.refresh_policy()  # a new policy from here on, for tokens in flight too
                self.active = self._age_out(self.active, version, ctx)
                until_refresh = refresh_every
        done, self.finished = done[:rows], done[rows:]
        self.paused = (time.monotonic(), version)
        return done

    def _age_out(self, seqs: list[dict], version: int, ctx: StageContext) -> list[dict]:
        """Sequences whose oldest token will be more than max_staleness versions old when
        this batch trains (at update `ctx.trains_by` at the latest; else the current policy
        `version`) can never be trained on: drop them, or start them again (`on_stale`,
        back to the waiting prompts), counted. Returns the sequences kept."""
        k, keep = ctx.schedule.max_staleness, []
        trains_at = max(version, ctx.trains_by if ctx.trains_by is not None else version)
        for s in seqs:
            if s["versions"] and trains_at - s["versions"][0] > k:
                if ctx.schedule.on_stale == "regenerate":
                    self.waiting.insert(0, (s["prompt_len"], s["len"], s["uid"]))
                    ctx.count(**{"rollout/stale_regenerated": 1})
                else:
                    ctx.count(**{"rollout/stale_dropped": 1})
                continue
            keep.append(s)
        return keep


def _streaming(batch: Batch, ctx: StageContext, p: SyntheticParams) -> Batch:
    dec = ctx.engines.scratch.setdefault("decoder", StreamingDecoder())
    n, P, R = p.n, p.max_prompt_len, p.max_response_len

    def admit(b: Batch) -> int:
        prompt_len = torch.as_tensor([min(int(x), P) for x in b["prompt_len"]], dtype=torch.int64).repeat_interleave(n)
        dec.add(prompt_len, _lengths(p, len(prompt_len), ctx.rng),
                np.repeat(np.asarray([f"{int(r)}" for r in b["row_id"]], dtype=object), n))
        return len(prompt_len)

    rows = admit(batch)
    slots = int(p.slots_per_row * rows)
    refill = (lambda: admit(ctx.loader.next_batch())) if ctx.loader is not None else None  # later steps' prompts
    done = dec.run(rows, slots, p.decode_us, p.refresh_every, ctx, refill)
    versions = torch.zeros((len(done), R), dtype=torch.int64)
    for i, s in enumerate(done):
        versions[i, :len(s["versions"])] = torch.as_tensor(s["versions"])
    out = _columns(torch.as_tensor([s["prompt_len"] for s in done]), torch.as_tensor([s["len"] for s in done]),
                   np.asarray([s["uid"] for s in done], dtype=object), versions, P, R, ctx.rng)
    spans_versions = [len(set(s["versions"])) > 1 for s in done]
    ctx.log(**{"rollout/partial_frac": float(np.mean(spans_versions)) if done else 0.0})
    return out


def reward(batch: Batch, ctx: StageContext) -> Batch:
    scores = (torch.rand(len(batch), generator=ctx.rng) < params(ctx).p_correct).to(torch.float32)
    _simulate(batch, ctx, tokens=int(batch["response_mask"].sum()))
    ctx.log(**{"reward/mean": scores.mean().item()})
    return batch.with_columns(scores=scores)


def grpo_advantage(batch: Batch, ctx: StageContext) -> Batch:
    adv, ret = grpo_outcome_advantage(batch["scores"], batch["response_mask"], batch["uid"])
    return batch.with_columns(advantages=adv.float(), returns=ret.float())


def _token_floats(batch: Batch, ctx: StageContext, scale: float = 1.0) -> torch.Tensor:
    mask = batch["response_mask"]
    return torch.randn(mask.shape, generator=ctx.rng) * scale * mask


def old_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    _simulate(batch, ctx)
    return batch.with_columns(old_log_probs=_token_floats(batch, ctx) - 2.0 * batch["response_mask"])


def ref_log_prob(batch: Batch, ctx: StageContext) -> Batch:
    _simulate(batch, ctx)
    return batch.with_columns(ref_log_probs=_token_floats(batch, ctx) - 2.0 * batch["response_mask"])


def values(batch: Batch, ctx: StageContext) -> Batch:
    _simulate(batch, ctx)
    return batch.with_columns(values=_token_floats(batch, ctx, 0.1))


def gae(batch: Batch, ctx: StageContext) -> Batch:
    mask = batch["response_mask"]
    adv, ret = gae_advantage(outcome_to_token_rewards(batch["scores"], mask), batch["values"], mask)
    return batch.with_columns(advantages=adv.float(), returns=ret.float())


def policy(ctx: StageContext) -> SyntheticWeights:
    """This worker's synthetic policy (created on first use; an update bumps its version)."""
    e = ctx.engines
    if e.weights is None:
        e.weights = SyntheticWeights(params(ctx).weight_mib, seed=ctx.seed)
    return e.weights


def actor_update(batch: Batch, ctx: StageContext) -> Batch:
    _simulate(batch, ctx)
    w = policy(ctx)
    w.bump(w.version + 1)  # what an optimizer step does to the policy, as far as weight sync can tell
    mask = batch["response_mask"]
    ctx.log(**{"actor/tokens": float(batch["attention_mask"].sum()),
               "actor/adv_mean": float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1))})
    return batch


def critic_update(batch: Batch, ctx: StageContext) -> Batch:
    _simulate(batch, ctx)
    mask = batch["response_mask"]
    err = ((batch["values"] - batch["returns"]) ** 2 * mask).sum() / mask.sum().clamp(min=1)
    ctx.log(**{"critic/vf_loss": float(err)})
    return batch


_M = "distflow_lab.experiments.synthetic:"
GRPO_FNS = {"data": load_batch, "rollout": _M + "rollout", "reward": _M + "reward", "advantage": _M + "grpo_advantage",
            "old_log_prob": _M + "old_log_prob", "ref_log_prob": _M + "ref_log_prob",
            "actor_update": _M + "actor_update"}
PPO_FNS = {**GRPO_FNS, "advantage": _M + "gae", "values": _M + "values", "critic_update": _M + "critic_update"}


def synthetic_data(batch_size: int, num_rows: int | None = None, lengths_from: str | None = None,
                   mean_len: float = 200.0, max_len: int = 1024) -> DataSpec:
    return DataSpec(source="synthetic", batch_size=batch_size, num_rows=num_rows or 8 * batch_size,
                    lengths_from=lengths_from, mean_len=mean_len, max_len=max_len)


def _knobs(**kw) -> dict:
    return SyntheticParams(**kw).model_dump(exclude_defaults=True)  # checked here, before anything starts


def synthetic_grpo(batch_size: int = 16, n: int = 4, max_prompt_len: int = 256, max_response_len: int = 256,
                   rollout_tp: int = 1, us_per_token: float = 0.0, data: DataSpec | None = None,
                   response_len_mean: float | None = None, response_len_sigma: float = 0.6,
                   groups: dict[str, int] | None = None, decode_us: float = 0.0, weight_mib: float = 1.0) -> DAG:
    """The synthetic GRPO DAG: `batch_size` prompts per step, `n` responses each; with
    `groups` (e.g. {"rollout": 2, "train": 2}) generation and training on disjoint workers;
    `decode_us` > 0 models batched decoding (see `rollout`); `weight_mib` is the policy size."""
    sim = {"params": _knobs(us_per_token=us_per_token)}
    roll = {"params": _knobs(n=n, max_prompt_len=max_prompt_len, max_response_len=max_response_len,
                             response_len_mean=response_len_mean, response_len_sigma=response_len_sigma,
                             us_per_token=us_per_token, decode_us=decode_us, weight_mib=weight_mib)}
    train = {"params": _knobs(us_per_token=us_per_token, weight_mib=weight_mib)}
    extras = {"rollout": roll, "old_log_prob": sim, "ref_log_prob": sim, "actor_update": train}
    return grpo_shape(GRPO_FNS, data or synthetic_data(batch_size, max_len=max_prompt_len), rollout_tp, extras,
                      name="synthetic-grpo", groups=groups)


def synthetic_ppo(batch_size: int = 16, n: int = 1, max_prompt_len: int = 256, max_response_len: int = 256,
                  rollout_tp: int = 1, us_per_token: float = 0.0, data: DataSpec | None = None) -> DAG:
    sim = {"params": _knobs(us_per_token=us_per_token)}
    roll = {"params": _knobs(n=n, max_prompt_len=max_prompt_len, max_response_len=max_response_len,
                             us_per_token=us_per_token)}
    extras = {"rollout": roll, "old_log_prob": sim, "ref_log_prob": sim, "values": sim, "critic_update": sim,
              "actor_update": sim}
    return ppo_shape(PPO_FNS, data or synthetic_data(batch_size, max_len=max_prompt_len), rollout_tp, extras,
                     name="synthetic-ppo")
