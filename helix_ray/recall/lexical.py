"""Stage 3b: BM25 over memory text plus doc2query expansions, scored within a tenant.

The index is built at ingest and memory-mapped at query time
(:mod:`helix_ray.index.bm25`); every query is analysed with the
:class:`~helix_ray.index.bm25.Analyzer` the index was built with. Scope filters are
applied inside the retriever: scores are computed only for the tenant's contiguous row
range and masked by the other filters before the top-k is taken, so a filtered-out
memory can never take a slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from helix_ray.index.bm25 import BM25Index


@dataclass(frozen=True)
class LexicalHits:
    rows: np.ndarray  # int64 global row ids, best first
    scores: np.ndarray  # float32 raw BM25
    normalised: np.ndarray  # raw / the query's ceiling (see :func:`ceiling`), in [0, 1]
    strong_signal: bool
    context: tuple[np.ndarray, ...] = ()  # rows, best first, per context turn of the plan
    window: np.ndarray | None = None  # rows, best first, among those created in the query's window


def ceiling(index: BM25Index, tokens: list[str], start: int = 0, end: int | None = None) -> float:
    """The best score any memory of rows [start, end) could reach for ``tokens``: Σ over
    query tokens of the token's highest per-memory score among those rows (one tenant's:
    another tenant's memories must not move this one's strong-signal decisions). A
    memory at 1.0 of it holds every query term at the best weight seen: the query is,
    lexically, that memory."""
    return float(sum(term_maxima(index, tokens, start, end)))


def term_maxima(index: BM25Index, tokens: list[str], start: int = 0, end: int | None = None) -> list[float]:
    """Per token, its highest per-memory score among rows [start, end); 0 for a token no
    memory there holds."""
    scores = index.retriever.scores
    vocab = index.retriever.vocab_dict
    data, indptr, indices = scores["data"], scores["indptr"], scores["indices"]
    whole = start <= 0 and (end is None or end >= scores["num_docs"])
    out = []
    for token in tokens:
        t = vocab[token]
        lo, hi = int(indptr[t]), int(indptr[t + 1])
        weights = np.asarray(data[lo:hi])
        if not whole and hi > lo:
            docs = np.asarray(indices[lo:hi])
            weights = weights[(docs >= start) & (docs < (scores["num_docs"] if end is None else end))]
        out.append(float(np.max(weights)) if len(weights) else 0.0)
    return out


SAMPLE_ROWS = 16_384
"""Rows in the strided sample that bounds the top-k threshold (see :func:`top_k_rows`)."""


def top_k_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` highest positive ``scores``, best first, ties by position.

    Exact, and cheap on a large tenant. The k-th largest score of any subset is a lower
    bound for the k-th largest of the whole, so the rows scoring at least the k-th best
    of a strided sample of :data:`SAMPLE_ROWS` hold the whole top-k; they are ~k·n/16k
    rows instead of every row that matches a query term, which on a large tenant is
    most of them (docs/benchmarks.md).
    """
    if k <= 0 or len(scores) == 0:
        return np.zeros(0, np.int64)
    threshold = 0.0
    if len(scores) > 4 * SAMPLE_ROWS:
        sample = scores[:: len(scores) // SAMPLE_ROWS]
        if len(sample) >= k:
            threshold = float(np.partition(sample, len(sample) - k)[len(sample) - k])
    hit = np.flatnonzero(scores >= threshold) if threshold > 0 else np.flatnonzero(scores > 0)
    k = min(k, len(hit))
    if k == 0:
        return np.zeros(0, np.int64)
    hit_scores = scores[hit]
    if k < len(hit):  # the k-th score, then every row above it and the first rows equal to it
        kth = np.partition(hit_scores, len(hit) - k)[len(hit) - k]
        above = hit[hit_scores > kth]
        top = np.concatenate([above, hit[hit_scores == kth][: k - len(above)]])
    else:
        top = hit
    return top[np.lexsort((top, -scores[top]))].astype(np.int64)


def search(
    index: BM25Index,
    query: str,
    *,
    start: int,
    end: int,
    mask: np.ndarray | None,
    top_k: int,
    strong_score: float,
    strong_gap: float,
    window: np.ndarray | None = None,
) -> LexicalHits:
    """Top-k BM25 rows within [start, end) where ``mask`` (length end-start) is true;
    with ``window`` (a narrower mask: the memories of the query's time window), also the
    top-k rows where it is true, from the same scores (``LexicalHits.window``).

    Strong signal: the top hit's normalised score, times the share of the query's terms
    the index knows, is at least ``strong_score``, and the top hit beats the second by
    at least ``strong_gap`` — the query names one memory exactly (an error string, a
    path), so fusion with the dense leg has nothing to add. (Without the share, "event
    bus" over a store where "bus" appears nowhere and "event" in one memory would name
    that memory.)
    """
    tokens, n_terms = index.query_terms(query)
    empty = LexicalHits(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32), False)
    if not tokens:
        return empty
    all_scores = np.asarray(index.scores(tokens)[start:end], dtype=np.float32)
    # BM25 scores are >= 0, so a product masks (cheaper than np.where)
    scores = all_scores * mask if mask is not None else all_scores
    within = None if window is None else top_k_rows(all_scores * window, top_k).astype(np.int64) + start
    top = top_k_rows(scores, top_k)
    if len(top) == 0:
        return empty if within is None else dataclasses.replace(empty, window=within)
    raw = scores[top]
    maxima = term_maxima(index, tokens, start, end)  # the tenant's own: other tenants' words do not count
    normalised = np.minimum(raw / (sum(maxima) or 1.0), 1.0).astype(np.float32)
    strong = is_strong(normalised, sum(m > 0 for m in maxima) / max(n_terms, 1), strong_score, strong_gap)
    return LexicalHits(rows=top.astype(np.int64) + start, scores=raw, normalised=normalised, strong_signal=strong,
                       window=within)


def is_strong(normalised: np.ndarray, coverage: float, strong_score: float, strong_gap: float) -> bool:
    """The strong-signal test of :func:`search` on a list's normalised scores, best
    first; ``coverage``: the share of the query's terms that some memory holds."""
    if not len(normalised):
        return False
    second = float(normalised[1]) if len(normalised) > 1 else 0.0
    return bool(normalised[0] * coverage >= strong_score and normalised[0] - second >= strong_gap)
