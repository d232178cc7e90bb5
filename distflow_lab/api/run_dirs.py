"""Where a run writes, decided before anything starts (plain file checks: the CLI
refuses to replace a run in well under a second). A run never silently replaces
an earlier run's outputs: `out` is refused if it holds a run unless `overwrite`
(or `resume`), and without `out` every run gets a new numbered folder
`runs/<config name>/run-NNN` under the working directory (`trainer.out_dir`
replaces `runs/<config name>`)."""
from __future__ import annotations

from pathlib import Path

from distflow_lab.core.config import ConfigError, RunConfig
from distflow_lab.runtime.checkpoint_files import latest_checkpoint

OUTPUT_FILES = ("metrics.parquet", "spans.parquet", "items.parquet", "trace.json", "report.html", "checkpoints")


def run_dir(cfg: RunConfig, out: str | Path | None = None, overwrite: bool = False, resume: bool = False) -> Path:
    """Where this run writes (see the module docstring)."""
    if out is not None:
        out = Path(out)
        held = [f for f in OUTPUT_FILES if (out / f).exists()]
        if held and not (overwrite or resume):
            raise ConfigError(f"{out} already holds a run ({', '.join(held)}); pass --overwrite to replace it, "
                              "--resume to continue it, or choose another --out")
        if resume and latest_checkpoint(out / "checkpoints") is None:
            raise ConfigError(f"no complete checkpoint under {out / 'checkpoints'} to resume from")
        return out
    base = Path(cfg.trainer.out_dir or Path("runs") / cfg.name)
    runs = sorted(base.glob("run-[0-9][0-9][0-9]"))
    if resume:
        with_ckpt = [r for r in runs if latest_checkpoint(r / "checkpoints") is not None]
        if not with_ckpt:
            raise ConfigError(f"no run with a checkpoint under {base} to resume from")
        return with_ckpt[-1]
    return base / f"run-{int(runs[-1].name[4:]) + 1 if runs else 1:03d}"
