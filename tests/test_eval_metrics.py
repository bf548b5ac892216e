"""Hand-computed cases for helix_ray.eval.metrics."""

from __future__ import annotations

import math

import pytest

from helix_ray.eval.metrics import (
    evaluate_ranking,
    hit_at_k,
    mean,
    mrr_at_k,
    ndcg_at_k,
    paired_difference,
    recall_all_at_k,
    recall_any_at_k,
    recall_at_k,
    summarise,
)

L3, L4, L5, L6 = math.log2(3), math.log2(4), math.log2(5), math.log2(6)

GOLD3 = {"g1", "g2", "g3"}
RANKED = ["g1", "x", "g2", "y", "g3"]


@pytest.mark.parametrize(
    ("k", "fractional", "any_", "all_"),
    [
        (1, 1 / 3, 1.0, 0.0),  # top-1 = {g1}
        (2, 1 / 3, 1.0, 0.0),  # top-2 = {g1, x}
        (3, 2 / 3, 1.0, 0.0),  # top-3 = {g1, x, g2}
        (4, 2 / 3, 1.0, 0.0),
        (5, 1.0, 1.0, 1.0),  # all three gold ids retrieved
    ],
)
def test_recall_variants_on_three_gold_query(k: int, fractional: float, any_: float, all_: float) -> None:
    assert recall_at_k(RANKED, GOLD3, k) == pytest.approx(fractional)
    assert recall_any_at_k(RANKED, GOLD3, k) == any_
    assert hit_at_k(RANKED, GOLD3, k) == any_
    assert recall_all_at_k(RANKED, GOLD3, k) == all_


def test_no_gold_retrieved_scores_zero() -> None:
    ranked = ["a", "b", "c"]
    for metric in (recall_at_k, recall_any_at_k, recall_all_at_k, ndcg_at_k, mrr_at_k):
        assert metric(ranked, GOLD3, 3) == 0.0


def test_ndcg_binary_several_gold_by_hand() -> None:
    # ranked = [x, g1, y, g2, g3], gold = {g1, g2, g3}, k = 5
    # DCG  = 1/log2(3) + 1/log2(5) + 1/log2(6) = 0.63093 + 0.43068 + 0.38685 = 1.44846
    # IDCG = 1/log2(2) + 1/log2(3) + 1/log2(4) = 1 + 0.63093 + 0.5          = 2.13093
    # NDCG = 1.44846 / 2.13093 = 0.67973
    ranked = ["x", "g1", "y", "g2", "g3"]
    expected = (1 / L3 + 1 / L5 + 1 / L6) / (1 + 1 / L3 + 1 / L4)
    assert ndcg_at_k(ranked, GOLD3, 5) == pytest.approx(expected)
    assert ndcg_at_k(ranked, GOLD3, 5) == pytest.approx(0.679731, abs=1e-6)
    # k = 2: DCG = 1/log2(3); IDCG uses only 2 ideal items = 1 + 1/log2(3)
    assert ndcg_at_k(ranked, GOLD3, 2) == pytest.approx((1 / L3) / (1 + 1 / L3))


def test_ndcg_graded_by_hand() -> None:
    # grades a=3, b=1, c=0 (c is not relevant); ranked [b, c, a], k=3
    # DCG  = 1/log2(2) + 0 + 3/log2(4) = 1 + 1.5 = 2.5
    # IDCG = 3/log2(2) + 1/log2(3)     = 3 + 0.63093 = 3.63093
    # NDCG = 2.5 / 3.63093 = 0.68853
    graded = {"a": 3, "b": 1, "c": 0}
    assert ndcg_at_k(["b", "c", "a"], graded, 3) == pytest.approx(0.688529, abs=1e-6)
    assert ndcg_at_k(["a", "b", "c"], graded, 3) == pytest.approx(1.0)
    # recall on a graded mapping counts ids with grade > 0 only
    assert recall_at_k(["c"], graded, 1) == 0.0
    assert recall_at_k(["b", "c", "a"], graded, 3) == 1.0


def test_ndcg_more_gold_than_k_uses_k_ideal_items() -> None:
    # gold {a, b, c}, ranked [a, b], k=2 -> DCG = IDCG = 1 + 1/log2(3) -> 1.0
    assert ndcg_at_k(["a", "b"], {"a", "b", "c"}, 2) == pytest.approx(1.0)
    # k=3: IDCG = 1 + 1/log2(3) + 1/log2(4) = 2.13093; DCG = 1.63093 -> 0.76536
    assert ndcg_at_k(["a", "b"], {"a", "b", "c"}, 3) == pytest.approx(0.765361, abs=1e-6)


def test_duplicates_count_once_and_use_their_slot() -> None:
    ranked = ["a", "a", "b"]
    gold = {"a", "b"}
    # k=2: slots [a, a] -> only a found
    assert recall_at_k(ranked, gold, 2) == 0.5
    assert recall_all_at_k(ranked, gold, 2) == 0.0
    # DCG = 1 (the repeated a earns nothing); IDCG = 1 + 1/log2(3)
    assert ndcg_at_k(ranked, gold, 2) == pytest.approx(1 / (1 + 1 / L3))
    # k=3: DCG = 1 + 1/log2(4) = 1.5; IDCG = 1.63093 -> 0.91972
    assert recall_at_k(ranked, gold, 3) == 1.0
    assert ndcg_at_k(ranked, gold, 3) == pytest.approx(0.919721, abs=1e-6)
    # duplicated gold never pushes NDCG above 1
    assert ndcg_at_k(["a", "a", "a"], {"a"}, 3) == pytest.approx(1.0)
    # MRR uses the first relevant slot
    assert mrr_at_k(["x", "x", "a", "a"], {"a"}, 4) == pytest.approx(1 / 3)


def test_order_among_gold_items_does_not_matter_for_binary_gold() -> None:
    # two gold ids swapped (a tie in relevance) give identical scores
    first, second = ["g2", "g1", "x"], ["g1", "g2", "x"]
    for metric in (recall_at_k, recall_all_at_k, ndcg_at_k, mrr_at_k):
        assert metric(first, {"g1", "g2"}, 2) == metric(second, {"g1", "g2"}, 2)


def test_k_larger_than_ranked_list() -> None:
    ranked = ["x", "a"]
    gold = {"a", "b"}
    assert recall_at_k(ranked, gold, 10) == 0.5
    assert recall_any_at_k(ranked, gold, 10) == 1.0
    assert recall_all_at_k(ranked, gold, 10) == 0.0
    assert mrr_at_k(ranked, gold, 10) == 0.5
    # DCG = 1/log2(3); IDCG = 1 + 1/log2(3) (only 2 gold) -> 0.38685
    assert ndcg_at_k(ranked, gold, 10) == pytest.approx(0.386853, abs=1e-6)
    assert recall_at_k([], gold, 5) == 0.0


def test_mrr_respects_cutoff() -> None:
    ranked = ["x", "y", "a"]
    assert mrr_at_k(ranked, {"a"}, 3) == pytest.approx(1 / 3)
    assert mrr_at_k(ranked, {"a"}, 2) == 0.0
    assert mrr_at_k(ranked, {"x", "a"}, 1) == 1.0


@pytest.mark.parametrize("metric", [recall_at_k, recall_any_at_k, recall_all_at_k, ndcg_at_k, mrr_at_k])
def test_empty_gold_raises(metric) -> None:
    with pytest.raises(ValueError, match="excluded by the loader"):
        metric(["a"], set(), 1)
    with pytest.raises(ValueError, match="excluded by the loader"):
        metric(["a"], {"a": 0, "b": -1}, 1)  # no grade > 0


@pytest.mark.parametrize("metric", [recall_at_k, recall_any_at_k, recall_all_at_k, ndcg_at_k, mrr_at_k])
@pytest.mark.parametrize("k", [0, -3, True, 2.0, "5"])
def test_bad_k_raises(metric, k) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        metric(["a"], {"a"}, k)


def test_bare_strings_rejected() -> None:
    with pytest.raises(ValueError, match="list of ids"):
        recall_at_k("abc", {"a"}, 2)
    with pytest.raises(ValueError, match="set of ids"):
        recall_at_k(["a"], "a", 2)
    with pytest.raises(ValueError, match="non-finite"):
        ndcg_at_k(["a"], {"a": float("nan")}, 1)


def test_evaluate_ranking_row() -> None:
    row = evaluate_ranking(RANKED, GOLD3, ks=(1, 5))
    assert set(row) == {
        f"{m}@{k}" for m in ("recall", "recall_any", "recall_all", "ndcg", "mrr") for k in (1, 5)
    }
    assert row["recall@1"] == pytest.approx(1 / 3)
    assert row["recall_all@5"] == 1.0
    assert row["mrr@5"] == 1.0
    with pytest.raises(ValueError, match="at least one cut-off"):
        evaluate_ranking(RANKED, GOLD3, ks=())


def test_mean() -> None:
    assert mean([1.0, 0.0, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no values"):
        mean([])
    with pytest.raises(ValueError, match="non-finite"):
        mean([1.0, float("inf")])


def test_summarise_per_category() -> None:
    rows = [
        {"id": "q1", "category": "1", "recall@5": 1.0, "mrr@5": 1.0},
        {"id": "q2", "category": "1", "recall@5": 0.5, "mrr@5": 0.5},
        {"id": "q3", "category": "2", "recall@5": 0.0, "mrr@5": 0.0},
        {"id": "q4", "category": "4", "recall@5": 1 / 3, "mrr@5": 0.25},
    ]
    out = summarise(rows)
    assert out["n"] == 4
    assert set(out["means"]) == {"recall@5", "mrr@5"}  # "id" is not numeric, "category" is the group
    assert out["means"]["recall@5"] == pytest.approx((1.0 + 0.5 + 0.0 + 1 / 3) / 4)
    assert out["means"]["mrr@5"] == pytest.approx(1.75 / 4)
    assert list(out["groups"]) == ["1", "2", "4"]
    assert out["groups"]["1"] == {"n": 2, "means": {"recall@5": 0.75, "mrr@5": 0.75}}
    assert out["groups"]["2"]["n"] == 1
    assert out["groups"]["4"]["means"]["recall@5"] == pytest.approx(1 / 3)


def test_summarise_other_group_key_and_missing_group() -> None:
    rows = [{"split": "a", "ndcg@10": 0.2}, {"ndcg@10": 0.4}]
    out = summarise(rows, group_key="split")
    assert out["groups"]["a"] == {"n": 1, "means": {"ndcg@10": 0.2}}
    assert out["groups"][None] == {"n": 1, "means": {"ndcg@10": 0.4}}
    assert summarise(rows, group_key="split", metrics=["ndcg@10"])["means"] == {"ndcg@10": pytest.approx(0.3)}


def test_summarise_errors() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        summarise([])
    with pytest.raises(ValueError, match="row 1"):
        summarise([{"category": "1", "recall@5": 1.0}, {"category": "1"}])
    with pytest.raises(ValueError, match="no numeric values"):
        summarise([{"category": "1", "id": "q"}])


# ----------------------------------------------------------------------------- paired comparison


def test_paired_difference_by_hand_exact_sign_flips() -> None:
    # d = [1, 0, 1]: of the 8 sign assignments, the four with d0 and d2 of equal sign
    # reach |mean| = 2/3 (the zero's sign does not matter): p = 4/8.
    out = paired_difference([1, 0, 1], [0, 0, 0])
    assert out["n"] == 3
    assert out["delta"] == pytest.approx(2 / 3)
    assert out["p"] == pytest.approx(0.5)
    assert 0.0 <= out["ci95"][0] <= out["delta"] <= out["ci95"][1] <= 1.0
    # Five wins of 1: only all-plus and all-minus are as extreme, 2 of 32.
    five = paired_difference([1] * 5, [0] * 5)
    assert five["p"] == pytest.approx(2 / 32)
    assert five["ci95"] == [1.0, 1.0]


def test_paired_difference_ties_and_symmetry() -> None:
    same = paired_difference([0.2, 0.5, 1.0], [0.2, 0.5, 1.0])
    assert same == {"n": 3, "delta": 0.0, "ci95": [0.0, 0.0], "p": 1.0}
    a, b = [0.9, 0.1, 0.4, 0.7, 0.3], [0.5, 0.3, 0.4, 0.2, 0.1]
    ab, ba = paired_difference(a, b), paired_difference(b, a)
    assert ab["delta"] == pytest.approx(-ba["delta"]) == pytest.approx(0.18)
    assert ab["p"] == pytest.approx(ba["p"])
    assert ab["ci95"] == pytest.approx([-ba["ci95"][1], -ba["ci95"][0]])


def test_paired_difference_sampled_for_many_queries() -> None:
    # 40 queries, all won by A: the exact p is 2 / 2^40; sampled, it is 1 / (resamples + 1).
    out = paired_difference([1.0] * 40, [0.0] * 40, resamples=2000)
    assert out["p"] == pytest.approx(1 / 2001)
    # A difference that is noise: half the queries +1, half −1.
    noise = paired_difference([1.0, 0.0] * 20, [0.0, 1.0] * 20, resamples=2000)
    assert noise["delta"] == 0.0 and noise["p"] > 0.9
    assert noise["ci95"][0] < 0 < noise["ci95"][1]
    assert paired_difference([1.0, 0.0] * 20, [0.0, 1.0] * 20, resamples=2000) == noise  # seeded


def test_paired_difference_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError, match="same queries"):
        paired_difference([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="same queries"):
        paired_difference([], [])
    with pytest.raises(ValueError, match="non-finite"):
        paired_difference([float("nan")], [0.0])
