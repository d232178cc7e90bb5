"""Multi-turn rollouts: the model's turns interleaved with an environment's answers
(models/environment.py, run on the actors of models/environment_pool.py).

A trajectory starts from a dataset row: its prompt, the environment's first observation,
then model turns and observations until the environment says done, `max_turns` model
turns were taken, or the trajectory holds `max_response_len` tokens. A model turn ends
at eos, at one of the environment's stop strings, after `max_turn_tokens`, or where the
trajectory's budget runs out.

Each model turn is a sequence of a streaming engine (continuous batching: HF's
rollout_stream.py or vLLM's rollout_vllm_stream.py) with the trajectory's whole context as
its prompt: a trajectory waiting for its environment is simply not in the batch, and
answers are collected every `poll_every` decode iterations, so tools run while other
trajectories decode. On HF a turn prefills its context again (no KV kept across turns); on
vLLM the prefix cache holds the earlier turns' KV in whole blocks (vllm.block_size), and
`stats.cached_tokens` counts what it reused.

Columns, one row per trajectory (n per prompt, in prompt order): the row's prompt;
`responses` = the model's tokens and the observations in order; `response_mask` 1 on both
(the model reads the observations); `loss_mask` 1 on the model's tokens only;
`rollout_log_probs` and `token_versions` (0 on observations); `version` the oldest model
token's; `env_reward` (the sum of the environment's rewards), `turns`, and the seconds the
trajectory spent in generation (`gen_s`: its turns from joining the engine's queue to their
last token) and in its environment (`env_s`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from distflow_lab.models.environment_pool import Answer, EnvPool
from distflow_lab.models.rollout_stream import HFStreamingRollout
from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout
from distflow_lab.models.sequences import assemble_columns


@dataclass
class Trajectory:
    """One trajectory's tokens so far: each token the model's (loss 1) or the environment's (0)."""

    key: str
    prompt: torch.Tensor  # [P] the row's prompt, unpadded
    tokens: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0  # model turns taken
    done: bool = False
    env_s: float = 0.0  # seconds its environment calls took
    gen_s: float = 0.0  # seconds its turns took, from joining the engine's queue to their last token
    turn_start: float = 0.0
    truncated: int = 0  # observation tokens cut by the trajectory's budget

    def extend(self, tokens: Sequence[int], model: bool, logps: Sequence[float] = (), versions: Sequence[int] = ()):
        self.tokens += list(tokens)
        self.loss += [int(model)] * len(tokens)
        self.logps += list(logps) if model else [0.0] * len(tokens)
        self.versions += list(versions) if model else [0] * len(tokens)


@dataclass
class MultiTurnStats:
    """What one `generate` did."""

    trajectories: int = 0
    turns: int = 0
    env_calls: int = 0
    env_s: float = 0.0  # summed over calls (they overlap each other and decoding)
    truncated_tokens: int = 0
    done_by_env: int = 0  # trajectories the environment ended (the rest hit max_turns or the budget)
    prompt_tokens: int = 0  # context tokens the turns prefilled (vLLM only: HF does not count)
    cached_tokens: int = 0  # of those, found in vLLM's prefix cache
    waits: list[tuple[float, float]] = field(default_factory=list)  # (start, end) time.time(): no turn to decode,
    # only environment calls in flight (the rollout records them as `env_wait` spans)


class MultiTurnRollout:
    """Trajectories of `pool`'s environment on the model behind `stream` (built with n=1 and the
    environment's stop tokens; see the module doc)."""

    def __init__(self, stream: HFStreamingRollout | VLLMStreamingRollout, pool: EnvPool, max_turns: int, max_turn_tokens: int,
                 max_response_len: int, poll_every: int = 4):
        if stream.cfg.n != 1:
            raise ValueError("the turn stream decodes one sequence per turn: build it with rollout options n=1")
        self.stream, self.pool = stream, pool
        self.max_turns, self.max_turn_tokens, self.R = max_turns, max_turn_tokens, max_response_len
        self.stream.refresh_every = poll_every
        self.stats = MultiTurnStats()

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[Mapping[str, Any]],
                 n: int, seed: int, version: int = 0) -> dict[str, torch.Tensor]:
        """n trajectories per prompt (left-padded [B, P]; `rows[i]` is what the environment's reset reads)."""
        if len(rows) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(rows)} rows")
        self.stats, self._version = MultiTurnStats(), version
        self.trajs = [Trajectory(f"{seed}:{i}:{k}", ids[m.bool()].cpu())
                      for i, (ids, m) in enumerate(zip(prompt_ids, prompt_mask)) for k in range(n)]
        by_key = {t.key: t for t in self.trajs}
        self._by_key = by_key
        for t in self.trajs:
            self.pool.reset(t.key, rows[int(t.key.split(":")[1])])
        calls, prefill = 0, (getattr(self.stream, "prompt_tokens", 0), getattr(self.stream, "cached_tokens", 0))
        while not all(t.done for t in self.trajs):
            turns = self.stream.in_flight + len(self.stream.book.ready)  # decoding, or decoded and not taken
            if not (turns or self.pool.in_flight):  # each open trajectory waits on one or the other
                raise RuntimeError(f"multi-turn rollout stalled: {sum(not t.done for t in self.trajs)} trajectories "
                                   "open, no turn decoding and no environment call in flight")
            t0 = time.time()
            self._collect(self.pool.ready(wait_s=0.0 if turns else 0.02))
            if not turns:
                self._waited(t0, time.time())
            if self.stream.in_flight or self.stream.book.ready:
                out = self.stream.run(max(1, len(self.stream.book.ready)), version=version,
                                      seed=seed * 100_003 + calls, refresh=self._poll)
                calls += 1
                self._turns_done(out)
        self.stats.trajectories = len(self.trajs)
        self.stats.prompt_tokens = getattr(self.stream, "prompt_tokens", 0) - prefill[0]
        self.stats.cached_tokens = getattr(self.stream, "cached_tokens", 0) - prefill[1]
        return self._columns(prompt_ids, prompt_mask, n)

    def _waited(self, start: float, end: float) -> None:
        w = self.stats.waits
        if w and start - w[-1][1] < 1e-3:  # one wait, polled in slices
            w[-1] = (w[-1][0], end)
        else:
            w.append((start, end))

    # ---- the loop's two halves -----------------------------------------------------------------
    def _poll(self) -> int:
        """Between decode iterations: take the environment answers that arrived (their next turns join)."""
        self._collect(self.pool.ready(wait_s=0.0))
        return self._version

    def _turns_done(self, out: Any) -> None:
        c = out.columns
        for i, key in enumerate(out.prompts):
            t = self._by_key[key]
            m = c["response_mask"][i].bool()
            toks = c["responses"][i][m].tolist()
            t.extend(toks, True, c["rollout_log_probs"][i][m].tolist(), c["token_versions"][i][m].tolist())
            t.turns += 1
            t.gen_s += time.perf_counter() - t.turn_start
            self.stats.turns += 1
            self.pool.step(key, toks, t.turns)
            self.stats.env_calls += 1

    def _collect(self, answers: list[Answer]) -> None:
        for a in answers:
            t = self._by_key[a.key]
            t.env_s += a.seconds
            self.stats.env_s += a.seconds
            obs = a.step.observation[: max(0, self.R - len(t.tokens))]
            t.truncated += len(a.step.observation) - len(obs)
            self.stats.truncated_tokens += len(a.step.observation) - len(obs)
            t.extend(obs, False)
            t.reward += a.step.reward
            if a.step.done:
                self.stats.done_by_env += 1
            budget = min(self.max_turn_tokens, self.R - len(t.tokens))
            if a.step.done or t.turns >= self.max_turns or budget <= 0:
                t.done = True
                self.pool.close(t.key)
                continue
            ctx = torch.cat([t.prompt, torch.tensor(t.tokens, dtype=torch.long)])
            self.stream.add(ctx[None], torch.ones_like(ctx)[None], metas=[t.key], budgets=[budget])
            t.turn_start = time.perf_counter()

    def _columns(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        B, R, pad = len(self.trajs), self.R, self.stream.pad_id
        responses = torch.full((B, R), pad, dtype=torch.long)
        response_mask = torch.zeros((B, R), dtype=torch.long)
        loss_mask = torch.zeros((B, R), dtype=torch.long)
        logps = torch.zeros((B, R), dtype=torch.float32)
        versions = torch.zeros((B, R), dtype=torch.int64)
        for i, t in enumerate(self.trajs):
            L = len(t.tokens)
            responses[i, :L], response_mask[i, :L] = torch.tensor(t.tokens, dtype=torch.long), 1
            loss_mask[i, :L] = torch.tensor(t.loss, dtype=torch.long)
            logps[i, :L], versions[i, :L] = torch.tensor(t.logps), torch.tensor(t.versions, dtype=torch.int64)
        cols = assemble_columns(prompt_ids.long().cpu().repeat_interleave(n, dim=0),
                                prompt_mask.long().cpu().repeat_interleave(n, dim=0), responses, response_mask)
        model = loss_mask.bool()
        cols.update(loss_mask=loss_mask, rollout_log_probs=logps, token_versions=versions,
                    version=torch.where(model, versions, 1 << 40).min(1).values.clamp(max=self._version),
                    env_reward=torch.tensor([t.reward for t in self.trajs], dtype=torch.float32),
                    turns=torch.tensor([t.turns for t in self.trajs], dtype=torch.int64),
                    gen_s=torch.tensor([t.gen_s for t in self.trajs], dtype=torch.float32),
                    env_s=torch.tensor([t.env_s for t in self.trajs], dtype=torch.float32))
        return cols
