"""Stage 4: Reciprocal Rank Fusion (Cormack, Clarke & Büttcher, SIGIR 2009).

score(d) = Σ_i w_i / (k + rank_i(d)), ranks 1-based, k = 60 by default. A list whose
weight is 0 contributes nothing (and the caller skips its retriever). With the top-rank
bonus, an item ranked 1st in any list gains +0.05 and one ranked 2nd–3rd +0.02, scaled by
that list's weight when it is below 1: a list the caller trusts less (adaptive fusion
down-weights a flat BM25 list) cannot push its top hit over the others at full strength.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

TOP1_BONUS = 0.05
TOP3_BONUS = 0.02


@dataclass(frozen=True)
class Fused:
    rows: np.ndarray  # int64, best first
    scores: np.ndarray  # float64
    ranks: dict[str, np.ndarray]  # per list: 1-based rank of each fused row, 0 = absent


def rrf(
    lists: Mapping[str, Sequence[int] | np.ndarray],
    *,
    k: int = 60,
    weights: Mapping[str, float] | None = None,
    top_rank_bonus: bool = False,
) -> Fused:
    """Fuse ranked lists of row ids (best first). Ties break by the smaller row id."""
    if k <= 0:
        raise ValueError(f"Got k={k}; RRF needs k > 0 (60 is the value from Cormack et al. 2009).")
    weights = dict(weights or {})
    scores: dict[int, float] = {}
    bonus: dict[int, float] = {}
    for name, rows in lists.items():
        w = weights.get(name, 1.0)
        if w == 0:
            continue
        scale = min(w, 1.0)
        for rank, row in enumerate(rows, start=1):
            row = int(row)
            scores[row] = scores.get(row, 0.0) + w / (k + rank)
            if rank <= 3:
                earned = scale * (TOP1_BONUS if rank == 1 else TOP3_BONUS)
                bonus[row] = max(bonus.get(row, 0.0), earned)
    if top_rank_bonus:
        for row, earned in bonus.items():
            scores[row] += earned
    order = sorted(scores, key=lambda r: (-scores[r], r))
    fused_rows = np.array(order, dtype=np.int64)
    ranks = {}
    for name, rows in lists.items():
        position = {int(r): i for i, r in enumerate(rows, start=1)}
        ranks[name] = np.array([position.get(r, 0) for r in order], dtype=np.int32)
    return Fused(fused_rows, np.array([scores[r] for r in order], dtype=np.float64), ranks)
