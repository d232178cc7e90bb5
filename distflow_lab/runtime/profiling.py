"""Framework profiler hook: `torch.profiler` traces of chosen stages and steps,
one file per rank per stage per step, in one folder per run. Filled in by
`profile_stage`; the worker wraps every stage's compute with it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class ProfileSpec:
    """Which stages and steps to profile, and where the traces go."""

    stages: list[str] = field(default_factory=list)
    steps: list[int] | None = None  # None: every step
    directory: str = "profiles"


@contextlib.contextmanager
def profile_stage(spec: ProfileSpec | None, step: int, stage: str, rank: int) -> Iterator[None]:
    """Profile this stage's compute when `spec` asks for it (a no-op otherwise)."""
    yield
