"""How a streaming rollout keeps its slots busy: one rule for the real engines (hf:
models/rollout_stream.py, vLLM: models/rollout_vllm_stream.py), the synthetic decoder
(experiments/synthetic.py) and the schedule replay's decoder (experiments/schedule_replay.py),
so that a replay of partial rollouts admits prompts when the engines do. Free of torch."""
from __future__ import annotations

from typing import Any, Callable


def top_up(in_flight: Callable[[], int], slots: int, refill: Callable[[], Any] | None) -> None:
    """`refill()` until `slots` sequences are in flight (or it adds none). Called after a call's
    ageing out, not before: at max_staleness 1 the last call's unreturned sequences are all too
    old, and counted before they were dropped they filled the slots, so a call prefetched nothing,
    kept only its own batch's prompts and had to finish every one, long tail and all (HF: 2 of 12
    calls ran 34 and 96 decode iterations where the others ran 5-7)."""
    while refill is not None and in_flight() < slots:
        before = in_flight()
        refill()
        if in_flight() == before:
            return
