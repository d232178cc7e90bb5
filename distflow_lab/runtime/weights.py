"""Weight sync between worker groups: the training group publishes each new policy
version, the generation group pulls it.

    train workers:  state = engines.weights.export_state()   (collective: FSDP gathers)
                    tensor-parallel rank 0 of dp rank 0: ray.put(state) -> board.post(version, ref)
    rollout workers: at the start of a generation (and, with partial rollouts, between
                    decode chunks): board.latest() -> newer? ray.get(ref) -> import_state

The payload goes through the object store once (one put, one read per node); the
driver and the board hold only the reference. The board keeps the last few versions
(`keep`): a checkpoint of an async run writes the versions its batches in flight were
generated from, and a resumed run replays those batches at exactly those versions. Every sync is a `weight_sync` span
with its bytes, on both sides. `checksum()` lets a test check that the version a
sync claims is the version the rollout workers hold.

An engine that can take part implements `PolicyWeights` and sits in the worker's
engines as "weights" (the synthetic workload's `SyntheticWeights`, the built-in
RL algorithms' actor/rollout pair).
"""
from __future__ import annotations

from typing import Any, Protocol

import ray
import torch


class PolicyWeights(Protocol):
    version: int

    def export_state(self) -> dict[str, torch.Tensor] | None:
        """The full policy (collective on the training group; None on ranks that do not publish)."""

    def import_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a published policy; it becomes `version`."""

    def checksum(self) -> float:
        """A number that changes with the weights (for tests and the timeline)."""


@ray.remote(num_cpus=0, max_restarts=0)
class WeightBoard:
    """The last `keep` published policies: version -> (object refs of its state, checksum, bytes).
    Not restarted by Ray: a board that died has lost its refs, so its death is a named error
    (WeightBoardLost) and the run resumes from a checkpoint."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = max(1, keep)
        self.posts: dict[int, tuple[list, float, int]] = {}

    def post(self, version: int, refs: list, checksum: float, nbytes: int) -> None:
        """A new version; a late post of a version older than the newest never wins."""
        if version > self.version:
            self.restore(version, refs, checksum, nbytes)

    def restore(self, version: int, refs: list, checksum: float, nbytes: int) -> None:
        """Put back a version (e.g. from a checkpoint), whatever the newest is."""
        self.posts[version] = (refs, checksum, nbytes)
        for v in sorted(self.posts)[:-self.keep]:
            del self.posts[v]

    @property
    def version(self) -> int:
        return max(self.posts, default=0)

    def latest(self) -> tuple[int, list, float, int]:
        v = self.version
        refs, checksum, nbytes = self.posts.get(v, ([], 0.0, 0))
        return v, refs, checksum, nbytes

    def get(self, version: int) -> tuple[list, float, int] | None:
        """Version `version` exactly, or None when it is not (or no longer) held."""
        return self.posts.get(version)

    def versions(self) -> list[int]:
        return sorted(self.posts)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def state_checksum(state: dict[str, torch.Tensor]) -> float:
    """Sum of the first few tensors (by name): equal on both sides of a sync of the same weights."""
    return float(sum(state[k].double().sum() for k in sorted(state)[:4]))


class SyntheticWeights:
    """A policy-sized stand-in for the synthetic workload: `mib` of float32 whose
    content is a function of the version, so `checksum()` tells versions apart."""

    def __init__(self, mib: float = 4.0, seed: int = 0) -> None:
        self.numel = max(1, int(mib * 2**20 / 4))
        self.seed, self.version = seed, 0
        self.tensor = self._make(0)

    @classmethod
    def at(cls, numel: int, seed: int, version: int) -> "SyntheticWeights":
        """The policy of this size and seed at `version` (what a checkpoint restores)."""
        w = cls.__new__(cls)
        w.numel, w.seed = numel, seed
        w.bump(version)
        return w

    def _make(self, version: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.numel, generator=g) + float(version)

    def bump(self, version: int) -> None:
        """What a training update does to the policy."""
        self.version, self.tensor = version, self._make(version)

    def export_state(self) -> dict[str, torch.Tensor]:
        return {"w": self.tensor}

    def import_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.tensor, self.version = state["w"].clone(), version

    def checksum(self) -> float:
        return state_checksum(self.export_state())


def expected_checksum(weights: Any, version: int) -> float:
    """The checksum `weights` (a SyntheticWeights) would have at `version`."""
    return float(weights._make(version).double().sum())
