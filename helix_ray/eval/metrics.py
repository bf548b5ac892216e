"""Ranking metrics for retrieval evaluation: one ranked list against one gold set.

Conventions shared by every metric here:

* ``ranked`` is a list of retrieved ids, best first. Position ``i`` (1-based) is
  the ``i``-th slot the consumer sees; ``top-k`` means the first ``k`` slots.
* An id repeated in ``ranked`` counts once, at its first occurrence: a later
  copy still occupies its slot but earns nothing (a retriever that returns
  duplicates wastes budget rather than being rewarded for it).
* ``k`` larger than ``len(ranked)`` is allowed: missing slots earn nothing.
* ``gold`` is a set of relevant ids, or a mapping ``id -> graded relevance``
  where only grades ``> 0`` count as relevant. A query with no relevant id
  cannot be scored; loaders must exclude it, so the metrics raise
  :class:`ValueError` instead of returning 0 or 1.
* Every metric returns a float in ``[0, 1]`` (unitless).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Union

from helix_ray.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: A gold set (binary relevance) or a graded-relevance mapping ``id -> grade``.
Gold = Union[Collection[str], Mapping[str, float]]

__all__ = [
    "Gold",
    "evaluate_ranking",
    "hit_at_k",
    "mean",
    "mrr_at_k",
    "ndcg_at_k",
    "paired_difference",
    "recall_all_at_k",
    "recall_any_at_k",
    "recall_at_k",
    "summarise",
]


# --------------------------------------------------------------------------- helpers


def _check_k(k: int) -> int:
    """Return ``k`` if it is a positive int (not bool), else raise ``InvalidArgument``."""
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise InvalidArgument(
            "k", k, "k must be a positive integer (the number of top slots scored)", "Pass k >= 1."
        )
    return k


def _check_ranked(ranked: Sequence[str]) -> Sequence[str]:
    """Reject a bare string (it would be scored character by character)."""
    if isinstance(ranked, (str, bytes)):
        raise InvalidArgument(
            "ranked",
            ranked,
            "ranked must be a list of ids, best first",
            "Wrap a single id in a list: [id].",
        )
    return ranked


def _grades(gold: Gold) -> dict[str, float]:
    """Relevant ids with their gain (1.0 for a plain set); grades <= 0 are dropped.

    Raises ValueError if ``gold`` is a bare string, holds a non-finite grade, or
    has no relevant id left.
    """
    if isinstance(gold, (str, bytes)):
        raise InvalidArgument(
            "gold",
            gold,
            "gold must be a set of ids or a mapping id -> grade",
            "Wrap a single id in a set: {id}.",
        )
    if isinstance(gold, Mapping):
        grades: dict[str, float] = {}
        for doc_id, grade in gold.items():
            value = float(grade)
            if not math.isfinite(value):
                raise ValueError(
                    f"Got a non-finite relevance grade {grade!r} for id {doc_id!r}; grades must be "
                    "finite numbers (> 0 means relevant). Fix the qrels before scoring."
                )
            if value > 0:
                grades[doc_id] = value
    else:
        grades = {doc_id: 1.0 for doc_id in gold}
    if not grades:
        raise ValueError(
            f"Got an empty gold set (received {gold!r}); every scored query needs at least one "
            "relevant id. A query without gold must be excluded by the loader, not scored."
        )
    return grades


def _first_occurrences(ranked: Sequence[str], k: int) -> list[tuple[int, str]]:
    """``(rank, id)`` pairs for the first ``k`` slots, 1-based, skipping repeated ids."""
    seen: set[str] = set()
    out: list[tuple[int, str]] = []
    for rank, doc_id in enumerate(ranked[:k], start=1):
        if doc_id in seen:
            continue
        seen.add(doc_id)
        out.append((rank, doc_id))
    return out


def _found(ranked: Sequence[str], gold: Gold, k: int) -> tuple[set[str], dict[str, float]]:
    """Validate inputs; return (relevant ids in top-k, all relevant ids with grades)."""
    _check_k(k)
    _check_ranked(ranked)
    grades = _grades(gold)
    hits = {doc_id for _, doc_id in _first_occurrences(ranked, k) if doc_id in grades}
    return hits, grades


# --------------------------------------------------------------------------- metrics


def recall_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """Fractional recall ``|gold ∩ top-k| / |gold|`` (LoCoMo's official ``recall_acc``).

    Unitless in [0, 1]. Grades in a mapping are ignored beyond "relevant or not".
    """
    hits, grades = _found(ranked, gold, k)
    return len(hits) / len(grades)


def recall_any_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """1.0 if at least one gold id is in the top-k, else 0.0 (a.k.a. hit@k, success@k)."""
    hits, _ = _found(ranked, gold, k)
    return 1.0 if hits else 0.0


def hit_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """Alias of :func:`recall_any_at_k`: 1.0 if any gold id is in the top-k."""
    return recall_any_at_k(ranked, gold, k)


def recall_all_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """1.0 if every gold id is in the top-k, else 0.0 (strict multi-evidence recall).

    Always 0.0 when ``|gold| > k``.
    """
    hits, grades = _found(ranked, gold, k)
    return 1.0 if len(hits) == len(grades) else 0.0


def ndcg_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """Normalised DCG at k with linear gains and a ``log2(rank + 1)`` discount.

    ``DCG = sum over slots r <= k of gain(id_r) / log2(r + 1)`` where the gain is
    1 for a gold id in a set, the grade for a mapping (grades <= 0 give 0), and 0
    for a repeated id after its first occurrence. ``IDCG`` is the DCG of the ideal
    ordering of the gold ids (highest grade first), truncated to ``k`` items when
    there are more gold ids than ``k``. Linear gains match trec_eval / pytrec_eval
    (BEIR). Unitless in [0, 1].
    """
    _check_k(k)
    _check_ranked(ranked)
    grades = _grades(gold)
    dcg = math.fsum(
        grades[doc_id] / math.log2(rank + 1)
        for rank, doc_id in _first_occurrences(ranked, k)
        if doc_id in grades
    )
    ideal = sorted(grades.values(), reverse=True)[:k]
    idcg = math.fsum(gain / math.log2(rank + 1) for rank, gain in enumerate(ideal, start=1))
    return dcg / idcg


def mrr_at_k(ranked: Sequence[str], gold: Gold, k: int) -> float:
    """Reciprocal rank ``1 / r`` of the first gold id within the top-k, else 0.0.

    ``r`` is the 1-based slot in ``ranked``. Average over queries for MRR@k.
    """
    _check_k(k)
    _check_ranked(ranked)
    grades = _grades(gold)
    for rank, doc_id in _first_occurrences(ranked, k):
        if doc_id in grades:
            return 1.0 / rank
    return 0.0


def evaluate_ranking(
    ranked: Sequence[str], gold: Gold, ks: Iterable[int] = (1, 5, 10)
) -> dict[str, float]:
    """All metrics for one query, keyed ``"<metric>@<k>"`` (e.g. ``"recall@10"``).

    Metrics: ``recall`` (fractional), ``recall_any``, ``recall_all``, ``ndcg``, ``mrr``.
    The result is a ready row for :func:`summarise` once the caller adds its own
    keys (query id, category).
    """
    ks = list(ks)
    if not ks:
        raise InvalidArgument("ks", ks, "ks must list at least one cut-off", "Pass e.g. ks=(1, 5, 10).")
    row: dict[str, float] = {}
    for k in ks:
        row[f"recall@{k}"] = recall_at_k(ranked, gold, k)
        row[f"recall_any@{k}"] = recall_any_at_k(ranked, gold, k)
        row[f"recall_all@{k}"] = recall_all_at_k(ranked, gold, k)
        row[f"ndcg@{k}"] = ndcg_at_k(ranked, gold, k)
        row[f"mrr@{k}"] = mrr_at_k(ranked, gold, k)
    return row


# --------------------------------------------------------------------------- aggregation


def _is_number(value: Any) -> bool:
    """True for int/float values that are not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean of per-query scores (macro over queries); exact summation.

    Raises ValueError on an empty input or a non-finite value.
    """
    items = [float(v) for v in values]
    if not items:
        raise ValueError(
            "Got no values to average; mean() needs at least one per-query score. "
            "Check that the loader returned queries and the filter kept some."
        )
    bad = [v for v in items if not math.isfinite(v)]
    if bad:
        raise ValueError(
            f"Got non-finite per-query scores {bad[:3]!r}; every score must be a finite number. "
            "Fix the metric computation that produced them."
        )
    return math.fsum(items) / len(items)


def summarise(
    per_query: Sequence[Mapping[str, Any]],
    group_key: str = "category",
    metrics: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Means over queries, overall and per group.

    ``per_query`` holds one dict per query (e.g. from :func:`evaluate_ranking`
    plus ``"category"``). ``metrics`` names the keys to average; by default every
    key of the first row whose value is a number (bool excluded), except
    ``group_key``. Rows lacking ``group_key`` (or holding None) fall in group None.

    Returns ``{"n": int, "means": {metric: float},
    "groups": {group: {"n": int, "means": {metric: float}}}}``; groups appear in
    sorted order of ``str(group)``.
    """
    if isinstance(per_query, Mapping) or not per_query:
        raise ValueError(
            f"Got per_query={type(per_query).__name__} with no rows; summarise() needs a non-empty "
            "list of per-query dicts. Score at least one query first."
        )
    if metrics is None:
        metrics = [key for key, value in per_query[0].items() if key != group_key and _is_number(value)]
        if not metrics:
            raise ValueError(
                f"Got a first row with no numeric values (keys {sorted(per_query[0])}); summarise() "
                "averages numeric per-query metrics. Pass metrics=[...] or add scores to the rows."
            )
    metrics = list(metrics)
    for index, row in enumerate(per_query):
        for name in metrics:
            if name not in row or not _is_number(row[name]):
                raise ValueError(
                    f"Got row {index} with {name}={row.get(name)!r}; every row needs a numeric value "
                    f"for each metric in {metrics}. Score every query with the same metrics."
                )

    def means(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        return {name: mean(row[name] for row in rows) for name in metrics}

    grouped: dict[Any, list[Mapping[str, Any]]] = {}
    for row in per_query:
        grouped.setdefault(row.get(group_key), []).append(row)
    groups = {
        group: {"n": len(rows), "means": means(rows)}
        for group, rows in sorted(grouped.items(), key=lambda item: str(item[0]))
    }
    return {"n": len(per_query), "means": means(per_query), "groups": groups}


# --------------------------------------------------------------------------- paired comparison

#: Below this many queries the sign-flip test enumerates every assignment (2^n); above,
#: it samples ``resamples`` of them with a fixed seed.
EXACT_SIGN_FLIPS = 16


def paired_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000,
                      seed: int = 0) -> dict[str, Any]:
    """How system A differs from system B on the same queries, scored per query.

    Returns ``{"n", "delta", "ci95": [low, high], "p"}``:

    * ``delta``: mean of ``a[i] − b[i]``;
    * ``ci95``: the 2.5th and 97.5th percentiles of that mean over ``resamples``
      bootstrap resamples of the queries (paired: a query is drawn with both scores);
    * ``p``: two-sided paired randomisation (sign-flip) test of "A and B are
      exchangeable": the share of sign assignments of the differences whose mean is
      at least as far from 0 as the observed one (exact for ≤ 16 queries; otherwise
      sampled, with the observed assignment counted, so p > 0).

    Both are deterministic for a given ``seed``. Ties (every difference 0) give
    ``delta`` 0, ``ci95`` [0, 0] and ``p`` 1.
    """
    import numpy as np

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or not len(x):
        raise ValueError(
            f"Got per-query score lists of lengths {len(x)} and {len(y)}; paired_difference() needs two "
            "non-empty lists over the same queries in the same order."
        )
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("Got non-finite per-query scores; every score must be a finite number.")
    if resamples < 1:
        raise ValueError(f"Got resamples={resamples}; give a whole number ≥ 1.")
    d = x - y
    n = len(d)
    observed = float(d.mean())
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    tolerance = 1e-12 * max(1.0, abs(observed))
    if not d.any():
        p = 1.0
    elif n <= EXACT_SIGN_FLIPS:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
        p = float(np.mean(np.abs(signs @ d / n) >= abs(observed) - tolerance))
    else:
        signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, n))
        extreme = int(np.count_nonzero(np.abs(signs @ d / n) >= abs(observed) - tolerance))
        p = (extreme + 1) / (resamples + 1)
    return {"n": n, "delta": observed, "ci95": [float(low), float(high)], "p": p}
