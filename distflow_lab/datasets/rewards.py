"""Rule rewards: plain functions `(response, ground_truth) -> float`.

The trainer looks the function up per row by the row's `data_source` in the
built-in `REWARD_FNS`, over which the run config's `reward.by_source` (and
`reward.fn`) take precedence. Those travel to the workers with the config; the
built-in table is read-only, because changing it in a notebook would change
only the driver's copy, never what the workers score with.

Number normalisation (both GSM8K methods): a number may carry a leading "$"
and thousands commas, which are dropped ("$1,000" -> "1000"); a trailing
sentence period is not part of the number ("72." -> "72"); an all-zero
decimal part is dropped ("72.0" -> "72", "72.50" stays "72.50").
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Callable

from distflow_lab.core.errors import ConfigError

RewardFn = Callable[..., float]

# "-$1,234.5", "$72", "7": optional sign, optional "$", digits with commas, optional decimals.
_NUMBER = r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?"
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE_RE = re.compile(_NUMBER)


def normalize_number(s: str) -> str:
    """Drop '$' and commas, and an all-zero decimal part: "$1,000.00" -> "1000"."""
    s = s.strip().replace("$", "").replace(",", "").rstrip(".")
    if "." in s:
        whole, frac = s.split(".", 1)
        if frac.strip("0") == "":
            s = whole
    return s


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The model's final answer in `text`, normalised, or None if there is none.

    strict:   the number after the last "####" (the format the prompt asks for).
    flexible: the last number anywhere in the text.
    """
    if method == "strict":
        found = _STRICT_RE.findall(text)
    elif method == "flexible":
        found = _FLEXIBLE_RE.findall(text)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    return normalize_number(found[-1]) if found else None


def gsm8k_reward(
    response: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K scorer: `score` if correct, `format_score` if an answer was found but wrong, else 0."""
    answer = extract_gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == normalize_number(ground_truth) else format_score


def exact_match_reward(response: str, ground_truth: str, stop: str = "<eos>") -> float:
    """1.0 if the response (cut at the first `stop` marker, whitespace stripped) equals ground_truth.

    `response` is the generated text after the prompt; if it was decoded with
    special tokens kept, everything from the EOS marker on is ignored.
    """
    if stop:
        response = response.split(stop, 1)[0]
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


class _BuiltIn(Mapping):
    """The built-in reward table, read-only: an assignment here would reach only this process."""

    def __init__(self, fns: dict[str, RewardFn]) -> None:
        self._fns = dict(fns)

    def __getitem__(self, key: str) -> RewardFn:
        return self._fns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __setitem__(self, key: str, value: RewardFn) -> None:
        raise ConfigError(f"REWARD_FNS is read-only: setting {key!r} here would change only this process, not the "
                          f"workers. Put it in the run config: cfg.reward.by_source[{key!r}] = fn (or the override "
                          f"reward.by_source.{key}=module:function)")


REWARD_FNS: Mapping[str, RewardFn] = _BuiltIn({
    "openai/gsm8k": gsm8k_reward,
    "distflow/arithmetic": exact_match_reward,
})


def reward_for(data_source: str, by_source: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """The reward function for `data_source`: from `by_source` (the run config's), else built in."""
    fns = {**REWARD_FNS, **(by_source or {})}
    try:
        return fns[data_source]
    except KeyError:
        raise ConfigError(
            f"no reward function for data_source {data_source!r}; known: {sorted(fns)}. "
            f"Add one to the run config: reward.by_source[{data_source!r}] = fn (or 'module:function')"
        ) from None
