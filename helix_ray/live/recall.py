"""Recall over a generation and the delta beside it: each leg searches both and merges,
and the finish sees them as one row space. Synchronous and Ray-free: the Serve shells
call these per request (on their event loop), and so does an open
:class:`helix_ray.Memory`, which has no event loop of its own (:func:`recall_over`).

============== ==========================================================================
lexical_over   the BM25 leg over the generation, then the delta's live entries, merged
dense_over     the dense leg likewise (the delta by exact cosine)
finish_over    ``Recaller.finish`` over both, rows this snapshot hides dropped first
recall_over    plan, the legs (dense unless BM25 is decisive) and finish, in this thread
============== ==========================================================================
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from helix_ray.live.delta import DELTA_BASE, DeltaSegment, merge_dense, merge_lexical
from helix_ray.live.views import ShellRecaller
from helix_ray.recall import dense as dense_mod
from helix_ray.recall import lexical as lexical_mod
from helix_ray.recall.pipeline import IdAccessOverlay, Plan, RecallResult, Recaller
from helix_ray.recall.threads import one_blas_thread


def elapsed_ms(since: float) -> float:
    """Milliseconds since ``since`` (a ``time.perf_counter()``), to the microsecond."""
    return round((time.perf_counter() - since) * 1000.0, 3)


def lexical_over(recaller: ShellRecaller, delta: DeltaSegment, plan: Plan) -> Any:
    """BM25 over the generation (rows the delta hides masked out) and the delta's live
    entries, merged into one list; None when the leg's weight is 0."""
    hits = recaller.lexical_leg(plan)
    if plan.weights.get("bm25", 0) > 0 and len(delta):
        lx, gen = plan.config.lexical, recaller.generation
        extra = delta.lexical_search(plan.query, plan.scope, gen.number, gen.bm25, top_k=lx.top_k,
                                     span=gen.partitions.get(plan.user))
        hits = merge_lexical(hits, extra, top_k=lx.top_k, strong_score=lx.strong_signal_score,
                             strong_gap=lx.strong_signal_gap)
    return hits


def dense_over(recaller: ShellRecaller, delta: DeltaSegment, plan: Plan) -> Any:
    """Dense top-k over the generation (hidden rows masked out) and the delta's live
    entries, merged; None when the leg's weight is 0."""
    hits = recaller.dense_leg(plan)
    if plan.weights.get("dense", 0) > 0 and len(delta):
        extra = delta.dense_search(plan.query_vector, plan.scope, recaller.generation.number,
                                   plan.config.dense.top_k)
        hits = merge_dense(hits, extra, plan.config.dense.top_k)
    return hits


def finish_over(recaller: ShellRecaller, delta: DeltaSegment, plan: Plan, lexical: Any, dense: Any, *,
                leg_timings_ms: dict[str, float] | None = None, accessed: Mapping[str, int] | None = None,
                started: float | None = None) -> RecallResult:
    """``Recaller.finish`` with ``recaller`` a joined one (:class:`~helix_ray.live.views.JoinedGeneration`:
    the graph is seeded and ranked over both): the legs' rows this snapshot hides
    dropped first; ``accessed``: last accesses (epoch µs) by id newer than the generation's."""
    number = recaller.generation.number
    hidden = set(int(r) for r in recaller.hidden_rows)
    return recaller.finish(plan, _visible(lexical, hidden, delta, number), _visible(dense, hidden, delta, number),
                           leg_timings_ms=leg_timings_ms, started=started,
                           last_access_overlay=IdAccessOverlay(recaller.columns.ids, accessed) if accessed else None)


@one_blas_thread  # the whole recall, delta search included: BLAS never spins beside the token encoder
def recall_over(legs: ShellRecaller, joined: ShellRecaller, delta: DeltaSegment, planner: Recaller, query: str, *,
                user: str, accessed: Mapping[str, int] | None = None, **request: Any) -> RecallResult:
    """One recall in this thread over a generation and ``delta`` (``legs`` and
    ``joined``: :meth:`StoreViews.recaller` of the two, plain and joined): ``planner``
    (encoders, router, adapter) plans it as the Embedder shell does, then the BM25 leg,
    the dense leg unless BM25 is decisive, and the Ranker's finish, as a Serve replica
    of the compact graph runs them. An open :class:`helix_ray.Memory` recalls with it."""
    started = time.perf_counter()
    plan = planner.over(joined.generation).plan(query, user=user, **request)
    try:
        lexical = dense = None
        timings: dict[str, float] = {}
        if not plan.skip:
            clock = time.perf_counter()
            lexical = lexical_over(legs, delta, plan)
            timings["bm25"] = elapsed_ms(clock)
            if not Recaller.strong(plan, lexical):
                clock = time.perf_counter()
                dense = dense_over(legs, delta, plan)
                timings["dense"] = elapsed_ms(clock)
        return finish_over(joined, delta, plan, lexical, dense, leg_timings_ms=timings, accessed=accessed,
                           started=started)
    finally:
        plan.drop_tokens()


def _visible(hits: Any, hidden: set[int], delta: DeltaSegment, generation: int) -> Any:
    """``hits`` without rows this snapshot hides: deleted or replaced generation rows,
    and delta entries it no longer holds (deleted or replaced since the leg ran) or that
    this generation already holds; the lists of a recall's context turns and of its time
    window likewise. Runs before packing, so a delete that was answered before this
    request arrived can never reach the result."""
    if hits is None:
        return hits

    def shown(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return rows[_shown(rows, hidden, delta, generation)]

    context = tuple(shown(rows) for rows in hits.context)
    window = None if hits.window is None else shown(hits.window)
    rows = np.asarray(hits.rows, dtype=np.int64)
    keep = _shown(rows, hidden, delta, generation)
    if keep.all() and not context and window is None:
        return hits
    if isinstance(hits, dense_mod.DenseHits):
        return dense_mod.DenseHits(rows[keep], hits.similarities[keep], hits.first_pass, context, window)
    return lexical_mod.LexicalHits(rows[keep], hits.scores[keep], hits.normalised[keep],
                                   bool(hits.strong_signal and len(keep) and keep[0]), context, window)


def _shown(rows: np.ndarray, hidden: set[int], delta: DeltaSegment, generation: int) -> np.ndarray:
    """Which of ``rows`` this snapshot shows (see :func:`_visible`)."""
    keep = np.ones(len(rows), dtype=bool)
    if not len(rows):
        return keep
    if hidden:
        keep &= np.array([int(r) not in hidden for r in rows], dtype=bool)
    in_delta = rows >= DELTA_BASE
    if in_delta.any():
        pos = delta.positions(rows[in_delta])
        ok = pos >= 0
        ok[ok] = delta.live(generation)[pos[ok]]
        keep[np.flatnonzero(in_delta)] &= ok
    return keep
