"""Stage 7c: what one generation hands the next, so that an ingest into a large store
(a compaction of a few hundred online writes into many thousands of memories) computes
the new rows' entities, BM25 terms and nearest neighbours, not every row's again.

Beside the indexes a reader uses, a generation keeps per row what built them (see
:mod:`helix_ray.store.generation`; the manifest's ``carry`` says which it has and how
they were made):

- ``mentions.arrow``: the entity keys each memory mentions (stage 7a);
- ``bm25/helix_terms.npy`` + ``helix_term_offsets.npy``: each memory's analysed terms,
  as ids of the BM25 index's vocabulary, in order;
- ``knn/neighbours.npy`` + ``similarities.npy``: each memory's nearest memories of its
  tenant, self included, before the graph's similarity cut (−1 pads a short list).

The next ingest takes them for the rows it carries over when they were made the way it
would make them (same extractor version, analyzer, k), and otherwise computes every row
once (the run after reuses). The results are the ones a full rebuild gives: the same
entity lists and term ids, and for tenants searched exactly the same nearest neighbours
(``tests/test_carry.py`` compares both ways).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from helix_ray.index.bm25 import Analyzer, Terms, TermsOfWords
from helix_ray.ingest import entities as entity_mod
from helix_ray.ingest.dense import Carried

if TYPE_CHECKING:
    from helix_ray.store.generation import Generation

#: Bump when :func:`helix_ray.ingest.entities.extract` finds something else in the same
#: text: a generation's stored mentions are then extracted again.
MENTIONS_VERSION = 1
#: A row's entity keys, as ingest holds and ``mentions.arrow`` stores them.
MENTIONS_TYPE = pa.list_(pa.string())


def _carry(previous: Generation | None, key: str) -> Any:
    return None if previous is None else (previous.manifest.get("carry") or {}).get(key)


# ----------------------------------------------------------------------------- mentions


def mentions(previous: Generation | None, old_rows: np.ndarray, old_texts: pa.ChunkedArray) -> pa.Array:
    """Entity keys of the carried-over rows (``old_rows`` of ``previous``, whose texts
    are ``old_texts``), a list per row (:data:`MENTIONS_TYPE`): stored ones when the same
    extractor made them, else extracted."""
    if len(old_rows) and _carry(previous, "mentions") == MENTIONS_VERSION:
        assert previous is not None
        return previous.mentions.take(np.asarray(old_rows, np.int64)).combine_chunks().cast(MENTIONS_TYPE)
    return pa.array([entity_mod.extract(t) for t in old_texts.to_pylist()], MENTIONS_TYPE)


# ----------------------------------------------------------------------------- BM25 terms


def terms(previous: Generation | None, old_rows: np.ndarray, old_lexical: Sequence[str] | None,
          new: TermsOfWords, analyzer: Analyzer,
          new_file: Callable[[int], np.ndarray] | None = None) -> Terms:
    """Terms of the carried-over rows then of the new ones (their words, analysed by
    the transform stage with ``analyzer``, numbered after the old rows' vocabulary into
    ``new_file(n)`` when given). The old rows' come from ``previous`` when its index was
    built with ``analyzer``; otherwise ``old_lexical`` (their text and expansions) is
    analysed again — pass None only when :func:`terms_carried` said yes."""
    if terms_carried(previous, analyzer):
        assert previous is not None
        old = previous.terms.take(old_rows)
    elif old_lexical is None:
        raise ValueError("the previous generation holds no terms made by this analyzer: pass old_lexical")
    else:
        old = Terms.analyse(analyzer, old_lexical)
    return old.then(new.terms(old.vocab, empty=new_file))


def terms_carried(previous: Generation | None, analyzer: Analyzer) -> bool:
    return _carry(previous, "terms") == analyzer.to_dict()


# ----------------------------------------------------------------------------- semantic kNN


def exact_knn(vectors: np.ndarray, k: int, *, offset: int, queries: np.ndarray | None = None,
              rows_per_step: int = 2048, out: tuple[np.ndarray, np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of ``vectors`` (unit rows: cosine) to each of its rows, or to the
    rows ``queries`` (relative row numbers) only; neighbours as ``offset`` + row, nearest
    first, ties by row. Computed in blocks of queries to bound memory, into ``out``
    (the (rows, k) arrays of neighbours and similarities) when given."""
    rows = np.arange(len(vectors)) if queries is None else np.asarray(queries, np.int64)
    neighbours, sims = out if out is not None else (np.empty((len(rows), k), np.int64),
                                                    np.empty((len(rows), k), np.float32))
    for lo in range(0, len(rows), rows_per_step):
        scores = vectors[rows[lo : lo + rows_per_step]] @ vectors.T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        part = np.take_along_axis(scores, top, axis=1)
        order = np.lexsort((top, -part), axis=1)
        neighbours[lo : lo + rows_per_step] = np.take_along_axis(top, order, axis=1) + offset
        sims[lo : lo + rows_per_step] = np.take_along_axis(part, order, axis=1)
    return neighbours, sims


def _merge(neighbours: np.ndarray, sims: np.ndarray, more: np.ndarray, more_sims: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k best of two candidate lists (−1 = none), nearest first, ties by row."""
    ids = np.concatenate([neighbours, more], axis=1)
    s = np.where(ids >= 0, np.concatenate([sims, more_sims], axis=1), -np.inf).astype(np.float32)
    order = np.lexsort((np.where(ids >= 0, ids, np.iinfo(np.int64).max), -s), axis=1)[:, :k]
    ids, s = np.take_along_axis(ids, order, axis=1), np.take_along_axis(s, order, axis=1)
    return np.where(np.isfinite(s), ids, -1), np.where(np.isfinite(s), s, 0.0).astype(np.float32)


def moved_to(previous_size: int, previous_row: np.ndarray) -> np.ndarray:
    """Per row of the previous generation, its row now (−1 if it left), from
    ``previous_row``: per row now, its row in the previous generation (−1 if new)."""
    now = np.full(previous_size, -1, np.int64)
    carried = previous_row >= 0
    now[previous_row[carried]] = np.flatnonzero(carried)
    return now


@dataclass
class PreviousKnn:
    """The previous generation's lists, and where its rows are now."""

    neighbours: np.ndarray  # (N_prev, K) previous row numbers, −1 pads
    similarities: np.ndarray  # (N_prev, K)
    now: np.ndarray  # (N_prev,) the row each previous row has now, −1 if it left


def previous_knn(previous: Generation | None, width: int, now: np.ndarray | None) -> PreviousKnn | None:
    """The previous generation's kNN lists if they are ``width`` wide; ``now`` is
    :func:`moved_to` of its rows."""
    if _carry(previous, "knn") != width:
        return None
    assert previous is not None and now is not None
    neighbours, sims = previous.knn
    return PreviousKnn(neighbours, sims, now)


#: A tenant with more new rows than this (and than a quarter of its rows) is searched
#: whole: meeting every new row from every old one would cost more.
MAX_FRESH_TO_MEET = 2048


def tenant_knn(vectors: np.ndarray, start: int, end: int, k: int, width: int, *,
               previous: PreviousKnn | None, previous_row: np.ndarray, search=None,
               similarity=None, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(end − start, width) nearest rows of a tenant's rows, self included, −1 padded:
    in ``out`` when given (views of a file's memory map, say), else new arrays.

    ``search(rows, out=None) -> (neighbours, sims)`` finds the k nearest of the given
    tenant rows (absolute numbers), into ``out`` when given; by default exactly.
    ``similarity(rows, candidates)`` scores row pairs as ``search`` does (default: dot
    products of ``vectors``, in float32).

    With ``previous``, a carried-over row keeps its list when none of its neighbours
    left (it meets only the tenant's new rows, scored directly); a new row, or one that
    lost a neighbour, is searched. Otherwise every row is searched."""
    n = end - start
    if search is None or similarity is None:
        block = np.asarray(vectors[start:end], np.float32)  # float16 rows are scored in float32
    if search is None:
        def search(rows: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
            return exact_knn(block, k, offset=start, queries=rows - start, out=out)
    if similarity is None:
        def similarity(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
            return block[rows - start] @ block[candidates - start].T

    out_n, out_s = out if out is not None else (np.empty((n, width), np.int64), np.empty((n, width), np.float32))
    out_n[:], out_s[:] = -1, 0
    rows = np.arange(start, end)
    before = previous_row[start:end]
    fresh = rows[before < 0]
    if previous is None or not (before >= 0).any() or len(fresh) > max(MAX_FRESH_TO_MEET, n // 4):
        searched = rows  # nothing to carry, or so much new that searching is cheaper
    else:
        old = rows[before >= 0]
        listed = previous.neighbours[before[before >= 0]].astype(np.int64)
        moved = np.where(listed >= 0, previous.now[np.maximum(listed, 0)], -1)
        lost = ((listed >= 0) & ((moved < start) | (moved >= end))).any(axis=1)
        keep, searched = old[~lost], np.concatenate([rows[before < 0], old[lost]])
        if len(keep):
            kept_n = moved[~lost]
            kept_s = np.asarray(previous.similarities[before[before >= 0]], np.float32)[~lost]
            if len(fresh):
                for lo in range(0, len(keep), 4096):
                    part = slice(lo, lo + 4096)
                    more_s = similarity(keep[part], fresh).astype(np.float32)
                    more_n = np.broadcast_to(fresh, more_s.shape)
                    if more_s.shape[1] > k:  # only a row's k best new ones can enter its list
                        top = np.argpartition(-more_s, k - 1, axis=1)[:, :k]
                        more_s, more_n = np.take_along_axis(more_s, top, axis=1), fresh[top]
                    kept_n[part], kept_s[part] = _merge_to(kept_n[part], kept_s[part], more_n, more_s, k, width)
            out_n[keep - start], out_s[keep - start] = kept_n, kept_s
    if len(searched) == n:  # every row (a first ingest): the lists go straight into place, not through a copy
        search(rows, out=(out_n[:, :k], out_s[:, :k]))
    elif len(searched):
        searched = np.sort(searched)
        found_n, found_s = search(searched)
        out_n[searched - start, : found_n.shape[1]] = found_n
        out_s[searched - start, : found_s.shape[1]] = found_s
    return out_n, out_s


def _merge_to(neighbours, sims, more, more_sims, k: int, width: int):
    ids, s = _merge(neighbours, sims, more, more_sims, k)
    pad = width - ids.shape[1]
    if pad > 0:
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        s = np.pad(s, ((0, 0), (0, pad)))
    return ids, s


# ----------------------------------------------------------------------------- HNSW

#: Past this share of a tenant's size in removed entries (deleted or edited memories,
#: kept as tombstones by usearch), its HNSW index is built anew instead of carried.
MAX_REMOVED_SHARE = 0.1


def dense_index(previous: Generation | None, user: str, start: int, end: int, previous_row: np.ndarray,
                now: np.ndarray | None, *, connectivity: int, expansion_add: int) -> tuple[Carried, int] | None:
    """How to make the tenant's HNSW index from the previous generation's: its memories
    that left removed, the others renamed to their rows now, the new ones added
    (:func:`helix_ray.ingest.dense.carry_index` does it). Returns ``(carried, removed)``
    with the tombstones the index will hold (``previous_row`` / ``now``: see
    :func:`moved_to`), or None when there is no index to carry, it was built with other
    parameters, or it would hold too many tombstones."""
    hnsw = (previous.manifest.get("hnsw") or {}) if previous is not None else {}
    if previous is None or not previous.has_dense_index(user) or user not in previous.partitions or \
            (hnsw.get("connectivity"), hnsw.get("expansion_add"), hnsw.get("dtype")) != \
            (connectivity, expansion_add, "i8"):
        return None
    assert now is not None
    p_start, p_end = previous.partitions[user]
    now = now[p_start:p_end]
    removed = int((now < 0).sum()) + int((_carry(previous, "dense_removed") or {}).get(user, 0))
    if removed > MAX_REMOVED_SHARE * (end - start):
        return None
    keys = np.arange(p_start, p_end, dtype=np.uint64)
    moved = (now >= 0) & (now != np.arange(p_start, p_end))
    carried = Carried(source=previous.dense_index_path(user), remove=keys[now < 0], rename_from=keys[moved],
                      rename_to=now[moved].astype(np.uint64),
                      add=start + np.flatnonzero(previous_row[start:end] < 0))
    return carried, removed
