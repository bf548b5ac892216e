"""Stage 3a: dense retrieval — a first pass, then rescoring with float vectors.

First pass, by the size of what is in scope:

- small scope (≤ ``exact_below`` rows, or a filtered subset that small): Hamming
  distance over the 1-bit sign codes of every row in scope — a scan, so no recall is
  lost to the graph, and cheap (one bit per dimension);
- large scope: the tenant's HNSW index over int8 vectors (usearch, memory-mapped view),
  asked for ``oversample × top_k`` candidates; with a filter, survivors of the mask are
  kept and, if fewer than ``top_k`` survive, the binary scan over the filtered rows
  takes over.

Survivors are rescored by exact cosine with the float32 vectors (rows are unit length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helix_ray.config import DenseConfig
from helix_ray.index.quantize import binary_codes, quantize_int8


@dataclass(frozen=True)
class DenseHits:
    rows: np.ndarray  # int64 global row ids, best first
    similarities: np.ndarray  # float32 cosine
    first_pass: str  # "binary" | "hnsw" | "hnsw+binary"
    context: tuple[np.ndarray, ...] = ()  # rows, best first, per context turn of the plan
    window: np.ndarray | None = None  # rows, best first, among those created in the query's window


def hamming_top(codes: np.ndarray, query_code: np.ndarray, count: int) -> np.ndarray:
    """Indices (into ``codes``) of the ``count`` codes nearest to ``query_code``."""
    if codes.shape[1] % 8 == 0:
        xor = np.bitwise_xor(codes.view(np.uint64), query_code.view(np.uint64))
    else:
        xor = np.bitwise_xor(codes, query_code)
    distance = np.bitwise_count(xor).sum(axis=1, dtype=np.int32)
    if count >= len(distance):
        return np.argsort(distance, kind="stable")
    top = np.argpartition(distance, count - 1)[:count]
    return top[np.argsort(distance[top], kind="stable")]


def rescore(vectors: np.ndarray, rows: np.ndarray, query: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.sort(rows)  # sorted reads of the file
    sims = np.asarray(vectors[rows], dtype=np.float32) @ query
    order = np.lexsort((rows, -sims))[:top_k]
    return rows[order].astype(np.int64), sims[order]


#: A filter that keeps less than this share of a tenant's rows: the binary codes of the
#: rows it keeps are scanned (and the nearest rescored) instead of searching the HNSW
#: graph, whose nearest neighbours would mostly be filtered out. Above it, when too few
#: of the graph's neighbours are in scope, the graph is searched once more,
#: 1 / SCAN_BELOW_SHARE times wider, before the scan (docs/benchmarks.md).
SCAN_BELOW_SHARE = 0.25


def search(generation, user: str, query: np.ndarray, *, mask: np.ndarray | None, config: DenseConfig) -> DenseHits:
    start, end = generation.partitions[user]
    want = config.top_k * config.oversample
    query_code = binary_codes(query)
    in_scope = np.arange(start, end) if mask is None else start + np.flatnonzero(mask)
    if len(in_scope) == 0:
        return DenseHits(np.zeros(0, np.int64), np.zeros(0, np.float32), "binary")
    share = len(in_scope) / max(end - start, 1)
    if len(in_scope) <= config.exact_below or not generation.has_dense_index(user) or share < SCAN_BELOW_SHARE:
        if len(in_scope) <= want:
            candidates = in_scope
        else:
            codes = np.asarray(generation.binary[start:end]) if mask is None else generation.binary[in_scope]
            candidates = in_scope[hamming_top(codes, query_code, want)]
        rows, sims = rescore(generation.vectors, candidates, query, config.top_k)
        return DenseHits(rows, sims, "binary")
    index = generation.dense_index(user)
    q8 = quantize_int8(query[None, :])[0]
    how, asked = "hnsw", want
    while True:
        index.expansion_search = max(config.expansion_search, asked)
        keys = np.asarray(index.search(q8, asked).keys, dtype=np.int64)
        if mask is None:
            break
        keys = keys[mask[keys - start]]
        if len(keys) >= config.top_k:
            break
        if asked < want / SCAN_BELOW_SHARE:  # the query's neighbourhood is mostly out of scope: a wider search
            asked = int(want / SCAN_BELOW_SHARE)
            continue
        codes = generation.binary[in_scope]
        keys = in_scope[hamming_top(codes, query_code, want)]
        how = "hnsw+binary"
        break
    rows, sims = rescore(generation.vectors, keys, query, config.top_k)
    return DenseHits(rows, sims, how)
