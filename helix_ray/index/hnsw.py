"""HNSW indexes (usearch) over int8 vectors: one per tenant partition of a generation,
keyed by global row id, saved as ``dense/p<k>.usearch``.

usearch is imported on first use, so importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build_hnsw(int8: np.ndarray, first_key: int, dim: int, *, connectivity: int, expansion_add: int,
               threads: int = 1):
    """HNSW over int8 vectors keyed by global row id (``first_key`` onwards).
    ``connectivity`` is the paper's M, ``expansion_add`` its efConstruction.
    ``threads=1`` is deterministic: usearch's parallel insertion order varies, so the
    same input could link differently."""
    from usearch.index import Index

    index = Index(ndim=dim, metric="cos", dtype="i8", connectivity=connectivity, expansion_add=expansion_add)
    if len(int8):
        index.add(np.arange(first_key, first_key + len(int8), dtype=np.uint64), int8, threads=threads)
    return index


def open_view(source: Path | np.ndarray):
    """The index saved at ``source``, opened as a read-only memory-mapped view (pages
    load on use); or viewed in place in ``source``, the file's bytes (a uint8 array the
    caller keeps alive while it uses the index)."""
    from usearch.index import Index

    return Index.restore(source.data if isinstance(source, np.ndarray) else str(source), view=True)


def load_copy(path: Path):
    """The index saved at ``path``, loaded into memory (to change and save elsewhere)."""
    from usearch.index import Index

    return Index.restore(str(path), view=False)
