"""Checkpoint folders on disk: a manifest of every file with its checksum, written
last (a folder without one is an interrupted write), and the newest complete
checkpoint of a run. Plain file I/O: the CLI checks a --resume before anything
heavy is imported."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from distflow_lab.core.errors import CheckpointError


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (directory / "manifest.json").write_text(json.dumps({"files": manifest}, indent=1))


def verify_checkpoint(directory: Path) -> None:
    """A complete checkpoint: state.json and every file of manifest.json, with its checksum."""
    if not (directory / "state.json").is_file():
        raise CheckpointError(f"{directory} is not a distflow_lab checkpoint (no state.json)")
    if not (directory / "manifest.json").is_file():
        raise CheckpointError(f"{directory} is incomplete: no manifest.json (its write did not finish)")
    files = json.loads((directory / "manifest.json").read_text())["files"]
    for name, meta in files.items():
        p = directory / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {directory} is missing {name}")
        if p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its checksum (corrupt)")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (folders step*), skipping broken ones."""
    for d in sorted(Path(root).glob("step*"), reverse=True):
        try:
            verify_checkpoint(d)
            return d
        except CheckpointError:
            continue
    return None
