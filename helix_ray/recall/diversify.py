"""Stage 7: diversity — near-duplicate removal, best chunks per document, then MMR.

1. Near-duplicates: walking the ranking, an item whose MinHash signature (computed at
   ingest) matches a kept item's at estimated Jaccard ≥ ``threshold`` is dropped.
2. At most ``max_per_document`` sections of one source document survive.
3. MMR (Carbonell & Goldstein 1998): repeatedly pick argmax λ·rel(i) − (1 − λ)·max_j
   cos(i, j) over picked j; rel is the ranking score min-max normalised.
   Session mode, for aggregation questions ("how many…", "list all…"): first the best
   item of each session (by rank), then MMR fills the rest.
"""

from __future__ import annotations

import re

import numpy as np

_AGGREGATE = re.compile(
    r"\b(how many|how often|list (all|every)|all the|every time|what are (all|the)|which .+s did|in total|"
    r"each time|summari[sz]e|over time|so far)\b",
    re.I,
)


def is_aggregation(query: str) -> bool:
    return bool(_AGGREGATE.search(query))


def drop_near_duplicates(order: list[int], signatures: np.ndarray, threshold: float) -> tuple[list[int], list[int]]:
    """(kept, dropped) indices, in order. ``signatures[i]`` belongs to item i."""
    kept: list[int] = []
    dropped: list[int] = []
    if not order:
        return kept, dropped
    sigs = np.asarray(signatures)
    # Estimated Jaccard of every pair at once (n × n), then one greedy pass.
    similar = (sigs[:, None, :] == sigs[None, :, :]).mean(axis=2) >= threshold
    for i in order:
        if kept and similar[i, kept].any():
            dropped.append(i)
        else:
            kept.append(i)
    return kept, dropped


def cap_per_document(order: list[int], documents: list[str | None], limit: int) -> tuple[list[int], list[int]]:
    """(kept, dropped) indices, in order: the first ``limit`` items of each source document
    (``documents[i]`` is item i's; an item without one is always kept)."""
    seen: dict[str, int] = {}
    kept: list[int] = []
    dropped: list[int] = []
    for i in order:
        doc = documents[i]
        if doc is None:
            kept.append(i)
            continue
        seen[doc] = seen.get(doc, 0) + 1
        (kept if seen[doc] <= limit else dropped).append(i)
    return kept, dropped


def mmr(candidates: list[int], relevance: np.ndarray, similarity: np.ndarray, lam: float, k: int,
        picked: list[int] | None = None) -> list[int]:
    """Greedy MMR over ``candidates`` (indices into relevance / similarity rows).

    ``similarity`` is the full pairwise matrix; ``picked`` are items already chosen.
    Ties go to the earlier candidate.
    """
    picked = list(picked or [])
    remaining = [c for c in candidates if c not in picked]
    while remaining and len(picked) < k:
        if picked:
            redundancy = similarity[np.ix_(remaining, picked)].max(axis=1)
        else:
            redundancy = np.zeros(len(remaining))
        gain = lam * relevance[remaining] - (1 - lam) * redundancy
        best = int(np.argmax(gain))
        picked.append(remaining.pop(best))
    return picked


def session_first(order: list[int], sessions: list[str | None], k: int) -> list[int]:
    """The best item of each session, in rank order, at most k."""
    seen: set[str] = set()
    picked = []
    for i in order:
        s = sessions[i]
        if s is not None and s not in seen:
            seen.add(s)
            picked.append(i)
            if len(picked) >= k:
                break
    return picked
