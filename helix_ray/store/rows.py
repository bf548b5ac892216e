"""Rows of a generation's ``.npy`` files read with ``pread``, not through a memory map.

A recall reads a few hundred scattered rows of the largest files of a generation (token
vectors, sentence vectors, MinHash signatures). Through a memory map, each row's page
fault maps the whole page-cache folio around it; a kernel that keeps file pages in large
folios (2 MiB on ext4 with Linux 6.18) so maps megabytes per row, and a serving process's
RSS and PSS grow toward the size of every file it reads rows from (docs/benchmarks.md).
``pread`` copies the bytes asked for into the process and maps nothing: the file's pages
stay in the page cache, shared by every process on the host and counted in none.

:class:`RowFile` reads like the array it stands for where the stores index it (an int, a
slice, an array of ints, ``np.asarray`` of the whole) and adds :meth:`RowFile.ranges`
for runs of rows. Reads of neighbouring rows are coalesced into one call, so a bulk read
(a compaction carrying most rows over) costs a few large reads, not one per row.

:class:`ArrowFile` memory-maps an Arrow IPC file for its table (bulk readers and the
fixed-width columns, a few bytes a row, use that) and reads single values of its string
columns with ``pread`` (:class:`ArrowStrings`): a string's bytes are found through the
column's offsets, which stay mapped (4 or 8 bytes a row).
"""

from __future__ import annotations

import bisect
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from helix_ray.errors import StoreError

#: Bytes one ``preadv`` call is asked for at most (Linux moves at most ~2 GiB per call).
_MAX_READ = 1 << 30
#: Reads up to this many bytes are joined from one ``pread`` a run (the fewest Python
#: steps a row); larger ones, a bulk read at ingest, go in place, without the joined copy.
_JOIN_BELOW = 1 << 24


class RowFile:
    """The array in a ``.npy`` file (C order), its rows read on demand with ``pread``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            self.offset = f.tell()
        if fortran and len(shape) > 1:
            raise StoreError(f"{self.path} holds a Fortran-ordered array; Helix writes and reads C order. "
                             "Rebuild the store with `helix ingest`.")
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.row_shape = self.shape[1:]
        self.row_bytes = int(self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64)))
        self.fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def __reduce__(self) -> tuple[Any, ...]:
        """Another process opens the file again: a file descriptor means nothing there."""
        return (RowFile, (self.path,))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self) -> str:
        return f"RowFile({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[0:len(self)]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            row = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= row < len(self):
                raise IndexError(f"row {key} is out of range for {len(self)} rows of {self.path.name}")
            return self._runs(np.array([row]), np.array([1]))[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self.take(np.arange(start, stop, step))
            return self._runs(np.array([start]), np.array([max(stop - start, 0)]))
        return self.take(key)

    def take(self, rows: Any) -> np.ndarray:
        """Rows ``rows`` (ints, in any order, repeats allowed, any shape), in that order."""
        asked = np.asarray(rows)
        if asked.size and not np.issubdtype(asked.dtype, np.integer):
            raise TypeError(f"{self.path.name}: rows are read by integer position; got {asked.dtype} indexes")
        flat = asked.astype(np.int64, copy=False).ravel()
        n = len(self)
        if len(flat) and (flat.min() < -n or flat.max() >= n):
            raise IndexError(f"rows {flat.min()}..{flat.max()} are out of range for {n} rows of {self.path.name}")
        flat = np.where(flat < 0, flat + n, flat)
        if len(flat) < 2 or (np.diff(flat) > 0).all():  # sorted and distinct: no reordering copy
            out = self.ranges(flat, np.ones(len(flat), np.int64))
        else:
            unique, inverse = np.unique(flat, return_inverse=True)
            out = self.ranges(unique, np.ones(len(unique), np.int64))[inverse]
        return out.reshape(asked.shape + self.row_shape)

    def ranges(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rows ``starts[k]:starts[k] + lengths[k]`` for every k, concatenated in that order."""
        starts = np.asarray(starts, np.int64)
        lengths = np.asarray(lengths, np.int64)
        if len(starts) and ((starts < 0).any() or (lengths < 0).any() or (starts + lengths > len(self)).any()):
            raise IndexError(f"a run of rows starts before row 0, has a negative length or reaches past the "
                             f"{len(self)} rows of {self.path.name}")
        if len(starts) > 1 and (np.diff(starts) >= 0).all():  # sorted: join runs that touch
            ends = starts + lengths
            joins = np.flatnonzero(starts[1:] != ends[:-1]) + 1
            first = np.concatenate([[0], joins])
            last = np.concatenate([joins, [len(starts)]]) - 1
            return self._runs(starts[first], ends[last] - starts[first])
        return self._runs(starts, lengths)

    def _runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The runs, read-only (as the memory-mapped arrays they stand for were)."""
        count = int(lengths.sum())
        sizes = lengths * self.row_bytes
        if len(starts) and count * self.row_bytes <= _JOIN_BELOW:  # a pread a run, joined: few Python steps a row
            positions = (self.offset + starts * self.row_bytes).tolist()
            data = b"".join([os.pread(self.fd, size, at) for size, at in zip(sizes.tolist(), positions)])
            if len(data) == count * self.row_bytes:
                return np.frombuffer(data, self.dtype).reshape((count,) + self.row_shape)
        out = np.empty((count,) + self.row_shape, self.dtype)  # a bulk read in place (no joined copy), or a short read
        buffer = out.data.cast("B") if out.size else memoryview(b"")
        at = 0
        for start, length in zip(starts.tolist(), lengths.tolist()):
            size = length * self.row_bytes
            self._read_into(buffer[at:at + size], self.offset + start * self.row_bytes)
            at += size
        return out

    def _read_into(self, view: memoryview, position: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:done + _MAX_READ]], position + done)
            if got == 0:
                raise StoreError(f"{self.path} ends before the rows its header announces (truncated?). Run "
                                 "`helix doctor --store DIR` to check the store.")
            done += got


class ArrowFile:
    """An Arrow IPC file: ``table`` memory-mapped, and :meth:`strings` for reading single
    values of a string column with ``pread``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.map = pa.memory_map(str(self.path), "r")
        self.table = ipc.open_file(self.map).read_all()
        self.map.seek(0)
        self.size = self.map.size()
        self.base = self.map.read_buffer(self.size).address  # the mapping's first byte: no page read
        self.fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def strings(self, name: str) -> "ArrowStrings | None":
        """Column ``name`` read by value with ``pread``; None when it is not a string
        column or its bytes are not the file's own (a compressed file's are decompressed
        into memory)."""
        column = self.table.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            return None
        inside = all(b is None or b.size == 0 or self.base <= b.address <= self.base + self.size - b.size
                     for chunk in column.chunks for b in chunk.buffers())
        return ArrowStrings(column, self) if inside else None


class ArrowStrings:
    """The values of one string column of an :class:`ArrowFile`, each read with one
    ``pread`` of its bytes."""

    def __init__(self, column: pa.ChunkedArray, file: ArrowFile):
        self.file = file  # holds the descriptor open while these strings are read
        self.fd, self.path, base = file.fd, file.path, file.base
        width = np.int64 if pa.types.is_large_string(column.type) else np.int32
        self.bounds = np.cumsum([0] + [len(c) for c in column.chunks])
        self.bounds_list: list[int] = self.bounds.tolist()
        self.chunks: list[tuple[np.ndarray | None, np.ndarray, int, int]] = []
        for chunk in column.chunks:
            validity, offsets, data = chunk.buffers()
            nulls = np.frombuffer(validity, np.uint8) if validity is not None and chunk.null_count else None
            at = data.address - base if data is not None and data.size else 0
            self.chunks.append((nulls, np.frombuffer(offsets, width), chunk.offset, at))

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def get(self, row: int) -> str | None:
        """The value of ``row`` (scalar steps: numpy's per-call cost would be most of it)."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} is out of range for {len(self)} rows of {self.path.name}")
        c = bisect.bisect_right(self.bounds_list, row) - 1
        nulls, offsets, shift, at = self.chunks[c]
        i = row - self.bounds_list[c] + shift
        if nulls is not None and not (int(nulls[i >> 3]) >> (i & 7)) & 1:
            return None
        start, end = int(offsets[i]), int(offsets[i + 1])
        return os.pread(self.fd, end - start, at + start).decode("utf-8") if end > start else ""

    def take(self, rows: np.ndarray) -> list[str | None]:
        """The values of ``rows`` (ints in any order), in that order."""
        rows = np.asarray(rows, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows {rows.min()}..{rows.max()} are out of range for {len(self)} rows of "
                             f"{self.path.name}")
        values: list[str | None] = [None] * len(rows)
        chunk_of = np.searchsorted(self.bounds, rows, side="right") - 1
        for c in np.unique(chunk_of).tolist():
            nulls, offsets, shift, at = self.chunks[c]
            mine = np.flatnonzero(chunk_of == c)
            i = rows[mine] - self.bounds[c] + shift
            starts, ends = offsets[i].astype(np.int64), offsets[i + 1].astype(np.int64)
            valid = np.ones(len(i), bool) if nulls is None else ((nulls[i >> 3] >> (i & 7)) & 1).astype(bool)
            for k, start, end, ok in zip(mine.tolist(), starts.tolist(), ends.tolist(), valid.tolist()):
                if ok:
                    values[k] = os.pread(self.fd, end - start, at + start).decode("utf-8") if end > start else ""
        return values


__all__ = ["ArrowFile", "ArrowStrings", "RowFile"]
