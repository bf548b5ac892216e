"""Stage 3: exact and near-duplicate removal with MinHash-LSH (datasketch's signatures and bands).

Signatures are MinHash over word shingles (lower-cased ``\\w+`` tokens, ``shingle``
words each). Two memories of the same tenant whose estimated Jaccard similarity is at
least ``threshold`` are duplicates; the one kept is the preferred one (pinned first,
then the newer ``created_at``, then the later in input order) and the other is recorded
as a link ``(dropped_id, kept_id, jaccard)``. Memories of different tenants never
deduplicate against each other.

The same signatures are stored in each generation, so recall's diversity stage can
drop near-duplicates among its candidates without hashing text on the query path.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

import numpy as np

_WORD = re.compile(r"\w+")


def shingles(text: str, size: int) -> list[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) <= size:
        return [" ".join(words).encode("utf-8")]
    return [" ".join(words[i : i + size]).encode("utf-8") for i in range(len(words) - size + 1)]


def signatures(texts: Sequence[str], *, num_perm: int, shingle: int) -> np.ndarray:
    """MinHash signatures, shape (len(texts), num_perm), uint32."""
    from datasketch import MinHash

    if not texts:
        return np.zeros((0, num_perm), dtype=np.uint32)
    hashes = MinHash.bulk([shingles(t, shingle) for t in texts], num_perm=num_perm)
    return np.stack([h.hashvalues for h in hashes]).astype(np.uint32, copy=False)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of two signatures (share of equal slots)."""
    return float(np.mean(a == b))


def exact_jaccard(a: str, b: str, size: int) -> float:
    sa, sb = set(shingles(a, size)), set(shingles(b, size))
    return len(sa & sb) / max(1, len(sa | sb))


def find_duplicates(
    users: Sequence[str] | np.ndarray,
    sigs: np.ndarray,
    preference: Sequence[tuple],
    *,
    threshold: float,
    texts: Sequence[str] | None = None,
    shingle: int = 3,
    settled: int = 0,
    parents: Sequence[str | None] | None = None,
) -> list[tuple[int, int, float]]:
    """Return ``(dropped, kept, jaccard)`` index triples. ``users``: each item's tenant,
    a name or a number (an integer array, as an ingest gives them).

    ``preference[i]`` is a sortable key; the larger key wins a duplicate pair. Items are
    visited best first, so each dropped item points at a kept one (no chains). The
    candidates of an item are the kept items of its tenant that share an LSH band with
    it (:func:`band_buckets`), lower rows first; the most similar one at or above
    ``threshold`` keeps it. With ``texts``, each candidate is confirmed by the exact
    Jaccard of the shingle sets (the 64-slot estimate alone has a standard error of about .05).

    ``settled``: the first ``settled`` items hold no duplicate pair among themselves (the
    previous generation's rows, deduplicated when it was built). Only those sharing an
    LSH band with a later item can then drop or be dropped, so the others are not
    visited: the same answer, for the cost of the new items rather than of the store
    (docs/benchmarks.md).

    ``parents``: item i is a chunk of memory ``parents[i]`` (None: a whole memory). Chunks
    of one memory are never duplicates of each other: a document that repeats itself
    keeps every part.
    """
    n = len(users)
    if settled >= n:
        return []  # nothing new
    buckets = band_buckets(users, sigs, settled, lsh_bands(sigs.shape[1], threshold))
    buckets_of: dict[int, list[int]] = {}  # item → the buckets it is in
    for b, members in enumerate(buckets):
        for i in members.tolist():
            buckets_of.setdefault(i, []).append(b)
    # An item in no group has no candidate and is no one's: it is kept, unvisited.
    order = sorted(buckets_of, key=lambda i: preference[i], reverse=True)
    kept = np.zeros(n, bool)  # visited and not dropped: the candidates of later items
    dropped: list[tuple[int, int, float]] = []
    for i in order:
        best, best_sim = -1, -1.0
        candidates = {j for b in buckets_of[i] for j in buckets[b].tolist() if kept[j]}
        for key in sorted(candidates):
            if users[key] != users[i]:
                continue  # a hash collision across tenants: never a pair
            if parents is not None and parents[i] is not None and parents[i] == parents[key]:
                continue
            sim = jaccard(sigs[i], sigs[key])
            if texts is not None and sim >= threshold - 0.15:
                sim = exact_jaccard(texts[i], texts[key], shingle)
            if sim >= threshold and sim > best_sim:
                best, best_sim = key, sim
        if best >= 0:
            dropped.append((i, best, round(best_sim, 4)))
        else:
            kept[i] = True
    return dropped


@functools.lru_cache(maxsize=None)
def lsh_bands(num_perm: int, threshold: float) -> tuple[tuple[int, int], ...]:
    """The bands (slot ranges) of a MinHash-LSH index for ``threshold``, as datasketch's
    ``MinHashLSH`` chooses them, tuned below the threshold: LSH only proposes
    candidates (missing a true pair at J = .85 otherwise happens), the similarity check
    decides. Chosen once per setting: datasketch integrates to find them."""
    from datasketch import MinHashLSH

    return tuple(MinHashLSH(threshold=max(0.3, threshold - 0.2), num_perm=num_perm).hashranges)


def band_buckets(users: Sequence[str] | np.ndarray, sigs: np.ndarray, settled: int,
                 bands: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """The groups of two or more items of one tenant with the same values in a band
    (each a sorted array of items), leaving out groups of ``[0, settled)`` items alone.
    Each band is hashed to 64 bits with the tenant, vectorised; a collision only adds a
    candidate, which the similarity check then turns down. An item held by no group has
    no candidate and is no one's: most items, in a store without near-duplicates. (Held
    as a few arrays, where an LSH index holds a Python bytes key per item and band:
    ~3 KB an item.)"""
    n = len(users)
    if not n or sigs.ndim != 2 or not sigs.shape[1]:
        return []
    if isinstance(users, np.ndarray) and users.dtype.kind in "iu":  # tenants as numbers already
        user = users.astype(np.uint64)
    else:
        user = np.unique(np.asarray(users, object), return_inverse=True)[1].astype(np.uint64)
    user *= np.uint64(0x9E3779B97F4A7C15)
    rng = np.random.default_rng(0)
    buckets: list[np.ndarray] = []
    with np.errstate(over="ignore"):
        for start, end in bands:
            mult = rng.integers(1, 2**63, size=end - start, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            h = (sigs[:, start:end].astype(np.uint64) * mult).sum(axis=1, dtype=np.uint64) ^ user
            order = np.argsort(h, kind="stable")
            ranked = h[order]
            firsts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
            lasts = np.r_[firsts[1:], n]
            wanted = (lasts - firsts >= 2) & (np.maximum.reduceat(order, firsts) >= settled)
            for first, last in zip(firsts[wanted].tolist(), lasts[wanted].tolist()):
                buckets.append(np.sort(order[first:last]))
    return buckets
