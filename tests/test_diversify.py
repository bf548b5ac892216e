"""Diversity (helix_ray.recall.diversify): MMR against a naive O(n²) reference, and the
near-duplicate, per-document and per-session steps on hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest

from helix_ray.recall import diversify


def naive_mmr(candidates, relevance, similarity, lam, k, picked=None):
    """Carbonell & Goldstein 1998, written out: argmax λ·rel(i) − (1 − λ)·max_j sim(i, j)
    over the picked j (0 before the first pick); ties go to the earlier candidate."""
    picked = list(picked or [])
    remaining = [c for c in candidates if c not in picked]
    while remaining and len(picked) < k:
        best, best_gain = None, -float("inf")
        for c in remaining:
            redundancy = max(float(similarity[c, j]) for j in picked) if picked else 0.0
            gain = lam * float(relevance[c]) - (1 - lam) * redundancy
            if gain > best_gain:
                best, best_gain = c, gain
        picked.append(best)
        remaining.remove(best)
    return picked


def random_case(seed: int, n: int, dim: int = 8, ties: bool = False):
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(n, dim))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    similarity = vectors @ vectors.T
    relevance = rng.random(n)
    if ties:  # coarse values make equal gains common, so the tie rule is exercised
        relevance = np.round(relevance, 1)
        similarity = np.round(similarity, 1)
    candidates = rng.permutation(n).tolist()  # not sorted: "earlier" means earlier in this list
    return candidates, relevance, similarity


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 0.7, 1.0])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 1), (7, 3), (7, 7), (7, 10), (20, 5), (33, 12)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mmr_equals_naive(lam, n, k, seed):
    candidates, relevance, similarity = random_case(seed, n)
    got = diversify.mmr(candidates, relevance, similarity, lam, k)
    assert got == naive_mmr(candidates, relevance, similarity, lam, k)
    assert len(got) == min(k, n) and len(set(got)) == len(got)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(5))
def test_mmr_equals_naive_with_ties(lam, seed):
    candidates, relevance, similarity = random_case(100 + seed, 9, ties=True)
    assert diversify.mmr(candidates, relevance, similarity, lam, 6) == naive_mmr(
        candidates, relevance, similarity, lam, 6)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_mmr_with_prepicked_items(lam):
    candidates, relevance, similarity = random_case(7, 11)
    seed = candidates[3:5]
    got = diversify.mmr(candidates, relevance, similarity, lam, 6, picked=seed)
    assert got[:2] == seed
    assert got == naive_mmr(candidates, relevance, similarity, lam, 6, picked=seed)


def test_mmr_lambda_one_is_relevance_order():
    relevance = np.array([0.2, 0.9, 0.5, 0.9])
    similarity = np.ones((4, 4))
    # 1 and 3 tie at 0.9: the earlier candidate (1) wins.
    assert diversify.mmr([0, 1, 2, 3], relevance, similarity, 1.0, 4) == [1, 3, 2, 0]


def test_mmr_hand_computed_tradeoff():
    # Items 0 and 1 are near copies; 2 is different and a little less relevant.
    relevance = np.array([1.0, 0.95, 0.8])
    similarity = np.array([[1.0, 0.99, 0.1], [0.99, 1.0, 0.1], [0.1, 0.1, 1.0]])
    # λ=0.5, after picking 0: gain(1) = .5·.95 − .5·.99 = −0.02; gain(2) = .5·.8 − .5·.1 = 0.35.
    assert diversify.mmr([0, 1, 2], relevance, similarity, 0.5, 2) == [0, 2]
    # λ=1: relevance only.
    assert diversify.mmr([0, 1, 2], relevance, similarity, 1.0, 2) == [0, 1]
    # λ=0: the first pick is the first candidate (all gains 0), then the least similar.
    assert diversify.mmr([1, 0, 2], relevance, similarity, 0.0, 2) == [1, 2]


def test_mmr_empty_candidates():
    assert diversify.mmr([], np.zeros(0), np.zeros((0, 0)), 0.5, 3) == []


def test_drop_near_duplicates():
    signatures = np.array([
        [1, 2, 3, 4, 5],
        [1, 2, 3, 4, 9],  # 4/5 = 0.8 agreement with item 0
        [1, 2, 7, 8, 9],  # 2/5 with 0, 3/5 with 1
        [6, 6, 6, 6, 6],
    ], dtype=np.uint32)
    kept, dropped = diversify.drop_near_duplicates([0, 1, 2, 3], signatures, 0.8)
    assert (kept, dropped) == ([0, 2, 3], [1])
    # Walking in another order keeps the earlier one of the pair.
    assert diversify.drop_near_duplicates([1, 0, 2, 3], signatures, 0.8) == ([1, 2, 3], [0])
    # Just above the agreement: nothing is a duplicate.
    assert diversify.drop_near_duplicates([0, 1, 2, 3], signatures, 0.81) == ([0, 1, 2, 3], [])


def test_cap_per_document():
    docs = ["a.md", "a.md", None, "b.md", "a.md", None, "b.md"]
    kept, dropped = diversify.cap_per_document([0, 1, 2, 3, 4, 5, 6], docs, 2)
    assert kept == [0, 1, 2, 3, 5, 6] and dropped == [4]
    kept, dropped = diversify.cap_per_document([4, 3, 2, 1, 0], docs, 1)
    assert kept == [4, 3, 2] and dropped == [1, 0]


def test_session_first():
    sessions = ["s1", "s1", None, "s2", "s3", "s2"]
    assert diversify.session_first([0, 1, 2, 3, 4, 5], sessions, 10) == [0, 3, 4]
    assert diversify.session_first([5, 1, 0, 3, 4], sessions, 2) == [5, 1]


@pytest.mark.parametrize(("query", "aggregate"), [
    ("how many times did the deploy fail", True),
    ("list all the incidents this year", True),
    ("summarize our database decisions", True),
    ("why did we pick NATS over Kafka?", False),
    ("how do I rotate the API keys", False),
])
def test_is_aggregation(query, aggregate):
    assert diversify.is_aggregation(query) is aggregate
