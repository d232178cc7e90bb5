"""An ipywidgets stepper for a session: buttons for step-stage, step and run-N,
toggles for the mode and the ablation switches, a live step timeline
(plotly FigureWidget) and a progress bar.

    lab.stepper(session)        # in a notebook cell

Takes a `Session`.
"""
from __future__ import annotations

import html

import ipywidgets as W
import plotly.graph_objects as go

from distflow_lab.api.session import Session
from distflow_lab.core.config import MODES, SWITCHES_BY_MODE, Balance
from distflow_lab.observe.timeline import last_batches, timeline


class Stepper:
    def __init__(self, session: Session, run_n: int = 5, last_steps: int = 2) -> None:
        self.s, self.last_steps = session, last_steps
        sw = session.config.switches
        self.b_stage = W.Button(description="step stage", icon="step-forward", tooltip="run the next stage on every worker")
        self.b_step = W.Button(description="step", icon="forward", tooltip="finish the current update")
        self.b_run = W.Button(description="run N", icon="fast-forward")
        self.n = W.BoundedIntText(value=run_n, min=1, max=10_000, description="N", layout=W.Layout(width="130px"))
        self.mode = W.ToggleButtons(options=list(MODES), value=session.mode)
        self.local_cache = W.Checkbox(value=sw.local_cache, description="local cache")
        self.double_buffer = W.Checkbox(value=sw.double_buffer, description="double buffer")
        self.balance = W.Dropdown(options=[b.value for b in Balance if b != Balance.IDENTITY], value=sw.balance.value,
                                  description="balance")
        self.num_buffers = W.Dropdown(options=["per_node", 1], value=sw.num_buffers, description="buffers")
        self.b_apply = W.Button(description="restart workers", icon="refresh",
                                tooltip="apply mode and switches (restarts the workers)")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="progress")
        self.status = W.HTML()
        self.errors = W.Output()
        self.figure = go.FigureWidget()  # filled by the _refresh below: draw once
        self.b_stage.on_click(lambda _: self._act(self.s.step_stage))
        self.b_step.on_click(lambda _: self._act(self.s.step))
        self.b_run.on_click(lambda _: self._act(self._run))
        self.b_apply.on_click(lambda _: self._act(self._reopen))
        self.widget = W.VBox([
            W.HBox([self.b_stage, self.b_step, self.b_run, self.n]),
            W.HBox([self.mode, self.local_cache, self.double_buffer]),
            W.HBox([self.balance, self.num_buffers, self.b_apply]),
            self.progress, self.status, self.figure, self.errors,
        ])
        self._refresh()

    # ---- actions -----------------------------------------------------------------
    def _act(self, fn) -> None:
        self.errors.clear_output()
        for b in (self.b_stage, self.b_step, self.b_run, self.b_apply):
            b.disabled = True
        try:
            fn()
        except Exception as e:  # show the message, not a widget-callback traceback
            with self.errors:
                print(f"{type(e).__name__}: {e}")
        finally:
            for b in (self.b_stage, self.b_step, self.b_run, self.b_apply):
                b.disabled = False
            self._refresh()

    def _run(self) -> None:
        self.progress.max, self.progress.value = self.n.value, 0
        for _ in range(self.n.value):
            self.s.step()
            self.progress.value += 1
            self._refresh()

    def _reopen(self) -> None:
        chosen = {"local_cache": self.local_cache.value, "double_buffer": self.double_buffer.value,
                  "balance": self.balance.value, "num_buffers": self.num_buffers.value}
        applies = SWITCHES_BY_MODE[self.mode.value]  # a switch the mode has no use for is not sent
        self.s.reopen(mode=self.mode.value, **{k: v for k, v in chosen.items() if k in applies})

    # ---- display ---------------------------------------------------------------------
    def _timeline(self) -> go.Figure:
        spans = self.s.spans
        return timeline(spans, batches=last_batches(spans, self.last_steps), title=f"{self.s.mode}: latest batches")

    def _refresh(self) -> None:
        new = self._timeline()
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(list(new.data))
            self.figure.layout = new.layout
        updates, stage = self.s.cursor
        metrics = self.s.metrics.tail(1).to_dict("records")
        shown = ", ".join(f"{k}={v:.4g}" for k, v in (metrics[0] if metrics else {}).items()
                          if isinstance(v, float) and k != "wall_s")
        self.status.value = (f"<b>{html.escape(self.s.mode)}</b> · update {updates} · next stage "
                             f"<code>{html.escape(stage)}</code><br><small>{html.escape(shown)}</small>")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def stepper(session: Session, run_n: int = 5) -> Stepper:
    """A stepper widget for `session` (display it as the last expression of a cell)."""
    return Stepper(session, run_n)
