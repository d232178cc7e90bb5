"""Rule rewards: GSM8K answer extraction and scoring (verl parity), exact match, registry."""
import importlib.util
import json
from pathlib import Path

import pytest

from distflow_lab.core.errors import ConfigError

from distflow_lab.datasets.rewards import (
    REWARD_FNS,
    exact_match_reward,
    extract_gsm8k_answer,
    gsm8k_lenient_reward,
    gsm8k_reward,
    reward_for,
)

FROZEN = Path(__file__).parent / "data" / "gsm8k_reward_probes.json"


def probe_set() -> list[tuple[str, str]]:
    """(response, ground_truth) pairs covering the formats where parsers disagree:
    spacing after ####, "$", commas, a trailing period, decimals, negatives,
    several ####, answers only a flexible parse finds, text beyond verl's 300-char window."""
    formats = ["#### {a}", "####{a}", "####  {a}", "#### {a}.", "#### ${a}", "#### {a} dollars", "#### {a}\n",
               "So the total is {a}.\n#### {a}", "first #### 3 then #### {a}", "#### {a} then #### 3",
               "The answer is {a}.", "Answer: {a}", "{a} apples and 7 pears", "##### {a}", "#### #### {a}",
               "x" * 400 + "#### {a}", "#### {a}" + " the end." * 40]
    probes = []
    for truth, shown in [("18", ["18", "18.0", "1,8"]), ("1000", ["1000", "1,000", "1,000.00"]),
                         ("-5", ["-5", "-5.0", "5"]), ("3.75", ["3.75", "3.750"]), ("0", ["0"])]:
        for fmt in formats:
            for a in shown[:2] if len(fmt) < 40 else shown[:1]:
                probes.append((fmt.format(a=a), truth))
    probes += [(text, "18") for text in
               ["", "####", "#### ", "#### .", "#### ,", "no numbers here", ". , .", "#### 18/2", "#### 18%",
                "#### 18\n#### 19", "#### 19\n#### 18", "#### \u221218", "the number -18", "#### -18",
                "48/2 = 24, so 48+24 = 72.\n#### 18", "#### 1.8e1", "#### 018", "#### 18 .", "#### 18,",
                "#### 18,000", "costs $18.", "costs $18", "18 18 18", "#### 18.5 (18)", "####\t18"]]
    return probes


def _verl_gsm8k():
    """verl's `verl/utils/reward_score/gsm8k.py`, loaded by path: importing the verl
    package would pull torch and Ray for a module that needs only `re`."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:  # the frozen table still checks parity
        pytest.skip("verl not installed (scripts/install_bench.sh)")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "reward_score" / "gsm8k.py"
    mod_spec = importlib.util.spec_from_file_location("verl_gsm8k_reference", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def write_frozen() -> None:
    """Regenerate the frozen table from verl's scorer: `python tests/test_rewards.py`."""
    verl = _verl_gsm8k()
    rows = [{"response": r, "ground_truth": t, "strict": float(verl.compute_score(r, t)),
             "flexible": float(verl.compute_score(r, t, method="flexible"))} for r, t in probe_set()]
    FROZEN.parent.mkdir(exist_ok=True)
    FROZEN.write_text(json.dumps({"source": "verl 0.7.1 verl.utils.reward_score.gsm8k.compute_score",
                                  "regenerate": "python tests/test_rewards.py", "probes": rows}, indent=1) + "\n")


def frozen() -> list[dict]:
    return json.loads(FROZEN.read_text())["probes"]


def test_probe_set_is_the_frozen_one():
    probes = probe_set()
    assert len(probes) >= 150 and len(set(probes)) == len(probes)
    assert [(p["response"], p["ground_truth"]) for p in frozen()] == probes


def test_gsm8k_matches_frozen_verl_scores():
    """Parity with verl's strict and flexible scores, without verl installed."""
    for p in frozen():
        got = (gsm8k_reward(p["response"], p["ground_truth"]),
               gsm8k_reward(p["response"], p["ground_truth"], method="flexible"))
        assert got == (p["strict"], p["flexible"]), p


def test_gsm8k_matches_verl():
    verl = _verl_gsm8k()
    for response, truth in probe_set():
        for method in ("strict", "flexible"):
            for kw in ({}, {"format_score": 0.1, "score": 2.0}):
                ours = gsm8k_reward(response, truth, method=method, **kw)
                assert ours == verl.compute_score(response, truth, method=method, **kw), (response, truth, method, kw)
        assert extract_gsm8k_answer(response, "strict") == verl.extract_solution(response, "strict"), response
        assert extract_gsm8k_answer(response, "flexible") == verl.extract_solution(response, "flexible"), response


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("48/2 = 24, so 48+24 = 72.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1,234"),  # verl drops commas only in strict
        ("She earned $10.\n#### $10", None, "10"),  # "$" right after "#### ": no strict answer
        ("#### 72.0", "72.0", "72.0"),  # no normalisation: scores 0 against "72"
        ("#### 18.", "18.", "18."),
        ("####18", None, "18"),
        ("#### -5", "-5", "-5"),
        ("#### 3.75 dollars", "3.75", "3.75"),
        ("first #### 3 then #### 4", "4", "4"),
        ("The answer is 1,000,000.", None, "1,000,000."),
        ("no numbers here", None, None),
        ("####", None, None),
        ("", None, None),
        (". , .", None, ","),  # a lone "." is skipped, a lone "," is not
        ("#### 7" + " " * 300, None, None),  # only the last 300 characters count
    ],
)
def test_extract_verl_semantics(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    "text, lenient, lenient_flexible",
    [
        ("48/2 = 24, so 48+24 = 72.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("She earned $10.\n#### $10", "10", "10"),
        ("#### 72.0", "72", "72"),
        ("#### 18.", "18", "18"),
        ("####18", "18", "18"),
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
def test_extract_lenient(text, lenient, lenient_flexible):
    assert extract_gsm8k_answer(text, "lenient") == lenient
    assert extract_gsm8k_answer(text, "lenient-flexible") == lenient_flexible


def test_extract_bad_method():
    with pytest.raises(ValueError, match="strict.*lenient"):
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
    # verl's strict format: these are answers-in-the-wrong-format, not correct answers
    for text in ("#### 18.", "####18", "#### $18", "#### 18.0"):
        assert gsm8k_reward(text, "18") == 0.0, text
    assert gsm8k_reward("#### 18.", "18", format_score=0.1) == 0.1  # found, but "18." != "18"
    assert gsm8k_reward("####18", "18", format_score=0.1) == 0.0  # nothing found


def test_gsm8k_lenient_is_a_named_option():
    for text in ("#### 18.", "####18", "#### $18", "#### 18.0", "####  1,8"):
        assert gsm8k_reward(text, "18", method="lenient") == 1.0, text
        assert gsm8k_lenient_reward(text, "18") == 1.0, text
    assert gsm8k_lenient_reward("#### 19", "18", format_score=0.1) == 0.1
    assert gsm8k_reward("it is $1,000.", "1000", method="lenient-flexible") == 1.0
    assert gsm8k_reward("it is $1,000.", "1000", method="flexible") == 0.0  # verl keeps the comma and period


def test_exact_match():
    assert exact_match_reward("7", "7") == 1.0
    assert exact_match_reward(" 7\n", "7") == 1.0
    assert exact_match_reward("7<eos><pad><pad>", "7") == 1.0
    assert exact_match_reward("77", "7") == 0.0
    assert exact_match_reward("", "7") == 0.0
    assert exact_match_reward("7 8", "7") == 0.0


def test_registry():
    assert reward_for("openai/gsm8k") is gsm8k_reward  # verl's strict semantics by default
    assert reward_for("distflow/arithmetic") is exact_match_reward
    with pytest.raises(ValueError, match=r"nope/x.*distflow/arithmetic.*openai/gsm8k"):
        reward_for("nope/x")
    # a notebook assignment would change only this process, never the workers: refused, with the way that works
    with pytest.raises(ConfigError, match=r"read-only.*reward.by_source"):
        REWARD_FNS["my/task"] = lambda r, gt: 0.5
    assert "my/task" not in REWARD_FNS
    assert reward_for("my/task", {"my/task": lambda r, gt: 0.5})("a", "b") == 0.5  # the config's table wins
    assert reward_for("openai/gsm8k", {"openai/gsm8k": exact_match_reward}) is exact_match_reward


if __name__ == "__main__":
    write_frozen()
