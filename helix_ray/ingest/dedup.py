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
) -> list[tuple[int, int, float]]:
    """Return ``(dropped, kept, jaccard)`` index triples.

    ``preference[i]`` is a sortable key; the larger key wins a duplicate pair. Items are
    visited best first, so each dropped item points at a kept one (no chains). With
    ``texts``, each LSH candidate is confirmed by the exact Jaccard of the shingle sets
    (the 64-slot estimate alone has a standard error of about .05).
    """
    from datasketch import MinHash, MinHashLSH

    num_perm = sigs.shape[1] if sigs.ndim == 2 else 0
    order = sorted(range(len(users)), key=lambda i: preference[i], reverse=True)
    indexes: dict[str, MinHashLSH] = {}
    dropped: list[tuple[int, int, float]] = []
    for i in order:
        lsh = indexes.get(users[i])
        if lsh is None:
            # Bands tuned below the threshold: LSH only proposes candidates (missing a true
            # pair at J = .85 otherwise happens), the similarity check below decides.
            lsh = indexes[users[i]] = MinHashLSH(threshold=max(0.3, threshold - 0.2), num_perm=num_perm)
        mh = MinHash(num_perm=num_perm, hashvalues=sigs[i], scheme="affine32")
        best, best_sim = -1, -1.0
        for key in lsh.query(mh):
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
