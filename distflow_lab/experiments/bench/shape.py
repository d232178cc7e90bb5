"""The shape of the benchmarks' synthetic GRPO DAG, in plain Python: the CLI
checks a benchmark's arguments with it before anything heavy is imported."""
from __future__ import annotations


def rollout_tp_for(workers: int, rollout_tp: int) -> int:
    """The rollout runs at tensor parallel `rollout_tp` where it divides `workers` (one
    redistribution per step into the training layout), else at tp 1."""
    return rollout_tp if workers % rollout_tp == 0 and workers >= rollout_tp else 1


def shape_problem(workers: int, batch: int, n: int, rollout_tp: int) -> str | None:
    """Why (workers, batch, n) cannot run, naming the arguments and values that would; None if it can."""
    if batch % n:
        return f"--batch {batch} is not a multiple of --n {n} (responses per prompt)"
    dp = workers // rollout_tp_for(workers, rollout_tp)
    prompts = batch // n
    if prompts % dp:
        fits = [w for w in range(1, 65) if prompts % (w // rollout_tp_for(w, rollout_tp)) == 0]
        return (f"--workers {workers} cannot share --batch {batch}: its {prompts} prompts (batch / n) do not split "
                f"over {dp} data-parallel rollout ranks; workers that fit this batch: {fits[:12]}, or a --batch "
                f"that is a multiple of {n * dp}")
    return None
