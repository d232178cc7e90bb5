"""Environments for multi-turn rollouts: the typed contract, the registry, and the checks
every answer passes before a rollout uses it.

An environment plays one trajectory. The rollout calls

    reset(row)       -> the first observation's token ids (may be empty: the prompt is the row's)
    step(tokens)     -> EnvStep(observation, reward, done, info) for the model's turn `tokens`

Observation tokens are appended to the context and carry no loss; the model's tokens do.
An environment is a class with a nested pydantic `Options` model (unknown keys are errors)
and a constructor `(tokenizer, options)`; `@register_env("name")` makes it configurable by
name. A class defined in a notebook works too: pass the class itself (Ray ships it to the
environment actors by value).

Latency: `Latency` draws a tool delay per call from a lognormal (median, sigma; zero by
default), so a researcher can study tail effects without a real sandbox; the built-in
environments sleep it inside `step`.
"""
from __future__ import annotations

import importlib
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol

from pydantic import BaseModel, ConfigDict, Field

from distflow_lab.core.errors import ConfigError, EnvError
from distflow_lab.core.registry import typed_options


class EnvOptions(BaseModel):
    """Base of every environment's `Options`: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Latency(EnvOptions):
    """A tool's delay per call: lognormal with this median (ms) and log-sd; 0 ms = none."""

    median_ms: float = Field(default=0.0, ge=0)
    sigma: float = Field(default=0.0, ge=0)

    def draw(self, rng: random.Random) -> float:
        """Seconds for one call."""
        if self.median_ms == 0:
            return 0.0
        return self.median_ms * 1e-3 * math.exp(rng.gauss(0.0, self.sigma) if self.sigma else 0.0)


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model turn."""

    observation: list[int]  # token ids appended after the model's turn (no loss)
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    Options: ClassVar[type[EnvOptions]]
    stop_strings: ClassVar[tuple[str, ...]]  # texts that end a model turn, besides eos

    def reset(self, row: Mapping[str, Any]) -> list[int]:
        """Start a trajectory for a dataset row (its prompt, ground truth, extra_info)."""

    def step(self, tokens: list[int]) -> EnvStep:
        """The model's turn (its token ids, the turn's stop token included)."""

    # optional: `demo(row) -> [(text, by_model), ...]`, a worked trajectory for the SFT warm start
    # (WarmStart.tool_demos); segments with by_model False are the environment's and carry no loss.


def demonstrations(env: str | type, rows: list[Mapping[str, Any]]) -> list[list[tuple[str, bool]]]:
    """The environment's worked trajectory for each row (see Environment's `demo`)."""
    cls = env_class(env)
    if not callable(getattr(cls, "demo", None)):
        raise ConfigError(f"model.warm_start.tool_demos: environment {env_label(env)!r} has no demo(row) "
                          "to learn from; set tool_demos: 0 or give the class a `demo` staticmethod")
    return [list(cls.demo(row)) for row in rows]


ENVIRONMENTS: dict[str, type] = {}
BUILTIN = {"calculator": "distflow_lab.models.env_calculator",  # imported on first use by name
           "guess_number": "distflow_lab.models.env_guess_number"}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: the environment becomes configurable as `name`."""
    def add(cls: type) -> type:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ConfigError(f"environment {name!r} is registered twice ({ENVIRONMENTS[name].__qualname__} and "
                              f"{cls.__qualname__})")
        if not (isinstance(getattr(cls, "Options", None), type) and issubclass(cls.Options, EnvOptions)):
            raise ConfigError(f"environment {name!r} ({cls.__qualname__}) needs a nested `Options` class derived "
                              "from EnvOptions")
        ENVIRONMENTS[name] = cls
        cls.env_name = name
        return cls
    return add


def env_class(env: str | type) -> type:
    """A registered name or an environment class -> the class."""
    if isinstance(env, type):
        return env
    if env not in ENVIRONMENTS and env in BUILTIN:
        importlib.import_module(BUILTIN[env])  # registers it
    if env not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {env!r}; registered: {sorted({*ENVIRONMENTS, *BUILTIN})} "
                          "(or pass the class)")
    return ENVIRONMENTS[env]


def env_label(env: str | type) -> str:
    return env if isinstance(env, str) else getattr(env, "env_name", env.__qualname__)


def parse_options(env: str | type, options: Mapping[str, Any] | None) -> EnvOptions:
    """The environment's typed options; a wrong or unknown key names the environment and the key."""
    return typed_options(env_class(env).Options, options, f"environment {env_label(env)!r}")


def make_env(env: str | type, tokenizer: Any, options: Mapping[str, Any] | EnvOptions | None = None) -> Environment:
    cls = env_class(env)
    opts = options if isinstance(options, EnvOptions) else parse_options(env, options)
    return cls(tokenizer, opts)


def check_observation(obs: Any, env: str, turn: int, vocab_size: int) -> list[int]:
    """Token ids in [0, vocab_size), or an EnvError naming the environment and the turn."""
    if not isinstance(obs, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in obs):
        raise EnvError(f"returned a malformed observation {type(obs).__name__} {str(obs)[:60]!r}: expected a list of "
                       "token ids", env=env, turn=turn)
    bad = [t for t in obs if not 0 <= t < vocab_size]
    if bad:
        raise EnvError(f"returned token id {bad[0]} outside the vocabulary [0, {vocab_size})", env=env, turn=turn)
    return list(obs)


def check_step(out: Any, env: str, turn: int, vocab_size: int) -> EnvStep:
    """An EnvStep with a valid observation, a finite reward and a bool `done`."""
    if not isinstance(out, EnvStep):
        raise EnvError(f"step returned {type(out).__name__}, not an EnvStep(observation, reward, done, info)",
                       env=env, turn=turn)
    obs = check_observation(out.observation, env, turn, vocab_size)
    if not isinstance(out.reward, (int, float)) or not math.isfinite(out.reward):
        raise EnvError(f"returned reward {out.reward!r}: expected a finite number", env=env, turn=turn)
    if not isinstance(out.done, bool):
        raise EnvError(f"returned done={out.done!r}: expected a bool", env=env, turn=turn)
    return EnvStep(obs, float(out.reward), out.done, dict(out.info))

