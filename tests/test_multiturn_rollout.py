"""Multi-turn rollouts on the HF engine (models/rollout_multiturn.py) with environments on the
Ray actor pool: turns and observations interleave in each trajectory's response, only the
model's tokens carry loss, every model token's log-prob is the policy's over the whole context
the trajectory had (prompt, observations, earlier turns), and slow tools overlap decoding."""
from __future__ import annotations

import time

import pytest
import torch

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.environment import EnvOptions, EnvStep
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_multiturn import MultiTurnRollout
from distflow_lab.models.rollout_stream import HFStreamingRollout
from distflow_lab.models.sequences import tokenize_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
P, R = 8, 24
PROMPTS = ["3+4=", "12*3=", "x", "99-9="]


class Talker:
    """Observation "ab" at reset, "<k>;" after turn k, done after `turns` turns with reward = turns taken."""

    class Options(EnvOptions):
        turns: int = 3
        sleep_s: float = 0.0

    stop_strings = (";",)

    def __init__(self, tokenizer, options):
        self.tok, self.o, self.k = tokenizer, options, 0

    def reset(self, row):
        self.k = 0
        return self.tok("ab", add_special_tokens=False)["input_ids"]

    def step(self, tokens):
        time.sleep(self.o.sleep_s)
        self.k += 1
        done = self.k >= self.o.turns
        return EnvStep([] if done else self.tok(f"{self.k};", add_special_tokens=False)["input_ids"],
                       float(done) * self.k, done)


def rollout(tok, pool, max_turns=4, turn_tokens=3, n=2):
    model = build_tiny_qwen2(tok, seed=0)
    stream = HFStreamingRollout(model, tok, RolloutOptions(n=1, max_response_len=R), P, slots=8,
                                stop_ids=tok(";", add_special_tokens=False)["input_ids"])
    return model, MultiTurnRollout(stream, pool, max_turns=max_turns, max_turn_tokens=turn_tokens,
                                   max_response_len=R)


@pytest.fixture
def pool(ray_cluster, tok):
    from distflow_lab.models.environment_pool import EnvPool

    made = []

    def make(**options):
        made.append(EnvPool(Talker, tok, options, size=4))
        return made[-1]

    yield make
    for p in made:
        p.shutdown()


def full_log_probs(model, context: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=context[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, context[1:, None]).squeeze(1)
    return lp[at - 1]  # log p(context[j] | context[:j]) for each position j in `at`


def test_turns_and_observations_interleave_and_only_the_model_carries_loss(pool, tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    model, mt = rollout(tok, pool(turns=3))
    cols = mt.generate(ids, mask, [{"i": i} for i in range(len(PROMPTS))], n=2, seed=0)
    B = len(PROMPTS) * 2
    assert cols["responses"].shape == (B, R) and cols["turns"].tolist() == [3] * B
    assert cols["env_reward"].tolist() == [3.0] * B  # done after 3 turns, reward = 3
    loss, resp = cols["loss_mask"].bool(), cols["response_mask"].bool()
    assert (loss <= resp).all() and (resp & ~loss).any()
    for i in range(B):
        L = int(resp[i].sum())
        text = tok.decode(cols["responses"][i, :L][~loss[i, :L]])
        assert text == "ab1;2;", text  # the observations, in order, and nothing else without loss
        prompt = cols["input_ids"][i, :P][cols["attention_mask"][i, :P].bool()]
        context = torch.cat([prompt, cols["responses"][i, :L]])
        at = torch.nonzero(loss[i, :L]).squeeze(1) + len(prompt)
        want = full_log_probs(model, context, at)
        assert torch.allclose(cols["rollout_log_probs"][i, :L][loss[i, :L]], want, atol=1e-5), i
    assert mt.stats.turns == 3 * B and mt.stats.env_calls == 3 * B and mt.stats.done_by_env == B


def test_slow_tools_overlap_with_decoding(pool, tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    _, mt = rollout(tok, pool(turns=2, sleep_s=0.3), n=1)
    t0 = time.perf_counter()
    mt.generate(ids, mask, [{} for _ in PROMPTS], n=1, seed=0)
    took = time.perf_counter() - t0
    print(f"4 trajectories x 2 tool calls of 0.3 s: {took:.2f} s")
    assert mt.stats.env_calls == 8 and mt.stats.env_s >= 8 * 0.3
    assert took < 8 * 0.3, took  # less than the tools' 2.4 s one after another: they ran side by side


def test_budgets_bound_turns_and_trajectories(pool, tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    _, mt = rollout(tok, pool(turns=100), max_turns=2, turn_tokens=4, n=1)
    cols = mt.generate(ids, mask, [{} for _ in PROMPTS], n=1, seed=1)
    assert cols["turns"].tolist() == [2] * len(PROMPTS) and (cols["env_reward"] == 0).all()  # never done: no reward
    assert (cols["loss_mask"].sum(1) <= 2 * 4).all() and mt.stats.done_by_env == 0


# ---------------------------------------------------------------- through a session
def test_grpo_with_the_calculator_environment(ray_cluster, tmp_path):
    """The preset end to end on a small batch: trajectories with tool turns reach the trainer with their
    loss mask, the environment's reward is the score, and a bad environment name fails before work."""
    from distflow_lab.api.runner import load_run_config, open_session
    from distflow_lab.core.errors import ConfigError

    base = [f"model.path={tmp_path}/tiny-qwen2", f"data.cache_dir={tmp_path}/data", f"trainer.out_dir={tmp_path}/out",
            "model.warm_start.steps=20", "data.prompts_per_step=4", "rollout.n=4", "cluster.stage_timeout_s=120"]
    with pytest.raises(ConfigError, match=r"rollout.multi_turn: unknown environment 'calc'"):
        load_run_config("tiny-cpu-calculator", base + ["rollout.multi_turn.env=calc"])
    cfg = load_run_config("tiny-cpu-calculator", base)
    with open_session(cfg, progress=False) as s:
        m = [s.step().metrics for _ in range(2)]
        trainer = s.plan.stage("old_log_prob").ranks[0]
        b = s.controller.peek("old_log_prob", trainer, n=1 << 30, columns=["loss_mask", "response_mask", "scores"])
    assert all(x["multi_turn/turns_mean"] >= 1 and "actor/loss" in x for x in m), m
    assert (b["loss_mask"] <= b["response_mask"]).all() and b["loss_mask"].sum() > 0
    assert set(b["scores"].tolist()) <= {0.0, 1.0}
