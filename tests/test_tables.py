"""Rows taken chunk by chunk (helix_ray/tables.py): what Arrow's take gives, without a
copy of the whole column."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from helix_ray.tables import take_rows


def _table(rows: int, chunk: int) -> pa.Table:
    parts = []
    for lo in range(0, rows, chunk):
        n = np.arange(lo, min(rows, lo + chunk))
        parts.append(pa.table({"text": [f"memory {i} " * (i % 4) for i in n.tolist()],
                               "tags": [[str(i)] * (i % 3) for i in n.tolist()],
                               "n": n, "maybe": [None if i % 5 == 0 else float(i) for i in n.tolist()]}))
    return pa.concat_tables(parts)


@pytest.mark.parametrize("at", [
    [], [0], [999], list(range(1000)),                      # none, the ends, all in order
    [5, 5, 130, 129, 999, 0, 5],                            # repeats, back and forth across chunks
    np.random.default_rng(0).permutation(1000)[:300],       # a shuffled block
    np.sort(np.random.default_rng(1).integers(0, 1000, 400)),  # ascending with repeats
])
def test_take_gives_what_arrows_take_gives(at):
    table = _table(1000, 128)
    assert table.column("text").num_chunks == 8
    want = table.combine_chunks().take(pa.array(np.asarray(at, np.int64), pa.int64()))
    got = take_rows(table, at)
    assert got.schema == table.schema and got.to_pylist() == want.to_pylist()
    column = take_rows(table.column("tags"), at)
    assert column.type == table.column("tags").type and column.to_pylist() == want.column("tags").to_pylist()


def test_take_of_one_chunk_or_none_and_rows_outside():
    one = _table(10, 10)
    assert take_rows(one, [3, 1]).column("n").to_pylist() == [3, 1]
    empty = one.schema.empty_table()
    assert take_rows(empty, []).num_rows == 0
    many = _table(100, 10)
    for bad in ([100], [-1], [3, 250]):
        with pytest.raises(IndexError):
            take_rows(many, bad)
        with pytest.raises(IndexError):
            take_rows(one, [10])


def test_take_holds_only_the_rows_it_returns():
    """Arrow's own take of 100 rows copies the whole 60 MB column first; take does not
    (measured in a fresh process, by the peak of Arrow's memory pool)."""
    script = textwrap.dedent("""
        import sys
        import pyarrow as pa
        from helix_ray.tables import take_rows
        column = pa.chunked_array([pa.array(["x" * 200] * 10000) for _ in range(30)])  # 60 MB of strings
        pool = pa.default_memory_pool()
        base = pool.max_memory()
        rows = take_rows(column, list(range(0, 300000, 3000))) if sys.argv[1] == "helix" else \\
            column.take(pa.array(list(range(0, 300000, 3000))))
        assert rows.to_pylist() == ["x" * 200] * 100
        print((pool.max_memory() - base) / 2**20)
    """)
    grown = {how: float(subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                                       check=True).stdout) for how in ("helix", "arrow")}
    assert grown["arrow"] > 50  # the column concatenated: what this test guards against
    assert grown["helix"] < 1
