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

Two ways to call it. `generate(...)` plays n trajectories for each prompt given and returns
them all (the synchronous schedules). With partial rollouts, `add(...)` admits prompts and
`run(groups, ...)` plays until `groups` prompts have all their trajectories done and returns
those, oldest first; the others stay open across calls, and so across weight updates:
`refresh()` every `poll_every` decode iterations may bring a new version (each token carries
the version that sampled it), and a `StaleRule` drops (or restarts) the prompt groups whose
oldest model token would be too old when trained.

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
from typing import Any, Callable, Mapping, Sequence

import torch

from distflow_lab.models.environment_pool import Answer, EnvPool
from distflow_lab.models.rollout_stream import HFStreamingRollout, StaleRule
from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout
from distflow_lab.models.sequences import assemble_columns


@dataclass(eq=False)
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
    """What one `generate` or `run` call did."""

    trajectories: int = 0  # returned
    turns: int = 0
    env_calls: int = 0
    env_s: float = 0.0  # summed over calls (they overlap each other and decoding)
    truncated_tokens: int = 0
    done_by_env: int = 0  # trajectories the environment ended (the rest hit max_turns or the budget)
    prompt_tokens: int = 0  # context tokens the turns prefilled (vLLM only: HF does not count)
    cached_tokens: int = 0  # of those, found in vLLM's prefix cache
    waits: list[tuple[float, float]] = field(default_factory=list)  # (start, end) time.time(): no turn to decode,
    # only environment calls in flight (the rollout records them as `env_wait` spans)
    partial: int = 0  # returned trajectories whose model tokens span more than one policy version
    stale_dropped: int = 0  # started trajectories dropped with their prompt group as too stale
    stale_regenerated: int = 0  # trajectories restarted as too stale


@dataclass(eq=False)
class TrajectoryGroup:
    """A prompt's n trajectories (one GRPO group) and the caller's object for it."""

    meta: Any
    prompt_ids: torch.Tensor  # [P] left-padded, as given
    prompt_mask: torch.Tensor
    row: Mapping[str, Any]  # what the environment's reset reads
    trajs: list[Trajectory] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(t.done for t in self.trajs)


class MultiTurnRollout:
    """Trajectories of `pool`'s environment on the model behind `stream` (built with n=1 and the
    environment's stop tokens; see the module doc)."""

    def __init__(self, stream: HFStreamingRollout | VLLMStreamingRollout, pool: EnvPool, max_turns: int,
                 max_turn_tokens: int, max_response_len: int, poll_every: int = 4):
        if stream.cfg.n != 1:
            raise ValueError("the turn stream decodes one sequence per turn: build it with rollout options n=1")
        self.stream, self.pool = stream, pool
        self.max_turns, self.max_turn_tokens, self.R = max_turns, max_turn_tokens, max_response_len
        self.stream.refresh_every = poll_every
        self.stats = MultiTurnStats()
        self.open: list[TrajectoryGroup] = []  # admitted, some trajectory not done (admission order)
        self.ready: list[TrajectoryGroup] = []  # every trajectory done, not yet returned
        self._by_key: dict[str, Trajectory] = {}  # live trajectories; a dropped one's late answers are ignored
        self._group: dict[str, TrajectoryGroup] = {}
        self._keys = 0
        self._version, self._refresh, self._stale = 0, None, None
        self._iterations = self._pulled = 0  # decode iterations over every call; at the last policy pull

    @property
    def in_flight(self) -> int:
        """Trajectories admitted and not done."""
        return sum(not t.done for g in self.open for t in g.trajs)

    def add(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[Mapping[str, Any]],
            metas: Sequence[Any], n: int) -> list[TrajectoryGroup]:
        """Admit prompts (left-padded [B, P]), n trajectories each; their environments start now."""
        if not len(rows) == len(metas) == len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts, {len(rows)} rows, {len(metas)} metas")
        groups = []
        for ids, mask, row, meta in zip(prompt_ids.long().cpu(), prompt_mask.long().cpu(), rows, metas):
            g = TrajectoryGroup(meta, ids, mask, dict(row))
            g.trajs = [self._start(g, Trajectory("", ids[mask.bool()])) for _ in range(n)]
            self.open.append(g)
            groups.append(g)
        return groups

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[Mapping[str, Any]],
                 n: int, seed: int, version: int = 0) -> dict[str, torch.Tensor]:
        """n trajectories per prompt, all of them (left-padded [B, P]; `rows[i]` is what the environment's
        reset reads). Trajectories admitted earlier by `add` decode on meanwhile."""
        if len(rows) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(rows)} rows")
        groups = self.add(prompt_ids, prompt_mask, rows, list(range(len(rows))), n)
        self._play(version, seed, until=lambda: all(g.done for g in groups))
        self.ready = [g for g in self.ready if g not in groups]
        return self._columns(groups)

    @torch.no_grad()
    def run(self, groups: int, version: int, seed: int, refresh: Callable[[], int] | None = None,
            stale: StaleRule | None = None, refill: Callable[[], Any] | None = None
            ) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """Partial rollouts: play until `groups` prompts have all n trajectories done (when none is open,
        `refill()` may admit more); returns their columns and each row's meta, oldest prompts first."""
        self._refresh, self._stale = refresh, stale
        try:
            self._play(version, seed, until=lambda: len(self.ready) >= groups, refill=refill)
        finally:
            self._refresh = self._stale = None
        taken, self.ready = self.ready[:groups], self.ready[groups:]
        return self._columns(taken), [g.meta for g in taken for _ in g.trajs]

    # ---- the loop --------------------------------------------------------------------------------
    def _play(self, version: int, seed: int, until: Callable[[], bool],
              refill: Callable[[], Any] | None = None) -> None:
        self.stats, self._version = MultiTurnStats(), version
        self._age_out()
        calls, prefill = 0, (getattr(self.stream, "prompt_tokens", 0), getattr(self.stream, "cached_tokens", 0))
        while not until():
            if not self.in_flight and refill is not None:
                refill()
            if not self.in_flight:
                break
            turns = self.stream.in_flight + len(self.stream.book.ready)  # decoding, or decoded and not taken
            if not (turns or self.pool.in_flight):  # each open trajectory waits on one or the other
                raise RuntimeError(f"multi-turn rollout stalled: {self.in_flight} trajectories open, no turn "
                                   "decoding and no environment call in flight")
            t0 = time.time()
            self._collect(self.pool.ready(wait_s=0.0 if turns else 0.02))
            if not turns:
                self._waited(t0, time.time())
            if self.stream.in_flight or self.stream.book.ready:
                out = self.stream.run(max(1, len(self.stream.book.ready)), version=self._version,
                                      seed=seed * 100_003 + calls, refresh=self._poll)
                calls += 1
                self._turns_done(out)
                self._iterations += out.counts.iterations
                if self._iterations >= self._pulled + self.stream.refresh_every:  # short turns: the stream's
                    self._pull()  # own poll may never come within one call
        self.stats.prompt_tokens = getattr(self.stream, "prompt_tokens", 0) - prefill[0]
        self.stats.cached_tokens = getattr(self.stream, "cached_tokens", 0) - prefill[1]

    def _waited(self, start: float, end: float) -> None:
        w = self.stats.waits
        if w and start - w[-1][1] < 1e-3:  # one wait, polled in slices
            w[-1] = (w[-1][0], end)
        else:
            w.append((start, end))

    def _poll(self) -> int:
        """Between decode iterations: take the environment answers that arrived (their next turns join),
        and pull the policy (partial rollouts)."""
        self._collect(self.pool.ready(wait_s=0.0))
        return self._pull()

    def _pull(self) -> int:
        """With partial rollouts: the newest policy's version (`refresh()`), and what it makes too stale aged out."""
        self._pulled = self._iterations
        if self._refresh is not None:
            version = self._refresh()
            if version != self._version:
                self._version = version
                self._age_out()
        return self._version

    def _turns_done(self, out: Any) -> None:
        c = out.columns
        for i, key in enumerate(out.prompts):
            t = self._by_key.get(key)
            if t is None:  # its trajectory was dropped or restarted meanwhile
                continue
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
            t = self._by_key.get(a.key)
            if t is None:  # dropped or restarted meanwhile
                continue
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
                self._finish(t)
                continue
            ctx = torch.cat([t.prompt, torch.tensor(t.tokens, dtype=torch.long)])
            self.stream.add(ctx[None], torch.ones_like(ctx)[None], metas=[t.key], budgets=[budget])
            t.turn_start = time.perf_counter()

    # ---- trajectories in and out -----------------------------------------------------------------
    def _start(self, g: TrajectoryGroup, t: Trajectory) -> Trajectory:
        """(Re)start `t` under a fresh key: its environment resets; answers for an old key are ignored."""
        t.key, self._keys = f"t{self._keys}", self._keys + 1
        self._by_key[t.key], self._group[t.key] = t, g
        self.pool.reset(t.key, g.row)
        return t

    def _finish(self, t: Trajectory) -> None:
        t.done = True
        self._forget(t)
        g = self._group.pop(t.key)
        if g.done:
            self.open.remove(g)
            self.ready.append(g)

    def _forget(self, t: Trajectory) -> None:
        self._by_key.pop(t.key, None)
        self.pool.close(t.key)

    def _age_out(self) -> None:
        """Prompt groups with a model token too old to train (`StaleRule`): dropped, or their stale
        trajectories restarted from the prompt."""
        rule = self._stale
        if rule is None:
            return
        trains_at = max(self._version, rule.trains_by if rule.trains_by is not None else self._version)
        for g in [*self.ready, *self.open]:
            stale = [t for t in g.trajs if any(l for l in t.loss)
                     and trains_at - min(v for v, l in zip(t.versions, t.loss) if l) > rule.max_staleness]
            if not stale:
                continue
            if rule.on_stale == "drop":
                for t in g.trajs:
                    if not t.done:
                        self._group.pop(t.key, None)
                    self._forget(t)
                (self.ready if g in self.ready else self.open).remove(g)
                self.stats.stale_dropped += sum(bool(t.tokens) for t in g.trajs)
                continue
            if g in self.ready:
                self.ready.remove(g)
                self.open.append(g)
            for t in stale:
                if not t.done:
                    self._group.pop(t.key, None)
                self._forget(t)
                fresh = Trajectory("", t.prompt)
                g.trajs[g.trajs.index(t)] = self._start(g, fresh)
                self.stats.stale_regenerated += 1

    def _columns(self, groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
        trajs = [t for g in groups for t in g.trajs]
        B, R, pad = len(trajs), self.R, self.stream.pad_id
        P = max((len(g.prompt_ids) for g in groups), default=1)
        prompts = torch.full((B, P), pad, dtype=torch.long)
        pmask = torch.zeros((B, P), dtype=torch.long)
        responses = torch.full((B, R), pad, dtype=torch.long)
        response_mask = torch.zeros((B, R), dtype=torch.long)
        loss_mask = torch.zeros((B, R), dtype=torch.long)
        logps = torch.zeros((B, R), dtype=torch.float32)
        versions = torch.zeros((B, R), dtype=torch.int64)
        rows = [(g, t) for g in groups for t in g.trajs]
        for i, (g, t) in enumerate(rows):
            w, L = len(g.prompt_ids), len(t.tokens)
            prompts[i, P - w:], pmask[i, P - w:] = g.prompt_ids, g.prompt_mask  # left-padded to the widest
            responses[i, :L], response_mask[i, :L] = torch.tensor(t.tokens, dtype=torch.long), 1
            loss_mask[i, :L] = torch.tensor(t.loss, dtype=torch.long)
            logps[i, :L], versions[i, :L] = torch.tensor(t.logps), torch.tensor(t.versions, dtype=torch.int64)
        cols = assemble_columns(prompts, pmask, responses, response_mask)
        model = loss_mask.bool()
        cols.update(loss_mask=loss_mask, rollout_log_probs=logps, token_versions=versions,
                    version=torch.where(model, versions, 1 << 40).min(1).values.clamp(max=self._version),
                    env_reward=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                    turns=torch.tensor([t.turns for t in trajs], dtype=torch.int64),
                    gen_s=torch.tensor([t.gen_s for t in trajs], dtype=torch.float32),
                    env_s=torch.tensor([t.env_s for t in trajs], dtype=torch.float32))
        self.stats.trajectories = B
        self.stats.partial = sum(len({v for v, l in zip(t.versions, t.loss) if l}) > 1 for t in trajs)
        return cols
