"""Where each worker is: a breadcrumb file per worker on its own node, overwritten
at the start of every stage of a whole step. No Ray call on the hot path (a
note per stage per worker used to cost an actor call each); read only after a
failure, by a small task scheduled on the worker's node, to name the stage a
dead or hung worker had reached."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

_WIDTH = 256  # one fixed-size record, overwritten in place


def note_path(session: str, rank: int) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"distflow-{session}-w{rank}.progress"


class ProgressNote:
    """The breadcrumb of one worker: `write(step, stage)` is a single pwrite."""

    def __init__(self, session: str, rank: int) -> None:
        self.path = note_path(session, rank)
        self.fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)

    def write(self, step: int, stage: str) -> None:
        os.pwrite(self.fd, f"{step}\t{stage}\n".encode()[:_WIDTH].ljust(_WIDTH), 0)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


@ray.remote(num_cpus=0)
def _read_note(path: str) -> str | None:
    p = Path(path)
    if not p.exists():
        return None
    text = p.read_bytes().decode(errors="replace").strip()
    p.unlink(missing_ok=True)  # the worker is gone: nobody else writes or reads it
    return text.split("\t", 1)[1] if "\t" in text else None


def stage_reached(session: str, rank: int, node_id: str) -> str | None:
    """The stage worker `rank` last started, read on its node; None if unknown."""
    task = _read_note.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    try:
        return ray.get(task.remote(str(note_path(session, rank))), timeout=30)
    except RayError:
        return None
