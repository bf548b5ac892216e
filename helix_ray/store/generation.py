"""The on-disk contract: an immutable generation of plain, memory-mappable files.

A store folder holds ``helix.duckdb`` (see :mod:`helix_ray.store.db`) and
``generations/<NNNNNN>/``, with ``CURRENT`` naming the live one. A generation holds:

================================ ==============================================
``manifest.json``                format version, generation, embedder name and
                                 dimension, counts, schema hash, partitions
``memories.arrow``               :data:`GENERATION_SCHEMA` rows, Arrow IPC; the row
                                 number is the memory's internal id. Rows are
                                 grouped by user: a tenant is one contiguous range
``vectors.f32.npy``              float32 embeddings (N × dim), for rescoring
``binary.npy``                   sign bits (N × dim/8), for the first-pass scan
``dense/p<k>.usearch``           HNSW over int8 vectors, one per tenant partition
``bm25/``                        bm25s index over text + doc2query expansions, and
                                 ``helix_terms.npy`` / ``helix_term_offsets.npy``: each
                                 row's analysed terms as ids of its vocabulary
``graph/{indptr,indices,weights,types}.npy``   CSR adjacency over memories then entities
``entities.arrow``               entity nodes: node, user, key, df
``minhash.npy``                  MinHash signatures (N × num_perm, uint32)
``late/{tokens,scales,offsets}.npy``  late-interaction token vectors (int8, T × 384),
                                 a scale per token, and each memory's token range
                                 (optional: absent when ingest ran without them)
``mentions.arrow``               the entity keys each row mentions (optional)
``knn/{neighbours,similarities}.npy``  each row's nearest rows of its tenant, self
                                 included, −1 padded (optional)
================================ ==============================================

The last three are not read by recall: the next ingest takes them for the rows it
carries over (:mod:`helix_ray.ingest.carry`); the manifest's ``carry`` says how they
were made.

Publishing is atomic: files are written into ``generations/.tmp-*``, fsynced, the folder
renamed to its number, then ``CURRENT`` is replaced by rename. A reader that opens
``CURRENT`` sees a whole generation or the previous one, never a partial one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from helix_ray.errors import ManifestMismatch, StoreError
from helix_ray.index import hnsw
from helix_ray.index.bm25 import Analyzer, BM25Index, build_bm25, load_bm25, load_terms
from helix_ray.index.csr import CSRGraph
from helix_ray.index.hnsw import build_hnsw
from helix_ray.index.quantize import binary_codes, quantize_int8
from helix_ray.schema import GENERATION_SCHEMA

log = logging.getLogger(__name__)

FORMAT = "helix-generation"
FORMAT_VERSION = 1
SCHEMA_HASH = hashlib.sha1(GENERATION_SCHEMA.to_string().encode()).hexdigest()[:16]
ENTITY_SCHEMA = pa.schema(
    [("node", pa.int64()), ("user", pa.string()), ("key", pa.string()), ("df", pa.int32())]
)


@dataclass
class GenerationData:
    """Everything a generation holds, in memory, ready to be written."""

    memories: pa.Table  # GENERATION_SCHEMA, grouped by user
    vectors: np.ndarray  # float32 (N, dim)
    minhash: np.ndarray  # uint32 (N, num_perm)
    terms: Any  # helix_ray.index.bm25.Terms: each row's text + expansions, analysed
    graph: CSRGraph
    entities: pa.Table  # ENTITY_SCHEMA
    embedder: str
    dim: int
    extra: dict[str, Any] = field(default_factory=dict)
    late: Any = None  # helix_ray.token_encoder.PassageTokens over the same rows, or None
    mentions: pa.Array | None = None  # entity keys per row: list<string> (helix_ray.ingest.carry.MENTIONS_TYPE)
    knn: tuple[np.ndarray, np.ndarray] | None = None  # (N, K) nearest rows, similarities


def partitions_of(users: np.ndarray | list[str]) -> list[dict[str, Any]]:
    """Contiguous [start, end) row ranges per user of a user-grouped column."""
    out: list[dict[str, Any]] = []
    users = list(users)
    start = 0
    for i in range(1, len(users) + 1):
        if i == len(users) or users[i] != users[start]:
            out.append({"user": users[start], "start": start, "end": i, "dense": f"dense/p{len(out)}.usearch"})
            start = i
    seen = [p["user"] for p in out]
    if len(seen) != len(set(seen)):
        raise ValueError("memories must be grouped by user before a generation is written")
    return out


# ----------------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array))


def _save_arrow(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def generations_dir(store: Path) -> Path:
    return store / "generations"


def current_generation_number(store: Path) -> int | None:
    pointer = store / "CURRENT"
    if not pointer.is_file():
        return None
    return int(pointer.read_text().strip())


#: The manifest key holding how far into the store's access log (``rowid``) a generation
#: has folded recall hits into ``last_accessed_at`` / ``access_count``.
ACCESS_WATERMARK = "access_log_folded"


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
    builds them for the semantic kNN edges); other tenants with at least
    ``hnsw_min_rows`` memories get one built here, smaller ones none (recall scans them).

    ``crash_after`` names a file after which to raise (tests inject a crash mid-publish).
    """
    analyzer = bm25_analyzer or Analyzer()

    root = generations_dir(store)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a crashed publish
        shutil.rmtree(stale, ignore_errors=True)
    previous = current_generation_number(store) or 0
    existing = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
    number = max([previous, *existing]) + 1
    tmp = root / f".tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    written: list[Path] = []

    def done(path: Path) -> None:
        written.append(path)
        if crash_after and path.name == crash_after:
            raise RuntimeError(f"injected crash after writing {path.name}")

    table = data.memories
    if table.schema != GENERATION_SCHEMA:
        table = table.cast(GENERATION_SCHEMA)
    n = table.num_rows
    if data.vectors.shape != (n, data.dim):
        raise ValueError(f"vectors have shape {data.vectors.shape}; expected ({n}, {data.dim})")
    parts = partitions_of(table.column("user").to_pylist())

    _save_arrow(tmp / "memories.arrow", table); done(tmp / "memories.arrow")
    vectors = np.ascontiguousarray(data.vectors, dtype=np.float32)
    _save_npy(tmp / "vectors.f32.npy", vectors); done(tmp / "vectors.f32.npy")
    _save_npy(tmp / "binary.npy", binary_codes(vectors)); done(tmp / "binary.npy")
    _save_npy(tmp / "minhash.npy", data.minhash.astype(np.uint32)); done(tmp / "minhash.npy")

    (tmp / "dense").mkdir()
    int8 = None
    for part in parts:
        index = (dense_indexes or {}).get(part["user"])
        if index is None and part["end"] - part["start"] >= hnsw_min_rows:
            int8 = quantize_int8(vectors) if int8 is None else int8
            index = build_hnsw(int8[part["start"]:part["end"]], part["start"], data.dim, threads=hnsw_threads,
                               connectivity=hnsw_connectivity, expansion_add=hnsw_expansion_add)
        if index is None:
            part["dense"] = None
            continue
        index.save(str(tmp / part["dense"]))
        done(tmp / part["dense"])

    build_bm25(None, tmp / "bm25", analyzer=analyzer, terms=data.terms)
    done(tmp / "bm25")
    carry = {**(data.extra.get("carry") or {}), "terms": analyzer.to_dict()}
    if data.mentions is not None:
        if len(data.mentions) != n:
            raise ValueError(f"mentions cover {len(data.mentions)} memories; expected {n}")
        _save_arrow(tmp / "mentions.arrow", pa.table({"entities": data.mentions}))
        done(tmp / "mentions.arrow")
    else:
        carry.pop("mentions", None)
    if data.knn is not None:
        neighbours, similarities = data.knn
        if neighbours.shape[0] != n or similarities.shape != neighbours.shape:
            raise ValueError(f"kNN lists have shapes {neighbours.shape} and {similarities.shape}; expected ({n}, K)")
        (tmp / "knn").mkdir()
        _save_npy(tmp / "knn" / "neighbours.npy", neighbours.astype(np.int32))
        _save_npy(tmp / "knn" / "similarities.npy", similarities.astype(np.float32))
        done(tmp / "knn")
        carry["knn"] = int(neighbours.shape[1])
    else:
        carry.pop("knn", None)

    (tmp / "graph").mkdir()
    for name in ("indptr", "indices", "weights", "types"):
        _save_npy(tmp / "graph" / f"{name}.npy", getattr(data.graph, name))
    done(tmp / "graph")
    _save_arrow(tmp / "entities.arrow", data.entities); done(tmp / "entities.arrow")

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generation": number,
        "parent": previous or None,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "embedder": {"name": data.embedder, "dim": data.dim},
        "schema_hash": SCHEMA_HASH,
        "counts": {
            "memories": n,
            "users": len(parts),
            "entities": data.entities.num_rows,
            "edges": int(len(data.graph.indices) // 2),
        },
        "bm25": analyzer.to_dict(),
        "hnsw": {"connectivity": hnsw_connectivity, "expansion_add": hnsw_expansion_add, "dtype": "i8",
                 "min_rows": hnsw_min_rows},
        "minhash": {"num_perm": int(data.minhash.shape[1]) if data.minhash.ndim == 2 else 0},
        "partitions": parts,
        **data.extra,
        "carry": carry,
    }
    if data.late is not None:
        if len(data.late) != n:
            raise ValueError(f"late-interaction tokens cover {len(data.late)} memories; expected {n}")
        from helix_ray.token_encoder import DIM as LATE_DIM, NAME as LATE_NAME

        (tmp / "late").mkdir()
        _save_npy(tmp / "late" / "tokens.npy", np.asarray(data.late.tokens, np.int8))
        _save_npy(tmp / "late" / "scales.npy", np.asarray(data.late.scales, np.float32))
        _save_npy(tmp / "late" / "offsets.npy", np.asarray(data.late.offsets, np.int64))
        done(tmp / "late")
        manifest["late"] = {"encoder": LATE_NAME, "dim": LATE_DIM, "tokens": int(data.late.offsets[-1])}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    done(tmp / "manifest.json")

    for path in tmp.rglob("*"):
        if path.is_file():
            _fsync(path)
    for folder in [tmp, *[p for p in tmp.rglob("*") if p.is_dir()]]:
        _fsync(folder)
    final = root / f"{number:06d}"
    os.rename(tmp, final)
    _fsync(root)
    if make_current:
        set_current(store, number)
    log.info("wrote generation %d (%d memories)%s", number, n, "" if make_current else "; not current yet")
    return number


def set_current(store: Path, number: int) -> None:
    """Point ``CURRENT`` at generation ``number`` atomically (write, fsync, rename)."""
    if not (generations_dir(store) / f"{number:06d}" / "manifest.json").is_file():
        raise StoreError(f"Generation {number} of {store} is not there; CURRENT stays at "
                         f"{current_generation_number(store)}.")
    pointer_tmp = store / f".CURRENT.{uuid.uuid4().hex[:8]}"
    pointer_tmp.write_text(f"{number}\n")
    _fsync(pointer_tmp)
    os.replace(pointer_tmp, store / "CURRENT")
    _fsync(store)


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


# ----------------------------------------------------------------------------- reading


class Generation:
    """A published generation, memory-mapped. Cheap to open; pages load on use.

    Opening checks the manifest against what this code reads and what the caller
    expects (``expect_embedder``), and refuses a mismatch with a message saying both.
    """

    def __init__(self, path: Path, *, expect_embedder: str | None = None, expect_dim: int | None = None):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise StoreError(f"{self.path} is not a generation: manifest.json is missing.")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise ManifestMismatch(f"{manifest_path} is not valid JSON ({exc}).") from None
        m = self.manifest
        problems = []
        if m.get("format") != FORMAT:
            problems.append(f"format {m.get('format')!r} (expected {FORMAT!r})")
        if m.get("format_version") != FORMAT_VERSION:
            problems.append(f"format_version {m.get('format_version')!r} (this Helix reads {FORMAT_VERSION})")
        if m.get("schema_hash") != SCHEMA_HASH:
            problems.append(f"schema_hash {m.get('schema_hash')!r} (expected {SCHEMA_HASH})")
        embedder = (m.get("embedder") or {}).get("name")
        dim = (m.get("embedder") or {}).get("dim")
        if expect_embedder and embedder != expect_embedder:
            problems.append(f"embedder {embedder!r} (this reader embeds queries with {expect_embedder!r})")
        if expect_dim and dim != expect_dim:
            problems.append(f"dimension {dim!r} (expected {expect_dim})")
        if problems:
            raise ManifestMismatch(
                f"Cannot open generation {self.path}: found " + "; ".join(problems)
                + ". Re-ingest with this version and embedder, or open it with the matching ones."
            )
        self.number: int = m["generation"]
        self.partitions: dict[str, tuple[int, int]] = {
            p["user"]: (p["start"], p["end"]) for p in m["partitions"]
        }
        self._partition_files = {p["user"]: p["dense"] for p in m["partitions"]}
        self._dense: dict[str, Any] = {}

    @classmethod
    def open_current(cls, store: Path, **expect: Any) -> "Generation":
        number = current_generation_number(Path(store))
        if number is None:
            raise StoreError(
                f"Store {store} has no published generation yet (no CURRENT file). "
                "Run `helix ingest SOURCE --store DIR` first."
            )
        return cls(generations_dir(Path(store)) / f"{number:06d}", **expect)

    @property
    def size(self) -> int:
        return int(self.manifest["counts"]["memories"])

    @cached_property
    def memories(self) -> pa.Table:
        source = pa.memory_map(str(self.path / "memories.arrow"), "r")
        return ipc.open_file(source).read_all()

    @cached_property
    def columns(self) -> "MemoryColumns":
        return MemoryColumns.from_table(self.memories)

    @cached_property
    def scope_columns(self) -> "ScopeColumns":
        return ScopeColumns.from_table(self.memories)

    @cached_property
    def _texts(self) -> pa.Array:
        return self.memories.column("text").combine_chunks()

    def text(self, row: int) -> str:
        return self._texts[row].as_py()

    @cached_property
    def vectors(self) -> np.ndarray:
        return np.load(self.path / "vectors.f32.npy", mmap_mode="r")

    @cached_property
    def binary(self) -> np.ndarray:
        return np.load(self.path / "binary.npy", mmap_mode="r")

    @cached_property
    def minhash(self) -> np.ndarray:
        return np.load(self.path / "minhash.npy", mmap_mode="r")

    @cached_property
    def graph(self) -> CSRGraph:
        g = self.path / "graph"
        return CSRGraph(*(np.load(g / f"{n}.npy", mmap_mode="r") for n in ("indptr", "indices", "weights", "types")))

    @cached_property
    def entities(self) -> pa.Table:
        return ipc.open_file(pa.memory_map(str(self.path / "entities.arrow"), "r")).read_all()

    @cached_property
    def late(self):
        """The memories' late-interaction token vectors (memory-mapped), or None when
        this generation was built without them."""
        from helix_ray.token_encoder import NAME, PassageTokens

        info = self.manifest.get("late")
        if not info:
            return None
        if info.get("encoder") != NAME:
            raise ManifestMismatch(
                f"Cannot read the late-interaction tokens of {self.path}: they were encoded with "
                f"{info.get('encoder')!r}, this Helix encodes queries with {NAME!r}. Re-ingest, or set "
                "late.enabled: false in the retrieval config.")
        folder = self.path / "late"
        return PassageTokens(*(np.load(folder / f"{n}.npy", mmap_mode="r") for n in ("tokens", "scales", "offsets")))

    @cached_property
    def bm25(self) -> BM25Index:
        return load_bm25(self.path / "bm25")

    @cached_property
    def terms(self):
        """Each row's BM25 terms (:class:`helix_ray.index.bm25.Terms`, memory-mapped),
        or None for a generation written without them."""
        return load_terms(self.path / "bm25", self.bm25.retriever.vocab_dict)

    @cached_property
    def mentions(self) -> pa.ChunkedArray:
        """The entity keys each row mentions (a list per row); only when the manifest's
        ``carry`` names ``mentions``."""
        return ipc.open_file(pa.memory_map(str(self.path / "mentions.arrow"), "r")).read_all().column("entities")

    @cached_property
    def knn(self) -> tuple[np.ndarray, np.ndarray]:
        """(N, K) nearest rows of each row's tenant and their similarities, memory-mapped;
        only when the manifest's ``carry`` names ``knn``."""
        return (np.load(self.path / "knn" / "neighbours.npy", mmap_mode="r"),
                np.load(self.path / "knn" / "similarities.npy", mmap_mode="r"))

    def dense_index_copy(self, user: str):
        """The tenant's HNSW index loaded into memory (to change and save elsewhere)."""
        return hnsw.load_copy(self.path / self._partition_files[user])

    def has_dense_index(self, user: str) -> bool:
        return self._partition_files.get(user) is not None

    def dense_index(self, user: str):
        """The tenant's HNSW index, opened as a read-only view of the file."""
        index = self._dense.get(user)
        if index is None:
            index = hnsw.open_view(self.path / self._partition_files[user])
            self._dense[user] = index
        return index


@dataclass
class MemoryColumns:
    """Numpy views of the columns the query path reads per candidate."""

    ids: np.ndarray  # object
    types: np.ndarray  # object
    projects: np.ndarray  # object
    sessions: np.ndarray  # object
    created_at: np.ndarray  # int64 microseconds
    last_accessed_at: np.ndarray  # int64 microseconds, 0 where never accessed
    salience: np.ndarray  # float32
    confidence: np.ndarray  # float32
    pinned: np.ndarray  # bool
    n_tokens: np.ndarray  # int32
    documents: list[str | None]  # source document of a section (Markdown file), else None
    id_to_row: dict[str, int]

    @classmethod
    def from_table(cls, table: pa.Table) -> "MemoryColumns":
        def ts(name: str) -> np.ndarray:
            return table.column(name).cast(pa.int64()).to_numpy(zero_copy_only=False)

        created = ts("created_at")
        last = table.column("last_accessed_at").cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        ids = np.asarray(table.column("id").to_pylist(), dtype=object)
        return cls(
            ids=ids,
            types=np.asarray(table.column("type").to_pylist(), dtype=object),
            projects=np.asarray(table.column("project").to_pylist(), dtype=object),
            sessions=np.asarray(table.column("session_id").to_pylist(), dtype=object),
            created_at=created,
            last_accessed_at=last,
            salience=table.column("salience").to_numpy().astype(np.float32),
            confidence=table.column("confidence").to_numpy().astype(np.float32),
            pinned=table.column("pinned").to_numpy(zero_copy_only=False).astype(bool),
            n_tokens=table.column("n_tokens").to_numpy().astype(np.int32),
            documents=[s if s.startswith("markdown:") else None for s in table.column("source").to_pylist()],
            id_to_row={mid: i for i, mid in enumerate(ids)},
        )


@dataclass
class ScopeColumns:
    """What the scope filters read over a tenant's whole row range, as numpy: built from
    Arrow in milliseconds (7 ms at 10^5), so every shell has it without
    :class:`MemoryColumns`' Python objects. Type and project are compared as an int
    code per row against the code of the value asked for, not a Python string per row
    (13 ms for a project and 22 ms for two types over 10^6 rows, once per leg)."""

    types: Coded
    projects: Coded
    created_at: np.ndarray  # int64 microseconds
    pinned: np.ndarray  # bool

    @classmethod
    def from_table(cls, table: pa.Table) -> "ScopeColumns":
        return cls(types=Coded.from_column(table.column("type")),
                   projects=Coded.from_column(table.column("project")),
                   created_at=table.column("created_at").cast(pa.int64()).to_numpy(zero_copy_only=False),
                   pinned=table.column("pinned").to_numpy(zero_copy_only=False).astype(bool))


@dataclass
class Coded:
    """A string column as one code per row (-1 where null) and its distinct values."""

    codes: np.ndarray  # int32
    values: dict[str, int]  # value -> code

    @classmethod
    def from_column(cls, column: pa.ChunkedArray) -> "Coded":
        encoded = column.combine_chunks().dictionary_encode()  # one dictionary for every row
        codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)
        return cls(codes, {str(v): i for i, v in enumerate(encoded.dictionary.to_pylist())})

    def isin(self, start: int, end: int, wanted: Iterable[str]) -> np.ndarray:
        """Whether each row in [start, end) holds one of ``wanted`` (10^6 rows: 0.05 ms
        for one value, 0.5 ms for several)."""
        codes = [self.values[w] for w in wanted if w in self.values]
        if len(codes) == 1:
            return self.codes[start:end] == codes[0]
        allowed = np.zeros(len(self.values) + 1, dtype=bool)  # the last slot: null (-1)
        allowed[codes] = True
        return np.take(allowed, self.codes[start:end])

