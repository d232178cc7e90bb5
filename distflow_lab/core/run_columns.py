"""Column names of saved runs that changed, and the one function that reads them.

"step" once meant two things: the data plane's key of a batch and the trainer's update.
Spans, items and ledgers now say `batch_id`; metrics say `update`. A run folder saved
before the rename still loads: every reader of a saved table passes it through
`current_names`, which renames what it finds and leaves the rest alone.
"""
from __future__ import annotations

import pandas as pd

RENAMED: dict[str, dict[str, str]] = {  # table -> old column -> current column
    "spans": {"step": "batch_id"},
    "items": {"step": "batch_id"},
    "ledger": {"step": "batch_id"},
    "metrics": {"step": "update", "timing_s/end_step": "timing_s/end_batch"},
}


def current_names(df: pd.DataFrame, table: str) -> pd.DataFrame:
    """`df` (a saved `table`: spans, items, ledger or metrics) with its old column names renamed."""
    if table not in RENAMED:
        raise ValueError(f"unknown saved table {table!r}; tables: {list(RENAMED)}")
    old = {a: b for a, b in RENAMED[table].items() if a in df.columns and b not in df.columns}
    return df.rename(columns=old) if old else df


def read_saved(path, table: str) -> pd.DataFrame:
    """A run folder's `<table>.parquet` (spans, items, ledger or metrics) under the current names."""
    return current_names(pd.read_parquet(path), table)
