"""Stage 6a: late interaction — MaxSim of the query's token vectors against each
candidate's stored token vectors (ColBERT, Khattab & Zaharia 2020).

Only the candidates are scored (the head of the fused list plus graph additions, bounded
by ``fusion.pool`` and ``graph.max_new``), so the cost does not grow with the store: the
passages' tokens were encoded at ingest and are read from the generation's memory-mapped
files.
"""

from __future__ import annotations

import numpy as np

from helix_ray.token_encoder import PassageTokens


def maxsim(query_tokens: np.ndarray, passages: PassageTokens, rows: np.ndarray) -> np.ndarray:
    """For each of ``rows``: the mean over query tokens of the best cosine with any of
    the row's tokens, in [-1, 1]. NaN for a row that has no stored tokens (not among the
    passages, or an empty passage). ``passages`` is anything with
    :meth:`PassageTokens.lookup`: the Serve ranker passes the generation's tokens joined
    with its delta's."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.full(len(rows), np.nan)
    known, block = passages.lookup(rows)
    if not len(known):
        return out
    lengths = np.diff(block.offsets)
    nonempty = lengths > 0
    if not nonempty.any():
        return out
    query = np.asarray(query_tokens, dtype=np.float32)
    sims = query @ block.tokens.astype(np.float32).T  # (query tokens, passage tokens)
    sims *= block.scales[None, :]
    best = np.maximum.reduceat(sims, block.offsets[:-1][nonempty], axis=1)  # per query token, per passage
    scored = np.full(len(block), np.nan)
    scored[nonempty] = best.mean(axis=0)
    out[known] = scored
    return out


def blend(cosine: np.ndarray, late: np.ndarray | None, weight: float) -> np.ndarray:
    """``(1 − weight) · cosine + weight · late``.

    A row without a late score (an online write from a writer configured without token
    vectors, or a delta snapshot written before they existed) gets an estimate on the
    MaxSim scale: its cosine plus the median of
    ``late − cosine`` over the rows that have both. MaxSim runs higher than cosine, so
    the raw cosine would sink such a row below every stored memory it competes with."""
    if late is None or weight <= 0:
        return cosine
    missing = np.isnan(late)
    if missing.all():
        return cosine
    offset = float(np.median(late[~missing] - cosine[~missing])) if missing.any() else 0.0
    filled = np.where(missing, cosine + offset, late)
    return (1.0 - weight) * cosine + weight * filled
