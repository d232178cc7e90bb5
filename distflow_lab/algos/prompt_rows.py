"""What the stages after the rollout keep of each prompt (its uid, ground truth and data
source), one object per response row: the one definition the rollout paths share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from distflow_lab.core.batch import Batch


@dataclass(frozen=True)
class PromptInfo:
    """A prompt's fields the later stages read; uid is the loader's row id."""

    uid: str
    ground_truth: Any
    data_source: str


def prompt_infos(batch: Batch) -> list[PromptInfo]:
    """One per prompt of a loader batch."""
    return [PromptInfo(str(r), rm["ground_truth"], src)
            for r, rm, src in zip(batch["row_id"].tolist(), batch["reward_model"], batch["data_source"])]


def response_objects(infos: Sequence[PromptInfo], n: int = 1) -> dict[str, list]:
    """The object columns of the response rows: each prompt's fields repeated for its n rows."""
    return {name: [getattr(p, name) for p in infos for _ in range(n)]
            for name in ("uid", "ground_truth", "data_source")}
