"""Rows of a chunked Arrow table or column, taken chunk by chunk.

Arrow's ``take`` over a chunked column of strings or lists first concatenates all of
its chunks into one array (apache/arrow#39565): a copy of the whole column on the heap
for every call, however few rows are asked for. The tables ingest maps from its work
folder and the generations' tables are written a block at a time, so they are many
chunks; a take of a 64 Ki-row block of a million mapped records copied every record.
:func:`take_rows` asks each chunk for its own rows instead, so a call holds only what it
returns.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

Rows = TypeVar("Rows", pa.Table, pa.ChunkedArray, pa.Array)


def take_rows(data: Rows, at: Any) -> Rows:
    """Rows ``at`` (row numbers, any order, repeats allowed) of ``data``, in that order,
    as Arrow's ``take`` gives them. Raises IndexError for a row outside ``data``."""
    at = np.asarray(at, np.int64).reshape(-1)
    if isinstance(data, pa.Array):  # one chunk: Arrow's take copies only the rows
        return data.take(pa.array(at, pa.int64()))
    pieces = data.to_batches() if isinstance(data, pa.Table) else data.chunks
    if len(pieces) <= 1:
        return data.take(pa.array(at, pa.int64()))
    if not len(at):
        return data.slice(0, 0)
    starts = np.cumsum([0] + [len(p) for p in pieces])
    if at.min() < 0 or at.max() >= starts[-1]:
        raise IndexError(f"row {int(at.min() if at.min() < 0 else at.max())} asked of {int(starts[-1])} rows")
    which = np.searchsorted(starts, at, side="right") - 1
    in_order = bool((np.diff(which) >= 0).all())  # ascending rows, a sorted block: no reordering
    order = None if in_order else np.argsort(which, kind="stable")
    grouped, rows = (which, at) if order is None else (which[order], at[order])
    cuts = np.flatnonzero(np.diff(grouped)) + 1
    parts = [pieces[grouped[lo]].take(pa.array(rows[lo:hi] - starts[grouped[lo]], pa.int64()))
             for lo, hi in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(at)].tolist())]
    out: Any = pa.Table.from_batches(parts, data.schema) if isinstance(data, pa.Table) \
        else pa.chunked_array(parts, data.type)
    if order is None:
        return out
    back = np.empty(len(at), np.int64)
    back[order] = np.arange(len(at))
    # one chunk of just the rows taken: putting them back in order copies only those
    return out.combine_chunks().take(pa.array(back)) if isinstance(out, pa.Table) \
        else pa.chunked_array([pa.concat_arrays(out.chunks).take(pa.array(back))], data.type)
