"""Environments for multi-turn rollouts (models/environment.py, env_calculator.py,
env_guess_number.py) and their Ray actor pool (models/environment_pool.py): the two
built-in games played by hand, the registry's and options' named errors, and the pool's
overlap, latency and failures (an environment that raises, hangs, dies or answers
malformed data is an EnvError naming the environment, the turn and the trajectory)."""
from __future__ import annotations

import time

import pytest

from distflow_lab.core.errors import ConfigError, EnvError
from distflow_lab.models.env_calculator import calculate
from distflow_lab.models.environment import EnvOptions, EnvStep, Latency, make_env, parse_options, register_env


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def text(tok, tokens: list[int]) -> str:
    return tok.decode(tokens)


# ---------------------------------------------------------------- tool-use demonstrations (the SFT warm start)
def test_a_demonstration_trains_the_models_tokens_only(tok):
    from distflow_lab.datasets.arithmetic import make_arithmetic_rows
    from distflow_lab.models.environment import demonstrations
    from distflow_lab.models.sequences import build_sft_batch

    row = make_arithmetic_rows(1, 0, max_operand=99, ops=("*",))[0]
    a, b = row["extra_info"]["question"].rstrip("=").split("*")
    (demo,) = demonstrations("calculator", [row])
    value = str(int(a) * int(b))
    assert demo == [(f"[{a}*{b}]", True), (value + ";", False), (value, True)]
    cols, _ = build_sft_batch(tok, [row["prompt"], row["prompt"]], [demo, value], 8, 24)
    L = int(cols["response_mask"][0].sum())
    assert tok.decode(cols["responses"][0, :L][cols["loss_mask"][0, :L] == 0]) == value + ";"  # the tool's answer
    assert cols["loss_mask"][0, L - 1] == 1 and (cols["loss_mask"][1] == cols["response_mask"][1]).all()  # eos; direct
    with pytest.raises(ConfigError, match="environment 'Scripted' has no demo"):
        demonstrations(Scripted, [row])


def test_the_guess_number_demo_is_a_bisection_the_environment_agrees_with(tok):
    from distflow_lab.datasets.guess_number import make_guess_number_rows
    from distflow_lab.models.environment import demonstrations

    rows = make_guess_number_rows(15 * 4, 0, high=15)
    for row, demo in zip(rows, demonstrations("guess_number", rows)):
        env = make_env("guess_number", tok)
        env.reset(row)
        guesses = [text for text, by_model in demo if by_model]
        assert 1 <= len(guesses) <= 4 and guesses[-1] == row["reward_model"]["ground_truth"] + ";"
        for k, guess in enumerate(guesses):  # played against the real environment: its answers are the demo's
            out = env.step(ids(tok, guess))
            if k + 1 < len(guesses):
                assert text(tok, out.observation) == demo[2 * k + 1][0] and not out.done
        assert out.done and out.reward == pytest.approx(1.0 - 0.1 * (len(guesses) - 1))
    with pytest.raises(ValueError, match="the secret 99 is outside 1..15"):
        demonstrations("guess_number", [{"reward_model": {"ground_truth": "99"}}])


def test_tool_demos_need_a_multi_turn_run():
    from distflow_lab.api.runner import load_run_config

    with pytest.raises(ConfigError, match="model.warm_start.tool_demos .* needs rollout.multi_turn"):
        load_run_config("tiny-cpu-grpo", ["model.warm_start.tool_demos=0.5"])


# ---------------------------------------------------------------- the games, by hand (no Ray)
@pytest.mark.parametrize("expr,want", [("4*5", 20), ("3+4*5", 23), ("(1+2)*3", 9), ("-2+1", -1), ("2*", None),
                                       ("__import__('os')", None), ("2**99", None), ("1/2", None), ("", None)])
def test_calculate_evaluates_integer_arithmetic_only(expr, want):
    assert calculate(expr) == want


def test_calculator_answers_calls_and_scores_the_final_answer(tok):
    env = make_env("calculator", tok, {"max_calls": 2})
    assert env.reset({"reward_model": {"ground_truth": "23"}}) == []
    a = env.step(ids(tok, "[4*5]"))
    assert text(tok, a.observation) == "20;" and (a.reward, a.done) == (0.0, False)
    b = env.step(ids(tok, "[2*]"))
    assert text(tok, b.observation) == "?;" and b.info["tool_error"] and not b.done
    c = env.step(ids(tok, "23") + [tok.eos_token_id])
    assert (c.reward, c.done, c.info["calls"]) == (1.0, True, 2)
    env.reset({"ground_truth": "7"})
    assert env.step(ids(tok, "8")).reward == 0.0
    for _ in range(2):
        env.step(ids(tok, "[1+1]"))
    over = env.step(ids(tok, "[1+1]"))  # a third call: over max_calls
    assert (over.reward, over.done, over.info["over_budget"]) == (0.0, True, True)


def test_guess_number_gives_feedback_and_a_reward_for_finding_it(tok):
    env = make_env("guess_number", tok, {"max_guesses": 4, "turn_penalty": 0.25})
    env.reset({"ground_truth": "13"})
    assert text(tok, env.step(ids(tok, "20;")).observation) == "<;"  # lower
    assert text(tok, env.step(ids(tok, "5;")).observation) == ">;"  # higher
    assert text(tok, env.step(ids(tok, "x;")).observation) == "?;"
    found = env.step(ids(tok, "13;"))
    assert found.done and found.reward == pytest.approx(1 - 0.25 * 3) and found.info["guesses"] == 4
    env.reset({"ground_truth": "2"})
    last = [env.step(ids(tok, "9;")) for _ in range(4)][-1]
    assert last.done and last.reward == 0.0


def test_latency_draws_a_lognormal_delay():
    import random

    rng = random.Random(0)
    assert Latency().draw(rng) == 0.0 and Latency(median_ms=20).draw(rng) == pytest.approx(0.02)
    draws = sorted(Latency(median_ms=10, sigma=1.0).draw(rng) for _ in range(2001))
    assert draws[1000] == pytest.approx(0.01, rel=0.15) and draws[-1] > 10 * draws[1000]  # a long tail


def test_registry_and_options_name_what_is_wrong(tok):
    with pytest.raises(ConfigError, match=r"unknown environment 'calculatr'; registered: \['calculator', "):
        make_env("calculatr", tok)
    with pytest.raises(ConfigError, match=r"environment 'calculator': option 'max_call': unknown key"):
        parse_options("calculator", {"max_call": 2})
    with pytest.raises(ConfigError, match=r"environment 'guess_number': option 'latency.median_ms'"):
        parse_options("guess_number", {"latency": {"median_ms": -1}})
    with pytest.raises(ConfigError, match="needs a nested `Options` class"):
        register_env("no_options")(type("NoOptions", (), {}))


# ---------------------------------------------------------------- the pool (Ray actors)
class Scripted:
    """A test environment: observation "ab", then per step what `mode` says."""

    class Options(EnvOptions):
        mode: str = "ok"
        sleep_s: float = 0.0

    stop_strings = ()

    def __init__(self, tokenizer, options):
        self.tok, self.o = tokenizer, options

    def reset(self, row):
        return self.tok("ab", add_special_tokens=False)["input_ids"]

    def step(self, tokens):
        time.sleep(self.o.sleep_s)
        if self.o.mode == "raise":
            raise ValueError("the sandbox crashed")
        if self.o.mode == "bad_token":
            return EnvStep([10**6], 0.0, False)
        if self.o.mode == "not_a_step":
            return {"observation": []}
        if self.o.mode == "exit":
            import os

            os._exit(1)
        return EnvStep(list(tokens)[::-1], float(len(tokens)), len(tokens) > 2)


@pytest.fixture
def pools(ray_cluster, tok):
    from distflow_lab.models.environment_pool import EnvPool

    made = []

    def make(env=Scripted, **kw):
        options = kw.pop("options", None)
        made.append(EnvPool(env, tok, options, **kw))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


def test_the_pool_plays_trajectories_and_overlaps_slow_tools(pools, tok):
    pool = pools(size=2)
    first = pool.call("t0", row={"prompt": "x"})
    assert (first.turn, text(tok, first.step.observation)) == (0, "ab")
    got = pool.call("t0", [5, 6, 7], turn=1)
    assert got.step == EnvStep([7, 6, 5], 3.0, True, {})
    slow = pools(size=4, options={"sleep_s": 0.4})
    for k in range(4):
        slow.reset(k, {})
    while slow.in_flight:
        slow.ready(0.05)
    t0 = time.perf_counter()
    for k in range(4):
        slow.step(k, [1], turn=1)
    answers = []
    while slow.in_flight:
        answers += slow.ready(0.05)
    took = time.perf_counter() - t0
    assert sorted(a.key for a in answers) == [0, 1, 2, 3] and took < 1.2, took  # four 0.4 s calls at once, not 1.6 s
    assert (slow.started, slow.answered) == (8, 8)
    threads = pools(size=1, concurrency=4, options={"sleep_s": 0.4})  # one actor, four calls at once on threads
    for k in range(4):
        threads.call(k, row={})
    t0 = time.perf_counter()
    for k in range(4):
        threads.step(k, [1], turn=1)
    while threads.in_flight:
        threads.ready(0.05)
    assert time.perf_counter() - t0 < 1.2 and threads.answered == 8


@pytest.mark.parametrize("mode,match", [
    ("raise", r"environment 'Scripted', turn 1, trajectory traj-3: raised ValueError: the sandbox crashed"),
    ("bad_token", r"environment 'Scripted', turn 1, trajectory traj-3: returned token id 1000000 outside"),
    ("not_a_step", r"turn 1, trajectory traj-3: step returned dict, not an EnvStep"),
    ("exit", r"environment 'Scripted', turn 1, trajectory traj-3: its actor died"),
])
def test_a_failing_environment_is_a_named_error(pools, mode, match):
    pool = pools(size=1, options={"mode": mode})
    pool.call("traj-3", row={})
    with pytest.raises(EnvError, match=match) as e:
        pool.call("traj-3", [1, 2], turn=1)
    assert (e.value.env, e.value.turn, e.value.trajectory) == ("Scripted", 1, "traj-3")


def test_an_environment_past_its_timeout_is_a_named_error(pools):
    pool = pools(size=1, timeout_s=0.5, options={"sleep_s": 5.0})
    pool.call("slow", row={})
    t0 = time.perf_counter()
    with pytest.raises(EnvError, match=r"environment 'Scripted', turn 2, trajectory slow: did not answer within 0.5 s"):
        pool.call("slow", [1], turn=2)
    assert time.perf_counter() - t0 < 3


def test_the_builtin_calculator_runs_on_the_pool_with_its_latency(pools, tok):
    pool = pools("calculator", size=1, options={"latency": {"median_ms": 200}})
    pool.call(0, row={"ground_truth": "23"})
    got = pool.call(0, ids(tok, "[4*5]"), turn=1)
    assert text(tok, got.step.observation) == "20;" and got.seconds >= 0.2
    with pytest.raises(ConfigError, match="option 'latency.sigma'"):
        pools("calculator", options={"latency": {"sigma": -1}})  # before any actor starts


def test_the_multi_turn_bench_refuses_what_it_cannot_run():
    """`bench async --workload calculator`: real engines only, and a readable latency."""
    import argparse

    from distflow_lab.cli import tool_latency
    from distflow_lab.experiments.bench import async_schedules

    assert tool_latency("50:1.0") == (50.0, 1.0)
    for bad in ("50", "a:1", "-5:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="MEDIAN_MS:SIGMA|must be >= 0"):
            tool_latency(bad)
    with pytest.raises(ConfigError, match="runs on the real engines"):
        async_schedules.run(engines=("synthetic",), workload="calculator")
