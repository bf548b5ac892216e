"""The records an ingest run reads (ingest/incoming.py): rows added after the read —
the segment rows a rebuild absorbs — join the table and the signatures in order, the
signatures staying in their file when they were mapped."""

import numpy as np
import pytest

from helix_ray.ingest.incoming import Incoming, signature_path

NUM_PERM = 4


def _rows(ids):
    return [{"id": i, "user": "ann", "text": f"text of {i}"} for i in ids]


def _sigs(start, n):
    return [np.arange(start + k * NUM_PERM, start + (k + 1) * NUM_PERM, dtype=np.uint32) for k in range(n)]


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "heap"])
def test_append_keeps_rows_and_signatures_in_order(tmp_path, mapped):
    path = tmp_path / "records.arrow" if mapped else None
    incoming = Incoming.gather(zip(_rows(["a", "b", "c"]), _sigs(0, 3)), NUM_PERM, path)
    incoming.append(_rows(["d", "e"]), _sigs(100, 2))
    assert incoming.table.column("id").to_pylist() == ["a", "b", "c", "d", "e"]
    expected = np.stack(_sigs(0, 3) + _sigs(100, 2))
    np.testing.assert_array_equal(np.asarray(incoming.sigs), expected)
    if mapped:
        assert isinstance(incoming.sigs, np.memmap)  # grown in its file, not copied to the heap
        assert signature_path(path).stat().st_size == expected.nbytes


def test_append_to_a_run_that_read_nothing(tmp_path):
    incoming = Incoming.gather(iter(()), NUM_PERM, tmp_path / "records.arrow")
    incoming.append(_rows(["a"]), _sigs(7, 1))
    assert incoming.table.column("id").to_pylist() == ["a"]
    np.testing.assert_array_equal(np.asarray(incoming.sigs), np.stack(_sigs(7, 1)))
