"""Guess the number, with feedback: a multi-step game.

The row's ground truth is a secret in [1, high]. Each model turn is a guess (digits; the
turn ends at ";" or eos); the environment answers "<;" (the secret is lower), ">;" (higher)
or ends the trajectory when the guess is right. Reward 1 for finding it, less
`turn_penalty` per guess after the first (never below 0); 0 after `max_guesses` wrong ones.
A turn that is not a number counts as a wrong guess and is answered "?;". Each answer
sleeps a delay drawn from `latency`.
"""
from __future__ import annotations

import random
import time
from typing import Any, Mapping

from pydantic import Field

from distflow_lab.models.env_calculator import ground_truth
from distflow_lab.models.environment import EnvOptions, EnvStep, Latency, register_env


@register_env("guess_number")
class GuessNumber:
    class Options(EnvOptions):
        max_guesses: int = Field(default=6, ge=1)
        turn_penalty: float = Field(default=0.1, ge=0)
        latency: Latency = Latency()
        seed: int = 0

    stop_strings = (";",)

    def __init__(self, tokenizer: Any, options: "GuessNumber.Options"):
        self.tok, self.opts = tokenizer, options
        self.rng = random.Random(options.seed)
        self.secret, self.guesses = 0, 0

    @staticmethod
    def demo(row: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """A worked game: bisection over 1..high (the row's `extra_info.high`, else 15), each guess
        answered as the environment would."""
        info = row.get("extra_info")
        lo, hi = 1, int(info.get("high", 15)) if isinstance(info, Mapping) else 15
        secret, out = int(ground_truth(row)), []
        if not lo <= secret <= hi:  # bisection would never find it
            raise ValueError(f"guess_number demo: the secret {secret} is outside 1..{hi} (extra_info.high)")
        while True:
            guess = (lo + hi) // 2
            out.append((f"{guess};", True))
            if guess == secret:
                return out
            lo, hi = (lo, guess - 1) if secret < guess else (guess + 1, hi)
            out.append(("<;" if secret < guess else ">;", False))

    def reset(self, row: Mapping[str, Any]) -> list[int]:
        self.secret, self.guesses = int(ground_truth(row)), 0
        return []

    def step(self, tokens: list[int]) -> EnvStep:
        text = self.tok.decode(tokens, skip_special_tokens=True).strip().rstrip(";").strip()
        self.guesses += 1
        time.sleep(self.opts.latency.draw(self.rng))
        guess = int(text) if text.isdigit() else None
        info = {"guesses": self.guesses, "guess": guess}
        if guess == self.secret:
            return EnvStep([], max(0.0, 1.0 - self.opts.turn_penalty * (self.guesses - 1)), True, info)
        if self.guesses >= self.opts.max_guesses:
            return EnvStep([], 0.0, True, info)
        reply = "?;" if guess is None else ("<;" if self.secret < guess else ">;")
        return EnvStep(self.tok(reply, add_special_tokens=False)["input_ids"], 0.0, False, info)
