"""Partial rollouts on vLLM: `HFStreamingRollout`'s contract (rollout_stream.py) over the
engine's own step loop.

Each sequence is one vLLM request (n=1, seeded, DELTA outputs: each `step()` hands back
the tokens and log-probs new since the last). At most `slots` requests are in the engine;
a finished one makes room for the next waiting sequence (vLLM batches them
continuously). A call steps until `groups` prompts have all n sequences finished and
returns them; unfinished requests stay in the engine, paused, until the next call.

Weight updates in flight use the engine's own pause and resume: `VLLMRollout.load_weights`
resets the prefix cache with `reset_running_requests=True`, which preempts every running
request (vllm/v1/core/sched/scheduler.py). A preempted request keeps its tokens and its
seeded generator, and when it is scheduled again vLLM recomputes its KV (prompt + tokens
so far) under the new weights. So each token after the switch is sampled from the new
policy proper (HFStreamingRollout's `recompute_kv_on_update=True`), and its log-prob is the
new policy's. The streamer counts those sequences (`counts.resumed`).

Every token carries the version current when it was sampled; ageing out (`StaleRule`)
aborts the requests of dropped or regenerated sequences. Sampling is seeded per request
from the call's seed; the global RNG is not moved (`kept_rng_state`).

Only `rollout.tp=1`: the ranks of a tensor-parallel group would each pull weights on their
own and could resume at different versions (config.check_partial_rollout refuses it).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from distflow_lab.models.rollout_stream import (SequenceBook, StaleRule, StreamBatch, StreamCounts, _Seq, decode_until,
                                                stream_batch)
from distflow_lab.models.rollout_vllm import ROW_SEEDS, VLLMRollout, kept_rng_state


class VLLMStreamingRollout:
    """Continuous batching with partial rollouts on a `VLLMRollout`'s engine (see the module doc).
    One per rollout worker, reused every step; the rollout's `load_weights` preempts its requests."""

    def __init__(self, rollout: VLLMRollout, max_prompt_len: int, slots: int, refresh_every: int = 8,
                 n: int | None = None, stop_ids: Sequence[int] = ()):
        if slots < 1 or refresh_every < 1:
            raise ValueError(f"VLLMStreamingRollout needs slots >= 1 and refresh_every >= 1; got slots={slots}, "
                             f"refresh_every={refresh_every}")
        self.rollout, self.max_prompt_len = rollout, max_prompt_len
        self.cfg = rollout.cfg if n is None else rollout.cfg.model_copy(update={"n": n})  # multi-turn: n=1 per turn
        self.engine = rollout.llm.llm_engine
        self.slots, self.refresh_every = slots, refresh_every
        self.stop_ids = [rollout.eos_id, *stop_ids]  # a sampled stop token ends the sequence (multi-turn: a turn)
        self.version: int | None = None
        self.book = SequenceBook(self.cfg.n, self._evict)
        self.running: dict[str, _Seq] = {}  # request id -> its sequence, in submission order
        self._submitted = 0  # request ids and seeds: one per submission, in order
        self.prompt_tokens = self.cached_tokens = 0  # over every request: prefill work, and what the prefix cache held

    @property
    def in_flight(self) -> int:
        return len(self.book.waiting) + len(self.running)

    @property
    def pad_id(self) -> int:
        return self.rollout.pad_id

    def add(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metas: Sequence[Any],
            budgets: Sequence[int] | None = None) -> None:
        self.book.add(prompt_ids, prompt_mask, metas, budgets)

    @torch.no_grad()
    def run(self, groups: int, version: int, seed: int, refresh: Callable[[], int] | None = None,
            stale: StaleRule | None = None, refill: Callable[[], Any] | None = None) -> StreamBatch:
        """HFStreamingRollout.run's contract: decode until `groups` prompts finished; return them."""
        if self.rollout.needs_weights:
            raise RuntimeError("vLLM's weights were discarded or partly synced: load_weights first")
        counts = StreamCounts()
        with kept_rng_state():  # seeded requests draw from torch's global generator
            self._new_version(version, stale, counts)
            decode_until(self, groups, lambda: self._step(seed), refresh, stale, refill, counts)
        return stream_batch(self.book.take(groups), counts, self.cfg.max_response_len, self.rollout.eos_id,
                            self.rollout.pad_id, self.max_prompt_len)

    def _step(self, seed: int) -> None:
        """Fill the free slots, then one engine step: every running request's next token."""
        self._submit(seed)
        for out in self.engine.step():
            self._take(out)

    def _submit(self, seed: int) -> None:
        """Waiting sequences into the engine while it has fewer than `slots` requests."""
        from vllm.sampling_params import RequestOutputKind  # lazy: vLLM is there if a VLLMRollout is

        base = (seed % (1 << 32)) * ROW_SEEDS
        while self.book.waiting and len(self.running) < self.slots:
            s = self.book.waiting.popleft()
            rid = f"stream-{self._submitted}"
            params = self.rollout.request_params(base + self._submitted % ROW_SEEDS, n=1, logprobs=0,
                                                 output_kind=RequestOutputKind.DELTA, stop_token_ids=self.stop_ids,
                                                 max_tokens=s.group.budget or self.cfg.max_response_len)
            prompt = s.group.prompt.tolist()
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            self.prompt_tokens += len(prompt)
            self.running[rid] = s
            self._submitted += 1

    def _take(self, out: Any) -> None:
        """A step's new tokens of one request, each stamped with the version that sampled it."""
        s = self.running.get(out.request_id)
        if s is None:  # aborted by ageing out this step
            return
        (c,) = out.outputs
        if not s.tokens and out.num_cached_tokens:  # the first output: how much of the prompt the prefix cache had
            self.cached_tokens += out.num_cached_tokens
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) < len(ids):
            raise RuntimeError(f"vLLM returned no log-prob for a token of request {out.request_id}: partial rollouts "
                               "need the behaviour log-probs")
        for t, pos in zip(ids, c.logprobs):
            s.tokens.append(t)
            s.logps.append(pos[t].logprob)
            s.versions.append(self.version)
        if out.finished:
            del self.running[out.request_id]
            self.book.finish(s)

    def _new_version(self, version: int, stale: StaleRule | None, counts: StreamCounts) -> None:
        if self.version is not None and version != self.version:  # load_weights preempted them: they resume
            counts.resumed += sum(bool(s.tokens) for s in self.running.values())
        self.version = version
        if stale is not None:
            self.book.age_out(stale, version, list(self.running.values()), counts)

    def _evict(self, seqs: set[_Seq]) -> None:
        gone = [rid for rid, s in self.running.items() if s in seqs]
        if gone:
            self.engine.abort_request(gone)
            for rid in gone:
                del self.running[rid]
