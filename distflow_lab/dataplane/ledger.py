"""The data planes' books: item counts per (batch, edge), in one row shape. Kept free of torch and
pandas: the DataBuffer and coordinator actors import it, and their processes start faster without."""
from __future__ import annotations

# Item counts per (batch, edge) that every data plane reports: what went in, what came out.
LEDGER_COLUMNS = ("items_reported", "items_in", "items_out", "pieces_in", "pieces_out",
                  "items_dropped")  # the last: async schedules (too-stale batches, never trained)


def ledger_row(batch_id: int, edge: str, **counts: int) -> dict:
    """The one shape of a ledger row: `batch_id`, `edge` and every count of LEDGER_COLUMNS (0
    unless given). A count not in LEDGER_COLUMNS is an error: it would vanish from the ledger."""
    unknown = sorted(set(counts) - set(LEDGER_COLUMNS))
    if unknown:
        raise ValueError(f"ledger row for batch {batch_id} edge {edge!r}: unknown count(s) {unknown}; "
                         f"the counts are {list(LEDGER_COLUMNS)}")
    return {"batch_id": batch_id, "edge": edge, **{c: int(counts.get(c, 0)) for c in LEDGER_COLUMNS}}
