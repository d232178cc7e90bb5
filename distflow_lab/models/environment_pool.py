"""Environments on a pool of Ray actors, sized apart from the DAG workers.

A trajectory (a key) lives on one actor, chosen round-robin at reset. Calls return at
once; `ready(wait_s)` gathers the answers that have arrived, so a rollout keeps decoding
other sequences while tools run. Every answer is checked (`environment.check_step`); an
environment that raises, dies, answers malformed data or runs past `timeout_s` becomes an
`EnvError` naming the environment, the turn and the trajectory: no raw Ray error reaches
the user, and the pool counts every call it started and answered.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from distflow_lab.core.errors import EnvError
from distflow_lab.models.environment import (EnvOptions, EnvStep, check_observation, check_step, env_label, make_env,
                                             parse_options)


START_TIMEOUT_S = 120.0  # an environment actor's start (imports, the environment's own set-up)


@ray.remote(max_restarts=0)
class EnvActor:
    """Many trajectories of one environment class, one instance each."""

    def __init__(self, env: Any, options: EnvOptions, tokenizer: Any) -> None:
        self.env, self.options, self.tok = env, options, tokenizer
        self.envs: dict[Hashable, Any] = {}

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> list[int]:
        self.envs[key] = make_env(self.env, self.tok, self.options)
        return self.envs[key].reset(row)

    def step(self, key: Hashable, tokens: list[int]) -> EnvStep:
        return self.envs[key].step(tokens)

    def close(self, key: Hashable) -> None:
        self.envs.pop(key, None)


@dataclass(frozen=True)
class Answer:
    """An arrived answer: the reset's observation (EnvStep with reward 0, not done) or a step's."""

    key: Hashable
    turn: int  # 0: the reset
    step: EnvStep
    seconds: float  # from the call to its answer being collected


@dataclass
class _Call:
    key: Hashable
    turn: int
    started: float


class EnvPool:
    """`size` actors of environment `env` (a registered name or a class) with `options`;
    `num_cpus` each (0: they share the DAG workers' cores without reserving them). Each actor
    serves `concurrency` calls at once, on threads: the trajectories' environments are separate
    instances, and tools that sleep or wait on I/O overlap (1: one call at a time)."""

    def __init__(self, env: str | type, tokenizer: Any, options: Mapping[str, Any] | None = None, *, size: int = 2,
                 timeout_s: float = 30.0, num_cpus: float = 0.0, concurrency: int = 1) -> None:
        if size < 1 or timeout_s <= 0 or concurrency < 1:
            raise ValueError(f"EnvPool needs size >= 1, timeout_s > 0 and concurrency >= 1; got size={size}, "
                             f"timeout_s={timeout_s}, concurrency={concurrency}")
        self.name, self.timeout_s = env_label(env), timeout_s
        self.vocab_size = len(tokenizer)
        opts = parse_options(env, options)  # a bad option fails here, before any actor starts
        self.actors = [EnvActor.options(num_cpus=num_cpus, max_concurrency=concurrency).remote(env, opts, tokenizer)
                       for _ in range(size)]
        try:  # started before the first call, so a call's timeout never pays for an actor's start
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except (RayActorError, GetTimeoutError, RayTaskError) as e:
            self.shutdown()
            raise EnvError(f"its actors did not start within {START_TIMEOUT_S:g} s ({type(e).__name__})",
                           env=self.name, turn=0) from None
        self._next = itertools.cycle(range(size))
        self._home: dict[Hashable, int] = {}
        self._pending: dict[ray.ObjectRef, _Call] = {}
        self.started = self.answered = 0

    # ---- calls ---------------------------------------------------------------------------------
    def reset(self, key: Hashable, row: Mapping[str, Any]) -> None:
        """Start trajectory `key` for a dataset row; its first observation arrives through ready()."""
        self._home[key] = i = next(self._next)
        self._start(self.actors[i].reset.remote(key, dict(row)), key, 0)

    def step(self, key: Hashable, tokens: list[int], turn: int) -> None:
        """Send the model's turn `turn` (1, 2, ...) of trajectory `key`."""
        if key not in self._home:
            raise KeyError(f"trajectory {key!r} was never reset")
        self._start(self.actors[self._home[key]].step.remote(key, [int(t) for t in tokens]), key, turn)

    def close(self, key: Hashable) -> None:
        """Forget a finished trajectory (its environment instance is dropped)."""
        if (i := self._home.pop(key, None)) is not None:
            self.actors[i].close.remote(key)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def ready(self, wait_s: float = 0.0) -> list[Answer]:
        """The answers arrived within `wait_s` seconds (all in flight are waited on together);
        raises EnvError for a call that failed or is older than timeout_s."""
        if not self._pending:
            return []
        refs = list(self._pending)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s, fetch_local=True)
        out = [self._collect(ref) for ref in done]
        now = time.perf_counter()
        for ref, call in list(self._pending.items()):
            if now - call.started > self.timeout_s:
                ray.cancel(ref, force=False)
                raise self._error(call, f"did not answer within {self.timeout_s:g} s (pool timeout_s)")
        return out

    def call(self, key: Hashable, tokens: list[int] | None = None, turn: int = 0,
             row: Mapping[str, Any] | None = None) -> Answer:
        """One blocking call (a reset when `row` is given, else a step), for notebooks and tests."""
        if self._pending:
            raise RuntimeError("EnvPool.call waits for its own answer only: other calls are in flight")
        self.reset(key, row) if row is not None else self.step(key, tokens or [], turn)
        deadline = time.perf_counter() + self.timeout_s + 1
        while time.perf_counter() < deadline:
            if got := self.ready(wait_s=0.05):
                return got[0]
        raise self._error(_Call(key, turn, 0.0), f"did not answer within {self.timeout_s:g} s (pool timeout_s)")

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors, self._pending = [], {}

    def __repr__(self) -> str:
        return (f"EnvPool({self.name!r}, actors={len(self.actors)}, in_flight={self.in_flight}, "
                f"started={self.started}, answered={self.answered})")

    def _repr_html_(self) -> str:
        return (f"<b>EnvPool</b> <code>{self.name}</code>: {len(self.actors)} actors, timeout {self.timeout_s:g} s; "
                f"calls started {self.started}, answered {self.answered}, in flight {self.in_flight}")

    # ---- internals --------------------------------------------------------------------------------
    def _start(self, ref: ray.ObjectRef, key: Hashable, turn: int) -> None:
        self._pending[ref] = _Call(key, turn, time.perf_counter())
        self.started += 1

    def _collect(self, ref: ray.ObjectRef) -> Answer:
        call = self._pending.pop(ref)
        try:
            got = ray.get(ref, timeout=self.timeout_s)
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise self._error(call, f"raised {type(cause).__name__}: {cause}") from None
        except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
            raise self._error(call, f"its actor died ({type(e).__name__})") from None
        except GetTimeoutError:
            raise self._error(call, f"did not answer within {self.timeout_s:g} s (pool timeout_s)") from None
        try:
            step = (EnvStep(check_observation(got, self.name, 0, self.vocab_size), 0.0, False) if call.turn == 0
                    else check_step(got, self.name, call.turn, self.vocab_size))
        except EnvError as e:
            raise self._error(call, e.reason) from None
        self.answered += 1
        return Answer(call.key, call.turn, step, time.perf_counter() - call.started)

    def _error(self, call: _Call, reason: str) -> EnvError:
        return EnvError(reason, env=self.name, turn=call.turn, trajectory=str(call.key))
