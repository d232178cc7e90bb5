"""Rule rewards: plain functions `(response, ground_truth) -> float`.

The trainer looks the function up per row by the row's `data_source` in the
built-in `REWARD_FNS`, over which the run config's `reward.by_source` (and
`reward.fn`) take precedence. Those travel to the workers with the config; the
built-in table is read-only, because changing it in a notebook would change
only the driver's copy, never what the workers score with.

GSM8K (`data_source="openai/gsm8k"`) is scored exactly as verl scores it
(`compute_score` in verl/utils/reward_score/gsm8k.py, strict), so reward curves
compare with published verl runs:

- only the last 300 characters of the response count;
- strict: the last "#### " (one space) directly followed by a run of digits,
  "." and "," (optionally after "-"); commas are dropped; the result must
  equal the ground truth string exactly. "#### 18." gives "18." and
  "####18" or "#### $18" give no answer: all score 0 against "18";
- flexible: the last run of digits, "." and "," that is not a lone "."
  (commas kept), compared the same way.

The lenient parse is kept as `method="lenient"` (and "lenient-flexible"), or
`gsm8k_lenient_reward` for `reward.by_source`: it allows any spacing after
"####" and normalises both sides (`normalize_number`): a leading "$" and
thousands commas are dropped ("$1,000" -> "1000"), a trailing sentence period
is not part of the number ("72." -> "72"), and an all-zero decimal part is
dropped ("72.0" -> "72", "72.50" stays "72.50").
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Callable

from distflow_lab.core.errors import ConfigError
from distflow_lab.datasets.long_tail import answer

RewardFn = Callable[..., float]

METHODS = ("strict", "flexible", "lenient", "lenient-flexible")

# verl's formats. Its scorer looks only at the tail: the final answer is at the end,
# and regexes over very long responses are slow.
_VERL_TAIL_CHARS = 300
_VERL_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_VERL_FLEXIBLE_RE = re.compile(r"-?[0-9.,]+")

# Lenient: "-$1,234.5", "$72", "7": optional sign, optional "$", digits with commas, optional decimals.
_NUMBER = r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?"
_LENIENT_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_LENIENT_FLEXIBLE_RE = re.compile(_NUMBER)


def normalize_number(s: str) -> str:
    """Drop '$' and commas, and an all-zero decimal part: "$1,000.00" -> "1000"."""
    s = s.strip().replace("$", "").replace(",", "").rstrip(".")
    if "." in s:
        whole, frac = s.split(".", 1)
        if frac.strip("0") == "":
            s = whole
    return s


def _verl_answer(text: str, flexible: bool) -> str | None:
    """The answer verl's GSM8K scorer extracts (same rules, our code)."""
    tail = text[-_VERL_TAIL_CHARS:]
    if not flexible:
        found = _VERL_STRICT_RE.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _VERL_FLEXIBLE_RE.findall(tail)
    if not found:
        return None
    # The last match that is not a lone "."; if all are, verl ends its scan on the first one.
    return next((f for f in reversed(found) if f != "."), found[0])


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The model's final answer in `text`, or None if there is none.

    strict / flexible: verl's extraction, unnormalised (see the module docstring).
    lenient: the number after the last "####" (any spacing), normalised.
    lenient-flexible: the last number anywhere in the text, normalised.
    """
    if method in ("strict", "flexible"):
        return _verl_answer(text, flexible=method == "flexible")
    if method == "lenient":
        found = _LENIENT_RE.findall(text)
    elif method == "lenient-flexible":
        found = _LENIENT_FLEXIBLE_RE.findall(text)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return normalize_number(found[-1]) if found else None


def gsm8k_reward(
    response: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K scorer: `score` if correct, `format_score` if an answer was found but wrong, else 0.

    strict and flexible match verl exactly (the answer must equal `ground_truth`
    as a string); the lenient methods normalise both sides first.
    """
    answer = extract_gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    truth = normalize_number(ground_truth) if method.startswith("lenient") else ground_truth
    return score if answer == truth else format_score


def gsm8k_lenient_reward(response: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """GSM8K with the lenient parse: "#### 18.", "####18" and "#### $18" all match "18".

    Use it in place of verl's semantics with
    `reward.by_source.openai/gsm8k=distflow_lab.datasets.rewards:gsm8k_lenient_reward`.
    """
    return gsm8k_reward(response, ground_truth, "lenient", format_score, score)


def exact_match_reward(response: str, ground_truth: str, stop: str = "<eos>") -> float:
    """1.0 if the response (cut at the first `stop` marker, whitespace stripped) equals ground_truth.

    `response` is the generated text after the prompt; if it was decoded with
    special tokens kept, everything from the EOS marker on is ignored.
    """
    if stop:
        response = response.split(stop, 1)[0]
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def last_number(response: str) -> str | None:
    """The last number in `response`, normalised ("$1,000." -> "1000"), or None."""
    found = _LENIENT_FLEXIBLE_RE.findall(response)
    return normalize_number(found[-1]) if found else None


def last_number_reward(response: str, ground_truth: str) -> float:
    """1.0 if the response's last number equals the ground truth (both normalised), else 0.0.

    For an instruct model asked a question in prose: it answers in sentences ("17 + 25 = 42."),
    so the final number is its answer, a format it uses without being taught one."""
    return 1.0 if last_number(response) == normalize_number(ground_truth) else 0.0


def length_reward(response: str, ground_truth: str, stop: str = "<eos>") -> float:
    """The long-tail task (datasets/long_tail.py): a response that follows the digit pattern
    scores 1 - |its length - the target's| / the target's (at least 0); any other scores 0."""
    if stop:
        response = response.split(stop, 1)[0]
    response = response.strip()
    if response != answer(len(response)):
        return 0.0
    return max(0.0, 1.0 - abs(len(response) - len(ground_truth)) / max(1, len(ground_truth)))


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
    "distflow/arithmetic_question": last_number_reward,
    "distflow/long_tail": length_reward,
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
