"""Every algorithm under every schedule and data plane a user can configure, on real
engines (tiny Qwen2, FSDP2 over gloo, HF rollout), two or three updates each. Each
combination runs or fails with a named error; none hangs. On worker groups the
rollout group's policy version advances with every update, and with k = 0 the
rollout's log-probs equal the trainer's current policy's (the one actor update
publishes for every algorithm: DAPO and GSPO once did not, and nothing noticed)."""
from __future__ import annotations

import pytest
import torch

import distflow_lab as lab
from distflow_lab.api.runner import load_run_config, open_session
from distflow_lab.core.errors import ConfigError
from distflow_lab.experiments.schedule_consistency import compare, tiny_config
from distflow_lab.runtime.worker_pool import POOL

from .conftest import VLLM_EAGER
from .notebook_cells import notebook_cells

# notebook 02's CISPO (a loss and a declaration) and OPO (an estimator), registered from its cells as a user does:
# the workers get them with the session (core/registry.py), so they meet the planes, schedules and vLLM like the rest
NOTEBOOK_02 = notebook_cells("02_build_your_own.ipynb", "cispo-loss", "opo-estimator", OVERRIDES=[])

# preset, extra overrides: every algorithm and every estimator a preset allows. GSPO trains LoRA adapters
# (models/lora.py: a sync sends the adapters, the rollout merges them): LoRA meets every plane, schedule and
# engine through GSPO's cells, full fine-tuning through the others (the loss and the update are the same
# code either way; GSPO's full fine-tuning learns in tests/test_rl_dapo_gspo.py)
ALGORITHMS = {
    "grpo": ("tiny-cpu-grpo", []),
    "dr_grpo": ("tiny-cpu-grpo", ["algorithm.name=dr_grpo"]),  # declared over GRPO: its estimator and aggregation
    "rloo": ("tiny-cpu-grpo", ["algorithm.name=rloo"]),
    "reinforce_plus_plus": ("tiny-cpu-grpo", ["algorithm.name=reinforce_plus_plus"]),
    "ppo": ("tiny-cpu-ppo", []),
    "dapo": ("tiny-cpu-dapo", ["algorithm.options.max_rounds=2"]),
    "gspo_lora": ("tiny-cpu-gspo", ["actor.lora={rank: 4, alpha: 8}"]),
    "notebook_cispo_opo": ("tiny-cpu-grpo", ["algorithm.name=cispo", "algorithm.adv_estimator=opo"]),
}
pytestmark = pytest.mark.full  # the whole algorithm x schedule x engine matrix: the full tier

GROUPS = "groups={rollout: 1, train: 1}"
# (schedule, plane, overrides): colocated sync in every plane; on worker groups sync (k = 0), one step
# off and async in the planes that run groups (centralized refuses groups: REFUSED below)
SCHEDULES = [
    ("colocated", "centralized", []),
    ("colocated", "coordinator", []),
    ("colocated", "distributed", []),
    ("groups-sync", "coordinator", [GROUPS]),
    ("groups-sync", "distributed", [GROUPS]),
    ("one_step_off", "coordinator", [GROUPS, "schedule.kind=one_step_off", "actor.off_policy=tis"]),
    ("one_step_off", "distributed", [GROUPS, "schedule.kind=one_step_off", "actor.off_policy=decoupled"]),
    ("async", "coordinator", [GROUPS, "schedule.kind=async", "schedule.max_staleness=2", "actor.off_policy=decoupled"]),
    ("async", "distributed", [GROUPS, "schedule.kind=async", "schedule.max_staleness=2",
                              "schedule.partial_rollout=true", "actor.off_policy=tis"]),
]
UPDATES = 3
REFUSED = [  # what a user can write but the centralized plane cannot run: a named error before any work
    ([GROUPS], "worker groups .* need the coordinator or distributed data plane"),
    ([GROUPS, "schedule.kind=one_step_off"], "schedule 'one_step_off' needs the coordinator or distributed"),
    ([GROUPS, "schedule.kind=async"], "schedule 'async' needs the coordinator or distributed"),
]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("matrix")
    return [f"trainer.out_dir={d}/out",
            "model.warm_start.steps=0", "cluster.world_size=2", "data.prompts_per_step=2", "rollout.n=4",
            "rollout.log_probs=true", "cluster.stage_timeout_s=60",
            "actor.entropy_coeff=0.01"]  # no warm start: reward 0, so the entropy term is what moves the weights


# The estimator variants differ from grpo only in the advantage function (tests/test_verl_parity.py,
# test_actor_update.py): one cell each, async on the distributed plane; REINFORCE++ also dp = 2 colocated
# (batch-wide whitening over gloo).
# Colocated sync runs on the distributed plane for GRPO, PPO and GSPO: tests/test_rl.py runs GRPO and PPO
# colocated in all three planes with identical metrics, and the planes move the same columns for every
# algorithm. DAPO, whose dynamic sampling changes the row count, runs colocated in all three. On worker
# groups GRPO runs every schedule kind on both planes; DAPO, PPO and GSPO run each kind on one plane,
# alternating the planes between them.
PARTIAL_COORDINATOR = ("async", "coordinator", [GROUPS, "schedule.kind=async", "schedule.max_staleness=1",
                                               "schedule.partial_rollout=true", "actor.off_policy=decoupled"])
CELLS = {"grpo": SCHEDULES[3:],  # (colocated on the distributed plane: PPO's, GSPO's and REINFORCE++'s cells)
         "dapo": [*SCHEDULES[:3], SCHEDULES[3], SCHEDULES[6], SCHEDULES[7]],
         "ppo": [SCHEDULES[2], SCHEDULES[4], SCHEDULES[5], SCHEDULES[8]],
         "gspo_lora": [SCHEDULES[2], SCHEDULES[3], SCHEDULES[6], SCHEDULES[7]],
         "dr_grpo": [SCHEDULES[8]], "rloo": [PARTIAL_COORDINATOR], "reinforce_plus_plus": [SCHEDULES[2], SCHEDULES[8]],
         "notebook_cispo_opo": [*SCHEDULES[:3], SCHEDULES[5], SCHEDULES[8]]}  # every plane; one step off; async


def ran_the_notebooks_code(s, m: dict, where: str) -> None:
    """The workers ran notebook 02's loss and estimator, not a built-in one: no dual-clip metric (PPO's
    loss logs it, CISPO's does not), and the advantages on a worker are OPO's of that worker's batch."""
    assert "actor/clipfrac" in m and "actor/clipfrac_lower" not in m, (where, sorted(m))
    b = s.output("advantage")
    opts = s.config.algo.algorithm
    torch.testing.assert_close(b["advantages"], NOTEBOOK_02.opo(lab.EstimatorInputs(b, None, opts))[0], msg=where)


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_schedule_and_plane(ray_cluster, small, algo):
    preset, extra = ALGORITHMS[algo]
    for overrides, error in REFUSED:
        with pytest.raises(ConfigError, match=error):
            load_run_config(preset, small + extra + overrides + ["mode=centralized"])
    cells = CELLS[algo]
    for schedule, plane, overrides in cells:
        cfg = load_run_config(preset, small + extra + overrides + [f"mode={plane}"])
        with open_session(cfg, progress=False) as s:  # colocated: 2 updates show the sync; groups: 3 show the lag
            reports = [s.step() for _ in range(2 if schedule == "colocated" else UPDATES)]
            if algo == "notebook_cispo_opo":
                ran_the_notebooks_code(s, reports[-1].metrics, f"{schedule} / {plane}")
            if algo == "grpo" and schedule == "groups-sync":  # the figure: 3 per-step series + the token histogram
                fig = s.mismatch()
                assert [t.type for t in fig.data] == ["scatter"] * 3 + ["histogram"] and len(fig.data[3].x) > 0
            if algo == "gspo_lora" and schedule != "colocated":  # each sync carried the adapters (async k = 2
                syncs = s.weight_sync()  # may generate every batch at version 0: no pull)
                sides = set(syncs["side"]) if schedule == "async" else {"publish", "pull"}
                assert set(syncs["mode"]) == {"lora"} and set(syncs["side"]) == sides, (
                    schedule, plane, syncs[["batch_id", "side", "mode", "tensors"]].to_string())
                assert syncs["tensors"].max() == 2 * 7 * 2, syncs  # A and B of 7 linear layers x 2 blocks
        where = f"{algo} / {schedule} / {plane}"
        m = [r.metrics for r in reports]
        assert all("actor/loss" in x and "reward/mean" in x for x in m), where
        diff = [x["rollout/logprob_diff_max"] for x in m]
        if schedule in ("colocated", "groups-sync"):  # the rollout held the trainer's current weights
            assert max(diff) < 1e-4, (where, diff)
        elif schedule == "one_step_off" and algo in ("grpo", "gspo_lora"):  # it lags one update: the weights moved
            assert diff[-1] > 1e-6, (where, diff)
        lag = [x["actor/stale_token_frac"] for x in m]
        if schedule in ("colocated", "groups-sync"):
            assert lag == [0.0] * len(m), (where, lag)  # every token from the version being trained
        elif schedule == "one_step_off":
            assert lag[0] == 0.0 and lag[-1] == 1.0, (where, lag)  # generated one update behind
        if schedule == "colocated":
            continue
        versions = [x["schedule/policy_version"] for x in m]
        assert versions == [1.0, 2.0, 3.0], (where, versions)  # the training group published every update
        k = {"groups-sync": 0, "one_step_off": 1, "async": 2}[schedule]
        k = min([k, *(int(o.split("=")[1]) for o in overrides if o.startswith("schedule.max_staleness="))])
        stale = [x["schedule/staleness"] for x in m]
        assert max(stale) <= k, (where, stale)
        rollout = [x["schedule/rollout_version"] for x in m]
        assert rollout[-1] >= UPDATES - 1 - k, (where, rollout)  # the rollout group pulled them
        if k < 2:
            assert rollout[-1] > 0, (where, rollout)  # (async k = 2 may generate all three batches at version 0)
        if k == 0:
            assert rollout == [0.0, 1.0, 2.0], (where, rollout)
        if "actor.off_policy=decoupled" in overrides or "actor.off_policy=tis" in overrides:
            assert all("actor/is_ratio_mean" in x for x in m), where


def test_a_checkpoint_on_worker_groups_resumes_at_its_policy_version(ray_cluster, small, tmp_path):
    """The loaded policy is published again and the rollout group continues from it (before, it restarted
    from the initial weights, and every batch looked too stale to train); the batch that was in flight at
    the checkpoint (batch 2, generated from version 1) is replayed at its own version, as the undisturbed
    run trained it."""
    cfg = load_run_config("tiny-cpu-grpo", small + [GROUPS, "schedule.kind=one_step_off", "mode=coordinator"])
    with open_session(cfg, progress=False) as s:
        s.step(), s.step()
        ckpt = s.save_checkpoint(tmp_path / "ckpt")
    with open_session(cfg, progress=False) as s:
        assert s.load_checkpoint(ckpt) == 2
        m = [s.step().metrics for _ in range(2)]
    assert [x["schedule/policy_version"] for x in m] == [3.0, 4.0]
    assert [x["schedule/rollout_version"] for x in m] == [1.0, 2.0], m  # the replayed batch, then the loaded policy
    assert max(x["schedule/staleness"] for x in m) <= 1


def test_async_k0_is_sync_and_k1_is_one_step_off_on_a_real_engine(ray_cluster, tmp_path):
    """verl's fully-async users ask for it ("on-policy mode (staleness=0) didn't match main_ppo"): on
    the HF engine and FSDP2, async with k = 0 gives the sync schedule's metrics and async k = 1
    one_step_off's, to the bit (same seeds, same versions pulled); on vLLM with
    `python -m distflow_lab.experiments.schedule_consistency --engine vllm` (the scheduler's rule itself:
    tests/test_schedules.py on the synthetic workload)."""
    table = compare(tiny_config("hf", str(tmp_path)), steps=UPDATES)
    assert table["equal"].all(), table.to_string()
    assert table["staleness_max"].tolist() == [0.0, 1.0]  # k = 1 did run one behind


# On the real vLLM engine: every plane, every kind of schedule and every algorithm, in 7 cells (the
# engine meets each plane and each schedule; the algorithm meets only the rollout's columns, and DAPO's
# dynamic sampling, which generates again). Each schedule kind runs on one of the two planes that take
# groups: groups-sync and async on the coordinator, one step off and async on the distributed plane.
# Async runs with partial rollouts on both planes that take it (vLLM's engine steps, rollout_vllm_stream.py).
TP2 = ["rollout.tp=2"]  # one vLLM engine over both workers, tensor parallel over gloo
VLLM_CELLS = {"grpo": [("colocated-tp2", "coordinator", TP2)],  # colocated tp=1: DAPO's cell; async with
              # partial rollouts on vLLM: PPO's cell here and tests/test_multiturn_rollout.py
              "dapo": [SCHEDULES[0]], "gspo_lora": [SCHEDULES[3], SCHEDULES[6]], "ppo": [PARTIAL_COORDINATOR],
              "notebook_cispo_opo": [SCHEDULES[1]]}


@pytest.mark.budget(180, reason="up to three vLLM sessions (engine builds of ~20 s each) in one cell")
@pytest.mark.parametrize("algo", list(VLLM_CELLS))
def test_every_algorithm_on_vllm(ray_cluster, small, algo):
    """The same walk on the real vLLM engine (its CPU build): colocated beside FSDP2 (a sync each update,
    also tensor parallel over two workers), and on a generation group of its own (a torch.distributed
    world per group: vLLM builds its groups over the world, which a training group that never builds an
    engine would never join)."""
    preset, extra = ALGORITHMS[algo]
    for schedule, plane, overrides in VLLM_CELLS[algo]:
        cfg = load_run_config(preset, small + extra + overrides + [f"mode={plane}", "rollout.engine=vllm", VLLM_EAGER])
        refused = POOL.stats.refused
        with open_session(cfg, progress=False) as s:  # colocated: 2 updates show the sync; groups: 3 show the lag
            m = [s.step().metrics for _ in range(2 if schedule.startswith("colocated") else UPDATES)]
            modes = set(s.weight_sync().get("mode", ["colocated"]))
            if algo == "notebook_cispo_opo":
                ran_the_notebooks_code(s, m[-1], f"vllm / {schedule} / {plane}")
        where = f"vllm / {algo} / {schedule} / {plane}"
        assert modes == ({"lora"} if algo == "gspo_lora" else {"full"} if "groups" in str(overrides) else
                         {"colocated"}), (where, modes)
        assert POOL.stats.refused == refused + 1, where  # vLLM's shutdown ended the world: never parked
        diff = [x["rollout/logprob_diff_max"] for x in m]
        if schedule.startswith("colocated") or schedule == "groups-sync":
            assert max(diff) < 1e-4, (where, diff)  # synced after every update: vLLM holds the trainer's weights
        if schedule.startswith("colocated"):
            continue
        assert [x["schedule/policy_version"] for x in m] == [1.0, 2.0, 3.0], where
        k = {"groups-sync": 0, "one_step_off": 1, "async": 2}[schedule]
        k = min([k, *(int(o.split("=")[1]) for o in overrides if o.startswith("schedule.max_staleness="))])
        assert max(x["schedule/staleness"] for x in m) <= k, where
        if k == 0:
            assert [x["schedule/rollout_version"] for x in m] == [0.0, 1.0, 2.0], where
        if "schedule.partial_rollout=true" in overrides:  # the streaming path ran (vLLM's engine steps)
            assert all("rollout/partial_frac" in x for x in m), (where, m[-1])
        if schedule == "one_step_off":
            assert m[-1]["schedule/rollout_version"] >= 1 and diff[-1] > 1e-6, (where, m[-1])  # it pulled, and lags
