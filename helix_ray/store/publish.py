"""Writing generations: :func:`publish` writes the files that
:mod:`helix_ray.store.generation` describes and opens, :func:`publish_segment` the next
generation as the current one plus a segment of rows, :func:`set_current` points
``CURRENT`` at one, :func:`prune` deletes the old ones.

:func:`publish` goes in steps, each its own function: the rows and vectors, the HNSW
index of each tenant, the BM25 index, what the next ingest carries over, the graph, the
late-interaction tokens (the previous generation's segments hard-linked, the new rows'
written: :mod:`helix_ray.store.late`), the manifest last (with every other file's size
and CRC-32, and its own: :mod:`helix_ray.store.integrity`); then every file and folder
is fsynced and the folder renamed from ``generations/.tmp-*`` to its number. A crash at any step leaves
only a ``.tmp-*`` folder, which the next publish deletes.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from helix_ray.errors import StoreError
from helix_ray.index.bm25 import Analyzer, Terms, build_bm25
from helix_ray.index.csr import CSRGraph, save_csr
from helix_ray.index.hnsw import build_hnsw
from helix_ray.index.quantize import binary_codes, quantize_int8
from helix_ray.schema import GENERATION_SCHEMA
from helix_ray.store.generation import (
    DEAD_FILE,
    DEAD_SCHEMA,
    FORMAT,
    FORMAT_VERSION,
    SCHEMA_HASH,
    SEGMENTED_VERSION,
    SEGMENTS_DIR,
    VECTORS_FILE,
    current_generation_number,
    generations_dir,
)
from helix_ray.store.integrity import MANIFEST, MANIFEST_CHECKSUM, read_manifest, record_files, seal
from helix_ray.store.late import TokenRows, link_or_copy, write_late
from helix_ray.token_encoder import DIM as LATE_DIM
from helix_ray.token_encoder import NAME as LATE_NAME
from helix_ray.tables import take_rows

log = logging.getLogger(__name__)


@dataclass
class GenerationData:
    """Everything a generation holds, in memory, ready to be written."""

    memories: pa.Table  # GENERATION_SCHEMA, grouped by user
    vectors: np.ndarray  # float16 or float32 (N, dim); stored as float16
    minhash: np.ndarray  # uint32 (N, num_perm)
    terms: Terms  # each row's text + expansions, analysed
    graph: CSRGraph
    entities: pa.Table  # ENTITY_SCHEMA
    embedder: str
    dim: int
    extra: dict[str, Any] = field(default_factory=dict)
    late: TokenRows | None = None  # late-interaction tokens over the same rows: carried or new
    mentions: pa.Array | None = None  # entity keys per row: list<string> (helix_ray.ingest.carry.MENTIONS_TYPE)
    knn: tuple[np.ndarray, np.ndarray] | None = None  # (N, K) nearest rows, similarities
    # ``vectors`` already saved as float16 .npy on the store's disk (ingest's work folder):
    # linked into the generation, not written again
    vectors_file: Path | None = None
    # ``minhash`` already saved as uint32 .npy on the store's disk: linked, as the vectors
    minhash_file: Path | None = None
    # ``knn`` already saved as int32 and float32 .npy on the store's disk: linked too
    knn_files: tuple[Path, Path] | None = None


@dataclass(frozen=True)
class HnswSettings:
    """How :func:`publish` builds a tenant's HNSW index: ``connectivity`` (the paper's M),
    ``expansion_add`` (efConstruction), the fewest rows a tenant needs to get one
    (``min_rows``; smaller tenants are scanned) and insertion ``threads``."""

    connectivity: int
    expansion_add: int
    min_rows: int
    threads: int


def partitions_of(users: pa.Array | pa.ChunkedArray | np.ndarray | list[str]) -> list[dict[str, Any]]:
    """Contiguous [start, end) row ranges per user of a user-grouped column (an Arrow
    column is compared as one: no Python string per row)."""
    column = users if isinstance(users, (pa.Array, pa.ChunkedArray)) else pa.array(list(users), pa.string())
    if not len(column):
        return []
    changed = pc.not_equal(column[1:], column[:-1]).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, changed])
    ends = np.r_[starts[1:], len(column)]
    seen = take_rows(column, starts).to_pylist()
    if len(seen) != len(set(seen)):
        raise ValueError("memories must be grouped by user before a generation is written")
    return [{"user": user, "start": int(start), "end": int(end), "dense": f"dense/p{k}.usearch"}
            for k, (user, start, end) in enumerate(zip(seen, starts.tolist(), ends.tolist()))]


# ----------------------------------------------------------------------------- files


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a folder: a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_saved(path: Path, dtype: Any, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless the ``.npy`` file at ``path`` holds ``dtype`` in ``shape``
    (a file a generation is to link rather than write)."""
    saved = np.load(path, mmap_mode="r")
    if saved.dtype != dtype or saved.shape != shape:
        raise ValueError(f"{path} holds {saved.dtype} {saved.shape}; expected {np.dtype(dtype)} {shape}")


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array))


def _npy_header(fh: Any, dtype: Any, shape: tuple[int, ...]) -> None:
    """The ``.npy`` header of a C-ordered array of ``dtype`` and ``shape``, written to ``fh``."""
    np.lib.format.write_array_header_1_0(
        fh, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})


def save_npy_blocks(path: Path, dtype: Any, shape: tuple[int, ...], blocks: Iterable[np.ndarray]) -> None:
    """An array of ``shape`` saved as ``.npy`` from ``blocks``, its rows in order, each
    written as it comes: the whole array is never in memory. Raises ValueError when the
    blocks do not hold exactly ``shape[0]`` rows."""
    rows = 0
    with open(path, "wb") as fh:
        _npy_header(fh, dtype, shape)
        for block in blocks:
            fh.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
            rows += len(block)
    if rows != shape[0]:
        raise ValueError(f"{path.name}: {rows} rows written for a shape of {shape}")


def _save_npy_rows(path: Path, array: np.ndarray, dtype: Any, convert: Callable[[np.ndarray], np.ndarray],
                   block: int = 65536) -> None:
    """``convert(array)`` saved as ``.npy``, converted and written ``block`` rows at a
    time: the converted copy is never whole in memory."""
    width = convert(array[:0]).shape[1:]
    save_npy_blocks(path, dtype, (len(array), *width),
                    (convert(array[lo:lo + block]) for lo in range(0, len(array), block)))


def save_arrow(path: Path, table: pa.Table) -> None:
    _save_arrow_parts(path, table.schema, [table])


def _save_arrow_parts(path: Path, schema: pa.Schema, parts: Iterable[pa.Table]) -> None:
    """The tables ``parts`` (each of ``schema``) written to ``path`` (Arrow IPC) one after
    another, as they come."""
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, schema) as writer:
        for part in parts:
            writer.write_table(part)


def mapped_table(table: pa.Table, path: Path, order: np.ndarray | None = None, block: int = 65536) -> pa.Table:
    """``table`` written to ``path`` (Arrow IPC) and read back from a memory map of it:
    the same rows, out of the heap. The kernel keeps their pages in its cache while
    memory allows and drops them when it does not (ingest holds its sorted rows so, from
    the sort until the database has recorded them). ``order``: its rows in that order
    instead, taken ``block`` at a time (never a sorted copy of the whole table)."""
    parts = [table] if order is None else \
        (take_rows(table, order[lo:lo + block]) for lo in range(0, len(order), block))
    return mapped_parts(parts, table.schema, path)


def mapped_parts(parts: Iterable[pa.Table], schema: pa.Schema, path: Path) -> pa.Table:
    """The tables ``parts`` (each of ``schema``) written one after another to ``path``
    (Arrow IPC) as they come, and read back from a memory map of it: the rows of a
    table made a block at a time, never whole in the heap (:func:`mapped_table`)."""
    _save_arrow_parts(path, schema, parts)
    return ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def file_array(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A new ``.npy`` file at ``path`` as a writable memory map of ``shape``: an array
    to fill out of the heap, as :func:`mapped_table` holds a table (one of no element
    too: numpy maps its header-only file). Its disk blocks are
    taken here, so that a full disk is an ``OSError`` now rather than a SIGBUS at a
    page written later."""
    with open(path, "wb") as fh:
        _npy_header(fh, dtype, shape)
        size = fh.tell() + int(np.prod(shape)) * np.dtype(dtype).itemsize
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fh.fileno(), 0, size)
        else:  # macOS: a sparse file
            fh.truncate(size)
    return np.load(path, mmap_mode="r+")


@dataclass
class _Staging:
    """A generation being written into ``folder`` (``generations/.tmp-*``).

    ``crash_after`` names a file or folder after which :meth:`done` raises (tests
    inject a crash mid-publish)."""

    folder: Path
    crash_after: str | None

    def done(self, path: Path) -> None:
        if self.crash_after and path.name == self.crash_after:
            raise RuntimeError(f"injected crash after writing {path.name}")


# ----------------------------------------------------------------------------- publishing


def publish(
    store: Path,
    data: GenerationData,
    *,
    hnsw_connectivity: int = 16,
    hnsw_expansion_add: int = 128,
    bm25_analyzer: Analyzer | None = None,
    crash_after: str | None = None,
    dense_indexes: dict[str, Any] | None = None,
    hnsw_min_rows: int = 0,
    hnsw_threads: int = 1,
    make_current: bool = True,
) -> int:
    """Write ``data`` as the next generation and make it current; return its number.
    ``make_current=False`` leaves ``CURRENT`` alone: the caller records the generation
    elsewhere first (ingest: in the database) and then calls :func:`set_current`.

    ``dense_indexes`` are per-tenant HNSW indexes already built over these rows (ingest
    builds them for the semantic kNN edges), as index objects or files on the store's
    disk (moved into the generation); other tenants with at least
    ``hnsw_min_rows`` memories get one built here, smaller ones none (recall scans them).

    ``crash_after`` names a file after which to raise (tests inject a crash mid-publish).
    """
    analyzer = bm25_analyzer or Analyzer()
    hnsw = HnswSettings(hnsw_connectivity, hnsw_expansion_add, hnsw_min_rows, hnsw_threads)
    root = generations_dir(store)
    previous, number = _next_number(store)
    staging = _Staging(root / f".tmp-{uuid.uuid4().hex[:12]}", crash_after)
    staging.folder.mkdir()

    table = data.memories
    if table.schema != GENERATION_SCHEMA:
        table = table.cast(GENERATION_SCHEMA)
    n = table.num_rows
    if data.vectors.shape != (n, data.dim):
        raise ValueError(f"vectors have shape {data.vectors.shape}; expected ({n}, {data.dim})")
    if data.vectors_file is not None:
        _check_saved(data.vectors_file, np.float16, (n, data.dim))
    if data.minhash_file is not None:
        _check_saved(data.minhash_file, np.uint32, (n, *data.minhash.shape[1:]))
    parts = partitions_of(table.column("user"))

    _write_rows(staging, table, data)
    _write_dense(staging, parts, data.vectors, data.dim, dense_indexes or {}, hnsw)
    build_bm25(None, staging.folder / "bm25", analyzer=analyzer, terms=data.terms)
    staging.done(staging.folder / "bm25")
    carry = _write_carried(staging, data, n, analyzer)
    _write_graph(staging, data)
    manifest = _manifest(data, number, previous, parts, analyzer, hnsw, carry)
    linked: dict[str, dict[str, Any]] = {}
    if data.late is not None:
        manifest["late"], linked = _write_late(staging, data.late, n, number)
    manifest["files"] = record_files(staging.folder, known=linked)
    (staging.folder / "manifest.json").write_text(json.dumps(seal(manifest), indent=1))
    staging.done(staging.folder / "manifest.json")

    _rename_durably(staging.folder, root / f"{number:06d}")
    if make_current:
        set_current(store, number)
    log.info("wrote generation %d (%d memories)%s", number, n, "" if make_current else "; not current yet")
    return number


def publish_segment(store: Path, rows: pa.Table, dead: pa.Table, *, make_current: bool = True,
                    crash_after: str | None = None) -> int:
    """Write the next generation as the current one plus one more segment; return its
    number. Every file of the current generation (its earlier segments too) is
    hard-linked, ``rows`` (the delta's row format) become ``segments/s<number>.arrow``,
    and ``dead`` (:data:`DEAD_SCHEMA`: every id dead since the base, not only this
    fold's) the dead list. It writes what ``rows`` hold, whatever the store's size.
    ``make_current`` and ``crash_after`` as for :func:`publish`."""
    previous, number = _next_number(store)
    if not previous:
        raise StoreError(f"Store {store} has no generation to add a segment to; ingest first.")
    base = generations_dir(store) / f"{previous:06d}"
    manifest = read_manifest(base)
    staging = _Staging(generations_dir(store) / f".tmp-{uuid.uuid4().hex[:12]}", crash_after)
    staging.folder.mkdir()
    for name in manifest["files"]:
        if name != DEAD_FILE:
            (staging.folder / name).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(base / name, staging.folder / name)
    (staging.folder / SEGMENTS_DIR).mkdir(exist_ok=True)
    segment = f"{SEGMENTS_DIR}/s{number:06d}.arrow"
    save_arrow(staging.folder / segment, rows)
    staging.done(staging.folder / segment)
    save_arrow(staging.folder / DEAD_FILE, dead.select(DEAD_SCHEMA.names).cast(DEAD_SCHEMA))
    segments = [*(manifest.get("segments") or []), {"file": segment, "rows": rows.num_rows}]
    out = {k: v for k, v in manifest.items() if k not in ("files", MANIFEST_CHECKSUM)}
    out.update({
        "format_version": SEGMENTED_VERSION, "generation": number, "parent": previous,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(), "base": manifest.get("base", previous),
        "segments": segments,
        "counts": {**manifest["counts"], "segment_rows": sum(int(seg["rows"]) for seg in segments),
                   "dead": dead.num_rows},
    })
    # The linked files keep their records; the dead list is new, whatever its size.
    out["files"] = record_files(staging.folder, known={k: v for k, v in manifest["files"].items() if k != DEAD_FILE})
    (staging.folder / MANIFEST).write_text(json.dumps(seal(out), indent=1))
    staging.done(staging.folder / MANIFEST)
    _rename_durably(staging.folder, generations_dir(store) / f"{number:06d}")
    if make_current:
        set_current(store, number)
    log.info("wrote generation %d: generation %d and a segment of %d rows", number, previous, rows.num_rows)
    return number


def _next_number(store: Path) -> tuple[int, int]:
    """The current generation's number (0 for none) and the next one's: past every
    folder there, so a run that never became current is not overwritten. Deletes the
    ``.tmp-*`` folders a crashed publish left."""
    root = generations_dir(store)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    previous = current_generation_number(store) or 0
    existing = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
    return previous, max([previous, *existing]) + 1


def _write_rows(staging: _Staging, table: pa.Table, data: GenerationData) -> None:
    """``memories.arrow``, the vectors (float16), their sign-bit codes and the MinHash
    signatures; each file is converted a block at a time, never as a copy of all the
    vectors."""
    tmp = staging.folder
    save_arrow(tmp / "memories.arrow", table)
    staging.done(tmp / "memories.arrow")
    vectors = data.vectors
    if data.vectors_file is not None:
        link_or_copy(data.vectors_file, tmp / VECTORS_FILE)
    else:
        _save_npy_rows(tmp / VECTORS_FILE, vectors, np.float16, lambda rows: rows.astype(np.float16))
    staging.done(tmp / VECTORS_FILE)
    _save_npy_rows(tmp / "binary.npy", vectors, np.uint8, binary_codes)
    staging.done(tmp / "binary.npy")
    if data.minhash_file is not None:
        link_or_copy(data.minhash_file, tmp / "minhash.npy")
    else:
        _save_npy(tmp / "minhash.npy", data.minhash.astype(np.uint32, copy=False))
    staging.done(tmp / "minhash.npy")


def _write_dense(staging: _Staging, parts: list[dict[str, Any]], vectors: np.ndarray, dim: int,
                 dense_indexes: dict[str, Any], hnsw: HnswSettings) -> None:
    """Each tenant's HNSW index: given as a file (moved in: it must be on the store's
    disk) or an index object (saved), or built here; a tenant with fewer than
    ``hnsw.min_rows`` rows gets none, and its partition's ``dense`` becomes None."""
    (staging.folder / "dense").mkdir()
    for part in parts:
        index = dense_indexes.get(part["user"])
        if index is None and part["end"] - part["start"] >= hnsw.min_rows:
            int8 = quantize_int8(vectors[part["start"]:part["end"]])
            index = build_hnsw(int8, part["start"], dim, threads=hnsw.threads,
                               connectivity=hnsw.connectivity, expansion_add=hnsw.expansion_add)
        if index is None:
            part["dense"] = None
            continue
        if isinstance(index, Path):
            os.replace(index, staging.folder / part["dense"])
        else:
            index.save(str(staging.folder / part["dense"]))
        staging.done(staging.folder / part["dense"])


def _write_carried(staging: _Staging, data: GenerationData, n: int, analyzer: Analyzer) -> dict[str, Any]:
    """``mentions.arrow`` and ``knn/`` when ``data`` has them; returns the manifest's
    ``carry``: what the next ingest can take from this generation, and how it was made."""
    tmp = staging.folder
    carry = {**(data.extra.get("carry") or {}), "terms": analyzer.to_dict()}
    if data.mentions is not None:
        if len(data.mentions) != n:
            raise ValueError(f"mentions cover {len(data.mentions)} memories; expected {n}")
        save_arrow(tmp / "mentions.arrow", pa.table({"entities": data.mentions}))
        staging.done(tmp / "mentions.arrow")
    else:
        carry.pop("mentions", None)
    if data.knn is not None:
        neighbours, similarities = data.knn
        if neighbours.shape[0] != n or similarities.shape != neighbours.shape:
            raise ValueError(f"kNN lists have shapes {neighbours.shape} and {similarities.shape}; expected ({n}, K)")
        (tmp / "knn").mkdir()
        saved = zip(data.knn_files or (None, None), ("neighbours.npy", "similarities.npy"), (neighbours, similarities),
                    (np.int32, np.float32))
        for given, name, array, dtype in saved:
            if given is not None:
                _check_saved(given, dtype, neighbours.shape)
                link_or_copy(given, tmp / "knn" / name)
            else:
                _save_npy(tmp / "knn" / name, array.astype(dtype, copy=False))
        staging.done(tmp / "knn")
        carry["knn"] = int(neighbours.shape[1])
    else:
        carry.pop("knn", None)
    return carry


def _write_graph(staging: _Staging, data: GenerationData) -> None:
    """The CSR adjacency (``graph/``) and the entity nodes (``entities.arrow``)."""
    tmp = staging.folder
    save_csr(tmp / "graph", data.graph)
    staging.done(tmp / "graph")
    save_arrow(tmp / "entities.arrow", data.entities)
    staging.done(tmp / "entities.arrow")


def _write_late(staging: _Staging, late: TokenRows, n: int, number: int
                ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The late-interaction tokens (``late/``): the previous generation's segments linked,
    the new rows' tokens as segment ``g<number>`` (:func:`helix_ray.store.late.write_late`).
    Returns the manifest's ``late`` and the checksum records of the linked files."""
    if len(late) != n:
        raise ValueError(f"late-interaction tokens cover {len(late)} memories; expected {n}")
    info, linked = write_late(staging.folder, late, f"g{number:06d}")
    staging.done(staging.folder / "late")
    return {"encoder": LATE_NAME, "dim": LATE_DIM, **info}, linked


def _manifest(data: GenerationData, number: int, previous: int, parts: list[dict[str, Any]], analyzer: Analyzer,
              hnsw: HnswSettings, carry: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json`` of generation ``number`` (without ``late``)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generation": number,
        "parent": previous or None,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "embedder": {"name": data.embedder, "dim": data.dim},
        "schema_hash": SCHEMA_HASH,
        "counts": {
            "memories": data.memories.num_rows,
            "users": len(parts),
            "entities": data.entities.num_rows,
            "edges": int(len(data.graph.indices) // 2),
        },
        "bm25": analyzer.to_dict(),
        "hnsw": {"connectivity": hnsw.connectivity, "expansion_add": hnsw.expansion_add, "dtype": "i8",
                 "min_rows": hnsw.min_rows},
        "minhash": {"num_perm": int(data.minhash.shape[1]) if data.minhash.ndim == 2 else 0},
        "partitions": parts,
        **data.extra,
        "carry": carry,
    }


def _rename_durably(tmp: Path, final: Path) -> None:
    """fsync every file and folder under ``tmp``, then rename it to ``final`` and fsync
    their parent: after a crash the generation is there whole, or not at all."""
    for path in tmp.rglob("*"):
        if path.is_file():
            fsync_path(path)
    for folder in [tmp, *[p for p in tmp.rglob("*") if p.is_dir()]]:
        fsync_path(folder)
    os.rename(tmp, final)
    fsync_path(final.parent)


# ----------------------------------------------------------------------------- CURRENT and pruning


def set_current(store: Path, number: int) -> None:
    """Point ``CURRENT`` at generation ``number`` atomically (write, fsync, rename)."""
    if not (generations_dir(store) / f"{number:06d}" / "manifest.json").is_file():
        raise StoreError(f"Generation {number} of {store} is not there; CURRENT stays at "
                         f"{current_generation_number(store)}.")
    pointer_tmp = store / f".CURRENT.{uuid.uuid4().hex[:8]}"
    pointer_tmp.write_text(f"{number}\n")
    fsync_path(pointer_tmp)
    os.replace(pointer_tmp, store / "CURRENT")
    fsync_path(store)


def prune(store: Path, keep: int = 2) -> list[int]:
    """Delete every generation folder but the current one and the ``keep − 1`` that were
    current before it (followed through each manifest's ``parent``): older ones, and
    folders of runs that never became current."""
    current = current_generation_number(store)
    if current is None:
        return []
    kept: list[int] = []
    number = current
    while number and len(kept) < keep:
        kept.append(number)
        try:
            number = json.loads((generations_dir(store) / f"{number:06d}" / "manifest.json").read_text()).get("parent")
        except (OSError, ValueError):
            break
    numbers = sorted(int(p.name) for p in generations_dir(store).iterdir() if p.name.isdigit())
    doomed = [g for g in numbers if g not in kept]
    for g in doomed:
        shutil.rmtree(generations_dir(store) / f"{g:06d}", ignore_errors=True)
    return doomed
