"""Stage 3: exact and near-duplicate removal with MinHash-LSH (datasketch).

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
    users: Sequence[str],
    sigs: np.ndarray,
    preference: Sequence[tuple],
    *,
    threshold: float,
    texts: Sequence[str] | None = None,
    shingle: int = 3,
    settled: int = 0,
    parents: Sequence[str | None] | None = None,
) -> list[tuple[int, int, float]]:
    """Return ``(dropped, kept, jaccard)`` index triples.

    ``preference[i]`` is a sortable key; the larger key wins a duplicate pair. Items are
    visited best first, so each dropped item points at a kept one (no chains). With
    ``texts``, each LSH candidate is confirmed by the exact Jaccard of the shingle sets
    (the 64-slot estimate alone has a standard error of about .05).

    ``settled``: the first ``settled`` items hold no duplicate pair among themselves (the
    previous generation's rows, deduplicated when it was built). Only those sharing an
    LSH band with a later item can then drop or be dropped, so the others are not
    visited: the same answer, for the cost of the new items rather than of the store
    (docs/benchmarks.md).

    ``parents``: item i is a chunk of memory ``parents[i]`` (None: a whole memory). Chunks
    of one memory are never duplicates of each other: a document that repeats itself
    keeps every part.
    """
    from datasketch import LeanMinHash, MinHashLSH

    num_perm = sigs.shape[1] if sigs.ndim == 2 else 0
    params: tuple[int, int] | None = None

    def make() -> MinHashLSH:
        # Bands tuned below the threshold: LSH only proposes candidates (missing a true
        # pair at J = .85 otherwise happens), the similarity check below decides. The
        # bands are chosen once: datasketch integrates to find them, and there is one
        # index per tenant.
        nonlocal params
        lsh = MinHashLSH(threshold=max(0.3, threshold - 0.2), num_perm=num_perm, params=params)
        params = (lsh.b, lsh.r)
        return lsh

    if settled >= len(users):
        return []  # nothing new
    visit: Sequence[int] = range(len(users))
    if settled and num_perm:
        visit = [*sharing_a_band(users, sigs, settled, make().hashranges), *range(settled, len(users))]
    order = sorted(visit, key=lambda i: preference[i], reverse=True)
    indexes: dict[str, MinHashLSH] = {}
    dropped: list[tuple[int, int, float]] = []
    for i in order:
        lsh = indexes.get(users[i])
        if lsh is None:
            lsh = indexes[users[i]] = make()
        # A LeanMinHash takes the stored values as they are (a MinHash would first draw
        # its permutations again, most of this loop's work).
        mh = LeanMinHash(seed=1, hashvalues=sigs[i], scheme="affine32")
        best, best_sim = -1, -1.0
        for key in lsh.query(mh):
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
            lsh.insert(i, mh, check_duplication=False)
    return dropped


def sharing_a_band(users: Sequence[str], sigs: np.ndarray, settled: int,
                   hashranges: Sequence[tuple[int, int]]) -> list[int]:
    """The items of ``[0, settled)`` that share an LSH band (``hashranges``, as
    MinHashLSH cuts the signature) and the user with an item of ``[settled, n)``: the
    ones LSH could propose as a candidate for a later item. Each band is hashed to 64
    bits with the user, vectorised; a collision only adds an item to visit."""
    codes = {u: n for n, u in enumerate(dict.fromkeys(users))}
    user = np.fromiter((codes[u] for u in users), np.uint64, count=len(users)) * np.uint64(0x9E3779B97F4A7C15)
    rng = np.random.default_rng(0)
    touched = np.zeros(settled, bool)
    with np.errstate(over="ignore"):
        for start, end in hashranges:
            mult = rng.integers(1, 2**63, size=end - start, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            h = (sigs[:, start:end].astype(np.uint64) * mult).sum(axis=1, dtype=np.uint64) ^ user
            touched |= np.isin(h[:settled], h[settled:])
    return np.flatnonzero(touched).tolist()
