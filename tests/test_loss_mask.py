"""Multi-turn batches: the environment's tokens sit in the response (attended to, so the model
reads them) but carry no loss. `loss_mask` (1 on the model's tokens) is the mask of every loss
term, estimator and normaliser (`algos.losses.loss_mask_key`): one place, the shared actor update
and the critic update, so GRPO, PPO, DAPO and GSPO all honour it.

The check, on the real training engine (tiny Qwen2, CPU): the gradient of a batch whose last
tokens are environment tokens equals the gradient of the same batch with those tokens removed;
environment tokens in the middle may hold any advantage or log-prob without changing it; and
marking them as the model's does change it (so the test can fail)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from distflow_lab.algos.actor_update import actor_loss
from distflow_lab.algos.estimators import ESTIMATORS, run_estimator
from distflow_lab.core.batch import Batch
from distflow_lab.core.config import ActorOptions, AlgorithmOptions
from distflow_lab.models.fsdp import TrainEngine
from distflow_lab.models.model_dir import build_tiny_qwen2
from distflow_lab.models.sequences import assemble_columns

pytestmark = pytest.mark.usefixtures("one_torch_thread")
R = 8
ENV_TAIL = slice(6, 8)  # the environment's last observation: tokens 6 and 7 of the rows that have them
ENV_MID = slice(2, 4)  # an observation between two model turns


def columns(tok, env_tail: bool, env_mid: bool, junk: float = 0.0) -> dict[str, torch.Tensor]:
    """4 rows of R response tokens. env_tail: tokens 6-7 are the environment's (loss_mask 0); False:
    they are removed (padding). env_mid: tokens 2-3 are the environment's. `junk` fills the
    environment tokens' advantages and log-probs (they must not matter)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (4, 3), generator=g)
    responses = torch.randint(3, 60, (4, R), generator=g)
    response_mask = torch.ones(4, R, dtype=torch.long)
    response_mask[3, 5:] = 0  # a short row
    loss_mask = response_mask.clone()
    if env_tail:
        loss_mask[:3, ENV_TAIL] = 0
    else:
        response_mask[:3, ENV_TAIL] = 0
        loss_mask[:3, ENV_TAIL] = 0
    if env_mid:
        loss_mask[:, ENV_MID] = 0
    cols = assemble_columns(prompts, torch.ones_like(prompts), responses, response_mask)
    lp = -torch.rand(4, R, generator=g)
    env = (response_mask.bool() & ~loss_mask.bool()).float()
    noise = junk * env
    cols.update(old_log_probs=lp + noise, ref_log_probs=lp - 0.3 + noise, rollout_log_probs=lp + 0.05 - noise,
                advantages=torch.randn(4, R, generator=g) * response_mask + noise * 7)
    if env_tail or env_mid:
        cols["loss_mask"] = loss_mask
    return cols


def grads(engine: TrainEngine, cols: dict, a: ActorOptions) -> list[torch.Tensor]:
    key = "loss_mask" if "loss_mask" in cols else "response_mask"
    engine.model.zero_grad(set_to_none=True)
    engine.compute_grads(cols, actor_loss(a), a.loss_agg_mode, with_entropy=a.entropy_coeff > 0, mask_key=key)
    return [p.grad.clone() for p in engine.model.parameters() if p.grad is not None]


@pytest.fixture(scope="module")
def engine(tok):
    torch.manual_seed(0)
    return TrainEngine(build_tiny_qwen2(tok, seed=1), ActorOptions(), device="cpu", use_fsdp=False)


POLICIES = {"grpo/ppo/dapo": "ppo_clip", "gspo": "gspo"}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_environment_tokens_carry_no_loss(engine, tok, policy, agg):
    a = ActorOptions(loss_agg_mode=agg, use_kl_loss=True, entropy_coeff=0.01, off_policy="tis",
                     policy_loss=POLICIES[policy])
    with_env = grads(engine, columns(tok, env_tail=True, env_mid=False), a)
    removed = grads(engine, columns(tok, env_tail=False, env_mid=False), a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(with_env, removed)), (policy, agg)
    mid = grads(engine, columns(tok, env_tail=True, env_mid=True), a)
    mid_junk = grads(engine, columns(tok, env_tail=True, env_mid=True, junk=5.0), a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(mid, mid_junk)), (policy, agg)
    as_model = columns(tok, env_tail=True, env_mid=True, junk=5.0)
    as_model["loss_mask"] = as_model["response_mask"].clone()  # the same tokens, carrying loss
    changed = grads(engine, as_model, a)
    assert not all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(mid_junk, changed))


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_estimators_give_environment_tokens_no_advantage(tok, estimator):
    """The outcome lands on the last model token, and every estimator leaves the environment's tokens
    at 0 (GAE and REINFORCE++ carry their returns through them, as through padding)."""
    cols = columns(tok, env_tail=True, env_mid=True)
    cols["values"] = torch.rand(4, R)
    cols["scores"] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    b = Batch(cols, {"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    adv, ret = run_estimator(estimator, b, AlgorithmOptions())
    env = cols["response_mask"].bool() & ~cols["loss_mask"].bool()
    assert (adv[env] == 0).all() and (ret[env] == 0).all(), estimator
    assert (adv[cols["loss_mask"].bool()] != 0).any(), estimator
