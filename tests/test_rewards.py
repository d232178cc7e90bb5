"""Rule rewards: GSM8K answer extraction and scoring, exact match, registry."""
import pytest

from distflow_lab.core.errors import ConfigError

from distflow_lab.datasets.rewards import (
    REWARD_FNS,
    exact_match_reward,
    extract_gsm8k_answer,
    gsm8k_reward,
    reward_for,
)


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("48/2 = 24, so 48+24 = 72.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("She earned $10.\n#### $10", "10", "10"),
        ("#### 72.0", "72", "72"),
        ("#### -5", "-5", "-5"),
        ("#### 3.75 dollars", "3.75", "3.75"),
        ("first #### 3 then #### 4", "4", "4"),
        ("The answer is 1,000,000.", None, "1000000"),
        ("so it costs $18", None, "18"),
        ("no numbers here", None, None),
        ("####", None, None),
        ("", None, None),
    ],
)
def test_extract(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_extract_bad_method():
    with pytest.raises(ValueError, match="strict"):
        extract_gsm8k_answer("#### 1", "loose")


def test_gsm8k_reward_scores():
    assert gsm8k_reward("so #### 72", "72") == 1.0
    assert gsm8k_reward("so #### 1,000", "1000") == 1.0
    assert gsm8k_reward("so #### 71", "72") == 0.0
    assert gsm8k_reward("so #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_reward("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k_reward("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_reward("nothing", "72", format_score=0.1) == 0.0
    assert gsm8k_reward("#### 72", "72", score=2.0) == 2.0


def test_exact_match():
    assert exact_match_reward("7", "7") == 1.0
    assert exact_match_reward(" 7\n", "7") == 1.0
    assert exact_match_reward("7<eos><pad><pad>", "7") == 1.0
    assert exact_match_reward("77", "7") == 0.0
    assert exact_match_reward("", "7") == 0.0
    assert exact_match_reward("7 8", "7") == 0.0


def test_registry():
    assert reward_for("openai/gsm8k") is gsm8k_reward
    assert reward_for("distflow/arithmetic") is exact_match_reward
    with pytest.raises(ValueError, match=r"nope/x.*distflow/arithmetic.*openai/gsm8k"):
        reward_for("nope/x")
    # a notebook assignment would change only this process, never the workers: refused, with the way that works
    with pytest.raises(ConfigError, match=r"read-only.*reward.by_source"):
        REWARD_FNS["my/task"] = lambda r, gt: 0.5
    assert "my/task" not in REWARD_FNS
    assert reward_for("my/task", {"my/task": lambda r, gt: 0.5})("a", "b") == 0.5  # the config's table wins
    assert reward_for("openai/gsm8k", {"openai/gsm8k": exact_match_reward}) is exact_match_reward
