"""Rule rewards: plain functions `(response, ground_truth) -> float`.

Swap one in from a notebook with `REWARD_FNS["my/source"] = my_fn`; the
trainer looks the function up per row by the row's `data_source`.

Number normalisation (both GSM8K methods): a number may carry a leading "$"
and thousands commas, which are dropped ("$1,000" -> "1000"); a trailing
sentence period is not part of the number ("72." -> "72"); an all-zero
decimal part is dropped ("72.0" -> "72", "72.50" stays "72.50").
"""
from __future__ import annotations

import re
from typing import Callable

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


REWARD_FNS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k_reward,
    "distflow/arithmetic": exact_match_reward,
}


def reward_for(data_source: str) -> RewardFn:
    """The reward function registered for `data_source` in `REWARD_FNS`."""
    try:
        return REWARD_FNS[data_source]
    except KeyError:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; known: {sorted(REWARD_FNS)}. "
            f"Register one with distflow_lab.rewards.REWARD_FNS[{data_source!r}] = fn"
        ) from None
