"""Bucketing of (name, tensor) pairs: how a policy is cut for a weight sync (the trainer's export
and the transport both use it). Kept apart from models/fsdp.py so that importing the transport,
which every worker does, does not import FSDP2, peft and transformers: a synthetic worker starts
in about half the time."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from distflow_lab.core.config.session import WeightSyncOptions

DEFAULT_BUCKET_BYTES = WeightSyncOptions().bucket_mib << 20  # weight_sync.bucket_mib's default; sessions set theirs


def buckets_of(items: Iterable[tuple[str, Tensor]], bucket_bytes: float) -> Iterator[list[tuple[str, Tensor]]]:
    """(name, tensor) pairs grouped into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
