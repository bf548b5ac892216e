"""Stage 7b's heavy part: each large tenant's HNSW index and the HNSW searches that list
every memory's nearest neighbours, as units of work over files.

Each unit reads the generation's sorted float16 vectors from the ``.npy`` file the
driver wrote them to once (:data:`VECTORS`; publish links it into the generation),
quantizes the rows it needs to int8 (as :func:`helix_ray.index.quantize.quantize_int8`
always does), and writes or opens an index file; it returns only small arrays. So the
units can run anywhere that sees the files, in parallel — as Ray tasks on the driver's
node for ``runner="ray"`` (``pipelines.ingest.RayTasks``), here in turn otherwise
(:class:`LocalTasks`) — and the driver never holds an index or the int8 copy of the
vectors: at a million memories those are ~0.9 GB and 0.4 GB.

The files live in a work folder (:func:`work_folder`) under the store's
``generations/``, on the same disk as the generation, so publish moves an index file
and links the vectors into the generation instead of writing them again.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

import numpy as np

from helix_ray.index.hnsw import build_hnsw, load_copy, open_view
from helix_ray.index.quantize import quantize_int8
from helix_ray.store.publish import HnswSettings

T = TypeVar("T")

WORK_PREFIX = ".work-"
VECTORS = "vectors.npy"  # in the work folder: the generation's sorted float16 vectors
_PARKED = np.uint64(1 << 62)  # above every row number
SEARCH_BLOCK = 65536  # rows per search unit at most: the queries' int8 copy is one block's


class Tasks(Protocol):
    """Runs units of work: ``map(fn, calls)`` gives ``fn(*call)`` for each call, in the
    calls' order. ``threads`` is what one unit may use for a search (0: every core);
    ``slots`` how many units run at once."""

    threads: int
    slots: int

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> Iterator[T]: ...


class LocalTasks:
    """Each unit here, one after the other; a search uses every core."""

    threads = 0
    slots = 1

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> Iterator[T]:
        return (fn(*call) for call in calls)


@contextmanager
def work_folder(store: Path) -> Iterator[Path]:
    """A new folder for one run's vectors and index files, under the store's
    ``generations/`` (the disk publish writes to), deleted after the block. Folders a
    crashed run left are deleted first: one writer ingests into a store at a time."""
    root = store / "generations"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(WORK_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    folder = root / f"{WORK_PREFIX}{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Carried:
    """How to make a tenant's index from the previous generation's file ``source``:
    ``remove`` the keys of memories that left, rename ``rename_from`` to ``rename_to``,
    add ``add`` (rows now)."""

    source: Path
    remove: np.ndarray
    rename_from: np.ndarray
    rename_to: np.ndarray
    add: np.ndarray


def build_index(vectors_path: Path, start: int, end: int, dim: int, params: HnswSettings, out: Path) -> Path:
    """The HNSW index of rows ``start … end − 1``, keyed by row, saved at ``out``."""
    vectors = np.load(vectors_path, mmap_mode="r")
    index = build_hnsw(quantize_int8(vectors[start:end]), start, dim, connectivity=params.connectivity,
                       expansion_add=params.expansion_add, threads=params.threads)
    index.save(str(out))
    return out


def carry_index(vectors_path: Path, carried: Carried, params: HnswSettings, out: Path) -> Path:
    """The previous generation's index changed as ``carried`` says, saved at ``out``."""
    index = load_copy(carried.source)
    if len(carried.remove):
        index.remove(carried.remove)
    if len(carried.rename_from):
        parked = carried.rename_from + _PARKED  # renamed keys pass through here, so no two ever collide
        index.rename(carried.rename_from, parked)
        index.rename(parked, carried.rename_to)
    if len(carried.add):
        vectors = np.load(vectors_path, mmap_mode="r")
        index.add(carried.add.astype(np.uint64), quantize_int8(vectors[carried.add]), threads=params.threads)
    index.save(str(out))
    return out


def search_block(vectors_path: Path, index_path: Path, rows: np.ndarray, k: int,
                 threads: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest keys of the index at ``index_path`` to each of ``rows`` (their
    vectors' int8 forms), −1 padded, and their cosine similarities."""
    vectors = np.load(vectors_path, mmap_mode="r")
    keys = np.full((len(rows), k), -1, np.int64)
    sims = np.zeros((len(rows), k), np.float32)
    if len(rows):
        matches = open_view(index_path).search(quantize_int8(vectors[rows]), k, threads=threads)
        found = matches.keys.astype(np.int64).reshape(len(rows), -1)  # one row: usearch answers 1-D
        keys[:, :found.shape[1]] = found
        sims[:, :found.shape[1]] = 1.0 - matches.distances.astype(np.float32).reshape(len(rows), -1)
    return keys, sims


def search(tasks: Tasks, vectors_path: Path, index_path: Path, rows: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`search_block` over ``rows``, at most :data:`SEARCH_BLOCK` of them per unit,
    in a multiple of ``tasks.slots`` units of equal size (so that no slot idles while
    another searches a last block)."""
    keys = np.full((len(rows), k), -1, np.int64)
    sims = np.zeros((len(rows), k), np.float32)
    slots = max(1, tasks.slots)
    units = -(-max(1, -(-len(rows) // SEARCH_BLOCK)) // slots) * slots
    size = max(1, -(-len(rows) // units))
    starts = range(0, len(rows), size)
    calls = [(vectors_path, index_path, rows[lo:lo + size], k, tasks.threads) for lo in starts]
    for lo, (found, found_sims) in zip(starts, tasks.map(search_block, calls)):
        keys[lo:lo + len(found)], sims[lo:lo + len(found)] = found, found_sims
    return keys, sims


class Int8Cosine:
    """Cosine similarities of rows to candidate rows of ``vectors`` as the HNSW index
    scores them (usearch's int8 cosine): ``(len(rows), len(candidates))``. The
    candidates' unit int8 forms are kept while the same array is asked again (a tenant's
    new rows, met by its old rows a block at a time)."""

    def __init__(self, vectors: np.ndarray):
        self.vectors = vectors
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        if self._last is None or self._last[0] is not candidates:
            self._last = (candidates, self._unit(candidates))
        return self._unit(rows) @ self._last[1].T

    def _unit(self, rows: np.ndarray) -> np.ndarray:
        out = quantize_int8(self.vectors[rows]).astype(np.float32)
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out
