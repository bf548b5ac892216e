"""Stage 6: multi-signal ranking.

Each signal named in ``RankConfig.minmax`` is min-max normalised within the candidate
pool (a constant signal becomes 0: it cannot separate candidates); the others, already in
[0, 1], are used as they are. Then

    score = Σ_s w[type][s] · signal_s,   s ∈ {similarity, recency, salience, confidence, graph}

with the weight table chosen by each memory's own type (with ``reweigh_silent``, a signal
that is 0 for every candidate is left out of every row, each row re-scaled to its sum),
a code memory taking a share of the score of the class or module enclosing it
(``container_share``), times the project and pinned multipliers and the boosts
(``boost``: the query's time window, a "when" question, the type the question's intent
favours).
Similarity blends cosine to the query (with late interaction) and the fused RRF score,
then takes a share of the candidate's own BM25 score (``lexical_share``, larger for long
memories) and of its cosine with a conversation's context turns; recency decays
exponentially from the last access (or creation) with a configurable half-life.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helix_ray.config import RankConfig
from helix_ray.schema import MEMORY_TYPES

SIGNALS = ("similarity", "recency", "salience", "confidence", "graph")
MICROS_PER_DAY = 86_400 * 1_000_000


def minmax(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return values
    lo, hi = float(values.min()), float(values.max())
    if hi - lo <= 1e-12:
        return np.zeros_like(values)
    return (values - lo) / (hi - lo)


#: An access stamped up to this much after ``now`` is taken as made now: another node's
#: clock may run a little ahead.
CLOCK_SKEW_US = 600 * 1_000_000


def recency(last_access_us: np.ndarray, now_us: int, half_life_days: float) -> np.ndarray:
    """0.5 ** (age in days / half-life); 0 for a memory never accessed (time 0) or
    accessed only after ``now`` (a recall asked as of an earlier moment, ``now=``: the
    store keeps each memory's last access, so what it was before then is not known)."""
    age_days = np.maximum(0, now_us - last_access_us) / MICROS_PER_DAY
    known = (last_access_us > 0) & (last_access_us <= now_us + CLOCK_SKEW_US)
    return np.where(known, np.power(0.5, age_days / half_life_days), 0.0)


def support_from_siblings(scores: np.ndarray, parents: list[str | None], share: float) -> np.ndarray:
    """Each parent's best-scoring chunk plus ``share`` × the score of its second best;
    every other score unchanged."""
    best: dict[str, list[int]] = {}
    for i, parent in enumerate(parents):
        if parent is not None:
            best.setdefault(parent, []).append(i)
    out = scores.copy()
    for members in best.values():
        if len(members) > 1:
            first, second = sorted(members, key=lambda i: -scores[i])[:2]
            out[first] += share * scores[second]
    return out


def support_from_containers(scores: np.ndarray, memories: list[str], containers: list[str | None],
                            share: float) -> np.ndarray:
    """Each candidate whose container (``containers``: the memory enclosing it, or None)
    is also a candidate gains ``share`` × that container's best score; each candidate
    that contains another keeps 1 − ``share`` of its own score. ``memories``: each
    candidate's memory (a chunk's parent), so a container's chunks count as one."""
    best: dict[str, float] = {}
    for score, memory in zip(scores.tolist(), memories):
        best[memory] = max(best.get(memory, score), score)
    holding = {c for c in containers if c is not None}
    out = np.array([(1.0 - share) * score if memory in holding else score
                    for score, memory in zip(scores.tolist(), memories)], dtype=np.float64)
    for i, container in enumerate(containers):
        if container is not None:
            out[i] += share * best[container]
    return out


@dataclass(frozen=True)
class Ranked:
    order: np.ndarray  # indices into the pool, best first
    scores: np.ndarray  # final score per pool item (pool order)
    signals: dict[str, np.ndarray]  # normalised signals (pool order)


def weight_matrix(config: RankConfig) -> np.ndarray:
    """(types × signals) weights, rows in MEMORY_TYPES order."""
    return np.array([[getattr(config.type_weights[t], s) for s in SIGNALS] for t in MEMORY_TYPES])


def _without_silent(weights: np.ndarray, signals: dict[str, np.ndarray]) -> np.ndarray:
    """``weights`` with the columns of signals that are 0 for every candidate set to 0,
    each row re-scaled to its former sum (a row left with no signal is kept whole). In a
    pool of one type every score is scaled alike, so its order does not change."""
    speaks = np.array([float(np.abs(signals[s]).max()) > 1e-12 for s in SIGNALS])
    kept = weights * speaks
    total, left = weights.sum(axis=1, keepdims=True), kept.sum(axis=1, keepdims=True)
    return np.where(left > 0, kept * total / np.where(left > 0, left, 1.0), weights)


def rank(
    *,
    types: np.ndarray,
    cosine: np.ndarray,
    fused: np.ndarray,
    last_access_us: np.ndarray,
    salience: np.ndarray,
    confidence: np.ndarray,
    graph: np.ndarray,
    projects: np.ndarray,
    pinned: np.ndarray,
    now_us: int,
    config: RankConfig,
    project: str | None = None,
    disabled: frozenset[str] = frozenset(),
    lexical: np.ndarray | None = None,
    lexical_share: float | np.ndarray = 0.0,
    context: np.ndarray | None = None,
    context_share: float = 0.0,
    boost: np.ndarray | None = None,
    parents: list[str | None] | None = None,
    containers: tuple[list[str], list[str | None]] | None = None,
) -> Ranked:
    blend = config.similarity_blend
    similarity = blend * minmax(cosine) + (1 - blend) * minmax(fused)
    if lexical is not None and np.any(lexical_share):
        similarity = (1 - lexical_share) * similarity + lexical_share * minmax(lexical)
    if context is not None and context_share > 0:
        similarity = (1 - context_share) * similarity + context_share * minmax(context)
    raw = {
        "similarity": similarity,
        "recency": recency(last_access_us, now_us, config.recency_half_life_days),
        "salience": salience,
        "confidence": confidence,
        "graph": graph,
    }
    signals = {
        name: (np.zeros(len(types)) if name in disabled
               else minmax(raw[name]) if name in config.minmax else np.asarray(raw[name], dtype=np.float64))
        for name in SIGNALS
    }
    weights = weight_matrix(config)
    if config.reweigh_silent and len(types) > 1:
        weights = _without_silent(weights, signals)
    type_index = np.array([MEMORY_TYPES.index(t) for t in types], dtype=np.int64)
    stacked = np.stack([signals[s] for s in SIGNALS], axis=1) if len(types) else np.zeros((0, len(SIGNALS)))
    scores = (stacked * weights[type_index]).sum(axis=1)
    # Before the multipliers: a boost (the intent's, a pin) weighs what a member took from its container too.
    if containers is not None and config.container_share > 0:
        scores = support_from_containers(scores, *containers, config.container_share)
    if project is not None:
        scores = np.where(projects == project, scores * config.project_boost, scores * config.other_project_penalty)
    scores = np.where(pinned, scores * config.pinned_boost, scores)
    if boost is not None:  # time-aware recall: per-candidate multipliers ≥ 1
        scores = scores * boost
    if parents is not None and config.chunk_support > 0:
        scores = support_from_siblings(scores, parents, config.chunk_support)
    order = np.lexsort((np.arange(len(scores)), -scores))
    return Ranked(order, scores, signals)
