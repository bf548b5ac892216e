"""The on-disk contract: an immutable generation of plain, memory-mappable files, and
opening one to read.

A store folder holds ``helix.duckdb`` (see :mod:`helix_ray.store.db`) and
``generations/<NNNNNN>/``, with ``CURRENT`` naming the live one. A generation holds:

================================ ==============================================
``manifest.json``                format version, generation, embedder name and
                                 dimension, counts, schema hash, partitions
``memories.arrow``               :data:`GENERATION_SCHEMA` rows, Arrow IPC; the row
                                 number is the memory's internal id. Rows are
                                 grouped by user: a tenant is one contiguous range
``vectors.f16.npy``              float16 embeddings (N × dim), for rescoring and
                                 ranking (``vectors.f32.npy``, float32, in
                                 generations written by earlier versions)
``binary.npy``                   sign bits (N × dim/8), for the first-pass scan
``dense/p<k>.usearch``           HNSW over int8 vectors, one per tenant partition
``bm25/``                        bm25s index over text + doc2query expansions, and
                                 ``helix_terms.npy`` / ``helix_term_offsets.npy``: each
                                 row's analysed terms as ids of its vocabulary
``graph/{indptr,indices,weights,types}.npy``   CSR adjacency over memories then entities
``entities.arrow``               entity nodes: node, user, key, df
``minhash.npy``                  MinHash signatures (N × num_perm, uint32)
``late/segments/<name>.{tokens,scales}.npy``  late-interaction token vectors (int8,
                                 T × 64) and a scale per token, in append-only
                                 segments shared with earlier generations by hard
                                 links; ``late/{segment,start,length}.npy`` (int16,
                                 int64, int32 per row) say where each memory's tokens
                                 are (:mod:`helix_ray.store.late`; optional: absent
                                 when ingest ran without them). Earlier versions
                                 wrote ``late/{tokens,scales,offsets}.npy``
``mentions.arrow``               the entity keys each row mentions (optional)
``knn/{neighbours,similarities}.npy``  each row's nearest rows of its tenant, self
                                 included, −1 padded (optional)
``segments/s<NNNNNN>.arrow``     format 2 only: online writes folded in since the
                                 generation's *base* (the full generation whose other
                                 files it hard-links), one file per fold, in the delta's
                                 row format (:mod:`helix_ray.live.delta_format`)
``segments/dead.arrow``          format 2 only: ``(id, seq)`` — the id's base row, and
                                 its segment rows below ``seq``, are deleted or replaced
================================ ==============================================

A format-1 generation holds every memory in its own files. A format-2 generation is a
format-1 one (its base) plus segments: recall searches the segments' rows as it does the
delta's (:mod:`helix_ray.live.delta`), and the next full ingest folds them into a new
format-1 generation.

The last three are not read by recall: the next ingest takes them for the rows it
carries over (:mod:`helix_ray.ingest.carry`); the manifest's ``carry`` says how they
were made. The index files are built and loaded by :mod:`helix_ray.index`.

Publishing (:mod:`helix_ray.store.publish`) is atomic: files are written into
``generations/.tmp-*``, fsynced, the folder renamed to its number, then ``CURRENT`` is
replaced by rename. A reader that opens ``CURRENT`` sees a whole generation or the
previous one, never a partial one.

The manifest records every other file's size and CRC-32, and a CRC-32 of itself
(:mod:`helix_ray.store.integrity`); opening checks them. A generation damaged later (a
truncated copy, a failing disk) is refused by name, and :func:`open_good_generation`
falls back to the newest earlier generation that is whole.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from helix_ray.errors import GenerationDamaged, ManifestMismatch, StoreError
from helix_ray.index import hnsw
from helix_ray.index.bm25 import BM25Index, load_bm25, load_terms
from helix_ray.index.csr import SESSION_KEY, CSRGraph, load_csr
from helix_ray.schema import GENERATION_SCHEMA
from helix_ray.store import integrity
from helix_ray.store.late import SegmentedTokens
from helix_ray.store.pointer import file_identity
from helix_ray.store.rows import ArrowFile, ArrowStrings, RowFile
from helix_ray.token_encoder import BACKBONE_NAME
from helix_ray.token_encoder import NAME as LATE_NAME
from helix_ray.token_encoder import ProjectedTokens

FORMAT = "helix-generation"
#: A generation whose rows are all in its own files (what :func:`publish` writes).
FORMAT_VERSION = 1
#: A full generation's files plus segments of rows folded in since (:func:`publish_segment`).
SEGMENTED_VERSION = 2
READ_VERSIONS = (FORMAT_VERSION, SEGMENTED_VERSION)
SEGMENTS_DIR = "segments"
DEAD_FILE = f"{SEGMENTS_DIR}/dead.arrow"
DEAD_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("seq", pa.int64(), nullable=False)])
SCHEMA_HASH = hashlib.sha1(GENERATION_SCHEMA.to_string().encode()).hexdigest()[:16]
ENTITY_SCHEMA = pa.schema(
    [("node", pa.int64()), ("user", pa.string()), ("key", pa.string()), ("df", pa.int32())]
)

#: How much of a generation :class:`Generation` checks when it opens (see its docstring).
Verify = Literal["manifest", "open", "full"]

log = logging.getLogger(__name__)

#: The manifest key holding how far into the store's access log (``rowid``) a generation
#: has folded recall hits into ``last_accessed_at`` / ``access_count``.
ACCESS_WATERMARK = "access_log_folded"


def generations_dir(store: Path) -> Path:
    return store / "generations"


#: The sentence vectors' file: float16 holds half of float32's bytes and ranks as float32
#: does (nDCG@10 and Recall@10 equal to the third decimal on LoCoMo and SciFact,
#: docs/benchmarks.md); ``vectors.f32.npy`` is what earlier versions wrote.
VECTORS_FILE = "vectors.f16.npy"
VECTOR_FILES = (VECTORS_FILE, "vectors.f32.npy")  # this version's name, then the earlier one


def vector_file(folder: Path) -> str:
    """The name of the sentence vectors' file in generation ``folder``."""
    for name in VECTOR_FILES:
        if (folder / name).is_file():
            return name
    return VECTORS_FILE  # neither: the reader's error names the current one


def current_generation_number(store: Path) -> int | None:
    pointer = store / "CURRENT"
    if not pointer.is_file():
        return None
    return int(pointer.read_text().strip())


def generation_counts(store: Path, number: int) -> dict[str, int]:
    """What generation ``number`` holds, from its manifest: ``memories``, ``users``,
    ``entities``, ``edges`` (its graph's, which only its files hold), and
    ``segment_rows`` once a fold has added some."""
    return dict(integrity.read_manifest(generations_dir(Path(store)) / f"{number:06d}")["counts"])


def folded_accesses(store: Path) -> int:
    """How far into the access log the current generation has folded (its manifest's
    :data:`ACCESS_WATERMARK`); 0 when there is no generation."""
    number = current_generation_number(Path(store))
    if number is None:
        return 0
    return int(integrity.read_manifest(generations_dir(Path(store)) / f"{number:06d}").get(ACCESS_WATERMARK, 0))


class Generation:
    """A published generation: its indexes memory-mapped, the rows a query reads at
    scattered places read with ``pread`` (:mod:`helix_ray.store.rows`). Cheap to open;
    pages load on use.

    Opening checks the manifest against what this code reads and what the caller
    expects (``expect_embedder``), and refuses a mismatch with a message saying both
    (:class:`ManifestMismatch`). It also checks the files against the checksums the
    manifest records (:mod:`helix_ray.store.integrity`), as ``verify`` says: "open"
    (the default) every size and the smallest files' CRC-32s, "full" every CRC-32,
    "manifest" only the manifest's own; a difference raises :class:`GenerationDamaged`
    naming each file.
    """

    def __init__(self, path: Path, *, expect_embedder: str | None = None, expect_dim: int | None = None,
                 verify: Verify = "open"):
        self.path = Path(path)
        self.manifest: dict[str, Any] = integrity.read_manifest(self.path)
        m = self.manifest
        problems = []
        if m.get("format") != FORMAT:
            problems.append(f"format {m.get('format')!r} (expected {FORMAT!r})")
        if m.get("format_version") not in READ_VERSIONS:
            problems.append(f"format_version {m.get('format_version')!r} (this Helix reads "
                            f"{' and '.join(map(str, READ_VERSIONS))})")
        if m.get("schema_hash") != SCHEMA_HASH:
            problems.append(f"schema_hash {m.get('schema_hash')!r} (expected {SCHEMA_HASH})")
        embedder = (m.get("embedder") or {}).get("name")
        dim = (m.get("embedder") or {}).get("dim")
        if expect_embedder and embedder != expect_embedder:
            problems.append(f"embedder {embedder!r} (this reader embeds queries with {expect_embedder!r})")
        if expect_dim and dim != expect_dim:
            problems.append(f"dimension {dim!r} (expected {expect_dim})")
        if m.get("format") == FORMAT and m.get("format_version") in READ_VERSIONS:
            integrity.check_manifest(self.path, m)  # another format may checksum itself otherwise
        if problems:
            raise ManifestMismatch(
                f"Cannot open generation {self.path}: found " + "; ".join(problems) + ". "
                + _version_remedy(m.get("format_version"))
            )
        try:
            self.number: int = m["generation"]
            self.partitions: dict[str, tuple[int, int]] = {
                p["user"]: (p["start"], p["end"]) for p in m["partitions"]
            }
            self._partition_files = {p["user"]: p["dense"] for p in m["partitions"]}
            self.segment_files: list[str] = [str(seg["file"]) for seg in m.get("segments") or []]
        except (KeyError, TypeError) as exc:
            raise integrity.damaged(self.path, [f"manifest.json lacks or misstates {exc}"]) from None
        self._dense: dict[str, Any] = {}
        if verify != "manifest":
            integrity.verify_files(self.path, m, full=verify == "full")

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
    def _memories_file(self) -> ArrowFile:
        return _shared("rows", self.path / "memories.arrow", lambda: ArrowFile(self.path / "memories.arrow"))

    @cached_property
    def memories(self) -> pa.Table:
        """The rows, memory-mapped (:class:`helix_ray.store.rows.ArrowFile`)."""
        return self._memories_file.table

    @cached_property
    def columns(self) -> "MemoryColumns":
        return _shared("columns", self.path / "memories.arrow",
                       lambda: MemoryColumns.from_table(self.memories, self.scope_columns, self._memories_file))

    @cached_property
    def scope_columns(self) -> "ScopeColumns":
        return _shared("scope", self.path / "memories.arrow", lambda: ScopeColumns.from_table(self.memories))

    @cached_property
    def _texts(self) -> "StringColumn":
        return StringColumn.of(self.memories, "text", self._memories_file)

    @cached_property
    def metadata(self) -> "StringColumn":
        """Each row's metadata as its JSON text (a chunk's place in its parent among it)."""
        return StringColumn.of(self.memories, "metadata", self._memories_file)

    def text(self, row: int) -> str:
        return self._texts[row]

    @cached_property
    def vectors(self) -> RowFile:
        """The sentence vectors, float16 (or float32 in an older generation), read by rows
        (:mod:`helix_ray.store.rows`); a reader that multiplies many of them converts the
        rows it took to float32."""
        return RowFile(self.path / vector_file(self.path))

    @cached_property
    def binary(self) -> np.ndarray:
        return np.load(self.path / "binary.npy", mmap_mode="r")

    @cached_property
    def minhash(self) -> RowFile:
        """Each row's MinHash signature, read by rows (:mod:`helix_ray.store.rows`)."""
        return RowFile(self.path / "minhash.npy")

    @cached_property
    def graph(self) -> CSRGraph:
        return load_csr(self.path / "graph")

    @cached_property
    def entities(self) -> pa.Table:
        return ipc.open_file(pa.memory_map(str(self.path / "entities.arrow"), "r")).read_all()

    @cached_property
    def session_nodes(self) -> "SessionNodes":
        """(user, session) → the graph's node of that session (a session of two memories
        or more: :func:`helix_ray.ingest.graph.build_graph`); shared with every open
        generation that links the same ``entities.arrow`` (a fold's)."""
        def build() -> SessionNodes:
            sessions = self.entities.filter(pc.starts_with(self.entities.column("key"), SESSION_KEY))
            return SessionNodes(((user, key[len(SESSION_KEY):]), int(node)) for user, key, node in zip(
                sessions.column("user").to_pylist(), sessions.column("key").to_pylist(),
                sessions.column("node").to_pylist()))

        return _shared("sessions", self.path / "entities.arrow", build)

    @cached_property
    def late(self) -> SegmentedTokens | ProjectedTokens | None:
        """The memories' late-interaction token vectors (segments read by row), or None
        when this generation was built without them. Backbone tokens (a store written
        before Helix projected them) are projected as they are read."""
        info = self.manifest.get("late")
        if not info:
            return None
        if info.get("encoder") == BACKBONE_NAME:
            return ProjectedTokens(self._late_files(info))
        if info.get("encoder") != LATE_NAME:
            raise ManifestMismatch(
                f"Cannot read the late-interaction tokens of {self.path}: they were encoded with "
                f"{info.get('encoder')!r}, this Helix encodes queries with {LATE_NAME!r}. Re-ingest, or set "
                "late.enabled: false in the retrieval config.")
        return self._late_files(info)

    def _late_files(self, info: dict[str, Any]) -> SegmentedTokens:
        return SegmentedTokens.open(self.path, info, self.manifest.get("files") or {})

    @cached_property
    def bm25(self) -> BM25Index:
        """The BM25 index, memory-mapped; one object for every open generation that links
        the same index files (a fold links its parent's: its vocabulary, JSON parsed
        under the GIL, is not parsed again beside recall)."""
        folder = self.path / "bm25"
        try:
            return _shared("bm25", folder / BM25_SCORES, lambda: load_bm25(folder))
        except FileNotFoundError:  # an index saved without a score matrix file: nothing to share it by
            return load_bm25(folder)

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

    @cached_property
    def segments(self) -> pa.Table | None:
        """The rows folded in since the base (format 2), all segments as one table in the
        order they were folded; None when this generation has none."""
        if not self.segment_files:
            return None
        tables = [ipc.open_file(pa.memory_map(str(self.path / name), "r")).read_all() for name in self.segment_files]
        return pa.concat_tables(tables, promote_options="default")

    def segment_rows(self) -> pa.Table | None:
        """The segments' rows this generation holds: each seq once, and no row that the
        dead list outdates (its id deleted or written again at a later seq); None when it
        has no segments."""
        table = self.segments
        if table is None:
            return None
        return table.filter(pa.array(self.segment_keep(table.column("seq").to_numpy(),
                                                       table.column("id").to_pylist())))

    def segment_keep(self, seq: np.ndarray, ids: Sequence[str]) -> np.ndarray:
        """Which of the segments' rows (their ``seq`` and ``ids``, all segments in turn)
        this generation holds: :meth:`segment_rows` as a mask."""
        keep = np.zeros(len(seq), dtype=bool)
        keep[np.unique(seq, return_index=True)[1]] = True  # a seq folded twice counts once
        dead = self.dead
        if dead:
            floor = np.fromiter((dead.get(i, -1) for i in ids), np.int64, len(seq))
            keep &= np.asarray(seq) >= floor
        return keep

    @cached_property
    def dead(self) -> dict[str, int]:
        """Id → seq: the id's base row, and its segment rows with a lower seq, are deleted
        or replaced in this generation ({} in format 1)."""
        if not self.segment_files:
            return {}
        table = ipc.open_file(pa.memory_map(str(self.path / DEAD_FILE), "r")).read_all()
        return dict(zip(table.column("id").to_pylist(), table.column("seq").to_pylist()))

    def dense_index_path(self, user: str) -> Path:
        """The tenant's HNSW index file."""
        return self.path / self._partition_files[user]

    def has_dense_index(self, user: str) -> bool:
        return self._partition_files.get(user) is not None

    def dense_index(self, user: str):
        """The tenant's HNSW index, opened as a read-only view of the file (one view for
        every open generation that links the file: a fold links its parent's)."""
        index = self._dense.get(user)
        if index is None:
            path = self.path / self._partition_files[user]
            index = _shared("hnsw", path, lambda: hnsw.open_view(path))
            self._dense[user] = index
        return index


#: What was built from a generation's file, by (what, device, inode, size, mtime) of the
#: file, while some open generation holds it: a generation that a compaction folded links
#: its parent's ``memories.arrow``, so the two share the per-row columns built from it.
_BUILT: "weakref.WeakValueDictionary[tuple[Any, ...], Any]" = weakref.WeakValueDictionary()
_BUILT_LOCK = threading.Lock()
#: The file of a BM25 index that a new build always writes anew (its score matrix):
#: what :attr:`Generation.bm25` is shared by.
BM25_SCORES = "data.csc.index.npy"


class SessionNodes(dict[tuple[str, str], int]):
    """:attr:`Generation.session_nodes` (a dict that :data:`_BUILT` can hold weakly)."""


def _shared(what: str, file: Path, build: Callable[[], Any]) -> Any:
    """``build()``, or what it returned for the same file (an immutable generation file:
    the objects are read, never changed)."""
    key = (what, *file_identity(file))
    with _BUILT_LOCK:
        found = _BUILT.get(key)
    if found is not None:
        return found
    built = build()
    with _BUILT_LOCK:
        return _BUILT.setdefault(key, built)


def _version_remedy(found: Any) -> str:
    """How to open a generation whose manifest this Helix refused, by its format
    version: a newer one needs a newer Helix; an older one is not converted in place by
    any command, its sources go into a new store."""
    if isinstance(found, int) and found > max(READ_VERSIONS):
        return (f"Format {found} was written by a newer Helix: upgrade this one (`pip install -U helix-ray`, or "
                "update the checkout) to open it; no command converts a generation to an older format.")
    if isinstance(found, int) and found < FORMAT_VERSION:
        return (f"Format {found} was written by an older Helix, and no command converts a generation in place: "
                "ingest the sources again into a new store (`helix ingest SOURCE --store NEWDIR`), or serve this "
                "one with the Helix version that wrote it.")
    return "Re-ingest with this version and embedder, or open it with the matching ones."


def open_good_generation(store: Path, *, newer_than: int | None = None, **expect: Any) -> Generation | None:
    """The store's current generation; when it is damaged, the newest earlier one on disk
    that opens whole, with a warning naming the damaged ones (recall goes on from the
    previous generation until the store is restored). :class:`helix_ray.Memory` and the
    serving replicas both open through this, so they fall back alike.

    ``expect`` is :class:`Generation`'s ``expect_embedder`` / ``expect_dim``. With
    ``newer_than`` (the generation a replica already serves), only generations newer than
    it are tried, and None means none of them is whole. Returns None when the store has
    no ``CURRENT``. Raises :class:`GenerationDamaged` naming every damaged generation when
    none opens; a current generation this Helix cannot read raises
    :class:`ManifestMismatch` as :class:`Generation` does.
    """
    store = Path(store)
    current = current_generation_number(store)
    if current is None:
        return None
    earlier = sorted((int(p.name) for p in generations_dir(store).iterdir() if p.name.isdigit()
                      and int(p.name) < current), reverse=True)
    damaged: list[str] = []
    for number in [current, *earlier]:
        if newer_than is not None and number <= newer_than:
            break
        try:
            generation = Generation(generations_dir(store) / f"{number:06d}", **expect)
        except GenerationDamaged as exc:
            damaged.append(str(exc))
            continue
        except StoreError as exc:  # an earlier generation this reader cannot read is no fallback
            if number == current:
                raise
            damaged.append(str(exc))
            continue
        if damaged:
            log.warning("%s Recall goes on from generation %d, the newest earlier one that opens whole.",
                        " ".join(damaged), number)
        return generation
    if newer_than is not None:
        if damaged:
            log.warning("%s Recall goes on from generation %d.", " ".join(damaged), newer_than)
        return None
    raise GenerationDamaged(" ".join(damaged) + (" No earlier generation opens whole either." if earlier else
                                                 " The store keeps no earlier generation to fall back to."))


class StringColumn:
    """One string column of a generation's rows, read when asked: ``column[row]`` is a
    ``str`` (or None), ``column[rows]`` and ``column[a:b]`` an object array. The bytes stay
    in the Arrow file, and no Python string is made for a row no request reads: single
    rows and arrays of rows (a request's candidates) are read with ``pread`` when
    ``rows`` gives the file (:class:`helix_ray.store.rows.ArrowStrings`), slices (bulk
    readers) from the mapped ``array``. ``transform`` maps each value read (e.g. a source
    to its document)."""

    def __init__(self, array: pa.ChunkedArray, transform: Callable[[Any], Any] | None = None,
                 rows: ArrowStrings | None = None):
        self.array = array
        self._transform = transform
        self._rows = rows

    @classmethod
    def of(cls, table: pa.Table, name: str, file: ArrowFile | None,
           transform: Callable[[Any], Any] | None = None) -> "StringColumn":
        """Column ``name`` of ``table``, read by row with ``pread`` from ``file`` (the
        Arrow file ``table`` was read from) where it can be."""
        return cls(table.column(name), transform, file.strings(name) if file is not None else None)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            row = int(key) + len(self) if key < 0 else int(key)
            value = self._rows.get(row) if self._rows is not None else self.array[row].as_py()
            return self._transform(value) if self._transform else value
        if isinstance(key, slice):
            values = self.array[key].to_pylist()
        elif self._rows is not None:
            values = self._rows.take(np.asarray(key, dtype=np.int64))
        else:
            values = self.array.take(pa.array(np.asarray(key, dtype=np.int64))).to_pylist()
        return self._objects(values)

    def __iter__(self) -> Iterator[Any]:
        for chunk in self.array.chunks:
            yield from self._objects(chunk.to_pylist())

    def _objects(self, values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = [self._transform(v) for v in values] if self._transform else values
        return out


def _document(source: str | None) -> str | None:
    """The document a row is a section of: its Markdown source, else None."""
    return source if source is not None and source.startswith("markdown:") else None


@dataclass
class MemoryColumns:
    """The columns the query path reads per candidate: the strings as
    :class:`StringColumn` over the Arrow file's rows, the numbers as numpy arrays
    (a few bytes per row, made once per process)."""

    ids: StringColumn
    types: "Coded"
    projects: "Coded"
    sessions: StringColumn
    created_at: np.ndarray  # int64 microseconds
    last_accessed_at: np.ndarray  # int64 microseconds, 0 where never accessed
    salience: np.ndarray  # float32
    confidence: np.ndarray  # float32
    pinned: np.ndarray  # bool
    n_tokens: np.ndarray  # int32
    documents: StringColumn  # source document of a section (Markdown file), else None

    @classmethod
    def from_table(cls, table: pa.Table, scope: "ScopeColumns | None" = None,
                   file: ArrowFile | None = None) -> "MemoryColumns":
        """``scope``: the same rows' :class:`ScopeColumns`, whose type and project codes
        (four bytes a row) these columns then share; ``file``: the Arrow file ``table``
        was read from, whose strings are then read by row with ``pread``."""
        scope = scope or ScopeColumns.from_table(table)
        created = table.column("created_at").cast(pa.int64()).to_numpy(zero_copy_only=False)
        last = table.column("last_accessed_at").cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        return cls(
            ids=StringColumn.of(table, "id", file),
            types=scope.types,
            projects=scope.projects,
            sessions=StringColumn.of(table, "session_id", file),
            created_at=created,
            last_accessed_at=last,
            salience=table.column("salience").to_numpy().astype(np.float32),
            confidence=table.column("confidence").to_numpy().astype(np.float32),
            pinned=table.column("pinned").to_numpy(zero_copy_only=False).astype(bool),
            n_tokens=table.column("n_tokens").to_numpy().astype(np.int32),
            documents=StringColumn.of(table, "source", file, _document),
        )

    @cached_property
    def id_to_row(self) -> dict[str, int]:
        """Memory id → row, built on first use (not on the query path)."""
        return {mid: i for i, mid in enumerate(self.ids)}


@dataclass
class ScopeColumns:
    """What the scope filters read over a tenant's whole row range, as numpy: cheap to
    build from Arrow, so every shell has it without :class:`MemoryColumns`' Python
    objects. Type and project are compared as an int code per row against the code of
    the value asked for, not as a Python string per row."""

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

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, key: Any) -> Any:
        """The value of a row (None where null), or an object array of rows' values."""
        if isinstance(key, (int, np.integer)):
            return self._names[self.codes[int(key)]]
        return self._names[self.codes[key]]

    @cached_property
    def _names(self) -> np.ndarray:
        """Each code's value, then None: code -1 (null) indexes the last slot."""
        names = np.empty(len(self.values) + 1, dtype=object)
        for value, code in self.values.items():
            names[code] = value
        return names

    def isin(self, start: int, end: int, wanted: Iterable[str]) -> np.ndarray:
        """Whether each row in [start, end) holds one of ``wanted``."""
        codes = [self.values[w] for w in wanted if w in self.values]
        if len(codes) == 1:
            return self.codes[start:end] == codes[0]
        allowed = np.zeros(len(self.values) + 1, dtype=bool)  # the last slot: null (-1)
        allowed[codes] = True
        return np.take(allowed, self.codes[start:end])
