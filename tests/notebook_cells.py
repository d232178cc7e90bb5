"""Code cells of a notebook, by id, run as a notebook kernel would run them: the tests check the
code a researcher reads (notebook 02's CISPO loss and OPO estimator), not a copy of it."""
from __future__ import annotations

import types
from pathlib import Path

import nbformat
import numpy as np
import torch

import distflow_lab as lab

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def notebook_cells(notebook: str, *ids: str, **names) -> types.SimpleNamespace:
    """Run the code cells `ids` of `notebook` in one fresh namespace (with lab, np, torch and `names`),
    as a module the workers cannot import: what they define travels to them by value, as from a kernel."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    cells = {c.get("id"): c for c in nb.cells if c.cell_type == "code"}
    missing = [i for i in ids if i not in cells]
    assert not missing, f"{notebook} has no code cell {missing}"
    scope = {"__name__": f"notebook_{Path(notebook).stem}", "lab": lab, "np": np, "torch": torch, **names}
    for i in ids:
        exec(compile(cells[i].source, f"{notebook}#{i}", "exec"), scope)
    return types.SimpleNamespace(**scope)
