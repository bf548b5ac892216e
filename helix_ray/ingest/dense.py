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

On a cluster of several nodes the searches leave the driver's node: each search unit
is given its rows' vectors and the index's bytes (:meth:`Tasks.share`: one copy in
Ray's object store, fetched once by each node that runs a unit) instead of the files'
paths, so every node's CPUs search (:func:`search`). Building and changing an index
writes a file into the generation, so those units stay on the driver's node.

The files live in a work folder (:func:`work_folder`) under the store's
``generations/``, on the same disk as the generation, so publish moves an index file
and links the vectors into the generation instead of writing them again.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections import Counter
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
    calls' order, each unit on the driver's node; with ``anywhere`` the calls carry
    their inputs (no path of the driver's disk), and units may run on every node.
    ``threads`` is what one unit may use for a search (0: every core); ``slots`` how
    many units run at once on the driver's node, ``spread_slots`` on every node;
    ``nodes`` how many nodes run units. ``units`` counts the units each node ran."""

    threads: int
    slots: int
    spread_slots: int
    nodes: int
    units: Counter[str]

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], *,
            anywhere: bool = False) -> Iterator[T]: ...

    def share(self, value: np.ndarray) -> Any:
        """What a unit that may run anywhere is given for ``value``: it receives the array."""
        ...


class LocalTasks:
    """Each unit here, one after the other; a search uses every core."""

    threads = 0
    slots = spread_slots = nodes = 1

    def __init__(self) -> None:
        self.units: Counter[str] = Counter()

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], *,
            anywhere: bool = False) -> Iterator[T]:
        for call in calls:
            self.units["local"] += 1
            yield fn(*call)

    def share(self, value: np.ndarray) -> np.ndarray:
        return value


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
    return search_vectors(index_path, np.load(vectors_path, mmap_mode="r")[rows], k, threads)


def search_vectors(index: Path | np.ndarray, queries: np.ndarray, k: int,
                   threads: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`search_block` for ``queries`` (float16 rows) given, against the index
    saved at ``index`` or given as its file's bytes (a uint8 array)."""
    keys = np.full((len(queries), k), -1, np.int64)
    sims = np.zeros((len(queries), k), np.float32)
    if len(queries):
        matches = open_view(index).search(quantize_int8(queries), k, threads=threads)
        found = matches.keys.astype(np.int64).reshape(len(queries), -1)  # one row: usearch answers 1-D
        keys[:, :found.shape[1]] = found
        sims[:, :found.shape[1]] = 1.0 - matches.distances.astype(np.float32).reshape(len(queries), -1)
    return keys, sims


def search(tasks: Tasks, vectors_path: Path, index_path: Path, rows: np.ndarray, k: int, *,
           out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`search_block` over ``rows``, at most :data:`SEARCH_BLOCK` of them per unit,
    in a multiple of the slots units of equal size (so that no slot idles while another
    searches a last block). On several nodes each unit is given its rows' vectors and
    the index's bytes, shared once (:func:`search_vectors`), and runs on any node.
    ``out``: the (len(rows), k) arrays of keys and similarities to fill and return (views
    of a file's memory map, say), new ones by default. Every row is written (a unit's
    answer is −1 padded), so ``out`` needs no filling first."""
    keys, sims = out if out is not None else (np.empty((len(rows), k), np.int64), np.empty((len(rows), k), np.float32))
    spread = tasks.nodes > 1
    slots = max(1, tasks.spread_slots if spread else tasks.slots)
    units = -(-max(1, -(-len(rows) // SEARCH_BLOCK)) // slots) * slots
    size = max(1, -(-len(rows) // units))
    starts = range(0, len(rows), size)
    if spread:
        vectors = np.load(vectors_path, mmap_mode="r")
        index = tasks.share(np.asarray(np.memmap(index_path, dtype=np.uint8, mode="r")))
        calls = [(index, tasks.share(np.ascontiguousarray(vectors[rows[lo:lo + size]])), k, tasks.threads)
                 for lo in starts]
        done = tasks.map(search_vectors, calls, anywhere=True)
    else:
        done = tasks.map(search_block, [(vectors_path, index_path, rows[lo:lo + size], k, tasks.threads)
                                        for lo in starts])
    for lo, (found, found_sims) in zip(starts, done):
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
