"""Every notebook in notebooks/ runs headless, top to bottom, at CI size.

Each notebook is executed by a real kernel (nbclient, kernel "python3") with
DISTFLOW_NOTEBOOK_SIZE=ci and DISTFLOW_HOME=<a tmp dir>, working directory that
tmp dir: models, data and outputs land there, never in the checkout. A cell
error fails the test with nbclient's CellExecutionError (it names the cell's
source and the traceback). Notebooks are committed without outputs.
"""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks under {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} have outputs or execution counts; clear them before "
                       "committing (jupyter nbconvert --clear-output --inplace)")


def test_quickstart_has_parameters_cell():
    path = NOTEBOOK_DIR / "01_quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    first = _code_cells(nb)[0]
    assert "parameters" in first.metadata.get("tags", []), f"{path.name}: first code cell is not tagged 'parameters'"
    assert "DISTFLOW_NOTEBOOK_SIZE" in first.source, f"{path.name}: the parameters cell must read DISTFLOW_NOTEBOOK_SIZE"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The kernel inherits this environment: CI size, and every run path under tmp_path.
    monkeypatch.setenv("DISTFLOW_NOTEBOOK_SIZE", "ci")
    monkeypatch.setenv("DISTFLOW_HOME", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError (with the cell's source) on the first failing cell
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[(e.ename, e.evalue) for e in errors]}"
