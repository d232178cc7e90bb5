"""Weight sync between worker groups: the training group publishes each new policy
version, the generation group pulls it.

    train workers:  buckets = engines.weights.export_buckets(bucket_bytes)  (collective: FSDP gathers)
                    tensor-parallel rank 0 of dp rank 0: weight_transport.publish -> a Manifest
                    (one object-store object per bucket) -> board.post(version, manifest)
    rollout workers: at the start of a generation (and, with partial rollouts, between
                    decode chunks): board.latest() -> newer? weight_transport.receive(manifest)
                    -> checked views -> import_tensors (the one copy, into the engine)

The payload goes through the object store once (one put; a reader maps it without copying);
the driver and the board hold only the manifest. The board keeps the last few versions
(`keep`): a checkpoint of an async run writes the versions its batches in flight were
generated from, and a resumed run replays those batches at exactly those versions. Every sync
is a `weight_sync` span with its bytes, on both sides, and a `SyncReport` with its parts
(gather, write, read, load, verify). `checksum()` lets a test check that the version a sync
claims is the version the rollout workers hold.

An engine that can take part implements `PolicyWeights` and sits in the worker's
engines as "weights" (the synthetic workload's `SyntheticWeights`, the built-in
RL algorithms' actor/rollout pair).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol

import ray
import torch

from distflow_lab.runtime.weight_transport import Bucket, Manifest, check_loaded, fingerprint


class PolicyWeights(Protocol):
    version: int
    mode: str  # what a sync carries: "full" (the policy) or "lora" (its adapters, models/lora.py)
    binds: bool  # the engine computes from the received views themselves (weight_sync.load "map")

    def export_buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The full policy in buckets (collective on the training group: every rank iterates)."""

    def aliases(self) -> dict[str, str]:
        """Names not sent because they share a tensor with another (tied weights): name -> sent name."""

    def import_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        """Load a published policy (checked views, consumed one at a time); it becomes `manifest.version`.
        A name that does not arrive is WeightSyncMismatch."""

    def import_delta(self, manifest: Manifest, patch: Callable[[dict[str, torch.Tensor]], set[str]]) -> bool:
        """Reach `manifest.version` by `patch`ing this engine's own tensors in place (weight_sync.mode
        "delta": `weight_transport.apply_delta`); False when this engine takes only full versions."""

    def checksum(self) -> float:
        """A number that changes with the weights (for tests and the timeline)."""


@ray.remote(num_cpus=0, max_restarts=0)
class WeightBoard:
    """The last `keep` published policies: version -> (its Manifest, checksum, bytes).
    Not restarted by Ray: a board that died has lost its refs, so its death is a named error
    (WeightBoardLost) and the run resumes from a checkpoint."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = max(1, keep)
        self.posts: dict[int, tuple[Any, float, int]] = {}

    def post(self, version: int, manifest: Any, checksum: float, nbytes: int) -> None:
        """A new version; a late post of a version older than the newest never wins."""
        if version > self.version:
            self.restore(version, manifest, checksum, nbytes)

    def restore(self, version: int, manifest: Any, checksum: float, nbytes: int) -> None:
        """Put back a version (e.g. from a checkpoint), whatever the newest is."""
        self.posts[version] = (manifest, checksum, nbytes)
        for v in sorted(self.posts)[:-self.keep]:
            del self.posts[v]

    @property
    def version(self) -> int:
        return max(self.posts, default=0)

    def latest(self) -> tuple[int, Any, float, int]:
        v = self.version
        manifest, checksum, nbytes = self.posts.get(v, (None, 0.0, 0))
        return v, manifest, checksum, nbytes

    def get(self, version: int) -> tuple[Any, float, int] | None:
        """Version `version` exactly, or None when it is not (or no longer) held."""
        return self.posts.get(version)

    def versions(self) -> list[int]:
        return sorted(self.posts)


def board_keep(staleness: int) -> int:
    """How many policy versions the WeightBoard holds: the staleness bound's worth of versions a
    batch may come from, plus the newest and the one being replaced."""
    return staleness + 2


def ring_slots(staleness: int) -> int:
    """How many shared-memory slots a publisher keeps (runtime/shm_slots.py): one more than the
    board holds, so a version the board still names is never being rewritten."""
    return board_keep(staleness) + 1


def state_checksum(state: dict[str, torch.Tensor]) -> float:
    """The sum of every tensor's fingerprint: what a sync's Manifest.checksum is for the same weights."""
    return float(sum(fingerprint(t) for t in state.values()))


class SyntheticWeights:
    """A policy-sized stand-in for the synthetic workload: `mib` of float32 whose
    content is a function of the version, so `checksum()` tells versions apart."""

    mode, binds = "full", False

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

    def export_buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        yield [("w", self.tensor)]

    def aliases(self) -> dict[str, str]:
        return {}

    def import_delta(self, manifest: Manifest, patch: Callable[[dict[str, torch.Tensor]], set[str]]) -> bool:
        return False

    def import_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        got = {name: t.clone() for name, t in tensors}
        check_loaded(manifest, set(got))
        self.tensor, self.version = got["w"], manifest.version

    def checksum(self) -> float:
        return state_checksum({"w": self.tensor})


def expected_checksum(weights: Any, version: int) -> float:
    """The checksum `weights` (a SyntheticWeights) would have at `version`."""
    return state_checksum({"w": weights._make(version)})
