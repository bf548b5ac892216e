"""Row reads with pread (:mod:`helix_ray.store.rows`): the same values as the arrays and
Arrow columns they stand for, clear errors for rows or files that are not there, and
no mapping of the file left in the process."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from helix_ray.errors import StoreError
from helix_ray.store.rows import ArrowFile, RowFile


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/smaps").read_text()


@pytest.mark.parametrize("dtype, shape", [(np.float16, (700, 384)), (np.uint32, (300, 128)), (np.float32, (900,)),
                                          (np.int8, (5, 64))])
def test_row_file_reads_what_numpy_reads(tmp_path, dtype, shape):
    """Protects every reader of vectors, MinHash and tokens: ints, negative ints, slices
    (with a step), arrays of rows in any order with repeats, runs of rows, and the whole
    array give numpy's values, dtype and shape."""
    rng = np.random.default_rng(7)
    array = (rng.random(shape) * 200 - 100).astype(dtype)
    np.save(tmp_path / "a.npy", array)
    rows = RowFile(tmp_path / "a.npy")
    assert (rows.shape, rows.dtype, rows.ndim, len(rows)) == (array.shape, array.dtype, array.ndim, len(array))
    picks = rng.integers(0, len(array), 60)
    picks[:3] = picks[3]  # repeats
    for key in (picks, picks.tolist(), np.sort(picks), slice(1, 4), slice(None, None, 2), slice(3, 1), 0, -1, 2):
        got, want = rows[key], array[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(rows), array)
    np.testing.assert_array_equal(np.asarray(rows, dtype=np.float64), array.astype(np.float64))
    starts, lengths = np.array([3, 0, 1, 4]), np.array([2, 1, 0, 1])
    np.testing.assert_array_equal(rows.ranges(starts, lengths),
                                  np.concatenate([array[a:a + n] for a, n in zip(starts, lengths)]))
    np.testing.assert_array_equal(rows.ranges(np.array([0, 2, 3]), np.array([2, 1, 2])), array[0:5])  # joined
    grid = picks[:4].reshape(2, 2)
    assert rows[grid].shape == array[grid].shape
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(rows))[picks], array[picks])  # opened again


def test_row_file_maps_nothing_and_refuses_what_is_not_there(tmp_path):
    """Protects the point of the module: reading rows leaves no mapping of the file in
    the process (its pages are not counted in the reader's RSS or PSS); rows out of range
    and a file shorter than its header says are refused, naming the file."""
    path = tmp_path / "vectors.npy"
    np.save(path, np.arange(4000 * 96, dtype=np.float32).reshape(4000, 96))
    rows = RowFile(path)
    assert rows[np.array([5, 3999, 17])].sum() > 0 and not _mapped(path)
    with pytest.raises(IndexError, match="out of range for 4000 rows of vectors.npy"):
        rows[np.array([1, 4000])]
    with pytest.raises(IndexError, match="out of range"):
        rows[-4001]
    with pytest.raises(TypeError, match="by integer position; got bool"):
        rows[np.ones(4000, bool)]
    with pytest.raises(TypeError, match="got float64"):
        rows[np.array([1.7])]
    with pytest.raises(IndexError, match="negative length"):
        rows.ranges(np.array([5]), np.array([-1]))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 96 * 4 * 10)  # the last ten rows gone
    with pytest.raises(StoreError, match="vectors.npy ends before the rows its header announces"):
        RowFile(path)[3995]


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_arrow_strings_read_the_values_arrow_reads(tmp_path, kind):
    """Protects ids, sessions, sources and texts on the query path: every value of a string
    column written in several record batches, nulls and empty and non-ASCII strings
    included, reads as Arrow reads it; a row out of range is refused, naming the file."""
    values = [None if i % 7 == 3 else ("" if i % 11 == 5 else f"mémoire {i} " + "x" * (i % 13)) for i in range(250)]
    table = pa.table({"id": pa.array([f"m{i}" for i in range(250)]), "text": pa.array(values, kind),
                      "n": pa.array(range(250))})
    path = tmp_path / "memories.arrow"
    with ipc.new_file(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    file = ArrowFile(path)
    assert file.strings("n") is None
    texts = file.strings("text")
    assert texts is not None and len(texts) == 250 and len(file.table.column("text").chunks) == 4
    assert [texts.get(i) for i in range(250)] == values
    picks = np.random.default_rng(3).integers(0, 250, 90)
    assert texts.take(picks) == [values[i] for i in picks] and texts.take(np.zeros(0, np.int64)) == []
    assert file.strings("id").get(249) == "m249"
    with pytest.raises(IndexError, match="out of range for 250 rows of memories.arrow"):
        texts.get(250)
    held = file.strings("text")
    del file, texts
    gc.collect()
    assert held is not None and held.get(249) == values[249]  # the strings keep their file open
    padded = tmp_path / "padded.arrow"  # an empty batch first: zero-length buffers, outside the mapping
    with ipc.new_file(padded, table.schema) as writer:
        writer.write_table(pa.concat_tables([table.slice(0, 0), table]))
    assert ArrowFile(padded).strings("text").get(0) == values[0]
    compressed = tmp_path / "compressed.arrow"  # its buffers live decompressed in memory, not in the file
    with ipc.new_file(compressed, table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table, max_chunksize=64)
    assert ArrowFile(compressed).strings("text") is None


def test_a_published_generation_reads_its_query_rows_with_pread(tenant_store):
    """Protects the serving memory goal: a generation that ingest published reads its
    vectors, MinHash, tokens, ids, sessions, sources and texts by pread, none through a
    mapping of the file (a layout change that made Arrow hand out other buffers would
    otherwise fall back to the mapping without a word)."""
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(tenant_store[0])
    assert isinstance(gen.vectors, RowFile) and isinstance(gen.minhash, RowFile)
    assert all(isinstance(part, RowFile) for pair in gen.late.arrays for part in pair)
    cols = gen.columns
    assert all(column._rows is not None for column in (cols.ids, cols.sessions, cols.documents, gen._texts))
    row = len(cols.ids) - 1
    assert gen.text(row) == gen.memories.column("text")[row].as_py()
    assert cols.ids[np.array([row, 0])].tolist() == [gen.memories.column("id")[i].as_py() for i in (row, 0)]
