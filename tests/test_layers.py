"""The package's layers: imports go downward only, and the three data planes (and the
two rollout engines) do not import each other. The contracts are `[tool.importlinter]`
in pyproject.toml; this runs import-linter on them, as a developer would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"import-linter found a broken contract:\n{out.stdout}\n{out.stderr}"
    assert "0 broken" in out.stdout and "kept" in out.stdout, out.stdout


def test_contracts_name_every_layer_folder():
    """A new top-level folder must be placed in the layers, or the contract checks nothing about it."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    named = {part.strip().split(".")[-1] for layer in layers for part in layer.split("|")}
    folders = {p.name for p in (ROOT / "distflow_lab").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    folders = {f.removesuffix(".py") for f in folders}
    assert folders - {"presets"} <= named, f"not in the layers contract: {sorted(folders - named)}"
