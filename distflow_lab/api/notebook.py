"""Notebook set-up: figures that survive a static export, progress bars that end.

    import distflow_lab as lab
    lab.notebook()        # once, near the top of a notebook (every notebook in notebooks/ does)
    lab.connect()

Two things a live JupyterLab hides and a saved notebook shows:

* **Figures.** Plotly's default notebook renderer saves a figure only as
  `application/vnd.plotly.v1+json`, which needs JupyterLab's plotly extension:
  `jupyter nbconvert --to html`, GitHub and other static viewers show nothing.
  `notebook()` sets `plotly.io.renderers.default = "plotly_mimetype+notebook"`:
  every figure also carries an HTML representation (a div and a
  `Plotly.newPlot` call), and plotly.js itself is embedded once, in the output
  of the first cell that shows a figure (about 4.7 MB, no network needed;
  "notebook_connected" would load it from a CDN instead, and fail offline).
  JupyterLab and VS Code still draw the interactive mimetype; the exported
  HTML, nbviewer and other viewers that run a page's scripts draw the HTML.
  GitHub's notebook view runs no scripts: for it, add a static image with
  `notebook(renderer="plotly_mimetype+notebook+png")` (needs kaleido and a
  Chromium, `pip install -e '.[docs]'`).
* **Progress bars.** A `tqdm` widget's saved text is the one it had when it was
  first displayed ("0/6"), so an executed notebook reads "0/6" forever. After
  `notebook()`, when a notebook bar closes its output is replaced with its
  final state ("6/6 [00:12<00:00, ...]"), or with nothing for a bar created
  with `leave=False` (the session's step bar, the SFT warm-up bar): what is
  saved is what happened. This holds for every `tqdm.auto` bar, whichever
  module created it.

Outside IPython `notebook()` changes nothing and says so. Calling it again is harmless.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_RENDERER = "plotly_mimetype+notebook"


@dataclass
class NotebookSetup:
    """What `notebook()` set."""

    in_kernel: bool
    renderer: str | None
    progress_bars: bool

    def _repr_html_(self) -> str:
        if not self.in_kernel:
            return "<small>distflow_lab.notebook(): not in a Jupyter kernel, nothing changed</small>"
        bars = "progress bars keep their final state" if self.progress_bars else "progress bars unchanged"
        return (f"<small>distflow_lab.notebook(): plotly renderer <code>{self.renderer}</code> "
                f"(figures also saved as HTML, plotly.js embedded once); {bars}</small>")


def in_kernel() -> bool:
    """True inside a Jupyter kernel (ipykernel), where outputs are saved with the notebook."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook(renderer: str = DEFAULT_RENDERER, progress_bars: bool = True) -> NotebookSetup:
    """Set up this kernel so that executed notebooks read right when saved or exported:
    plotly figures with an HTML representation (`renderer`, see the module docstring)
    and progress bars that leave their final state. Returns what it set."""
    if not in_kernel():
        return NotebookSetup(False, None, False)
    import plotly.io as pio

    if pio.renderers.default != renderer:  # plotly.js goes (once) into the first figure's cell
        pio.renderers.default = renderer
    if progress_bars:
        _final_progress_bars()
    return NotebookSetup(True, renderer, progress_bars)


# ---- progress bars --------------------------------------------------------------------------------


def _final_progress_bars() -> None:
    """Make `tqdm.notebook` bars replace their saved output with their final state on close.

    tqdm.notebook shows a bar with `display(container)`; its saved `text/plain` is the
    bar at that moment. We give that display an id, and when the bar closes we update
    the display: with the final bar text (`leave=True`, or a bar that stopped early),
    or with nothing (`leave=False`). Patched on the class, so bars created by modules
    that imported `tqdm.auto.tqdm` before this call are covered too."""
    try:
        import tqdm.notebook as tn
    except ImportError:
        return
    if getattr(tn, "_distflow_final_state", False):
        return
    from IPython.display import display as ipython_display

    def display(obj: Any, *args: Any, **kwargs: Any) -> None:
        handle = ipython_display(obj, *args, display_id=True, **kwargs)
        try:
            obj._distflow_display = handle
        except Exception:  # an object that takes no attributes: the bar stays as tqdm draws it
            pass

    original_close = tn.tqdm_notebook.close

    def close(self) -> None:
        original_close(self)
        handle = getattr(getattr(self, "container", None), "_distflow_display", None)
        if handle is None or getattr(self, "_distflow_closed", False):
            return
        self._distflow_closed = True
        stopped_early = bool(self.total) and self.n < self.total
        text = str(self) if (self.leave or stopped_early) else ""
        handle.update({"text/plain": text}, raw=True)

    tn.display = display
    tn.tqdm_notebook.close = close
    tn._distflow_final_state = True


__all__ = ["notebook", "NotebookSetup", "in_kernel", "DEFAULT_RENDERER"]
