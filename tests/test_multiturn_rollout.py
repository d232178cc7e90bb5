"""Multi-turn rollouts on the HF engine (models/rollout_multiturn.py) with environments on the
Ray actor pool: turns and observations interleave in each trajectory's response, only the
model's tokens carry loss, every model token's log-prob is the policy's over the whole context
the trajectory had (prompt, observations, earlier turns), and slow tools overlap decoding."""
from __future__ import annotations

import os
import time

import pytest
import torch

from distflow_lab.core.config import RolloutOptions
from distflow_lab.models.environment import EnvOptions, EnvStep
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.rollout_multiturn import MultiTurnRollout
from distflow_lab.models.rollout_stream import HFStreamingRollout
from distflow_lab.models.sequences import tokenize_prompts

from .conftest import CALCULATOR_WARM_START, GUESS_NUMBER_WARM_START, VLLM_EAGER

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


@pytest.mark.full
def test_slow_tools_overlap_with_decoding(pool, tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    _, mt = rollout(tok, pool(turns=2, sleep_s=0.3), n=1)
    t0 = time.perf_counter()
    mt.generate(ids, mask, [{} for _ in PROMPTS], n=1, seed=0)
    took = time.perf_counter() - t0
    print(f"4 trajectories x 2 tool calls of 0.3 s: {took:.2f} s")
    assert mt.stats.env_calls == 8 and mt.stats.env_s >= 8 * 0.3
    assert took < 8 * 0.3, took  # less than the tools' 2.4 s one after another: they ran side by side


@pytest.mark.full
def test_budgets_bound_turns_and_trajectories(pool, tok):
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    _, mt = rollout(tok, pool(turns=100), max_turns=2, turn_tokens=4, n=1)
    cols = mt.generate(ids, mask, [{} for _ in PROMPTS], n=1, seed=1)
    assert cols["turns"].tolist() == [2] * len(PROMPTS) and (cols["env_reward"] == 0).all()  # never done: no reward
    assert (cols["loss_mask"].sum(1) <= 2 * 4).all() and mt.stats.done_by_env == 0


@pytest.mark.full
def test_partial_rollouts_carry_trajectories_across_calls_and_policy_versions(pool, tok):
    """run(groups) returns whole prompt groups, oldest first; open trajectories stay for the next call and
    go on under the versions refresh() brings, each model token tagged with the one that sampled it."""
    from distflow_lab.models.rollout_stream import StaleRule

    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    model, mt = rollout(tok, pool(turns=3), turn_tokens=4, n=2)
    mt.add(ids, mask, [{} for _ in PROMPTS], metas=list(range(len(PROMPTS))), n=2)
    polls = iter(range(1000))
    bump = lambda: next(polls) // 2  # noqa: E731  (a new version every second poll)
    first, metas1 = mt.run(2, version=0, seed=0, refresh=bump)
    assert len(metas1) == 4 and len(set(metas1)) == 2 and mt.in_flight + 2 * len(mt.ready) > 0
    second, metas2 = mt.run(2, version=mt._version, seed=1, refresh=bump)
    assert sorted({*metas1, *metas2}) == [0, 1, 2, 3] and mt.in_flight == 0 and not mt.ready
    for cols in (first, second):
        loss = cols["loss_mask"].bool()
        for i in range(len(loss)):
            v = cols["token_versions"][i][loss[i]].tolist()
            assert v == sorted(v) and cols["version"][i] == v[0], v  # tagged as sampled, oldest first
            L = int(cols["response_mask"][i].sum())
            prompt = cols["input_ids"][i, :P][cols["attention_mask"][i, :P].bool()]
            context = torch.cat([prompt, cols["responses"][i, :L]])
            want = full_log_probs(model, context, torch.nonzero(loss[i, :L]).squeeze(1) + len(prompt))
            assert torch.allclose(cols["rollout_log_probs"][i, :L][loss[i, :L]], want, atol=1e-5)
    versions = torch.cat([c["token_versions"][c["loss_mask"].bool()] for c in (first, second)])
    assert versions.unique().numel() > 1  # the policy moved while they played
    # k = 0 with the version moving every second poll: groups that straddle a version are dropped, not returned
    mt.add(ids, mask, [{} for _ in PROMPTS], metas=list(range(len(PROMPTS))), n=2)
    got, _ = mt.run(4, version=mt._version, seed=2, refresh=bump, stale=StaleRule(max_staleness=0))
    assert mt.stats.stale_dropped > 0
    for i in range(len(got["turns"])):
        v = got["token_versions"][i][got["loss_mask"][i].bool()]
        assert (v == v[0]).all()  # never trained more than k = 0 versions stale


# ---------------------------------------------------------------- through a session
@pytest.mark.full
@pytest.mark.parametrize("engine", ["hf"])
def test_grpo_learns_to_call_the_calculator(ray_cluster, tmp_path, engine, calculator_model):
    """The preset end to end, on each engine: after a warm start that shows the tool half the time, GRPO
    raises the reward by calling it more (two-digit products, which the model rarely gets right alone).
    Trajectories reach the trainer with their loss mask, the environment's reward is the score, and a
    bad environment name fails before any work."""
    from distflow_lab.api.runner import load_run_config, open_session
    from distflow_lab.core.errors import ConfigError

    if engine == "vllm":
        pytest.importorskip("vllm") if not os.environ.get("CI") else __import__("vllm")
    base = [f"data.cache_dir={tmp_path}/data", f"trainer.out_dir={tmp_path}/out", f"rollout.engine={engine}", CALCULATOR_WARM_START,
            "data.prompts_per_step=16",  # the preset's 32 take twice as long; 16 x 8 trajectories still show the lift
            "cluster.stage_timeout_s=300",  # the default model path: one cached warm start for both engines
            "rollout.multi_turn.options={max_calls: 2, latency: {median_ms: 20}}"]
    with pytest.raises(ConfigError, match=r"rollout.multi_turn: unknown environment 'calc'"):
        load_run_config("tiny-cpu-calculator", base + ["rollout.multi_turn.env=calc"])
    with open_session(load_run_config("tiny-cpu-calculator", base), progress=False) as s:
        m = [s.step().metrics for _ in range(12)]
        trainer = s.plan.stage("old_log_prob").ranks[0]
        b = s.controller.peek("old_log_prob", trainer, n=1 << 30, columns=["loss_mask", "response_mask", "scores"])
        t, bub, items = s.trajectories().table, s.bubbles().table, s.items()
        path = s.lineage(t["uid"][0])
    # the per-trajectory view, turns in the lineage, environment time a cause of its own
    assert len(t) == 16 * 8 and (t["turns"] == t["tokens_per_turn"].map(len)).all(), t.head()
    assert t["reward"].mean() == pytest.approx(m[-1]["reward/mean"]) and (t["env_s"][t["turns"] > 1] >= 0.02).all()
    assert (t["gen_s"] > 0).all() and (path["turns"] >= 1).all() and len(path) >= 8
    assert (items.loc[items["stage"] == "rollout", "turns"] >= 1).all()
    assert bub["environment"].sum() > 0, bub.sum()
    reward, turns = ([x[k] for x in m] for k in ("reward/mean", "multi_turn/turns_mean"))
    print(engine, "reward", [round(r, 2) for r in reward], "turns", [round(t, 2) for t in turns])
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.08, reward
    assert sum(turns[-3:]) / 3 > sum(turns[:3]) / 3, turns  # by calling the tool more
    assert (b["loss_mask"] <= b["response_mask"]).all() and (b["loss_mask"] < b["response_mask"]).any()
    assert set(b["scores"].tolist()) <= {0.0, 1.0}


GROUPS = "groups={rollout: 1, train: 1}"
ALGOS = {"grpo": [],
         "ppo": ["algorithm.name=ppo", "algorithm.adv_estimator=gae", "actor.use_kl_loss=false"],
         "gspo": ["algorithm.name=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.use_kl_loss=false"],
         "dapo": ["algorithm.name=dapo", "actor.use_kl_loss=false", "algorithm.options.max_rounds=2",
                  "algorithm.options.oversample=1.0"]}
# (algorithm, plane, schedule overrides): every schedule kind of worker groups, both planes that run them, partial
# rollouts on both engines (colocated sync: test_grpo_learns_to_call_the_calculator, GRPO on each engine)
MT_CELLS = [("grpo", "coordinator", [GROUPS, "schedule.kind=async", "schedule.max_staleness=1",  # vLLM: a sync
                                     "schedule.partial_rollout=true", "actor.off_policy=tis",  # preempts the turns
                                     "rollout.engine=vllm", VLLM_EAGER]),  # in flight; they resume under the new weights
            ("ppo", "coordinator", [GROUPS, "schedule.kind=one_step_off", "actor.off_policy=tis"]),
            ("dapo", "coordinator", [GROUPS, "schedule.kind=async", "schedule.max_staleness=1"])]
# (HF partial rollouts with trajectories across weight updates: test_partial_rollouts_carry_... above)


@pytest.mark.full
def test_multi_turn_under_every_algorithm_and_schedule(ray_cluster, tmp_path, calculator_model):
    """PPO, GSPO and DAPO (its later sampling rounds play new trajectories) on worker groups under
    one_step_off and async, in both planes that run groups, and GRPO async with partial rollouts
    (trajectories carried across weight updates) on vLLM: the trained batch keeps its loss mask,
    the schedule's staleness bound holds, and the rollout group follows the training group's versions."""
    from distflow_lab.api.runner import load_run_config, open_session

    base = [f"data.cache_dir={tmp_path}/data", f"trainer.out_dir={tmp_path}/out", "data.prompts_per_step=4", CALCULATOR_WARM_START,
            "rollout.n=4", "rollout.log_probs=true", "cluster.stage_timeout_s=120"]
    for algo, plane, overrides in MT_CELLS:
        if "rollout.engine=vllm" in overrides and not os.environ.get("CI"):
            pytest.importorskip("vllm")
        cfg = load_run_config("tiny-cpu-calculator", base + ALGOS[algo] + overrides + [f"mode={plane}"])
        where = f"{algo} / {plane} / {overrides[1:] or 'colocated'}"
        with open_session(cfg, progress=False) as s:
            m = [s.step().metrics for _ in range(3)]
            b = s.controller.peek("old_log_prob", s.plan.stage("old_log_prob").ranks[0], n=1 << 30,
                                  columns=["loss_mask", "response_mask"])
        assert all("actor/loss" in x and x["multi_turn/turns_mean"] >= 1 for x in m), (where, m[-1])
        assert (b["loss_mask"] <= b["response_mask"]).all() and (b["loss_mask"] < b["response_mask"]).any(), where
        if algo == "ppo":
            assert all("critic/loss" in x for x in m), where
        if algo == "dapo":
            assert max(x["dynamic_sampling/rounds"] for x in m) > 1, where  # new trajectories were played
        if "schedule.partial_rollout=true" in overrides:  # the streaming path ran (HF: across weight updates)
            assert all("rollout/partial_frac" in x for x in m), where
            assert "rollout.engine=vllm" in overrides or sum(x["rollout/partial_frac"] for x in m) > 0, where
        if overrides:
            k = 1
            assert [x["schedule/policy_version"] for x in m] == [1.0, 2.0, 3.0], where
            assert max(x["schedule/staleness"] for x in m) <= k and m[-1]["schedule/rollout_version"] >= 1, where


@pytest.mark.full
def test_the_guess_number_preset_plays_games(ray_cluster, tmp_path, guess_number_model):
    """tiny-cpu-guess-number: after a warm start that shows bisection half the time, trajectories span
    several guesses, each answered by the environment, and some find the secret."""
    from distflow_lab.api.runner import load_run_config, open_session

    cfg = load_run_config("tiny-cpu-guess-number", [f"data.cache_dir={tmp_path}/data", "data.prompts_per_step=8",
                                                   GUESS_NUMBER_WARM_START,
                                                   f"trainer.out_dir={tmp_path}/out", "rollout.n=4"])
    with open_session(cfg, progress=False) as s:
        m = [s.step().metrics for _ in range(2)]
        t = s.trajectories().table
    assert all("actor/loss" in x for x in m) and len(t) == 32
    assert t["turns"].max() > 1 and (t["env_tokens"] > 0).any()  # guesses answered "<;" / ">;"
    assert t["reward"].between(0, 1).all() and (t["reward"] > 0).any()


# ---------------------------------------------------------------- on vLLM
@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory, tok):
    """A fp32 vLLM engine on a tiny checkpoint with 32-token KV blocks (the prefix cache shares whole blocks;
    CPU attention takes multiples of 32)."""
    import torch.distributed as dist

    pytest.importorskip("vllm") if not os.environ.get("CI") else __import__("vllm")  # CI must have it
    from distflow_lab.core.config import VLLMOptions
    from distflow_lab.models.model_dir import save_model_dir
    from distflow_lab.models.rollout_vllm import VLLMRollout

    had_world = dist.is_initialized()
    model = build_tiny_qwen2(tok, seed=0)
    path = tmp_path_factory.mktemp("vllm-mt") / "m"
    save_model_dir(model, tok, path)
    opts = RolloutOptions(n=1, max_response_len=48, log_probs=True, engine="vllm", vllm=VLLMOptions(block_size=32, enforce_eager=True))
    engine = VLLMRollout(str(path), tok, opts, P, dtype="float32", seed=0, sleep_at_start=False)
    yield model, engine
    engine.close()
    if dist.is_initialized() and not had_world:
        dist.destroy_process_group()


@pytest.mark.full
def test_on_vllm_turns_interleave_log_probs_are_the_policys_and_the_prefix_cache_is_reused(vllm_engine, pool, tok):
    from distflow_lab.models.rollout_vllm_stream import VLLMStreamingRollout

    model, engine = vllm_engine
    stream = VLLMStreamingRollout(engine, P, slots=8, n=1, stop_ids=tok(";", add_special_tokens=False)["input_ids"])
    mt = MultiTurnRollout(stream, pool(turns=3), max_turns=4, max_turn_tokens=12, max_response_len=48)
    ids, mask, _ = tokenize_prompts(tok, PROMPTS, P)
    cols = mt.generate(ids, mask, [{} for _ in PROMPTS], n=2, seed=0)
    loss, resp = cols["loss_mask"].bool(), cols["response_mask"].bool()
    assert cols["turns"].tolist() == [3] * 8 and cols["env_reward"].tolist() == [3.0] * 8
    for i in range(8):
        L = int(resp[i].sum())
        assert tok.decode(cols["responses"][i, :L][~loss[i, :L]]) == "ab1;2;"
        prompt = cols["input_ids"][i, :P][cols["attention_mask"][i, :P].bool()]
        context = torch.cat([prompt, cols["responses"][i, :L]])
        want = full_log_probs(model, context, torch.nonzero(loss[i, :L]).squeeze(1) + len(prompt))
        assert torch.allclose(cols["rollout_log_probs"][i, :L][loss[i, :L]], want, atol=1e-4), i
    # a third turn's context past 32 tokens starts with the second's: its first block comes from the cache
    print(mt.stats)
    assert mt.stats.cached_tokens >= 32 and mt.stats.cached_tokens < mt.stats.prompt_tokens, mt.stats
    assert stream.in_flight == 0 and not engine.llm.llm_engine.has_unfinished_requests()
