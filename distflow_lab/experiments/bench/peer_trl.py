"""The lab's GRPO against Hugging Face TRL's `GRPOTrainer` on the same work: one preset, the same
converted checkpoint, the same prompts in the same steps (TRL gets the rows the lab's sharded loaders
serve, unshuffled), the same group size, response length, sampling, reward function, optimizer and
loss, run one after the other in one command. Per system: step seconds (median, min, max), split into
generation / old-policy log-prob / update (and the rest: reward, advantage, data movement), generated
tokens per second end to end, reward per step, and greedy accuracy on the fixed held-out set after
training (`base_eval`: the lab's checkpoint through `evaluate`, TRL's trained model through `score`).

    distflow-lab bench peer --against trl --preset smollm2-arith --steps 4 --json benchmarks/results/peer_trl.json
    distflow-lab bench peer --against trl --steps 1 --prompts 2 --n 2 --max-tokens 8 --rows 4 --engine hf  # smoke

Both use the whole machine: the lab runs its workers (cluster.world_size, FSDP2 over gloo) with their
torch threads (cores // workers each); TRL runs in this one process with as many torch threads as
the lab's workers together. Run it on an otherwise idle machine: multi-threaded torch in one process
loses far more to other load than single-threaded workers do (on 2 busy cores HF generate with 2
threads ran 20x slower than with 1). The lab generates with `--engine` (vLLM's CPU build or HF
generate), TRL with transformers `generate` (its vLLM path wants a vLLM server or a colocated GPU
engine).

What is timed. The lab: from each step's spans, the slowest worker's compute in the rollout stage
(with the weight sync into the rollout engine), in old_log_prob and ref_log_prob, and in
actor_update; the rest of the step wall (reward, advantage, data plane) is `other_s`. TRL: step
begin to end (a TrainerCallback); its model's `generate` (wrapped); the log-prob passes it runs
while scoring the batch (the old policy when it needs one, the reference with a KL term); update =
the step after the batch is scored (loss forward, backward, optimizer step); `other_s` = decoding,
reward, advantage. Generated tokens: response lengths (eos included) summed over the step's
responses. The first step of each system includes warm-up (engine start, first allocations): with
more than one step, medians, min/max and tokens/s are over the steps after the first, and
`first_step_s` shows the first.

Settings the two cannot share (`trl_config` maps the rest; `tests/test_bench_peer.py` checks it):
- The old policy. TRL skips the old-policy log-prob pass when it updates once per generation
  (num_iterations 1, steps_per_generation 1): the ratio is taken against the detached current
  log-probs. The lab does the same with `actor.old_log_prob: from_update` (the smollm2 presets);
  with `recompute` it runs the old_log_prob stage, a forward over the batch, timed as `logprob_s`.
- The lab's dual clip for negative advantages (`actor.clip_ratio_c`) has no TRL counterpart (TRL's
  `delta` clamps the ratio from above for every token, a different rule). On-policy, with one
  update per batch, the ratio is 1 and neither clip acts.
- The group-normalised advantage divides by std + 1e-4 in TRL (fixed), std + 1e-6 in the lab.
- With a KL loss (actor.use_kl_loss; smollm2-arith has none): both use k3, the lab's low_var_kl with
  the log-ratio clamped to +-20 and the KL to +-10, TRL's unclamped.
- Sampling: the same prompts in the same steps, but each system draws from its own random stream,
  so the completions (and rewards) differ by sampling noise.
- TRL applies `weight_decay` to all but bias and norm weights; the lab's AdamW to every parameter
  (the same with the presets' weight_decay 0).
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from distflow_lab.experiments.bench.common import print_table, summarize, write_json
from distflow_lab.observe.span_stats import stage_breakdown

PEER_ALGORITHMS = ("grpo",)  # what `bench peer` maps onto TRL's GRPOTrainer (the same estimator and clipped loss)
PARTS = ("gen_s", "logprob_s", "update_s", "other_s")
COLUMNS = ["system", "engine", "processes", "threads", "steps", "first_step_s", "step_s_median", "step_s_min",
           "step_s_max", *(f"{p}_median" for p in PARTS), "tokens_per_step", "tokens_per_s", "tps_over_trl",
           "reward_per_step", "heldout_accuracy", "heldout_format_rate"]


def overrides_for(engine: str = "vllm", prompts: int | None = None, n: int | None = None,
                  max_tokens: int | None = None) -> list[str]:
    """Run-config overrides of the preset that both systems run: the lab's rollout engine, and the
    smaller sizes of a smoke run (None: the preset's)."""
    sizes = {"data.prompts_per_step": prompts, "rollout.n": n, "rollout.max_response_len": max_tokens}
    return [f"rollout.engine={engine}", *(f"{k}={v}" for k, v in sizes.items() if v is not None)]


def trl_config(cfg, steps: int, out_dir: str | Path):
    """TRL's GRPOConfig for the lab's RunConfig `cfg`: the same batch, sampling, optimizer and loss."""
    from trl import GRPOConfig

    a, r = cfg.actor, cfg.rollout
    if a.mini_batches != 1:
        raise ValueError(f"actor.mini_batches={a.mini_batches}: the TRL peer maps one optimizer step per RL step")
    return GRPOConfig(
        output_dir=str(out_dir), report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        seed=cfg.session.seed, data_seed=cfg.session.seed,
        shuffle_dataset=False,  # the dataset is already the lab's rows in the lab's order (lab_prompt_rows)
        use_cpu=True, bf16=False, model_init_kwargs={"dtype": cfg.model.dtype},
        gradient_checkpointing=a.gradient_checkpointing,
        # one generation, one optimizer step per RL step: prompts x n completions, on-policy
        max_steps=steps, per_device_train_batch_size=cfg.data.prompts_per_step * r.n, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=r.n,
        max_completion_length=r.max_response_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        # the lab's actor: torch AdamW at a constant lr (models/fsdp.py builds no scheduler), clipped grad norm
        optim="adamw_torch", learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=a.betas[0], adam_beta2=a.betas[1], adam_epsilon=a.eps, weight_decay=a.weight_decay,
        max_grad_norm=max(a.grad_clip, 0.0),
        # the loss: PPO clip at the lab's ratios, KL to the reference only with actor.use_kl_loss (k3 both),
        # advantages (s - mean) / std within each group; loss_type "dapo" divides the summed token losses by
        # the step's token count, the lab's loss_agg_mode token-mean over the global batch
        beta=a.kl_loss_coef if a.use_kl_loss else 0.0, epsilon=a.clip_ratio_low, epsilon_high=a.clip_ratio_high,
        scale_rewards="group", loss_type="dapo", mask_truncated_completions=False, entropy_coef=a.entropy_coeff,
    )


def lab_prompt_rows(cfg, data_path: str, steps: int) -> list[dict]:
    """The rows the lab's data stage serves in `steps` steps, in order (each step: rank 0's rows, then
    rank 1's, ...), from the same loaders the workers build (`cfg`: the prepared config)."""
    from distflow_lab.api.runner import build_dag
    from distflow_lab.datasets.loader import make_loader

    first = build_dag(cfg, data_path).plan(cfg.session.cluster.world_size).stages[0]
    loaders = [make_loader(first.data, rank, first.dp, cfg.session.seed) for rank in range(first.dp)]
    rows = []
    for _ in range(steps):
        for loader in loaders:
            objects = loader.next_batch().objects
            rows += [dict(zip(objects, values)) for values in zip(*objects.values())]
    return rows


def lab_threads(cfg) -> int:
    """torch threads of the lab's workers together (the controller's default: cores // workers each)."""
    c = cfg.session.cluster
    return (c.threads_per_worker or max(1, (os.cpu_count() or 1) // c.world_size)) * c.world_size


def summary(system: str, per_step: list[dict], heldout, **info: Any) -> dict:
    """One system's record: medians over the steps after the first (all of them with one step)."""
    measured = per_step[1:] if len(per_step) > 1 else per_step
    step = summarize(r["step_s"] for r in measured)
    return {"system": system, **info, "steps": len(per_step), "measured_steps": len(measured),
            "first_step_s": per_step[0]["step_s"], "step_s_median": step["median"], "step_s_min": step["min"],
            "step_s_max": step["max"], **{f"{p}_median": float(np.median([r[p] for r in measured])) for p in PARTS},
            "tokens_per_step": float(np.median([r["tokens"] for r in measured])),
            "tokens_per_s": sum(r["tokens"] for r in measured) / sum(r["step_s"] for r in measured),
            "reward_per_step": [round(r["reward"], 4) for r in per_step],
            "heldout_accuracy": heldout.accuracy, "heldout_format_rate": heldout.format_rate,
            "heldout_rows": heldout.rows, "per_step": per_step}


# ---- the lab ---------------------------------------------------------------------------------


def lab_step(rep, responses: int) -> dict:
    """One lab step: wall seconds; per stage the slowest worker's compute (the rollout's with its weight
    sync); the rest of the step (reward, advantage, data plane) in other_s; generated tokens, mean reward."""
    crit = stage_breakdown(rep.spans)

    def seconds(stage: str, phases: tuple[str, ...] = ("compute",)) -> float:
        return float(sum(crit.loc[stage].get(p, 0.0) for p in phases)) if stage in crit.index else 0.0

    row = {"step_s": rep.wall_seconds, "gen_s": seconds("rollout", ("compute", "weight_sync")),
           "logprob_s": seconds("old_log_prob") + seconds("ref_log_prob"), "update_s": seconds("actor_update")}
    row["other_s"] = max(0.0, row["step_s"] - row["gen_s"] - row["logprob_s"] - row["update_s"])
    m = rep.metrics
    return {**row, "tokens": m["response_length/mean"] * responses, "reward": m["reward/mean"]}


def run_lab(cfg, steps: int, rows: int, workdir: Path) -> dict:
    import ray

    from distflow_lab.api.runner import rl_session
    from distflow_lab.experiments.base_eval import evaluate
    from distflow_lab.runtime.cluster import shutdown

    per_step, ours = [], not ray.is_initialized()  # a cluster started here ends here; a notebook's stays
    s = rl_session(cfg, progress=False, fresh_workers=True)  # its workers end at close: TRL gets the cores
    try:
        for _ in range(steps):
            per_step.append(lab_step(s.step(), cfg.data.prompts_per_step * cfg.rollout.n))
        checkpoint = s.save_checkpoint(workdir / "lab-checkpoint")
    finally:
        s.close()
        if ours:
            shutdown()
    heldout = evaluate(cfg, rows=rows, checkpoint=checkpoint, progress=False)
    c = cfg.session.cluster
    return summary("distflow_lab", per_step, heldout, engine=cfg.rollout.engine, processes=c.world_size,
                   threads=lab_threads(cfg))


# ---- TRL -------------------------------------------------------------------------------------


def _timed_trainer():
    """GRPOTrainer with clocks: instrumentation only, every override calls TRL's own method."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self, trainer: "TimedGRPOTrainer") -> None:
            self.trainer = trainer

        def on_step_begin(self, args, state, control, **kwargs):
            self.trainer.peer_now = {"t0": time.perf_counter(), "gen_s": 0.0, "logprob_s": 0.0, "scored_s": 0.0,
                                     "tokens": 0, "rewards": []}

        def on_step_end(self, args, state, control, **kwargs):
            now = self.trainer.peer_now
            step_s = time.perf_counter() - now["t0"]
            self.trainer.peer_steps.append({
                "step_s": step_s, "gen_s": now["gen_s"], "logprob_s": now["logprob_s"],
                "update_s": step_s - now["scored_s"], "other_s": now["scored_s"] - now["gen_s"] - now["logprob_s"],
                "tokens": now["tokens"], "reward": float(np.mean(now["rewards"]))})

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.peer_steps: list[dict] = []
            self.peer_now: dict = {}
            self._peer_scoring = False
            super().__init__(*args, **kwargs)
            self.add_callback(StepClock(self))
            model = self.accelerator.unwrap_model(self.model)
            generate = model.generate

            def timed_generate(*a: Any, **k: Any):
                t0 = time.perf_counter()
                try:
                    return generate(*a, **k)
                finally:
                    self.peer_now["gen_s"] += time.perf_counter() - t0

            model.generate = timed_generate  # instrumentation: the unwrapped model TRL generates with

        def _generate_and_score_completions(self, *args: Any, **kwargs: Any):
            t0, self._peer_scoring = time.perf_counter(), True
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                self._peer_scoring = False
                self.peer_now["scored_s"] += time.perf_counter() - t0

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                if self._peer_scoring:  # old-policy / reference passes; the loss's own forward is the update's
                    self.peer_now["logprob_s"] += time.perf_counter() - t0

        def count(self, tokens: int, rewards: list[float]) -> None:
            self.peer_now["tokens"] += tokens
            self.peer_now["rewards"] += rewards

    return TimedGRPOTrainer


def trl_reward(cfg, trainer_ref: list):
    """TRL's reward function: the lab's (make_reward_fn: by data source, last_number_reward for the
    arithmetic questions) on each completion's text; it also counts the step's tokens and rewards."""
    from distflow_lab.algos.engine_setup import make_reward_fn

    reward = make_reward_fn(cfg.reward)

    def lab_reward(completions, ground_truth, data_source, completion_ids, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        scores = [float(reward(src, text, truth)) for src, text, truth in zip(data_source, texts, ground_truth)]
        trainer_ref[0].count(sum(len(ids) for ids in completion_ids), scores)
        return scores

    return lab_reward


def run_trl(cfg, prepared, data_path: str, steps: int, rows: int, workdir: Path) -> dict:
    # TRL checks the installed vLLM's version on import; its vLLM path is not used here
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    import datasets
    import torch
    import trl
    from transformers import PrinterCallback

    from distflow_lab.experiments.base_eval import eval_config, heldout_rows, score

    data = datasets.Dataset.from_list([
        {"prompt": list(r["prompt"]), "ground_truth": str(r["reward_model"]["ground_truth"]),
         "data_source": r["data_source"]} for r in lab_prompt_rows(prepared, data_path, steps)])
    threads, before = lab_threads(cfg), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer_ref: list = []
        trainer = _timed_trainer()(model=prepared.model.path, reward_funcs=[trl_reward(cfg, trainer_ref)],
                                   args=trl_config(cfg, steps, workdir / "trl"), train_dataset=data)
        trainer_ref.append(trainer)
        trainer.remove_callback(PrinterCallback)  # no log dict printed per step
        trainer.train()
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.gradient_checkpointing_disable()
        model.config.use_cache = True
        ecfg = eval_config(cfg, progress=False)
        torch.manual_seed(ecfg.session.seed)  # as evaluate() does before scoring
        heldout = score(model.eval(), trainer.processing_class, ecfg, heldout_rows(ecfg, rows), progress=False,
                        label=f"trl {trl.__version__}")
    finally:
        torch.set_num_threads(before)
    return summary("trl", trainer.peer_steps, heldout, engine="transformers generate", processes=1,
                   threads=threads, trl_version=trl.__version__)


def run(preset: str = "smollm2-arith", steps: int = 4, rows: int = 64, engine: str = "vllm",
        prompts: int | None = None, n: int | None = None, max_tokens: int | None = None,
        json_path: str | None = None) -> list[dict]:
    """The lab, then TRL, on the preset (with the overrides of `overrides_for`); prints the table and
    writes the records (with every step's numbers under `per_step`) to `json_path`."""
    from distflow_lab.api.runner import load_run_config, prepare

    cfg = load_run_config(preset, overrides_for(engine, prompts, n, max_tokens))
    prepared, data_path = prepare(cfg, progress=False)  # the converted checkpoint and the parquet, cached
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        lab = run_lab(cfg, steps, rows, Path(tmp))
        peer = run_trl(cfg, prepared, data_path, steps, rows, Path(tmp))
    records = [lab, peer]
    for r in records:
        r["tps_over_trl"] = r["tokens_per_s"] / peer["tokens_per_s"]
    warm = f"medians over steps 2..{steps} (step 1: warm-up)" if steps > 1 else "one step, warm-up included"
    print_table(records, COLUMNS, title=f"bench peer: distflow_lab vs TRL {peer['trl_version']} GRPOTrainer, "
                f"{cfg.name}: {cfg.data.prompts_per_step} prompts x {cfg.rollout.n}, <= {cfg.rollout.max_response_len} "
                f"tokens, {warm}; held-out accuracy on {rows} rows, greedy")
    write_json(records, json_path)
    return records
