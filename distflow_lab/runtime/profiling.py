"""Framework profiler hook: `torch.profiler` traces of chosen stages and batches,
one file per rank per stage per batch, in one folder per run. Filled in by
`profile_stage`; the worker wraps every stage's compute with it.

    ProfileSpec(stages=["actor_update"], batches=[2, 3], directory="runs/x/profiles")
    -> runs/x/profiles/batch2/actor_update-rank0.json, ...-rank1.json, batch3/...

Each file is a Chrome trace (`{"traceEvents": [...]}`, CPU activities, shapes not
recorded): open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing.
The directory is made absolute on the driver when the spec is built, so every worker
on this machine writes to the same folder (on a multi-node cluster each node writes its
ranks' files to that path on its own disk).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


@dataclass
class ProfileSpec:
    """Which stages and batches to profile, and where the traces go."""

    stages: list[str] = field(default_factory=list)  # empty: every stage
    batches: list[int] | None = None  # None: every batch
    directory: str = "profiles"
    with_stack: bool = False  # Python stacks per op (bigger files)

    def __post_init__(self) -> None:
        self.stages = [self.stages] if isinstance(self.stages, str) else list(self.stages)
        self.batches = None if self.batches is None else [int(s) for s in self.batches]
        self.directory = str(Path(self.directory).expanduser().resolve())

    def wants(self, batch_id: int, stage: str) -> bool:
        return (not self.stages or stage in self.stages) and (self.batches is None or batch_id in self.batches)

    def path(self, batch_id: int, stage: str, rank: int) -> Path:
        return Path(self.directory) / f"batch{batch_id}" / f"{stage}-rank{rank}.json"


@contextlib.contextmanager
def profile_stage(spec: ProfileSpec | None, batch_id: int, stage: str, rank: int) -> Iterator[None]:
    """Profile this stage's compute when `spec` asks for it (a no-op otherwise); the
    trace goes to `spec.path(batch, stage, rank)`, also when the stage raises."""
    if spec is None or not spec.wants(batch_id, stage):
        yield
        return
    from torch.profiler import ProfilerActivity, profile, record_function

    out = spec.path(batch_id, stage, rank)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=spec.with_stack)
    prof.__enter__()
    try:
        with record_function(f"{stage} (batch {batch_id}, rank {rank})"):
            yield
    finally:
        prof.__exit__(None, None, None)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        # Holistic Trace Analysis tells ranks apart by this key (torch adds it only under torch.distributed)
        trace.setdefault("distributedInfo", {"rank": rank})
        trace.setdefault("distflow", {"batch_id": batch_id, "stage": stage, "rank": rank})
        tmp.write_text(json.dumps(trace))
        tmp.replace(out)  # a reader never sees half a file
