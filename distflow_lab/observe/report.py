"""One self-contained HTML report of a run: config, DAG, timeline, stage
breakdown, cache hits, load balance and training curves. plotly.js is inlined
once in <head>, so the file opens anywhere, offline, with no server.

`session` is duck-typed: `.spans`, `.metrics`, `.plan`, `.mode`, `.config`
(a pydantic model), optionally `.dag` (a DAG or its name) and
`.redistribution_lengths()` -> {edge name: (lengths, consumers)}.
"""
from __future__ import annotations

import datetime as _dt
import html
import traceback
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import plotly.graph_objects as go
import plotly.offline
import yaml

from distflow_lab.observe.span_stats import step_table
from distflow_lab.observe.load_balance import load_balance, load_balance_table, policy_stats
from distflow_lab.observe.breakdown import breakdown, cache_hits
from distflow_lab.observe.curves import metric_curves
from distflow_lab.observe.dag_figure import dag_figure
from distflow_lab.observe.mismatch import METRICS as MISMATCH, mismatch_figure
from distflow_lab.observe.timeline import last_batches, timeline

_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:24px auto;max-width:1280px;color:#222;padding:0 16px}
h1{margin-bottom:4px} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:36px}
.meta{color:#555} pre{background:#f6f8fa;padding:10px;overflow:auto;font-size:12px;max-height:480px}
table.df{border-collapse:collapse;font-size:12px} table.df td,table.df th{border:1px solid #ddd;padding:3px 6px;
text-align:right} .error{color:#b00020} .note{color:#666}
.table-scroll{overflow-x:auto;max-width:100%} table.df th{position:sticky;top:0;background:#fff}
"""


def _fig_html(fig: go.Figure) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})


def _table_html(df: pd.DataFrame, float_format: str = "{:.4g}", dash_zero: bool = False) -> str:
    """A table in a horizontally scrolling box (a wide metrics table never pushes the page
    wider than the window). `dash_zero`: print exact zeros as "–", as the paper's Table 1 does."""
    fmt = (lambda v: "–" if v == 0 else float_format.format(v)) if dash_zero else float_format.format
    return f"<div class='table-scroll'>{df.to_html(classes='df', border=0, float_format=fmt, na_rep='–')}</div>"


def _section(sid: str, heading: str, build: Callable[[], str]) -> str:
    """A titled section with a stable id; a failing figure shows its error
    instead of losing the whole report."""
    try:
        body = build()
    except Exception as e:  # a report is written at the end of a run: keep the rest of it
        body = (f"<p class='error'>figure failed: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>"
                f"<pre>{html.escape(traceback.format_exc())}</pre>")
    return f"<section id='{sid}'><h2>{html.escape(heading)}</h2>{body}</section>"


def _yaml(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _config_html(config: Any) -> str:
    """The config as YAML; an `algo` that is a pydantic model gets its own block."""
    if config is None:
        return "<p class='note'>no config</p>"
    if not hasattr(config, "model_dump"):
        return f"<pre>{html.escape(_yaml(config) if isinstance(config, dict) else repr(config))}</pre>"
    algo = getattr(config, "algo", None)
    nested = hasattr(algo, "model_dump")
    main = config.model_dump(mode="json", exclude={"algo"} if nested else None)
    out = f"<h3>session</h3><pre>{html.escape(_yaml(main))}</pre>"
    if nested:
        dumped = html.escape(_yaml(algo.model_dump(mode="json")))
        out += f"<h3>algorithm ({html.escape(type(algo).__name__)})</h3><pre>{dumped}</pre>"
    return out


def _dag_name(session: Any) -> str:
    dag = getattr(session, "dag", None)
    if dag is not None:
        return str(getattr(dag, "name", dag))
    plan = getattr(session, "plan", None)
    return str(getattr(plan, "dag_name", "?"))


def _lengths(session: Any) -> dict | Exception:
    """{edge: (lengths, consumers)} or {} when the session has none; an error is kept to be shown."""
    get = getattr(session, "redistribution_lengths", None)
    try:
        return (get() if callable(get) else None) or {}
    except Exception as e:  # a dead cluster must not cost the rest of the report
        return e


def _balance_html(data: dict | Exception) -> str:
    if isinstance(data, Exception):
        raise data
    out = []
    for edge, (lengths, k) in data.items():
        stats = policy_stats(lengths, int(k))  # partition once for figure and table
        out.append(f"<h3>{html.escape(edge)}</h3>")
        out.append(_fig_html(load_balance(lengths, int(k), title=f"token load per consumer at {edge}", stats=stats)))
        out.append(_table_html(load_balance_table(lengths, int(k), stats=stats).set_index("policy")))
    return "".join(out)


def _metrics_html(spans: pd.DataFrame, metrics: pd.DataFrame) -> str:
    if not len(metrics):
        return "<p class='note'>no metrics recorded</p>"
    out = _fig_html(metric_curves(metrics))
    if "wall_s" in metrics.columns and "update" in metrics.columns and len(spans):
        steps = step_table(spans, metrics.set_index("update")["wall_s"])
        out += "<h3>per batch: wall vs compute critical path</h3>" + _table_html(steps.tail(20))
    return out + "<h3>metrics (last 20 updates)</h3>" + _table_html(metrics.tail(20).set_index(
        "update") if "update" in metrics.columns else metrics.tail(20))


def write_report(session: Any, path: str | Path, extra_spans: dict[str, pd.DataFrame] | None = None) -> Path:
    """Write the run's report to `path` (one standalone .html file) and return it.
    `extra_spans` ({mode: spans}) adds other runs' modes to the breakdown."""
    path = Path(path)
    spans: pd.DataFrame = session.spans
    metrics: pd.DataFrame = session.metrics  # a property that builds the frame: read it once
    metrics = pd.DataFrame() if metrics is None else metrics
    plan = getattr(session, "plan", None)
    mode, dag_name = str(session.mode), _dag_name(session)
    n_steps = max(spans["batch_id"].nunique() if len(spans) else 0, len(metrics))
    title = f"DistFlow lab report: {dag_name} ({mode})"
    shown = last_batches(spans, 2)  # two steps: enough to see one overlap the next
    by_mode = {mode: spans, **{m: df for m, df in (extra_spans or {}).items() if m != mode}}  # this run first
    order = [s.id for s in plan.stages] if plan is not None else None

    def breakdown_html() -> str:
        fig, table = breakdown(by_mode, order)
        return _fig_html(fig) + "<h3>table (seconds)</h3>" + _table_html(table, "{:.3f}", dash_zero=True)

    lengths = _lengths(session)  # empty: no redistribute edge or no step yet, so no section
    balance = (_section("fig-balance", "load balance at redistribution", lambda: _balance_html(lengths))
               if lengths else "")
    sections = [
        _section("config", "configuration", lambda: _config_html(getattr(session, "config", None))),
        _section("fig-dag", "DAG and plan", lambda: _fig_html(dag_figure(plan)) if plan is not None
                 else "<p class='note'>no plan</p>"),
        _section("fig-timeline", f"timeline (batches {shown})",
                 lambda: _fig_html(timeline(spans, batches=shown))),
        _section("fig-breakdown", "stage breakdown (paper Table 1)", breakdown_html),
        _section("fig-cache", "local cache hits and bytes moved", lambda: _fig_html(cache_hits(spans))),
        balance,
        _section("fig-metrics", "training metrics", lambda: _metrics_html(spans, metrics)),
        (_section("fig-mismatch", "train-inference mismatch", lambda: _fig_html(mismatch_figure(metrics)))
         if set(MISMATCH) <= set(metrics.columns) else ""),
    ]
    world = getattr(plan, "world_size", "?")
    header = (f"<h1>{html.escape(title)}</h1><p class='meta'>mode <b>{html.escape(mode)}</b> · DAG "
              f"<b>{html.escape(dag_name)}</b> · {world} workers · {n_steps} steps · "
              f"written {_dt.datetime.now().isoformat(timespec='seconds')}</p>")
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style><script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>"
           f"</head><body>{header}{''.join(s for s in sections if s)}</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
    return path
