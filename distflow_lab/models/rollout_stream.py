"""Streaming decode on the HF model object: continuous batching with partial rollouts.

`HFStreamingRollout` decodes up to `slots` sequences together, one token each per
iteration, with one KV cache (a transformers `DynamicCache`) kept across iterations
and across calls:

    admit     waiting sequences fill free slots: their prompts are prefilled on their own
              and their cache rows are merged into the running cache (left-padded to the
              longer of the two, concatenated on the batch dim); attention is an explicit
              2-D mask and every row carries explicit position ids, so padding moves nothing
    decode    one forward of the last sampled token of every active row
    retire    rows that sampled eos or reached R leave (the cache rows are indexed out and
              leading columns no row uses are cut)
    refresh   every `refresh_every` iterations the caller's `refresh()` may load new
              weights into the same module in place and returns the policy version

A call returns when `groups` prompts have all n of their sequences finished (GRPO's
baseline needs whole groups); sequences still decoding stay, paused, for the next call
(nothing decodes between calls). Each token carries the version current when its logits
were computed, and its behaviour log-prob: log_softmax(logits / temperature) of the
untruncated distribution, as `HFRollout` reports it and the trainer recomputes it. The
rows always include `rollout_log_probs`: with tokens from several policies the trainer
cannot recompute the behaviour policy, so off-policy corrections need them.

Weight updates in flight (APRIL's partial rollouts): by default a sequence keeps the
KV cache its prefix built under the old weights, and the new weights attend over it:
the behaviour policy of a token after the switch is "new weights on an old-weights
prefix cache", and its recorded log-prob is exactly that. `recompute_kv_on_update`
rebuilds the active rows' cache with the new weights (one prefill of prompt + tokens so
far) on every version change, so each token after the switch is sampled from the new
policy proper, at the cost of that prefill.

Staleness: a sequence whose oldest token would be more than `max_staleness` versions
old when its batch trains (`StaleRule`) is dropped or regenerated. Dropping loses the
whole prompt (all n sequences: a partial group has no baseline); regenerating puts that
one sequence back at the head of the queue, from its first token.

The output depends only on the inputs, the calls' seeds and the versions seen: sampling
draws from a `torch.Generator` seeded per call; the global RNG is not touched.

The bookkeeping that does not depend on the engine (waiting and finished sequences, ageing
out, the output columns) is `SequenceBook` and `stream_batch`, shared with vLLM's streamer
(rollout_vllm_stream.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.sequences import assemble_columns, response_mask_from_eos
from distflow_lab.models.stream_slots import top_up


@dataclass(frozen=True)
class StaleRule:
    """When a sequence is too old to train: its oldest token's version v is stale once
    max(current, trains_by) - v > max_staleness."""

    max_staleness: int
    trains_by: int | None = None  # the latest update the batch trains at (None: the current version)
    on_stale: Literal["drop", "regenerate"] = "drop"


@dataclass
class StreamCounts:
    """What one call did besides returning rows."""

    partial: int = 0  # returned sequences whose tokens span more than one policy version
    stale_dropped: int = 0  # sequences discarded (all of a dropped prompt's started or finished ones)
    stale_regenerated: int = 0  # sequences sent back to start again
    iterations: int = 0  # decode iterations run
    refreshes: int = 0  # refresh() calls that brought a new version
    resumed: int = 0  # sequences in flight (started, unfinished) when the weights changed: they go on


@dataclass
class StreamBatch:
    """A call's rows: verl columns (+ rollout_log_probs, token_versions, version) and, per row,
    the caller's object of the prompt it came from (n consecutive rows per prompt)."""

    columns: dict[str, torch.Tensor]
    prompts: list[Any]
    counts: StreamCounts


@dataclass(eq=False)
class _Group:
    """One prompt and its n sequences."""

    meta: Any  # the caller's object for this prompt, handed back with its rows
    prompt_ids: torch.Tensor  # [P] left-padded, as given
    prompt_mask: torch.Tensor  # [P]
    seqs: list["_Seq"] = field(default_factory=list)
    budget: int | None = None  # most tokens per sequence (None: max_response_len)

    @property
    def prompt(self) -> torch.Tensor:
        return self.prompt_ids[self.prompt_mask.bool()]

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.seqs)


@dataclass(eq=False)
class _Seq:
    group: _Group
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False

    def restart(self) -> None:
        self.tokens, self.logps, self.versions, self.done = [], [], [], False


class SequenceBook:
    """The sequences a streaming engine holds between calls, besides its running ones: `waiting`
    to start and `ready` prompts (all n finished) not yet returned, oldest first. Ageing out
    removes sequences; `evict(seqs)` takes the running ones out of the engine."""

    def __init__(self, n: int, evict: Callable[[set[_Seq]], None]):
        self.n, self.evict = n, evict
        self.waiting: deque[_Seq] = deque()
        self.ready: list[_Group] = []

    def add(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metas: Sequence[Any],
            budgets: Sequence[int] | None = None) -> None:
        """Queue prompts (left-padded [B, P]), n sequences each; `metas[i]` comes back with prompt i's rows;
        `budgets[i]`: prompt i's most tokens per sequence (default max_response_len)."""
        if len(metas) != len(prompt_ids) or prompt_ids.shape != prompt_mask.shape:
            raise ValueError(f"add: {len(prompt_ids)} prompts, mask {tuple(prompt_mask.shape)}, {len(metas)} metas")
        budgets = list(budgets) if budgets is not None else [None] * len(metas)
        for ids, mask, meta, budget in zip(prompt_ids.long().cpu(), prompt_mask.long().cpu(), metas, budgets):
            g = _Group(meta, ids, mask, budget=budget)
            g.seqs = [_Seq(g) for _ in range(self.n)]
            self.waiting.extend(g.seqs)

    def finish(self, s: _Seq) -> None:
        s.done = True
        if s.group.finished:
            self.ready.append(s.group)

    def take(self, groups: int) -> list[_Group]:
        out, self.ready = self.ready[:groups], self.ready[groups:]
        return out

    def age_out(self, rule: StaleRule, version: int, running: Sequence[_Seq], counts: StreamCounts) -> None:
        """Drop or regenerate the sequences, started and not yet returned, that `rule` finds stale."""
        trains_at = max(version, rule.trains_by if rule.trains_by is not None else version)
        held = dict.fromkeys([*self.ready, *(s.group for s in running), *(s.group for s in self.waiting)])
        for g in held:
            stale = [s for s in g.seqs if s.versions and trains_at - s.versions[0] > rule.max_staleness]
            if stale and rule.on_stale == "drop":
                counts.stale_dropped += self._drop(g)
                continue
            for s in stale:
                self._restart(s)
                counts.stale_regenerated += 1

    def _restart(self, s: _Seq) -> None:
        """`s` starts again from its first token, at the head of the queue."""
        if s.group in self.ready:
            self.ready.remove(s.group)
        self.evict({s})
        s.restart()
        self.waiting.appendleft(s)

    def _drop(self, g: _Group) -> int:
        """Forget the prompt and all its sequences; returns how many had started."""
        if g in self.ready:
            self.ready.remove(g)
        self.evict(set(g.seqs))
        self.waiting = deque(s for s in self.waiting if s.group is not g)
        return sum(bool(s.tokens) for s in g.seqs)


class HFStreamingRollout:
    """Continuous batching over `model` (see the module doc). Holds sequences between calls:
    one instance per rollout worker, reused every step."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions,
                 max_prompt_len: int, slots: int, refresh_every: int = 8, recompute_kv_on_update: bool = False,
                 stop_ids: Sequence[int] = ()):
        if slots < 1 or refresh_every < 1:
            raise ValueError(f"HFStreamingRollout needs slots >= 1 and refresh_every >= 1; got slots={slots}, "
                             f"refresh_every={refresh_every}")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("tokenizer needs both an eos and a pad token")
        self.model, self.cfg, self.max_prompt_len = model, opts, max_prompt_len
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.stops = {self.eos_id, *stop_ids}  # a sampled stop token ends the sequence (multi-turn: a turn)
        self.slots, self.refresh_every, self.recompute_kv_on_update = slots, refresh_every, recompute_kv_on_update
        self.warpers = _warpers(opts)
        self.version: int | None = None  # the weights' version as of the last call or refresh
        self.book = SequenceBook(opts.n, self._evict)  # waiting and ready sequences
        self.active: list[_Seq] = []  # aligned with the cache's batch rows
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [active, T]: 1 where the cache holds a real token

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def in_flight(self) -> int:
        """Sequences admitted or waiting that a later call may return."""
        return len(self.book.waiting) + len(self.active)

    def add(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metas: Sequence[Any],
            budgets: Sequence[int] | None = None) -> None:
        """Queue prompts (left-padded [B, P]), n sequences each; `metas[i]` comes back with prompt i's rows."""
        self.book.add(prompt_ids, prompt_mask, metas, budgets)

    @torch.no_grad()
    def run(self, groups: int, version: int, seed: int, refresh: Callable[[], int] | None = None,
            stale: StaleRule | None = None, refill: Callable[[], Any] | None = None) -> StreamBatch:
        """Decode until `groups` prompts have finished; return them, oldest first. `version` is the
        weights' version now (they may have changed since the last call). When nothing is left to decode
        (ageing out may drop prompts), `refill()` may `add` more; without it the call returns fewer."""
        counts, gen = StreamCounts(), torch.Generator(self.device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            self._new_version(version, stale, counts)
            decode_until(self, groups, lambda: self._iterate(gen), refresh, stale, refill, counts)
        finally:
            self.model.train(was_training)
        return stream_batch(self.book.take(groups), counts, self.cfg.max_response_len, self.eos_id, self.pad_id,
                            self.max_prompt_len)

    # ---- one iteration ------------------------------------------------------------------
    def _iterate(self, gen: torch.Generator) -> None:
        """One token for every active row (decode) and for every joiner (prefill), then retire."""
        if self.active:
            logits = self._decode()
            self._sample(self.active, logits, gen)
        w = self.book.waiting
        joiners = [w.popleft() for _ in range(min(self.slots - len(self.active), len(w)))]
        if joiners:
            cache, mask, logits = self._prefill([s.group.prompt for s in joiners])
            self._sample(joiners, logits, gen)
            self._join(joiners, cache, mask)
        self._retire()

    def _decode(self) -> torch.Tensor:
        ids = torch.tensor([[s.tokens[-1]] for s in self.active], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, self._mask.new_ones((len(self.active), 1))], dim=1)
        positions = self._mask.sum(1, keepdim=True)  # real tokens before this one
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._mask = mask
        return out.logits[:, -1].float()

    def _prefill(self, seqs: list[torch.Tensor]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Left-padded forward of these token rows into a fresh cache: (cache, mask [b, L], last logits)."""
        L = max(len(t) for t in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, t in enumerate(seqs):
            ids[i, L - len(t):], mask[i, L - len(t):] = t, 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        _check_layers(cache)
        return cache, mask, out.logits[:, -1].float()

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, gen: torch.Generator) -> None:
        c = self.cfg
        if c.do_sample:
            scaled = logits / c.temperature if c.temperature != 1.0 else logits
            probs = torch.softmax(self.warpers(None, logits), dim=-1)  # HF's warpers: generate's distribution
            tokens = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        else:
            scaled, tokens = logits, logits.argmax(-1)
        logps = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(1)
        for s, t, lp in zip(seqs, tokens.tolist(), logps.tolist()):
            s.tokens.append(t)
            s.logps.append(lp)
            s.versions.append(self.version)

    # ---- the cache: rows join, rows leave ---------------------------------------------------
    def _join(self, joiners: list[_Seq], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append the joiners' cache rows below the active ones, both left-padded to the longer."""
        if self._cache is None or not self.active:
            self._cache, self._mask, self.active = cache, mask, list(joiners)
            return
        T = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, T, 2), _left_pad(theirs.keys, T, 2)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, T, 2), _left_pad(theirs.values, T, 2)], dim=0)
        self._mask = torch.cat([_left_pad(self._mask, T, 1), _left_pad(mask, T, 1)], dim=0)
        self.active += joiners

    def _keep(self, rows: list[int]) -> None:
        """Only these active rows stay in the cache; columns no row uses any more are cut."""
        if not rows:
            self._cache, self._mask, self.active = None, None, []
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self._mask[idx]
        first = int(mask.any(0).long().argmax())  # the leftmost column any row still attends to
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]
        self._mask, self.active = mask[:, first:], [self.active[i] for i in rows]

    def _retire(self) -> None:
        R = self.cfg.max_response_len
        keep = []
        for i, s in enumerate(self.active):
            if s.tokens[-1] in self.stops or len(s.tokens) >= (s.group.budget or R):
                self.book.finish(s)
            else:
                keep.append(i)
        if len(keep) < len(self.active):
            self._keep(keep)

    # ---- versions and staleness --------------------------------------------------------------
    def _new_version(self, version: int, stale: StaleRule | None, counts: StreamCounts) -> None:
        changed = self.version is not None and version != self.version
        self.version = version
        if stale is not None:
            self.book.age_out(stale, version, self.active, counts)
        if changed:
            counts.resumed += sum(bool(s.tokens) for s in self.active)
        if changed and self.recompute_kv_on_update and self.active:
            self._recompute_cache()

    def _recompute_cache(self) -> None:
        """The active rows' cache again, under the current weights: prompt + every token but the last
        (the last is the next decode's input)."""
        rows = [torch.cat([s.group.prompt, torch.tensor(s.tokens[:-1], dtype=torch.long)]) for s in self.active]
        self._cache, self._mask, _ = self._prefill(rows)

    def _evict(self, seqs: set[_Seq]) -> None:
        if any(s in seqs for s in self.active):
            self._keep([i for i, s in enumerate(self.active) if s not in seqs])

def decode_until(engine: Any, groups: int, iterate: Callable[[], None], refresh: Callable[[], int] | None,
                 stale: StaleRule | None, refill: Callable[[], Any] | None, counts: StreamCounts) -> None:
    """The streaming engines' loop: first `refill()` tops the engine up to its slots (the call has
    aged out what it will never train, so those sequences hold no slot), then one decode
    iteration at a time until `groups` prompts are ready; when nothing is in flight `refill()`
    may add prompts; every `engine.refresh_every` iterations `refresh()` may bring a new version
    (`engine._new_version` ages sequences out)."""
    top_up(lambda: engine.in_flight, engine.slots, refill)
    while len(engine.book.ready) < groups:
        if not engine.in_flight and refill is not None:
            refill()
        if not engine.in_flight:
            break
        iterate()
        counts.iterations += 1
        if refresh is not None and counts.iterations % engine.refresh_every == 0:
            before = engine.version
            engine._new_version(refresh(), stale, counts)
            counts.refreshes += int(engine.version != before)


def stream_batch(groups: list[_Group], counts: StreamCounts, max_response_len: int, eos_id: int, pad_id: int,
                 max_prompt_len: int) -> StreamBatch:
    """The rows of finished prompts (n per prompt, in order): verl's columns, the behaviour
    log-probs, every token's version, and each row's oldest version; `counts.partial` is set."""
    seqs = [s for g in groups for s in g.seqs]
    R, B = max_response_len, len(seqs)
    responses = torch.full((B, R), pad_id, dtype=torch.long)
    valid = torch.zeros((B, R), dtype=torch.bool)
    logps = torch.zeros((B, R), dtype=torch.float32)
    versions = torch.zeros((B, R), dtype=torch.int64)
    for i, s in enumerate(seqs):
        L = len(s.tokens)
        responses[i, :L], valid[i, :L] = torch.tensor(s.tokens), True
        logps[i, :L], versions[i, :L] = torch.tensor(s.logps), torch.tensor(s.versions)
    response_mask = response_mask_from_eos(responses, eos_id, valid)
    responses = torch.where(response_mask.bool(), responses, pad_id)
    P = max((len(s.group.prompt_ids) for s in seqs), default=max_prompt_len)  # groups may differ (multi-turn)
    prompts = torch.full((B, P), pad_id, dtype=torch.long)
    pmask = torch.zeros((B, P), dtype=torch.long)
    for i, s in enumerate(seqs):  # left-padded to the widest
        w = len(s.group.prompt_ids)
        prompts[i, P - w:], pmask[i, P - w:] = s.group.prompt_ids, s.group.prompt_mask
    cols = assemble_columns(prompts, pmask, responses, response_mask)
    cols["rollout_log_probs"] = logps * response_mask
    cols["token_versions"] = versions * response_mask
    cols["version"] = torch.tensor([s.versions[0] for s in seqs], dtype=torch.int64)  # the oldest token's
    counts.partial = sum(len(set(s.versions)) > 1 for s in seqs)
    return StreamBatch(cols, [s.group.meta for s in seqs], counts)


def _warpers(c: RolloutOptions) -> LogitsProcessorList:
    """generate's sampling warpers for these options, in its order (temperature, top-k, top-p)."""
    out = LogitsProcessorList()
    if c.do_sample and c.temperature != 1.0:
        out.append(TemperatureLogitsWarper(c.temperature))
    if c.do_sample and c.top_k:
        out.append(TopKLogitsWarper(c.top_k))
    if c.do_sample and c.top_p < 1.0:
        out.append(TopPLogitsWarper(c.top_p))
    return out


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zeros before `t` along `dim` up to `length` (zero keys/values under a 0 mask are never attended)."""
    short = length - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _check_layers(cache: DynamicCache) -> None:
    """Rows are merged and cut by editing each layer's key/value tensors: full-attention dynamic layers only."""
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
            raise NotImplementedError(f"HFStreamingRollout: cache layer {i} is a {type(layer).__name__}; only full "
                                      "attention (DynamicLayer) caches can be merged row-wise")
