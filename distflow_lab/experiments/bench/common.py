"""Shared helpers for benchmarks: timing summaries and output (memcpy bandwidth: observe/bandwidth.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from distflow_lab.observe.span_stats import step_table


def summarize(xs: Iterable[float]) -> dict[str, float]:
    a = np.asarray(list(xs), dtype=float)
    lo, hi = np.percentile(a, [2.5, 97.5]) if len(a) > 1 else (a[0], a[0])
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "p2_5": float(lo), "p97_5": float(hi), "n": int(len(a))}


def step_row(rep, spans: pd.DataFrame | None = None) -> dict:
    """One step's wall_s, compute_s, data_plane_s, bytes_moved (`spans`: rep.spans, if already built)."""
    spans = rep.spans if spans is None else spans
    return step_table(spans, pd.Series({rep.update: rep.wall_seconds})).iloc[0].to_dict()


def write_json(records: list[dict], path: str | Path | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(records, indent=1, default=float))
        print(f"wrote {p}")


def print_table(records: list[dict], columns: list[str] | None = None, title: str = "") -> pd.DataFrame:
    df = pd.DataFrame(records)
    if columns:
        df = df[[c for c in columns if c in df.columns]]
    if title:
        print(title)
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))
    return df

