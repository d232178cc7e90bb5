"""Every notebook in notebooks/ runs headless, top to bottom, at CI size.

Each notebook is executed by a real kernel (nbclient, kernel "python3") with
DISTFLOW_NOTEBOOK_SIZE=ci, the suite's DISTFLOW_HOME (models and warm starts built once
per run) and the suite's Ray cluster (RAY_ADDRESS), working directory a tmp dir:
nothing lands in the checkout. 01_quickstart runs in the browser instead (test_browser.py). A cell
error fails the test with nbclient's CellExecutionError (it names the cell's
source and the traceback). Notebooks are committed without outputs.

The executed notebook is then read as a static viewer would read it: converted
to HTML (nbconvert), every plotly figure must be there (a div and a
`Plotly.newPlot` call, plotly.js embedded once), and no saved progress bar may
be stuck at its first state ("0/6"). `lab.notebook()` makes both hold; a fast
test checks it on a tiny notebook without Ray.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import suite_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]


PLOTLY = "application/vnd.plotly.v1+json"
STUCK_BAR = re.compile(r"(?:^|\s)0%\|.*\| 0/\d+ \[")  # a tqdm bar saved at its first state


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb) -> list:
    return [o for c in _code_cells(nb) for o in c.outputs]


def check_static_export(nb, name: str) -> dict[str, int]:
    """What a static viewer sees of an executed notebook: every plotly figure also saved as
    HTML and drawn in nbconvert's HTML (plotly.js embedded once, no CDN needed), and no
    progress bar saved at 0. Returns the counts, for the caller's message."""
    from nbconvert import HTMLExporter

    figures = [o for o in _outputs(nb) if PLOTLY in o.get("data", {})]
    bare = [i for i, o in enumerate(figures) if "text/html" not in o["data"]]
    assert not bare, f"{name}: {len(bare)} of {len(figures)} figures saved without HTML (call lab.notebook())"
    stuck = [o["data"]["text/plain"] for o in _outputs(nb)
             if STUCK_BAR.search(str(o.get("data", {}).get("text/plain", "")))]
    assert not stuck, f"{name}: progress bars saved at their first state: {stuck}"
    body, _ = HTMLExporter().from_notebook_node(nb)
    divs, plots = body.count('class="plotly-graph-div"'), body.count("Plotly.newPlot(")
    assert divs >= len(figures) and plots >= len(figures), (
        f"{name}: {len(figures)} figures but {divs} plotly divs / {plots} Plotly.newPlot calls in the HTML")
    if figures:
        assert body.count("* plotly.js v") == 1, f"{name}: plotly.js should be embedded exactly once"
    return {"figures": len(figures), "divs": divs}


def slowest_cells(nb, n: int = 5) -> list[tuple[int, float]]:
    """(cell index, seconds) of an executed notebook's n slowest cells, from nbclient's timing metadata."""
    from datetime import datetime

    def seconds(cell) -> float:
        t = cell.metadata.get("execution", {})
        start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
        return (datetime.fromisoformat(end.rstrip("Z")) - datetime.fromisoformat(start.rstrip("Z"))).total_seconds() \
            if start and end else 0.0

    cells = [(i, seconds(c)) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    return sorted(cells, key=lambda x: -x[1])[:n]


def test_every_notebook_sets_up_its_outputs():
    for path in NOTEBOOKS:
        src = "\n".join(c.source for c in _code_cells(nbformat.read(path, as_version=4)))
        assert "lab.notebook()" in src, f"{path.name}: call lab.notebook() so figures and bars survive export"


def test_notebook_setup_survives_static_export(tmp_path: Path):
    """lab.notebook() in a real kernel, no Ray: finished bars keep their final state,
    leave=False bars vanish, a bar stopped early says where, figures export as HTML."""
    cells = ["import distflow_lab as lab\nlab.notebook()",
             "from tqdm.auto import tqdm\nfor i in tqdm(range(6), desc='kept'):\n    pass",
             "bar = tqdm(range(6), desc='gone', leave=False)\nfor i in bar:\n    pass\nbar.close()",
             "b = tqdm(range(6), desc='early')\nfor i in b:\n    if i == 2:\n        break\nb.close()",
             "import plotly.graph_objects as go\ngo.Figure(go.Bar(y=[1, 2, 3]))",
             "go.Figure(go.Scatter(y=[3, 1, 2]))"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = lambda i: [o["data"].get("text/plain", "") for o in nb.cells[i].outputs if "data" in o]  # noqa: E731
    assert len(text(1)) == 1 and "| 6/6 [" in text(1)[0] and text(1)[0].startswith("kept: 100%")
    assert text(2) == [""]
    assert "| 2/6 [" in text(3)[0]
    assert check_static_export(nb, "setup notebook") == {"figures": 2, "divs": 2}


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
    no_id = [i for i, c in enumerate(json.loads(path.read_text())["cells"]) if "id" not in c]
    assert not no_id, f"{path.name}: cells {no_id} have no id (tests address cells by id; nbformat would invent one)"


def test_quickstart_has_parameters_cell():
    path = NOTEBOOK_DIR / "01_quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    first = _code_cells(nb)[0]
    assert "parameters" in first.metadata.get("tags", []), f"{path.name}: first code cell is not tagged 'parameters'"
    assert "DISTFLOW_NOTEBOOK_SIZE" in first.source, f"{path.name}: the parameters cell must read DISTFLOW_NOTEBOOK_SIZE"


# 01_quickstart runs once, in the browser (tests/test_browser.py), which also checks its static export.
EXECUTED = [p for p in NOTEBOOKS if p.stem != "01_quickstart"]


@pytest.mark.full
@pytest.mark.budget(300, reason="a notebook top to bottom at CI size in a real kernel")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", EXECUTED, ids=[p.stem for p in EXECUTED])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster,
                           record_property):
    # The kernel inherits this environment: CI size, the suite's model home (models and warm starts built
    # once per run) and the suite's Ray cluster (RAY_ADDRESS: no cluster start per kernel); outputs under
    # the suite's home, the working directory tmp_path.
    from distflow_lab.runtime.worker_pool import POOL

    POOL.drain()  # this process's parked workers would hold logical CPUs the kernel's sessions need
    for key, value in suite_env(DISTFLOW_NOTEBOOK_SIZE="ci").items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError (with the cell's source) on the first failing cell
    # where a notebook's CI-size time goes, in the junit XML beside the test's own time (the suite's budget)
    record_property("slowest_cells", " ".join(f"[{i}]{s:.0f}s" for i, s in slowest_cells(nb)))
    # the kernel attached to the suite's cluster and called lab.shutdown(): that only detached it
    assert ray_cluster.get(ray_cluster.put(1), timeout=30) == 1 and ray_cluster.cluster_resources()["CPU"] >= 8
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[(e.ename, e.evalue) for e in errors]}"
    check_static_export(nb, path.name)  # the same executed notebook, as nbconvert --to html shows it
