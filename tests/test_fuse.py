"""Reciprocal Rank Fusion (helix_ray.recall.fuse.rrf) on hand-computed lists.

score(d) = Σ_i w_i / (k + rank_i(d)), ranks 1-based; ties break by the smaller row id.
"""

from __future__ import annotations

import numpy as np
import pytest

from helix_ray.config import RetrievalConfig, load_config
from helix_ray.errors import InvalidArgument
from helix_ray.recall import fuse

# Three lists over rows 10..50 (best first):
#   a: 10, 20, 30
#   b: 30, 10, 40
#   c: 20, 30, 50
THREE = {"a": [10, 20, 30], "b": [30, 10, 40], "c": [20, 30, 50]}


def test_three_lists_hand_computed():
    fused = fuse.rrf(THREE, k=60)
    expected = {
        30: 1 / (60 + 3) + 1 / (60 + 1) + 1 / (60 + 2),  # a#3, b#1, c#2
        10: 1 / (60 + 1) + 1 / (60 + 2),  # a#1, b#2
        20: 1 / (60 + 2) + 1 / (60 + 1),  # a#2, c#1 — same total as 10: tie
        40: 1 / (60 + 3),  # b#3
        50: 1 / (60 + 3),  # c#3 — same total as 40: tie
    }
    # 30 leads; the ties 10/20 and 40/50 break by the smaller row id.
    assert fused.rows.tolist() == [30, 10, 20, 40, 50]
    assert fused.rows.dtype == np.int64
    np.testing.assert_allclose(fused.scores, [expected[r] for r in fused.rows], rtol=0, atol=1e-15)
    # Per-list 1-based rank of each fused row, 0 where the list does not hold it.
    assert fused.ranks["a"].tolist() == [3, 1, 2, 0, 0]
    assert fused.ranks["b"].tolist() == [1, 2, 0, 3, 0]
    assert fused.ranks["c"].tolist() == [2, 0, 1, 0, 3]


def test_rank_base_is_one():
    """Rank 1 alone with k=60 scores exactly 1/61 (a 0-based rank would give 1/60)."""
    fused = fuse.rrf({"only": [7]}, k=60)
    assert fused.rows.tolist() == [7]
    assert fused.scores[0] == 1 / 61
    assert fuse.rrf({"only": [7, 8]}, k=1).scores.tolist() == [1 / 2, 1 / 3]


def test_k_changes_the_curve():
    # k=10: a#1 → 1/11, a#2 → 1/12.
    fused = fuse.rrf({"a": [1, 2]}, k=10)
    assert fused.scores.tolist() == [1 / 11, 1 / 12]


def test_per_list_weights():
    fused = fuse.rrf({"dense": [1, 2], "bm25": [2, 3]}, k=60, weights={"dense": 2.0, "bm25": 0.5})
    expected = {
        1: 2.0 / 61,  # dense#1                       = 0.03279
        2: 2.0 / 62 + 0.5 / 61,  # dense#2 + bm25#1   = 0.04046
        3: 0.5 / 62,  # bm25#2                        = 0.00806
    }
    assert fused.rows.tolist() == [2, 1, 3]
    np.testing.assert_allclose(fused.scores, [expected[r] for r in fused.rows], rtol=0, atol=1e-15)


def test_weights_reorder_the_lists():
    # Unweighted, 1 and 2 tie (1/61 + 1/62 each) and 1 wins by row id; weighting list b
    # by 3 makes its first item, 2, win: 3/61 + 1/62 > 1/61 + 3/62.
    lists = {"a": [1, 2], "b": [2, 1]}
    assert fuse.rrf(lists).rows.tolist() == [1, 2]
    fused = fuse.rrf(lists, weights={"b": 3.0})
    assert fused.rows.tolist() == [2, 1]
    np.testing.assert_allclose(fused.scores, [1 / 62 + 3 / 61, 1 / 61 + 3 / 62], rtol=0, atol=1e-15)


def test_missing_weight_defaults_to_one():
    assert fuse.rrf({"a": [5]}, weights={"other": 9.0}).scores.tolist() == [1 / 61]


def test_weight_zero_list_contributes_nothing():
    fused = fuse.rrf({"dense": [1, 2], "bm25": [3, 1]}, weights={"dense": 1.0, "bm25": 0.0})
    assert fused.rows.tolist() == [1, 2]  # 3 exists only in the zero-weight list
    assert fused.scores.tolist() == [1 / 61, 1 / 62]


@pytest.mark.parametrize("k", [0, -1, -60])
def test_k_not_positive_is_rejected(k):
    with pytest.raises(ValueError, match=rf"k={k}\b") as info:
        fuse.rrf({"a": [1]}, k=k)
    assert "k > 0" in str(info.value)


def test_config_rejects_k_zero_naming_k():
    with pytest.raises(InvalidArgument) as info:
        load_config(RetrievalConfig, overrides={"fusion": {"k": 0}})
    message = str(info.value)
    assert "fusion.k" in message and "got 0" in message


def test_top_rank_bonus():
    fused = fuse.rrf({"a": [1, 2, 3, 4]}, k=60, top_rank_bonus=True)
    assert fused.rows.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(
        fused.scores,
        [1 / 61 + 0.05, 1 / 62 + 0.02, 1 / 63 + 0.02, 1 / 64],  # +0.05 rank 1, +0.02 ranks 2–3, none at 4
        rtol=0, atol=1e-15,
    )
    assert fuse.TOP1_BONUS == 0.05 and fuse.TOP3_BONUS == 0.02


def test_top_rank_bonus_counts_the_best_rank_once():
    # Row 1 is 1st in a and 3rd in b: one +0.05 (its best rank), not +0.05 + 0.02.
    # Row 2 is 2nd in a and 1st in b: +0.05. Row 3 is 4th at best: no bonus.
    fused = fuse.rrf({"a": [1, 2, 9, 3], "b": [2, 8, 1]}, top_rank_bonus=True)
    score = dict(zip(fused.rows.tolist(), fused.scores.tolist()))
    assert score[1] == pytest.approx(1 / 61 + 1 / 63 + 0.05, abs=1e-15)
    assert score[2] == pytest.approx(1 / 62 + 1 / 61 + 0.05, abs=1e-15)
    assert score[3] == pytest.approx(1 / 64, abs=1e-15)
    assert score[8] == pytest.approx(1 / 62 + 0.02, abs=1e-15)
    assert score[9] == pytest.approx(1 / 63 + 0.02, abs=1e-15)


def test_top_rank_bonus_ignores_zero_weight_lists():
    fused = fuse.rrf({"a": [1], "b": [2, 1]}, weights={"b": 0.0}, top_rank_bonus=True)
    assert fused.rows.tolist() == [1]
    assert fused.scores.tolist() == [1 / 61 + 0.05]


def test_top_rank_bonus_is_scaled_by_a_list_weight_below_one():
    # b (weight 0.4) ranks 2 first: its bonus is 0.4 × 0.05; a's rank-2 bonus 0.02 is larger
    # than 0.4 × 0.02 for row 1 (3rd in b), so the best earned bonus counts once.
    fused = fuse.rrf({"a": [7, 1], "b": [2, 8, 1]}, weights={"b": 0.4}, top_rank_bonus=True)
    score = dict(zip(fused.rows.tolist(), fused.scores.tolist()))
    assert score[2] == pytest.approx(0.4 / 61 + 0.4 * 0.05, abs=1e-15)
    assert score[1] == pytest.approx(1 / 62 + 0.4 / 63 + 0.02, abs=1e-15)
    assert score[7] == pytest.approx(1 / 61 + 0.05, abs=1e-15)
    assert score[8] == pytest.approx(0.4 / 62 + 0.4 * 0.02, abs=1e-15)
    # A weight above 1 does not scale the bonus up.
    heavy = fuse.rrf({"a": [5]}, weights={"a": 3.0}, top_rank_bonus=True)
    assert heavy.scores.tolist() == [pytest.approx(3 / 61 + 0.05, abs=1e-15)]


def test_empty_lists():
    fused = fuse.rrf({"a": [], "b": []})
    assert len(fused.rows) == 0 and len(fused.scores) == 0
    assert fused.ranks["a"].tolist() == []


def test_numpy_input_rows():
    fused = fuse.rrf({"a": np.array([3, 1], dtype=np.int64), "b": np.array([1], dtype=np.int64)})
    assert fused.rows.tolist() == [1, 3]
    np.testing.assert_allclose(fused.scores, [1 / 62 + 1 / 61, 1 / 61], rtol=0, atol=1e-15)
