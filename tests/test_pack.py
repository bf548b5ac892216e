"""Token-budgeted packing (helix_ray.recall.pack) with the real cl100k encoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_ray import tokens
from helix_ray.recall import pack

count = tokens.token_counter()


def items_of(token_counts: list[int]) -> list[pack.PackItem]:
    return [pack.PackItem(row=i, text=f"item {i}", n_tokens=n) for i, n in enumerate(token_counts)]


# Final order as 1-based ranks: rank 1 first, rank 2 last, rank 3 second, rank 4
# second to last, ...
LITM = {
    1: [1],
    2: [1, 2],
    3: [1, 3, 2],
    4: [1, 3, 4, 2],
    5: [1, 3, 5, 4, 2],
    6: [1, 3, 5, 6, 4, 2],
}


@pytest.mark.parametrize("n", sorted(LITM))
def test_lost_in_the_middle_order(n):
    packed = pack.pack(items_of([10] * n), budget=1000)
    assert [p.rank for p in packed] == LITM[n]
    assert [p.row for p in packed] == [r - 1 for r in LITM[n]]
    assert [i + 1 for i in pack.litm_order(n)] == LITM[n]
    assert not any(p.truncated for p in packed)


def test_greedy_skips_what_does_not_fit_and_keeps_filling():
    # budget 50, separator 2: 20+2 → 22; 40+2 would make 64 (skip); 10+2 → 34;
    # 15+2 → 51 (skip); 14+2 → 50 (exactly full); 1+2 → 53 (skip).
    packed = pack.pack(items_of([20, 40, 10, 15, 14, 1]), budget=50, separator_tokens=2)
    assert sorted(p.rank for p in packed) == [1, 3, 5]
    assert [p.rank for p in packed] == [1, 5, 3]  # lost-in-the-middle over the packed three
    assert sum(p.n_tokens + 2 for p in packed) == 50


@pytest.mark.parametrize("budget", [0, -1, -512])
def test_budget_not_positive_raises(budget):
    with pytest.raises(ValueError, match=rf"budget={budget}\b") as info:
        pack.pack(items_of([1]), budget)
    assert "positive" in str(info.value)


def test_item_larger_than_budget_is_cut_at_a_token_boundary():
    text = " ".join(f"word{i}" for i in range(400))
    assert count(text) > 100
    packed = pack.pack([pack.PackItem(0, text, count(text))], budget=40, separator_tokens=2)
    assert len(packed) == 1
    cut = packed[0]
    assert cut.truncated and cut.rank == 1
    assert cut.n_tokens == count(cut.text) <= 38  # room = budget − separator
    assert cut.n_tokens + 2 <= 40
    assert text.startswith(cut.text)
    # The cut lands on a token boundary: it is exactly the first n tokens of the text.
    enc = tokens.encoding()
    assert enc.encode(cut.text) == enc.encode(text)[: cut.n_tokens]


def test_oversized_first_item_then_nothing_else_fits():
    big = " ".join(["alpha"] * 200)
    items = [pack.PackItem(0, big, count(big)), pack.PackItem(1, "tiny", 1)]
    packed = pack.pack(items, budget=30)
    assert [p.row for p in packed] == [0]  # the cut fills the room; the next item has none
    assert packed[0].truncated and packed[0].n_tokens <= 30


def test_oversized_item_after_a_packed_one_is_skipped_not_cut():
    big = " ".join(["alpha"] * 200)
    items = [pack.PackItem(0, "small one", 2), pack.PackItem(1, big, count(big)), pack.PackItem(2, "x", 1)]
    packed = pack.pack(items, budget=30)
    assert sorted(p.row for p in packed) == [0, 2]
    assert not any(p.truncated for p in packed)


@pytest.mark.parametrize("budget", [3, 4, 7, 10])
def test_cut_of_multibyte_text_reencodes_within_budget(budget):
    text = "🎉" * 50 + "日本語のテキスト" * 10  # 3 tokens per emoji: cuts can split a character
    packed = pack.pack([pack.PackItem(0, text, count(text))], budget=budget)
    assert len(packed) == 1 and packed[0].truncated
    assert count(packed[0].text) == packed[0].n_tokens <= budget


def test_cut_of_multibyte_text_is_a_prefix():
    text = "🎉" * 50
    packed = pack.pack([pack.PackItem(0, text, count(text))], budget=4)  # 4 tokens = 1⅓ emoji
    assert "\ufffd" not in packed[0].text
    assert text.startswith(packed[0].text)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    token_counts=st.lists(st.integers(1, 400), min_size=0, max_size=12),  # a memory has text
    budget=st.integers(1, 600),
    separator=st.integers(0, 4),
)
def test_budget_is_never_exceeded(token_counts, budget, separator):
    # Texts whose real token count is the declared one, so a cut item is cut for real.
    items = [pack.PackItem(i, "a" + " a" * (n - 1), n) for i, n in enumerate(token_counts)]
    assert all(count(it.text) == it.n_tokens for it in items)
    packed = pack.pack(items, budget, separator_tokens=separator)

    assert sum(p.n_tokens + separator for p in packed) <= budget
    assert len({p.row for p in packed}) == len(packed)
    assert all(items[p.rank - 1].row == p.row for p in packed)  # rank is the 1-based input position
    for p in packed:
        assert count(p.text) == p.n_tokens
        if p.truncated:
            assert p.rank == 1
            assert items[0].n_tokens + separator > budget
        else:
            assert p.text == items[p.row].text
    # Order: lost in the middle over the packed ranks.
    ranks = sorted(p.rank for p in packed)
    assert [p.rank for p in packed] == [ranks[i] for i in pack.litm_order(len(ranks))]
    # Greedy: every skipped item truly did not fit when its turn came.
    used = 0
    chosen = {p.rank for p in packed}
    for rank, it in enumerate(items, start=1):
        if rank in chosen:
            used += next(p.n_tokens for p in packed if p.rank == rank) + separator
        else:
            assert used + it.n_tokens + separator > budget


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(text=st.text(min_size=1, max_size=300), budget=st.integers(1, 40))
def test_cut_of_any_text_reencodes_within_budget(text, budget):
    n = count(text)
    packed = pack.pack([pack.PackItem(0, text, n)], budget=budget)
    if n <= budget:
        assert [p.text for p in packed] == [text] and not packed[0].truncated
    else:
        assert len(packed) == 1 and packed[0].truncated
        assert count(packed[0].text) == packed[0].n_tokens <= budget
