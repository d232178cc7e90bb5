"""Supervised warm-up: teach the base model the answer format (prompt ->
ground truth + eos) for a few steps, so RL starts from a policy whose reward
is not zero. Runs once in the driver process (a tiny model trains in seconds
on a CPU) and is cached on disk next to the base model."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from distflow_lab.core.config import RunConfig
from distflow_lab.datasets.schema import read_rows
from distflow_lab.core.config import Optim
from distflow_lab.models.environment import demonstrations, env_label
from distflow_lab.models.fsdp import TrainEngine, sft_loss_fn
from distflow_lab.models.model_dir import has_model, load_model_dir, save_model_dir
from distflow_lab.models.sequences import build_sft_batch


def warm_start_dir(cfg: RunConfig, data_path: str) -> Path:
    """Named by everything that changes the result, the training file's name included
    (a generated task's file is named by its size and difficulty)."""
    ws = cfg.model.warm_start
    tools = f"-tool{ws.tool_demos:g}-{env_label(cfg.rollout.multi_turn.env)}" if ws.tool_demos else ""
    return Path(f"{cfg.model.path}-sft{ws.steps}-lr{ws.lr:g}-b{ws.batch_size}-s{cfg.seed}-{Path(data_path).stem}"
                f"{tools}")


def warm_start(cfg: RunConfig, data_path: str, progress: bool = True) -> Path:
    """SFT `cfg.model.path` on the training set's (prompt, ground truth) pairs; return the new model dir."""
    ws, out = cfg.model.warm_start, warm_start_dir(cfg, data_path)
    if ws.steps == 0 or has_model(out):
        return out if ws.steps else Path(cfg.model.path)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    model, tok = load_model_dir(cfg.model.path)
    engine = TrainEngine(model, Optim(lr=ws.lr), use_fsdp=False, device="cpu",
                         micro_token_budget=cfg.actor.micro_token_budget)
    rows = read_rows(data_path)
    prompts = [r["prompt"] for r in rows]
    targets = [r["reward_model"]["ground_truth"] for r in rows]
    rng = np.random.default_rng(cfg.seed)
    if ws.tool_demos:  # these rows are shown as the environment's worked trajectory instead
        shown = np.flatnonzero(rng.random(len(rows)) < ws.tool_demos).tolist()
        for i, demo in zip(shown, demonstrations(cfg.rollout.multi_turn.env, [rows[i] for i in shown])):
            targets[i] = demo
    bar = tqdm(range(ws.steps), desc="SFT warm-up", disable=not progress, leave=False)
    for _ in bar:
        idx = rng.choice(len(rows), size=min(ws.batch_size, len(rows)), replace=False)
        cols, _ = build_sft_batch(tok, [prompts[i] for i in idx], [targets[i] for i in idx],
                                  cfg.data.max_prompt_len, cfg.rollout.max_response_len)
        m = engine.train_step(cols, sft_loss_fn, mask_key="loss_mask" if "loss_mask" in cols else "response_mask")
        bar.set_postfix(loss=round(m["loss"], 4))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save_model_dir(model, tok, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written model is never picked up
    return out
