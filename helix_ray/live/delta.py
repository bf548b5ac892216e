"""The delta segment: online writes that no generation holds yet.

A write accepted by the server is durable in DuckDB and the store's ``inbox/`` before
it is answered, but the published generation is immutable: rebuilding it for every write
would cost seconds. So the single writer keeps the memories written since the last
compaction — and the ids deleted since then — in a small *delta*, and publishes a new
snapshot of it every time it changes: a small manifest over immutable segment files
(:mod:`helix_ray.live.delta_format` holds the files and their format; this module
loads a snapshot, searches it, and merges its hits into the generation legs' lists).

Every replica checks ``delta/CURRENT`` on each request (one ``stat``) and reloads the
snapshot when it changed, so a write is searchable by the next request that arrives
after its 201, and a delete hides the memory from the next request after its 200. A
replica parses each segment file once (:class:`SegmentCache`): a new snapshot costs it
the new segments and a join of arrays it already holds.

**Row ids.** A delta entry takes part in recall under the row id ``DELTA_BASE + seq``
(``seq`` is the entry's position in the writer's log, never reused): far above any
generation row or graph node, and the same in every snapshot that holds the entry, so
hits computed by one replica on one snapshot mean the same memory in another.

**Search**: exact cosine via :func:`helix_ray.recall.dense.rescore` (the dense leg's
own rescoring) over the entries in scope, and BM25 over the entries' text plus doc2query
expansions, tokenised like a generation's index and scored with the generation's IDF
statistics so the two lists compare (:meth:`DeltaSegment.lexical_search`).
:func:`merge_dense` and :func:`merge_lexical` fold those hits into the generation leg's
list.

**After compaction** an entry that the new generation ``N`` holds is marked
``folded_into = N`` and stays in the snapshot until the next compaction: a replica
still serving generation ``N - 1`` keeps finding it in the delta, one already on ``N``
finds it in the generation. Tombstones carry ``applies_below`` the same way.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from helix_ray.errors import StoreError
from helix_ray.index.bm25 import Analyzer
from helix_ray.live.delta_format import NOT_FOLDED, Tombstone, check_format, delta_dir, delta_schema
from helix_ray.recall import dense, lexical
from helix_ray.recall.scope import Scope
from helix_ray.store.pointer import file_identity
from helix_ray.token_encoder import from_blobs

#: Delta entries recall under row ids ``DELTA_BASE + seq``: above any generation row
#: (and any graph node: memories then entities), below int64's limit.
DELTA_BASE = 1 << 40


# ----------------------------------------------------------------------------- reading


@dataclass
class DeltaSegment:
    """One snapshot of the delta, loaded in memory (it is small: compaction bounds it)."""

    version: int
    seq: np.ndarray  # int64, ascending
    ids: np.ndarray  # object
    users: np.ndarray  # object
    texts: list[str]
    lexical_texts: list[str]
    types: np.ndarray  # object
    projects: np.ndarray  # object
    sessions: np.ndarray  # object
    created_at: np.ndarray  # int64 µs
    salience: np.ndarray  # float32
    confidence: np.ndarray  # float32
    pinned: np.ndarray  # bool
    n_tokens: np.ndarray  # int32
    vectors: np.ndarray  # float32 (d, dim), unit length
    minhash: np.ndarray  # uint32 (d, num_perm)
    folded_into: np.ndarray  # int64, NOT_FOLDED where no generation holds the entry
    tombstones: dict[str, Tombstone] = field(default_factory=dict)
    late_codes: list = field(default_factory=list)  # bytes or None per entry
    late_scales: list = field(default_factory=list)
    segments: tuple[str, ...] = ()  # the segment files this snapshot was joined from (format 2)
    _terms_by: dict = field(default_factory=dict, repr=False, compare=False)  # per analyzer: see _analysed
    # (segments, their concatenated rows this snapshot holds in its order, concatenated row →
    # position here or -1, each segment's first concatenated row): BM25 reuses each
    # segment's postings instead of analysing every entry again
    _joined_from: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, dim: int = 384, num_perm: int = 64) -> "DeltaSegment":
        return cls.from_table(0, delta_schema(dim, num_perm).empty_table(), [])

    @classmethod
    def load(cls, store: Path, version: int, cache: "SegmentCache | None" = None) -> "DeltaSegment":
        """Snapshot ``version`` of ``store``'s delta; ``cache`` keeps the segment files
        already parsed by this process (a replica's :class:`SegmentCache`)."""
        if version == 0:
            return cls.empty()
        folder = delta_dir(store)
        path = folder / f"{version:010d}.json"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            if (folder / f"{version:010d}.arrow").exists():
                return cls._load_whole(folder / f"{version:010d}.arrow", version)
            raise StoreError(
                f"Delta snapshot {path} is missing (pruned while this replica lagged); "
                "the next request reads the current one."
            ) from None
        check_format(meta, path)
        cache = cache if cache is not None else SegmentCache()
        try:
            parts = cache.get_many(folder, meta["segments"])
        except FileNotFoundError as exc:
            raise StoreError(f"Delta segment {exc.filename} of snapshot {version} is missing (pruned while this "
                             "replica lagged); the next request reads the current snapshot.") from None
        return cls.join(version, parts, names=meta["segments"], dead=meta.get("dead", ()),
                        folded=dict(meta.get("folded", [])),
                        tombstones=[Tombstone(i, u, b) for i, u, b in meta.get("tombstones", [])])

    @classmethod
    def _load_whole(cls, path: Path, version: int) -> "DeltaSegment":
        """A format-1 snapshot: one table of every entry, the tombstones in its metadata."""
        with pa.memory_map(str(path), "r") as source:
            table = ipc.open_file(source).read_all()
        meta = json.loads((table.schema.metadata or {}).get(b"helix_delta", b"{}"))
        check_format(meta, path)
        tombstones = [Tombstone(i, u, b) for i, u, b in meta.get("tombstones", [])]
        return cls.from_table(version, table, tombstones)

    @classmethod
    def join(cls, version: int, parts: Sequence["DeltaSegment"], *, names: Sequence[str] = (),
             dead: Iterable[int] = (), folded: Mapping[int, int] | None = None,
             tombstones: Iterable[Tombstone] = (), keep: np.ndarray | None = None) -> "DeltaSegment":
        """One snapshot over segment ``parts``: their rows but the ``dead`` seqs (and,
        with ``keep``, a bool per row of the parts in turn, those it marks), in seq order,
        ``folded`` ({seq: generation}) applied. Copies arrays of a few KB per entry; the
        token blobs and analysed texts are shared with the parts."""
        tombstones = list(tombstones)
        if not parts:
            return cls.empty().with_tombstones(version, tombstones, tuple(names))
        seq = np.concatenate([p.seq for p in parts])
        dead_seqs = np.fromiter((int(s) for s in dead), dtype=np.int64)
        kept = np.ones(len(seq), dtype=bool) if keep is None else np.asarray(keep, dtype=bool)
        if len(dead_seqs):
            kept &= ~np.isin(seq, dead_seqs)
        held = np.flatnonzero(kept)
        order = held[np.argsort(seq[held], kind="stable")]

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])[order]

        def joined(name: str) -> list:
            values = [v for p in parts for v in getattr(p, name)]
            return [values[i] for i in order]

        inverse = np.full(len(seq), -1, dtype=np.int64)  # concatenated row → position here (-1: dropped)
        inverse[order] = np.arange(len(order))
        offsets = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
        folded_into = np.full(len(order), NOT_FOLDED, dtype=np.int64)
        ordered_seq = seq[order]
        for s, generation in (folded or {}).items():
            at = int(np.searchsorted(ordered_seq, int(s)))
            if at < len(ordered_seq) and ordered_seq[at] == int(s):
                folded_into[at] = int(generation)
        return cls(
            version=version, seq=ordered_seq, ids=cat("ids"), users=cat("users"), texts=joined("texts"),
            lexical_texts=joined("lexical_texts"), types=cat("types"), projects=cat("projects"),
            sessions=cat("sessions"), created_at=cat("created_at"), salience=cat("salience"),
            confidence=cat("confidence"), pinned=cat("pinned"), n_tokens=cat("n_tokens"), vectors=cat("vectors"),
            minhash=cat("minhash"), folded_into=folded_into, tombstones={t.id: t for t in tombstones},
            late_codes=joined("late_codes"), late_scales=joined("late_scales"), segments=tuple(names),
            _joined_from=(tuple(parts), order, inverse, offsets),
        )

    def with_tombstones(self, version: int, tombstones: Iterable[Tombstone], names: tuple[str, ...] = ()) \
            -> "DeltaSegment":
        """This (empty) snapshot as ``version``, with ``tombstones``."""
        from dataclasses import replace

        return replace(self, version=version, tombstones={t.id: t for t in tombstones}, segments=names,
                       _terms_by={})

    @classmethod
    def from_table(cls, version: int, table: pa.Table, tombstones: Iterable[Tombstone]) -> "DeltaSegment":
        n = table.num_rows
        dim = table.schema.field("vector").type.list_size
        num_perm = table.schema.field("minhash").type.list_size

        def obj(name: str) -> np.ndarray:
            return np.asarray(table.column(name).to_pylist(), dtype=object)

        def flat(name: str, dtype, width: int) -> np.ndarray:
            col = table.column(name).combine_chunks()
            values = col.values.to_numpy(zero_copy_only=False) if n else np.zeros(0, dtype)
            return np.asarray(values, dtype=dtype).reshape(n, width)

        return cls(
            version=version,
            seq=table.column("seq").to_numpy().astype(np.int64),
            ids=obj("id"), users=obj("user"),
            texts=table.column("text").to_pylist(), lexical_texts=table.column("lexical").to_pylist(),
            types=obj("type"), projects=obj("project"), sessions=obj("session_id"),
            created_at=table.column("created_at").to_numpy().astype(np.int64),
            salience=table.column("salience").to_numpy().astype(np.float32),
            confidence=table.column("confidence").to_numpy().astype(np.float32),
            pinned=table.column("pinned").to_numpy(zero_copy_only=False).astype(bool),
            n_tokens=table.column("n_tokens").to_numpy().astype(np.int32),
            vectors=flat("vector", np.float32, dim), minhash=flat("minhash", np.uint32, num_perm),
            folded_into=table.column("folded_into").to_numpy().astype(np.int64),
            tombstones={t.id: t for t in tombstones},
            # Snapshots written before token vectors existed have neither column.
            late_codes=table.column("late_codes").to_pylist() if "late_codes" in table.schema.names else [None] * n,
            late_scales=table.column("late_scales").to_pylist() if "late_scales" in table.schema.names else [None] * n,
        )

    def __len__(self) -> int:
        return len(self.seq)

    # ---------------------------------------------------------------- visibility
    def live(self, generation: int | None) -> np.ndarray:
        """Entries that generation ``generation`` does not hold yet."""
        if generation is None:
            return np.ones(len(self), dtype=bool)
        return (self.folded_into == NOT_FOLDED) | (self.folded_into > generation)

    def hidden_ids(self, generation: int | None) -> frozenset[str]:
        """Ids whose generation row must not be returned: deleted ones, and ones the
        delta holds a newer version of."""
        gone = {i for i, t in self.tombstones.items() if t.applies_to(generation)}
        return frozenset(gone | set(self.ids[self.live(generation)].tolist()))

    def users_with_entries(self, generation: int | None) -> set[str]:
        return set(self.users[self.live(generation)].tolist())

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """Positions in this snapshot of delta row ids; -1 where the entry is gone."""
        seq = np.asarray(rows, dtype=np.int64) - DELTA_BASE
        if not len(self.seq):
            return np.full(len(seq), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.seq, seq), len(self.seq) - 1)
        return np.where(self.seq[pos] == seq, pos, -1)

    @functools.cached_property
    def late(self) -> "DeltaTokens":
        """The entries' late-interaction tokens (an entry without them: no tokens),
        decoded for the rows a query scores only."""
        return DeltaTokens(self.late_codes, self.late_scales)

    # ---------------------------------------------------------------- search
    def scope_mask(self, scope: Scope, generation: int | None) -> np.ndarray:
        """Entries of ``scope.user`` that match every filter of the scope."""
        mask = (self.users == scope.user) & self.live(generation)
        if scope.project is not None and scope.project_mode == "filter":
            mask &= self.projects == scope.project
        if scope.types is not None:
            mask &= np.isin(self.types, list(scope.types))
        if scope.since is not None:
            mask &= self.created_at >= int(scope.since.timestamp() * 1_000_000)
        if scope.until is not None:
            mask &= self.created_at <= int(scope.until.timestamp() * 1_000_000)
        if scope.pinned is not None:
            mask &= self.pinned == scope.pinned
        return mask

    def dense_search(self, query_vector: np.ndarray, scope: Scope, generation: int | None,
                     top_k: int) -> dense.DenseHits:
        """Exact cosine over the entries in scope (the same rescoring the dense leg does)."""
        candidates = np.flatnonzero(self.scope_mask(scope, generation))
        if len(candidates) == 0:
            return dense.DenseHits(np.zeros(0, np.int64), np.zeros(0, np.float32), "delta")
        if 4 * len(candidates) >= len(self):  # most entries: one product over all, no copy of their rows
            sims = (self.vectors @ np.asarray(query_vector, np.float32))[candidates]
            order = np.lexsort((candidates, -sims))[:top_k]
            rows, sims = candidates[order], sims[order]
        else:
            rows, sims = dense.rescore(self.vectors, candidates, query_vector, top_k)
        return dense.DenseHits(DELTA_BASE + self.seq[rows], sims, "delta")

    def _analysed(self, analyzer: Analyzer) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """This object's own entries (text + expansions) analysed as the generation's BM25
        index is: postings ``token → (positions, counts)`` and each entry's length in
        tokens. Kept per analyzer (a swap to a generation built with another one analyses
        again); a segment's are made once per process and shared by every snapshot."""
        if analyzer not in self._terms_by:
            tokens = analysed_texts(analyzer, self.lexical_texts)
            postings: dict[str, tuple[list[int], list[int]]] = {}
            for i, entry in enumerate(tokens):
                for token, n in Counter(entry).items():
                    at, tf = postings.setdefault(token, ([], []))
                    at.append(i)
                    tf.append(n)
            self._terms_by[analyzer] = (
                {t: (np.array(at, np.int64), np.array(tf, np.float64)) for t, (at, tf) in postings.items()},
                np.array([len(t) for t in tokens], dtype=np.float64))
        return self._terms_by[analyzer]

    def parts_kept(self, keep: np.ndarray) -> tuple[list["DeltaSegment"], np.ndarray]:
        """The segments this snapshot was joined from (itself when it was not), and a
        mask over their rows in turn of those it holds that ``keep`` (a mask over its own
        rows) marks: a join of them is this snapshot, or a part of another, reusing their
        analysed texts."""
        if self._joined_from is None:
            return [self], np.asarray(keep, dtype=bool)
        parts, _, inverse, _ = self._joined_from
        return list(parts), (inverse >= 0) & np.asarray(keep, dtype=bool)[np.maximum(inverse, 0)]

    def analyse(self, analyzer: Analyzer) -> None:
        """Analyse the texts of the segments this snapshot was joined from (or its own)
        for BM25 now, as a search would at first use."""
        for part in self.parts_kept(np.ones(len(self), dtype=bool))[0]:
            part._analysed(analyzer)

    def _lengths(self, analyzer: Analyzer) -> np.ndarray:
        if self._joined_from is None:
            return self._analysed(analyzer)[1]
        key = ("lengths", analyzer)
        if key not in self._terms_by:
            parts, order, _, _ = self._joined_from
            self._terms_by[key] = np.concatenate([p._analysed(analyzer)[1] for p in parts])[order]
        return self._terms_by[key]

    def _postings(self, analyzer: Analyzer, token: str) -> tuple[np.ndarray, np.ndarray]:
        """(positions in this snapshot of the entries holding ``token``, its count in each):
        the segments' postings mapped through the join, entries the snapshot dropped left out."""
        if self._joined_from is None:
            return self._analysed(analyzer)[0].get(token, _NO_POSTINGS)
        parts, _, inverse, offsets = self._joined_from
        at, tf = [], []
        for part, offset in zip(parts, offsets):
            found = part._analysed(analyzer)[0].get(token)
            if found is not None:
                positions = inverse[offset + found[0]]
                held = positions >= 0
                at.append(positions[held])
                tf.append(found[1][held])
        return (np.concatenate(at), np.concatenate(tf)) if at else _NO_POSTINGS

    def lexical_search(self, query: str, scope: Scope, generation: int | None, base: lexical.BM25Index | None,
                       *, top_k: int, span: tuple[int, int] | None = None) -> "DeltaLexical | None":
        """BM25 over the entries in scope, scored on the generation's scale.

        A tiny index of its own would give IDFs from a handful of documents, and scores
        comparable neither to the generation's nor (normalised by its own ceiling) to
        anything: one entry would look like a perfect match. So each query term gets the
        IDF of the generation and the delta together (``df = df_generation + df_delta``,
        Lucene's idf, bm25s's k1 and b), and the ceiling is taken over both — over the
        user's own memories: ``span``, their rows in the generation (None: none there)."""
        mask = self.scope_mask(scope, generation)
        if not mask.any():
            return None
        analyzer = base.analyzer if base is not None else Analyzer()
        tokens = analyzer.tokenize([query], return_ids=False)[0]
        if not tokens:
            return None
        lengths = self._lengths(analyzer)
        retriever = base.retriever if base is not None else None
        k1 = float(getattr(retriever, "k1", 1.5)) if retriever is not None else 1.5
        b = float(getattr(retriever, "b", 0.75)) if retriever is not None else 0.75
        n_base = int(retriever.scores["num_docs"]) if retriever is not None else 0
        vocab = retriever.vocab_dict if retriever is not None else {}
        avgdl = float(lengths.mean()) if len(lengths) and lengths.mean() > 0 else 1.0
        norm = k1 * (1.0 - b + b * lengths / avgdl)
        scores = np.zeros(len(self), dtype=np.float64)
        mine = (self.users == scope.user) & self.live(generation)
        ceiling, known = 0.0, 0
        for token in tokens:
            at, tf = self._postings(analyzer, token)  # only the entries holding it: a posting list
            df_base, max_base = 0, 0.0
            if token in vocab:
                assert base is not None  # vocab is empty without a base index
                t = vocab[token]
                lo, hi = int(base.retriever.scores["indptr"][t]), int(base.retriever.scores["indptr"][t + 1])
                df_base = hi - lo
                if span is not None:
                    max_base = lexical.ceiling(base, [token], *span)
            df = df_base + len(at)
            idf = math.log(1.0 + (n_base + len(self) - df + 0.5) / (df + 0.5))
            term = idf * tf / (tf + norm[at])
            scores[at] += term
            held = term[mine[at]]
            best = max(max_base, float(held.max()) if len(held) else 0.0)
            ceiling += best
            known += best > 0
        scores = np.where(mask, scores, 0.0)
        k = min(top_k, int(np.count_nonzero(scores > 0)))
        if k == 0:
            return None
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.lexsort((top, -scores[top]))]
        return DeltaLexical(DELTA_BASE + self.seq[top], scores[top].astype(np.float32), ceiling,
                            known / len(tokens))


def effective(live: DeltaSegment, frozen: DeltaSegment | None, dead: Mapping[str, int],
              generation: int | None) -> DeltaSegment:
    """What recall searches beside a generation's files, as one delta: the rows its
    segments hold (``frozen``: :meth:`helix_ray.store.generation.Generation.segment_rows`)
    but those the ``live`` snapshot replaces or deletes, and the live entries the
    generation does not hold. A ``dead`` id ({id: seq}) hides the generation's base row,
    as a tombstone does. ``live`` itself when the generation has no segments.

    An entry both in a segment and pending in the live snapshot (a replica that has
    opened the folded generation before the writer's next snapshot) is the segment's.
    The segments' rows keep their analysed texts across snapshots: only the live
    entries' are joined anew."""
    if frozen is None or (not len(frozen) and not dead):
        return live
    live_keep = live.live(generation) & ~np.isin(live.seq, frozen.seq)
    replaced = {i for i, t in live.tombstones.items() if t.applies_to(generation)} | set(live.ids[live_keep].tolist())
    frozen_parts, keep_frozen = frozen.parts_kept(
        np.fromiter((i not in replaced for i in frozen.ids), dtype=bool, count=len(frozen)))
    parts, keep_live = live.parts_kept(live_keep) if len(live) else ([], np.zeros(0, dtype=bool))
    # entries kept that a later generation holds (this one is older): they stay live here
    folded = {int(q): int(g) for q, g in zip(live.seq[live_keep], live.folded_into[live_keep]) if g != NOT_FOLDED}
    tombstones = dict(live.tombstones)
    for i in dead:  # hidden in this generation, whatever generations a live tombstone of it applies below
        tombstones[i] = Tombstone(i, tombstones[i].user if i in tombstones else "", None)
    return DeltaSegment.join(live.version, [*frozen_parts, *parts], names=live.segments, folded=folded,
                             tombstones=tombstones.values(), keep=np.concatenate([keep_frozen, keep_live]))


@dataclass(frozen=True)
class DeltaLexical:
    rows: np.ndarray  # int64 delta row ids, best first
    scores: np.ndarray  # float32 BM25 on the generation's scale
    ceiling: float  # Σ over query tokens of the best score any of the user's memories (generation or delta) reaches
    coverage: float = 1.0  # share of the query's terms some memory of the user holds


class DeltaTokens:
    """The delta entries' late-interaction tokens with
    :meth:`helix_ray.token_encoder.PassageTokens.lookup`'s contract, decoded from their
    blobs for the rows asked for only: a new snapshot never joins every entry's tokens."""

    def __init__(self, codes: Sequence[bytes | None], scales: Sequence[bytes | None]):
        self.codes, self.scales = codes, scales

    def __len__(self) -> int:
        return len(self.codes)

    def take(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64)
        return from_blobs([self.codes[r] or b"" for r in rows], [self.scales[r] or b"" for r in rows])

    def lookup(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64)
        known = np.flatnonzero((rows >= 0) & (rows < len(self)))
        return known, self.take(rows[known])


class SegmentCache:
    """The delta segment files one process has parsed, by name (they never change).
    Safe to share between a replica's event loop and the thread loading a generation."""

    def __init__(self) -> None:
        self.parts: dict[str, DeltaSegment] = {}
        self.reads = 0  # files parsed so far (a test's and a benchmark's view of the reuse)
        self._lock = threading.Lock()

    def get_many(self, folder: Path, names: Sequence[str], *, keys: Sequence[str] | None = None) \
            -> list[DeltaSegment]:
        """The segments ``names``, in that order. Every file not parsed yet is opened
        before any is parsed: once open, the Writer pruning it (four snapshots later)
        cannot take it away, however long the parsing of the others takes.

        ``keys`` (default: the names) are what the cache knows them by: a generation's
        segments by their file's identity (:meth:`key`), since the next generation
        hard-links them under the same names, so each is parsed (and its texts
        analysed) once, whichever generation asks."""
        keys = list(names) if keys is None else list(keys)
        with self._lock:
            found = {key: self.parts[key] for key in keys if key in self.parts}
        opened: dict[str, Any] = {}
        try:
            for key, name in dict(zip(keys, names)).items():
                if key not in found:
                    opened[key] = pa.memory_map(str(folder / name), "r")
            for key, source in opened.items():
                found[key] = DeltaSegment.from_table(0, ipc.open_file(source).read_all(), [])
                self.reads += 1
        finally:
            for source in opened.values():
                source.close()
        with self._lock:
            self.parts.update((key, found[key]) for key in opened)
        return [found[key] for key in keys]

    @staticmethod
    def key(folder: Path, name: str) -> str:
        """``name`` and the identity of its file in ``folder`` (device, inode, size): the
        same for every hard link of it, another for another file under that name."""
        device, inode, size, _ = file_identity(folder / name)
        return f"{name}@{device}:{inode}:{size}"

    def retain(self, names: Iterable[str]) -> None:
        """Forget every segment but ``names`` (those of the snapshots still held)."""
        keep = set(names)
        with self._lock:
            for name in [n for n in self.parts if n not in keep]:
                del self.parts[name]


_NO_POSTINGS = (np.zeros(0, np.int64), np.zeros(0, np.float64))

#: How many texts' terms :func:`analysed_texts` keeps: more than the writes a compaction
#: folds at a time (``fold.max_rows``).
TERMS_KEPT = 10_000
_TERMS: "OrderedDict[tuple[Analyzer, str], list[str]]" = OrderedDict()  # oldest first
_TERMS_LOCK = threading.Lock()


def analysed_texts(analyzer: Analyzer, texts: Sequence[str]) -> list[list[str]]:
    """Each text's BM25 terms, as ``analyzer.tokenize`` gives them; the latest
    :data:`TERMS_KEPT` are kept by this process. A fold's segment holds the writes the
    live delta's segments held, with the same texts: the replica warming the fold's
    generation looks their terms up instead of analysing them again, holding the GIL
    beside recall."""
    with _TERMS_LOCK:
        found: list[list[str] | None] = [_TERMS.get((analyzer, t)) for t in texts]
    missing = [i for i, terms in enumerate(found) if terms is None]
    if missing:
        fresh = analyzer.tokenize([texts[i] for i in missing], return_ids=False)
        with _TERMS_LOCK:
            for i, terms in zip(missing, fresh):
                found[i] = _TERMS[(analyzer, texts[i])] = terms
            while len(_TERMS) > TERMS_KEPT:
                _TERMS.popitem(last=False)
    return [terms for terms in found if terms is not None]


def _no_lexical_hits() -> lexical.LexicalHits:
    return lexical.LexicalHits(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32), False)


# ----------------------------------------------------------------------------- merging


def merge_dense(base: dense.DenseHits | None, extra: dense.DenseHits | None, top_k: int) -> dense.DenseHits | None:
    """One list by cosine (both are exact float cosines, so they compare directly)."""
    if extra is None or not len(extra.rows):
        return base
    if base is None:
        return dense.DenseHits(extra.rows[:top_k], extra.similarities[:top_k], "delta")
    rows = np.concatenate([base.rows, extra.rows])
    sims = np.concatenate([base.similarities, extra.similarities]).astype(np.float32)
    order = np.lexsort((rows, -sims))[:top_k]
    return dense.DenseHits(rows[order], sims[order], base.first_pass + "+delta", base.context, base.window)


def merge_lexical(base: lexical.LexicalHits | None, extra: DeltaLexical | None, *, top_k: int,
                  strong_score: float, strong_gap: float) -> lexical.LexicalHits | None:
    """One list by BM25 score (the delta's is on the generation's scale, see
    :meth:`DeltaSegment.lexical_search`), normalised again by the ceiling over both, and
    the strong-signal test re-run on the merged list. Without delta hits, ``base`` is
    returned as it is."""
    if extra is None or not len(extra.rows):
        return base
    base = base if base is not None else _no_lexical_hits()
    rows = np.concatenate([base.rows, extra.rows])
    raw = np.concatenate([base.scores, extra.scores]).astype(np.float32)
    order = np.lexsort((rows, -raw))[:top_k]
    rows, raw = rows[order], raw[order]
    normalised = np.minimum(raw / (extra.ceiling or 1.0), 1.0).astype(np.float32)
    return lexical.LexicalHits(rows, raw, normalised,
                               lexical.is_strong(normalised, extra.coverage, strong_score, strong_gap), base.context,
                               base.window)
