"""Stage 3's near-duplicate search: against a deduplicated store, only the new items
and the old ones sharing an LSH band with them are visited, with the same answer."""

from __future__ import annotations

import numpy as np

from helix_ray.ingest.dedup import find_duplicates, signatures

WORDS = [f"w{i}" for i in range(400)]


def _corpus(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, 30)) for _ in range(n)]


def _near(text: str, rng: np.random.Generator) -> str:
    words = text.split()
    words[-1] = str(rng.choice(WORDS))  # one shingle of 28 changes: Jaccard ~.93
    return " ".join(words)


def test_settled_items_are_skipped_without_changing_the_answer():
    rng = np.random.default_rng(7)
    users = ["ann", "bo", "cy"]
    # The store: deduplicated as a generation is (its kept items only).
    pool = _corpus(rng, 600)
    pool += [_near(t, rng) for t in pool[:60]]
    pool_users = [users[i % 3] for i in range(600)] + [users[i % 3] for i in range(60)]
    pool_sigs = signatures(pool, num_perm=64, shingle=3)
    pool_pref = [(False, int(rng.integers(0, 10**6)), i) for i in range(len(pool))]
    gone = {i for i, _, _ in find_duplicates(pool_users, pool_sigs, pool_pref, threshold=0.8, texts=pool)}
    old = [i for i in range(len(pool)) if i not in gone]
    # New items: unrelated ones, near-copies of old items (some preferred, so the old
    # one is dropped, some not), one of the same text for another user, and a pair
    # among themselves.
    fresh_texts = _corpus(rng, 80)
    fresh_users = [users[i % 3] for i in range(80)]
    fresh_pref = [(False, int(rng.integers(0, 10**6)), 10**6 + i) for i in range(80)]
    for k, i in enumerate(old[:40]):
        fresh_texts.append(_near(pool[i], rng))
        fresh_users.append(pool_users[i] if k != 0 else "dee")  # another tenant: never a duplicate
        fresh_pref.append((k % 2 == 0, int(rng.integers(0, 10**6)), 2 * 10**6 + k))  # pinned: wins
    fresh_texts.append(_near(fresh_texts[0], rng))
    fresh_users.append(fresh_users[0])
    fresh_pref.append((False, -1, 3 * 10**6))

    texts = [pool[i] for i in old] + fresh_texts
    all_users = [pool_users[i] for i in old] + fresh_users
    sigs = np.concatenate([pool_sigs[old], signatures(fresh_texts, num_perm=64, shingle=3)])
    pref = [pool_pref[i] for i in old] + fresh_pref
    full = find_duplicates(all_users, sigs, pref, threshold=0.8, texts=texts)
    quick = find_duplicates(all_users, sigs, pref, threshold=0.8, texts=texts, settled=len(old))
    assert sorted(quick) == sorted(full)
    dropped = {i for i, _, _ in full}
    n_old = len(old)
    assert sum(1 for i in dropped if i < n_old) >= 15  # old items a preferred new one replaced
    assert sum(1 for i in dropped if i >= n_old) >= 8  # new items an old (or new) one kept out
    assert n_old + 80 + 40 in dropped  # the pair among the new items
    assert n_old + 80 not in dropped  # the other tenant's copy
    # Nothing new: nothing to visit.
    assert find_duplicates(all_users[:n_old], sigs[:n_old], pref[:n_old], threshold=0.8, settled=n_old) == []


def test_band_buckets_group_exactly_the_items_that_share_a_band_within_a_tenant():
    from helix_ray.ingest.dedup import band_buckets, lsh_bands

    rng = np.random.default_rng(3)
    texts = _corpus(rng, 300)
    texts += [_near(t, rng) for t in texts[:40]]  # near-copies: they share bands
    users = [("ann", "bo")[i % 2] for i in range(len(texts))]
    users[300] = "bo"  # texts[0] is ann's: its copy for another tenant shares no bucket with it
    sigs = signatures(texts, num_perm=64, shingle=3)
    bands = lsh_bands(64, 0.8)
    assert len(bands) > 1 and bands[-1][1] <= 64
    for settled in (0, 300):
        expected = set()  # pairs in one bucket: same tenant, same values in a band, one of them new
        for start, end in bands:
            groups: dict[tuple, list[int]] = {}
            for i in range(len(texts)):
                groups.setdefault((users[i], sigs[i, start:end].tobytes()), []).append(i)
            for members in groups.values():
                if len(members) > 1 and max(members) >= settled:
                    expected |= {(a, b) for a in members for b in members if a < b}
        got = {(int(a), int(b)) for g in band_buckets(users, sigs, settled, bands) for a in g for b in g if a < b}
        assert got == expected
        assert len(expected) >= 30 and (0, 300) not in expected
