"""The records an ingest run reads, as Arrow columns from the moment they are decoded.

A run holds every record it read until deduplication has chosen what to keep: at a
million records, as Python dicts, that is ~1.2 KB a record of small objects, and the
process keeps their memory for as long as any object allocated among them lives. So
:class:`Incoming` decodes them a block at a time into a table (and their MinHash
signatures into one array), the read phase's steps read the columns they need, and the
new rows deduplication keeps are taken from it into a table of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.schema import PENDING_SCHEMA
from helix_ray.store.publish import mapped_parts
from helix_ray.tables import take_rows

#: A record's columns as read: :data:`PENDING_SCHEMA`, with ``salience`` and
#: ``confidence`` as given (float64), so a record held back goes to the quarantine with
#: the values it came with; the new rows take float32, as the generation stores them.
INCOMING_SCHEMA = pa.schema([pa.field(f.name, pa.float64(), nullable=f.nullable)
                             if f.name in ("salience", "confidence") else f for f in PENDING_SCHEMA])

#: Records decoded into a table at a time.
BLOCK = 8192

#: New rows taken into their table (:meth:`Incoming.pending`) at a time.
PENDING_BLOCK = 65536


class Incoming:
    """Records as columns (``table``, :data:`INCOMING_SCHEMA`) and their MinHash
    signatures (``sigs``, a row each), in the order they came. ``index`` maps each id
    the run keeps to its row: the caller decides which of several rows of one id that
    is (:func:`helix_ray.ingest.run.ingest`). A row's ``fixed`` values (see
    :meth:`fix`) stand in for its own."""

    def __init__(self, table: pa.Table, sigs: np.ndarray, sig_file: Path | None = None):
        if len(sigs) != table.num_rows:
            raise ValueError(f"{len(sigs)} signatures for {table.num_rows} records")
        self.table, self.sigs = table, sigs
        self.sig_file = sig_file  # the file ``sigs`` maps, when they are mapped
        self.index: dict[str, int] = {}
        self.fixed: dict[int, dict[str, Any]] = {}

    @classmethod
    def gather(cls, rows: Iterable[tuple[dict[str, Any], Any]], num_perm: int, path: Path | None = None) -> Incoming:
        """The records ``rows`` gives — (a decoded record, its signature as uint32 bytes
        or values) — :data:`BLOCK` at a time; with ``path``, their table is written
        there a block at a time and mapped from it (:func:`mapped_parts`), and their
        signatures beside it (:func:`signature_path`), mapped as well: at a million
        records, 0.25 GB the heap does not hold from the read to the sort."""
        sigs: list[np.ndarray] = []
        keep: Callable[[Any], Any] = sigs.append  # takes a block's signatures (an array)
        block: list[dict[str, Any]] = []
        block_sigs: list[Any] = []

        def flush() -> pa.Table:
            keep(_signatures(block_sigs, num_perm))
            table = pa.Table.from_pylist(block, schema=INCOMING_SCHEMA)
            block.clear()
            block_sigs.clear()
            return table

        def blocks() -> Iterator[pa.Table]:
            for row, sig in rows:
                block.append(row)
                block_sigs.append(sig)
                if len(block) == BLOCK:
                    yield flush()
            yield flush()

        if path is None:
            return cls(pa.concat_tables(blocks()), np.concatenate(sigs))
        sig_file = signature_path(path)
        with open(sig_file, "wb") as fh:
            keep = fh.write
            table = mapped_parts(blocks(), INCOMING_SCHEMA, path)
        return cls(table, _mapped_signatures(sig_file, table.num_rows, num_perm), sig_file)

    def __len__(self) -> int:
        return self.table.num_rows

    def append(self, rows: list[dict[str, Any]], sigs: Sequence[Any]) -> None:
        """Adds ``rows`` (decoded records) and their signatures after the others."""
        num_perm = self.sigs.shape[1]
        more = Incoming.gather(zip(rows, sigs), num_perm)
        self.table = pa.concat_tables([self.table, more.table])
        if self.sig_file is None:
            self.sigs = np.concatenate([self.sigs, more.sigs])
            return
        # Mapped signatures grow in their file: the heap never holds all of them.
        with open(self.sig_file, "ab") as fh:
            fh.write(np.ascontiguousarray(more.sigs, np.uint32).tobytes())
        self.sigs = _mapped_signatures(self.sig_file, self.table.num_rows, num_perm)

    def values(self, name: str) -> list[Any]:
        """Column ``name`` as Python values, a row each (fixed values in place)."""
        out = self.table.column(name).to_pylist()
        for i, fixed in self.fixed.items():
            if name in fixed:
                out[i] = fixed[name]
        return out

    def shared(self, name: str) -> list[Any]:
        """Column ``name`` (never fixed) as Python values, a row each, each distinct
        value one object: for a column of few values (users, sources), a list of
        references rather than a string per row."""
        column = self.table.column(name)
        distinct = pc.unique(column)
        values = distinct.to_pylist()
        return [values[k] for k in pc.index_in(column, value_set=distinct).to_numpy().tolist()]

    def row_ids(self) -> list[str]:
        """The id of each row that ``index`` keeps, by row ("" for the others): the
        index's own strings."""
        out = [""] * len(self)
        for memory_id, at in self.index.items():
            out[at] = memory_id
        return out

    def rows(self, at: Sequence[int]) -> list[dict[str, Any]]:
        """Rows ``at`` as decoded records (:func:`helix_ray.ingest.stages.decode_row`)."""
        out = take_rows(self.table, at).to_pylist()
        for row, i in zip(out, at):
            row.update(self.fixed.get(i, {}))
        return out

    def fix(self, at: Sequence[int], rows: list[dict[str, Any]], names: Sequence[str]) -> None:
        """Rows ``at`` take ``rows``' values of ``names`` from now on."""
        for i, row in zip(at, rows):
            self.fixed.setdefault(i, {}).update((k, row.get(k)) for k in names)

    def pending(self, at: Sequence[int] | np.ndarray, path: Path | None = None) -> pa.Table:
        """Rows ``at`` as the new rows' table (:data:`PENDING_SCHEMA`); with ``path``,
        written there a block at a time and mapped from it (:func:`mapped_parts`)."""
        parts = (self._pending(at[lo:lo + PENDING_BLOCK]) for lo in range(0, len(at), PENDING_BLOCK))
        if path is not None:
            return mapped_parts(parts, PENDING_SCHEMA, path)
        return pa.concat_tables([PENDING_SCHEMA.empty_table(), *parts]).combine_chunks()

    def _pending(self, at: Sequence[int] | np.ndarray) -> pa.Table:
        taken = take_rows(self.table, at)
        fixed = [(k, i) for k, i in enumerate(at) if i in self.fixed]
        columns = []
        for f in PENDING_SCHEMA:
            column = taken.column(f.name)
            changed = [(k, self.fixed[i][f.name]) for k, i in fixed if f.name in self.fixed[i]]
            if changed:
                values = column.to_pylist()
                for k, v in changed:
                    values[k] = v
                column = pa.chunked_array([pa.array(values, f.type)])
            columns.append(column.cast(f.type))
        return pa.Table.from_arrays(columns, schema=PENDING_SCHEMA)

    def reader(self, name: str, at: Sequence[int] | np.ndarray) -> Callable[[int], Any]:
        """``k`` → column ``name`` of row ``at[k]``, read when asked for."""
        column = self.table.column(name)

        def read(k: int) -> Any:
            fixed = self.fixed.get(at[k])
            return fixed[name] if fixed is not None and name in fixed else column[at[k]].as_py()
        return read


def signature_path(path: Path) -> Path:
    """Where :meth:`Incoming.gather` writes the signatures of the records it writes to
    ``path``: uint32, ``num_perm`` a record, in their order, no header."""
    return path.with_name(path.stem + "-minhash.u32")


def _mapped_signatures(sig_file: Path, n: int, num_perm: int) -> np.ndarray:
    """The ``n`` signatures ``sig_file`` holds, mapped (an empty array for none: a file
    of no bytes cannot be mapped)."""
    if not n:
        return np.zeros((0, num_perm), np.uint32)
    return np.memmap(sig_file, np.uint32, mode="r", shape=(n, num_perm))


def _signatures(sigs: list[Any], num_perm: int) -> np.ndarray:
    out = np.empty((len(sigs), num_perm), np.uint32)
    for k, sig in enumerate(sigs):
        out[k] = np.frombuffer(sig, np.uint32) if isinstance(sig, bytes) else np.asarray(sig, np.uint32)
    return out
