"""The query path, in flow order: embed → scope/route → (the store's query adapter, if
any) → BM25 ∥ dense → RRF → graph expansion → late interaction → ranking → diversity →
packing. Pure Python over a memory-mapped generation; imports no Ray (the Serve
deployments call these same functions).

:class:`Recaller` runs the stages; each is a function of its own module
(:mod:`~helix_ray.recall.scope`, :mod:`~helix_ray.recall.lexical`, :mod:`~helix_ray.recall.dense`,
:mod:`~helix_ray.recall.fuse`, :mod:`~helix_ray.recall.expand`, :mod:`~helix_ray.recall.late`,
:mod:`~helix_ray.recall.rank`, :mod:`~helix_ray.recall.diversify`, :mod:`~helix_ray.recall.pack`).
What a recall returns is in :mod:`~helix_ray.recall.result`; how its threads share the
cores, in :mod:`~helix_ray.recall.threads`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from helix_ray.config import RetrievalConfig
from helix_ray.embedder import DIM
from helix_ray.schema import CHUNK_ID, chunk_id, code_containers, parent_of
from helix_ray.tokens import token_counter
from helix_ray import when
from helix_ray.recall import dense, diversify, expand, fuse, intent, late, lexical, pack, rank, rerank, scope
from helix_ray.recall.embed import embed_queries, embed_query
from helix_ray.recall.result import (WINDOW_LISTS, Candidates, RecallItem, RecallResult, empty_explain, explain_table,
                                     iso)
from helix_ray.recall.threads import (blas_on_caller, elapsed_ms, encode_tokens, encoder_threads, late_on,
                                      one_blas_thread, overlap_tokens, token_pool)
from helix_ray.token_encoder import get_token_encoder

STAGES = ("embed", "route", "bm25", "dense", "fuse", "expand", "late", "rank", "diversify", "pack")

#: The BLAS limit under its name here, which tests/test_late.py reads as ``pipeline._blas_on_caller``.
_blas_on_caller = blas_on_caller

__all__ = ["STAGES", "AccessOverlay", "IdAccessOverlay", "Plan", "Recaller", "RecallItem", "RecallResult",
           "encoder_threads"]


class AccessOverlay(Protocol):
    """Last accesses newer than the generation's, by row: epoch µs, or None."""

    def get(self, row: int, /) -> int | None: ...


class IdAccessOverlay:
    """An :class:`AccessOverlay` over last accesses kept by memory id (an open
    ``Memory``'s own recalls, the Serve Writer's recent hits): looked up only for the
    candidate rows the ranking asks about, however many ids it holds."""

    def __init__(self, ids: Any, accessed: Mapping[str, int]):
        self.ids, self.accessed = ids, accessed  # ids: row → memory id (the columns' ids)

    def __bool__(self) -> bool:
        return bool(self.accessed)

    def get(self, row: int, /) -> int | None:
        try:
            return self.accessed.get(str(self.ids[row]))
        except (IndexError, KeyError):
            return None


@dataclass(frozen=True)
class ContextTurn:
    """One turn of a conversational recall's context: its fusion weight and vector."""

    text: str
    weight: float
    vector: np.ndarray
    unadapted: np.ndarray | None = None  # the encoder's vector, where a query adapter moved ``vector``


@dataclass
class Plan:
    """A checked, embedded and routed request: what every later stage needs. It holds no
    generation, so a Serve ingress can build it and pass it to the retriever replicas."""

    query: str
    user: str
    scope: scope.Scope
    config: RetrievalConfig
    k: int
    budget_tokens: int
    explain: bool
    disabled: frozenset[str]
    now_us: int
    weights: dict[str, float]
    query_vector: np.ndarray
    flags: dict[str, Any]
    timings_ms: dict[str, float]
    query_tokens: np.ndarray | None = None  # float16 (32, 384) for late interaction, or None
    context: tuple[ContextTurn, ...] = ()  # the conversation's recent turns, oldest first
    window: when.TimeWindow | None = None  # the span of time the query names, if any
    asks_when: bool = False  # the query asks for a time or a duration
    # The query's token encoding while it still runs on another core (see Recaller.plan):
    # (tokens, encoder ms). Read the tokens through tokens(), which waits for it.
    pending_tokens: Future | None = field(default=None, repr=False, compare=False)
    intent: intent.Intent | None = None  # code or its history, as the query asks (recall/intent.py)
    # The encoder's own query vector, where the store's query adapter moved query_vector:
    # the weak-match threshold was set on the encoder's vectors (see _match).
    unadapted: np.ndarray | None = None
    # The scope's mask narrowed to the query's window: made by the first leg, read by the other
    # (Recaller._window_mask); never sent over a Serve hop, where each retriever makes its own.
    window_mask: tuple[tuple[int, int, int], np.ndarray | None] | None = field(default=None, repr=False,
                                                                                 compare=False)

    @property
    def skip(self) -> bool:
        return bool(self.flags.get("router_skip"))

    def tokens(self) -> np.ndarray | None:
        """The query's late-interaction tokens, waiting for an overlapped encoding (its
        time goes into ``timings_ms``: ``embed_tokens`` the encoder's, ``wait_tokens``
        what the caller still waited for it)."""
        pending = self.pending_tokens
        if pending is not None:
            clock = time.perf_counter()
            self.query_tokens, encoded_ms = pending.result()
            self.pending_tokens = None
            self.timings_ms["embed_tokens"] = encoded_ms
            self.timings_ms["wait_tokens"] = elapsed_ms(clock)
        return self.query_tokens

    def drop_tokens(self) -> None:
        """No stage will read the tokens: cancel an encoding not started yet, so it does
        not take the second core (or the pool's queue) from the next query."""
        pending, self.pending_tokens = self.pending_tokens, None
        if pending is not None:
            pending.cancel()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a Serve hop) with its tokens, never a running encoding."""
        self.tokens()
        return {**self.__dict__, "window_mask": None}


class Recaller:
    """Holds what recall needs between queries: the generation, the embedder, the router.

    :meth:`recall` runs every stage in order. The stages are also exposed in the groups a
    distributed deployment needs — :meth:`plan` (check, embed, route), :meth:`lexical_leg`,
    :meth:`dense_leg` (independent of each other) and :meth:`finish` (fuse, expand, late
    interaction, rank, diversify, pack) — and ``recall`` is exactly their composition.
    """

    _overlap_tokens = False  # set by __init__ (subclasses that skip it never overlap)

    def __init__(self, generation, embedder, config: RetrievalConfig | None = None, token_encoder=None,
                 threads: int | None = None, adapter=None, router: scope.Router | None = None):
        self.generation = generation
        self.embedder = embedder
        self.adapter = adapter  # a QueryAdapter (stage 1b) or None
        self.config = config or RetrievalConfig()
        self._router = router  # another Recaller's of the same embedder and config: its centroids are theirs
        self._token_encoder = token_encoder
        self._threads = threads  # onnxruntime threads of the query token encoder (None: default)
        self._overlap_tokens = overlap_tokens(threads)

    @property
    def token_encoder(self):
        """Loaded on first use: only :meth:`plan` encodes query tokens."""
        if self._token_encoder is None:
            self._token_encoder = get_token_encoder(threads=self._threads)
        return self._token_encoder

    def _wants_late(self, cfg: RetrievalConfig, disabled: frozenset[str]) -> bool:
        """Late interaction is on and the generation has token vectors (a replica that
        holds no generation, such as the Serve Embedder, cannot tell: it encodes)."""
        return late_on(cfg, disabled) and (self.generation is None or self.generation.late is not None)

    def overlaps_tokens(self, cfg: RetrievalConfig, disabled: frozenset[str] = frozenset()) -> bool:
        """Whether :meth:`plan` encodes the query's tokens on another thread."""
        return self._overlap_tokens and self._wants_late(cfg, disabled)

    @property
    def router(self) -> scope.Router:
        """Built on first use: only :meth:`plan` routes (retriever replicas never do)."""
        if self._router is None:
            self._router = scope.Router(self.embedder, self.config.router)
        return self._router

    @property
    def columns(self):
        return self.generation.columns if self.generation is not None else None

    def over(self, generation: Any) -> "Recaller":
        """This recaller's encoders, router and adapter over another generation-shaped
        object (a generation joined with the Writer's delta, whose tenants and token
        vectors :meth:`plan` then sees). The router is built here once, for both."""
        other = copy.copy(self)
        other._router = self.router
        other.generation = generation
        return other

    @one_blas_thread
    def recall(
        self,
        query: str,
        *,
        user: str,
        budget_tokens: int | None = None,
        k: int | None = None,
        project: str | None = None,
        types: Sequence[str] | str | None = None,
        since: Any = None,
        until: Any = None,
        pinned: bool | None = None,
        project_mode: str = "filter",
        explain: bool = False,
        now: dt.datetime | str | None = None,
        context: Sequence[str] | None = None,
        last_access_overlay: AccessOverlay | None = None,
        disabled: frozenset[str] = frozenset(),
        config: RetrievalConfig | None = None,
    ) -> RecallResult:
        """Recall memories of ``user`` for ``query``, packed into ``budget_tokens``.

        ``context``: the conversation's recent turns, oldest first, when ``query`` is its
        latest turn (see :class:`~helix_ray.config.ContextConfig`).
        ``disabled`` turns stages off for ablations: any of "dense", "bm25", "graph",
        "late", "mmr", "recency", "strong_signal", "router", "dedup", "rerank", "context",
        "time", "intent", "speaker".
        """
        started = time.perf_counter()
        plan = self.plan(query, user=user, budget_tokens=budget_tokens, k=k, project=project, types=types,
                         since=since, until=until, pinned=pinned, project_mode=project_mode, explain=explain,
                         now=now, context=context, disabled=disabled, config=config)
        lex = dense_hits = None
        legs: dict[str, float] = {}
        try:
            if not plan.skip and self._has_scope(plan):
                clock = time.perf_counter()
                lex = self.lexical_leg(plan)
                legs["bm25"] = elapsed_ms(clock)
                clock = time.perf_counter()
                dense_hits = None if self.strong(plan, lex) else self.dense_leg(plan)
                legs["dense"] = elapsed_ms(clock)
            return self.finish(plan, lex, dense_hits, last_access_overlay=last_access_overlay, started=started,
                               leg_timings_ms=legs)
        finally:
            plan.drop_tokens()  # a leg or finish that raised, or returned before the late stage

    # ------------------------------------------------------------------ embed, scope, route
    @one_blas_thread
    def plan(self, query: str, *, user: str, budget_tokens: int | None = None, k: int | None = None,
             project: str | None = None, types: Sequence[str] | str | None = None, since: Any = None,
             until: Any = None, pinned: bool | None = None, project_mode: str = "filter", explain: bool = False,
             now: dt.datetime | str | None = None, context: Sequence[str] | None = None,
             disabled: frozenset[str] = frozenset(), config: RetrievalConfig | None = None,
             query_vector: np.ndarray | None = None) -> Plan:
        """Check the request, embed the query (unless ``query_vector`` is given) and its
        context turns, and route."""
        cfg = config or self.config
        budget_tokens = cfg.default_budget_tokens if budget_tokens is None else budget_tokens
        k = cfg.default_k if k is None else k
        sc = scope.make_scope(query=query, user=user, budget_tokens=budget_tokens, k=k, project=project,
                              types=types, since=since, until=until, pinned=pinned, project_mode=project_mode)
        turns = scope.check_context(context)
        timings: dict[str, float] = {}
        flags: dict[str, Any] = {"router_skip": False, "strong_signal_skip": False, "degraded": []}
        if not turns and cfg.context.split_transcript and "context" not in disabled:
            split = scope.split_transcript(query)
            if split is not None:  # a pasted window of turns: its last line asks
                query, turns = split
                flags["query_split"] = {"query": query, "context_turns": len(turns)}
        clock = time.perf_counter()
        query_tokens = pending = None
        has_memories = self.generation is None or user in self.generation.partitions  # else nothing to re-score
        if has_memories and self._wants_late(cfg, frozenset(disabled)):
            # The token encoder (32 positions: slower than the sentence encoder) is needed
            # only at the late-interaction stage: on a second core it runs alongside the
            # sentence embedding and the legs instead of before them.
            if self._overlap_tokens:
                pending = token_pool().submit(encode_tokens, self.token_encoder, query)
            else:
                query_tokens, _ = encode_tokens(self.token_encoder, query)
        try:
            encoded = own_vector = query_vector is None
            if query_vector is None:
                query_vector = embed_query(self.embedder, query)
            if encoded or query_tokens is not None:  # the query-encoding stage (tokens: unless overlapped)
                timings["embed"] = elapsed_ms(clock)
            clock = time.perf_counter()
            if "router" not in disabled:
                route = self.router.route(query, query_vector, cfg.router)
                flags["route"] = {"skip": route.skip, "reason": route.reason,
                                  "no_memory_similarity": round(route.no_memory_similarity, 4),
                                  "memory_similarity": round(route.memory_similarity, 4)}
                flags["router_skip"] = route.skip
            timings["route"] = elapsed_ms(clock)
            unadapted = None
            if own_vector and self.adapter is not None:  # after routing: the router's prototypes are raw vectors
                unadapted, query_vector = query_vector, self.adapter.apply(query_vector)
                flags["query_adapter"] = True
            weights = {name: (0.0 if name in disabled else w) for name, w in cfg.fusion.weights.items()}
            if not any(weights.values()):
                weights = {"dense": 1.0, "bm25": 0.0}
            now = scope.as_time("now", now) or dt.datetime.now(dt.timezone.utc)
            now_us = int((now if now.tzinfo else now.replace(tzinfo=dt.timezone.utc)).timestamp() * 1_000_000)
            window, asks = _time_of(query, now, cfg, disabled, flags)
            plan = Plan(query, user, sc, cfg, k, budget_tokens, explain, frozenset(disabled), now_us, weights,
                        query_vector, flags, timings, query_tokens,
                        self._context(turns, cfg, disabled, has_memories and own_vector, timings), window, asks,
                        pending, _intent_of(query, cfg, disabled), unadapted=unadapted)
        except BaseException:
            if pending is not None:
                pending.cancel()  # the plan is never built: nothing will wait for them
            raise
        if plan.skip:
            plan.drop_tokens()  # no stage will read them
        return plan

    def _context(self, turns: tuple[str, ...], cfg: RetrievalConfig, disabled: frozenset[str], embed: bool,
                 timings: dict[str, float]) -> tuple[ContextTurn, ...]:
        """The latest ``context.max_turns`` turns with their weights (the latest turn
        ``context.weight``, each one back ``context.decay`` times the next) and vectors."""
        c = cfg.context
        turns = turns[len(turns) - c.max_turns:] if c.max_turns else ()
        if not turns or not embed or "context" in disabled or c.weight <= 0:
            return ()
        clock = time.perf_counter()
        vectors = unadapted = embed_queries(self.embedder, list(turns))
        if self.adapter is not None:
            vectors = np.stack([self.adapter.apply(v) for v in vectors])
        timings["embed_context"] = elapsed_ms(clock)
        n = len(turns)
        return tuple(ContextTurn(t, c.weight * c.decay ** (n - 1 - j), vectors[j],
                                 unadapted[j] if self.adapter is not None else None) for j, t in enumerate(turns))

    #: The stages a plan without a query vector leaves out: those that read the vector.
    NO_VECTOR = frozenset({"dense", "late", "router"})

    def plan_without_vector(self, query: str, *, user: str, config: RetrievalConfig | None = None,
                            disabled: frozenset[str] = frozenset(), **request: Any) -> Plan:
        """A plan for the lexical leg alone, for when no query vector can be had (the Serve
        Embedder has no live replica): checked as :meth:`plan` does, with the dense leg,
        late interaction and the router off, and the similarity signal made of the fused
        (BM25) rank alone (``similarity_blend`` 0: there is no cosine); needs no model."""
        cfg = config or self.config
        cfg = cfg.model_copy(update={"rank": cfg.rank.model_copy(update={"similarity_blend": 0.0})})
        return self.plan(query, user=user, config=cfg, disabled=frozenset(disabled) | self.NO_VECTOR,
                         query_vector=np.zeros(DIM, dtype=np.float32), **request)

    def _has_scope(self, plan: Plan) -> bool:
        return self.generation is not None and plan.user in self.generation.partitions

    def _mask(self, plan: Plan) -> np.ndarray | None:
        start, end = self.generation.partitions[plan.user]
        return scope.build_mask(self.generation.scope_columns, start, end, plan.scope)

    def _reachable(self, plan: Plan) -> np.ndarray | None:
        """Rows numbered past the tenant's (a replica's online writes) that graph
        expansion may add, in scope; None: none (a generation alone has no such rows)."""
        return None

    def _window_mask(self, plan: Plan, mask: np.ndarray | None) -> np.ndarray | None:
        """The scope's mask narrowed to the memories created inside the query's window
        (``time.window_leg``); None when the query names no window, or the window holds
        none or all of the scope's memories (a second search would find nothing new). Made
        once per plan and generation: the other leg reads it from the plan."""
        if plan.window is None or plan.config.time.window_leg <= 0:
            return None
        start, end = self.generation.partitions[plan.user]
        key = (self.generation.number, start, end)
        if plan.window_mask is not None and plan.window_mask[0] == key:  # the other leg's, over the same rows
            return plan.window_mask[1]
        created = self.generation.scope_columns.created_at[start:end]
        lo = int(plan.window.start.timestamp() * 1_000_000) if plan.window.start > when.UNBOUNDED_START else None
        hi = int(plan.window.end.timestamp() * 1_000_000) if plan.window.end < when.UNBOUNDED_END else None
        inside = created >= lo if lo is not None else np.ones(end - start, dtype=bool)
        if hi is not None:
            inside &= created < hi
        if mask is not None:
            inside &= mask
        count = np.count_nonzero(inside)
        useful = inside if 0 < count < (end - start if mask is None else np.count_nonzero(mask)) else None
        plan.window_mask = (key, useful)
        return useful

    # ------------------------------------------------------------------ BM25 ∥ dense
    def lexical_leg(self, plan: Plan) -> lexical.LexicalHits | None:
        """BM25 top-k inside the scope; None when its list weight is 0."""
        if plan.weights.get("bm25", 0) <= 0 or not self._has_scope(plan):
            return None
        start, end = self.generation.partitions[plan.user]
        lx, mask = plan.config.lexical, self._mask(plan)
        hits = lexical.search(self.generation.bm25, plan.query, start=start, end=end, mask=mask,
                              top_k=lx.top_k, strong_score=lx.strong_signal_score, strong_gap=lx.strong_signal_gap,
                              window=self._window_mask(plan, mask))
        if self.strong(plan, hits):  # a decisive query: no other list is fused
            return dataclasses.replace(hits, window=None)
        if not plan.context:
            return hits
        context = tuple(lexical.search(self.generation.bm25, turn.text, start=start, end=end, mask=mask,
                                       top_k=lx.top_k, strong_score=1.0, strong_gap=1.0).rows for turn in plan.context)
        return dataclasses.replace(hits, context=context)

    @one_blas_thread
    def dense_leg(self, plan: Plan) -> dense.DenseHits | None:
        """Dense top-k inside the scope; None when its list weight is 0."""
        if plan.weights.get("dense", 0) <= 0 or not self._has_scope(plan):
            return None
        mask = self._mask(plan)
        hits = dense.search(self.generation, plan.user, plan.query_vector, mask=mask, config=plan.config.dense)
        window = self._window_mask(plan, mask)
        if window is not None:
            hits = dataclasses.replace(hits, window=dense.search(self.generation, plan.user, plan.query_vector,
                                                                 mask=window, config=plan.config.dense).rows)
        if not plan.context:
            return hits
        context = tuple(dense.search(self.generation, plan.user, turn.vector, mask=mask, config=plan.config.dense).rows
                        for turn in plan.context)
        return dataclasses.replace(hits, context=context)

    @staticmethod
    def strong(plan: Plan, lex: lexical.LexicalHits | None) -> bool:
        """Whether the strong-lexical-signal short-circuit applies to this request."""
        return bool(lex is not None and lex.strong_signal and plan.config.lexical.strong_signal_skip
                    and "strong_signal" not in plan.disabled)

    # ------------------------------------------------------------------ RRF → … → pack
    @one_blas_thread
    def finish(self, plan: Plan, lex: lexical.LexicalHits | None, dense_hits: dense.DenseHits | None, *,
               last_access_overlay: AccessOverlay | None = None, started: float | None = None,
               leg_timings_ms: Mapping[str, float] | None = None) -> RecallResult:
        """Fuse the legs' lists, expand, late interaction, rank, diversify and pack."""
        cfg, gen, cols = plan.config, self.generation, self.columns
        started = time.perf_counter() if started is None else started
        timings = dict(plan.timings_ms)
        flags = dict(plan.flags)
        if plan.skip or not self._has_scope(plan):
            if gen is not None and not plan.skip:
                flags["empty_scope"] = "no memories for this user"
            return _nothing_found(plan, gen, timings, flags, started)
        start, end = gen.partitions[plan.user]
        mask = self._mask(plan)
        strong = self.strong(plan, lex)
        flags["strong_signal_skip"] = strong
        if strong:
            dense_hits = None  # a lexically decisive query: the dense list is not fused
        if dense_hits is not None:
            flags["dense_first_pass"] = dense_hits.first_pass
        if leg_timings_ms:
            timings.update(leg_timings_ms)
        lap = _Laps(timings)

        found = _fuse(plan, lex, dense_hits, flags)
        lap("fuse")
        if cfg.graph.enabled and "graph" not in plan.disabled and not strong and len(found.rows):
            found.added, found.graph_score, flags["graph"] = _expand(gen, found.rows, found.fused_score, start, end,
                                                                     mask, cfg, self._reachable(plan))
        found.rows = np.concatenate([found.rows, np.array(found.added, dtype=np.int64)]).astype(np.int64)
        lap("expand")
        if len(found.rows) == 0:
            return _nothing_found(plan, gen, timings, flags, started)
        _late_interaction(plan, found, gen, self._wants_late(cfg, plan.disabled), timings, flags)
        _match(plan, found, decisive=bool(lex is not None and lex.strong_signal), dense_ran=dense_hits is not None,
               filtered=mask is not None, flags=flags)
        _query_feedback(plan, found, flags)
        lap("late")
        ranked = found.ranked = _rank(plan, found, cols, last_access_overlay, gen, flags)
        lap("rank")
        order = [int(i) for i in ranked.order]
        reranked = cfg.rerank.enabled and "rerank" not in plan.disabled and len(order) > 1
        if reranked:
            order = _rerank(plan, found, order, gen, flags)
            lap("rerank")
        order = _drop_repeats(plan, found, order, gen, cols)
        selected = _diversify(plan, found, order, reranked, cols, flags)
        lap("diversify")
        packed, items = _pack(plan, found, selected, gen, cols)
        over = sum(1 for i in selected if found.dropped_by.get(i) == "budget")
        if over:
            flags["over_budget"] = over  # selected and ranked, but left out to keep within the token budget
        lap("pack")
        timings["total"] = elapsed_ms(started)
        total = sum(p.n_tokens for p in packed) + cfg.pack.separator_tokens * len(packed)
        table = None
        if plan.explain:
            table = explain_table(found, cols.ids, {p.row: n for n, p in enumerate(packed, start=1)})
        return RecallResult(plan.query, plan.user, items, total, plan.budget_tokens, timings, flags, gen.number,
                            table)


def _fuse(plan: Plan, lex: lexical.LexicalHits | None, dense_hits: dense.DenseHits | None,
          flags: dict[str, Any]) -> Candidates:
    """RRF over the legs' lists; the candidates are the head of the fused list."""
    cfg = plan.config
    weights = dict(plan.weights)
    lists: dict[str, np.ndarray] = {}
    if lex is not None:
        lists["bm25"] = lex.rows
    if dense_hits is not None:
        lists["dense"] = dense_hits.rows
    for leg, hits in (("bm25", lex), ("dense", dense_hits)):
        for j, rows in enumerate(hits.context if hits is not None else ()):
            lists[f"{leg}@context{j}"] = rows
            weights[f"{leg}@context{j}"] = plan.weights.get(leg, 0.0) * plan.context[j].weight
    for leg, hits in (("bm25", lex), ("dense", dense_hits)):
        if hits is not None and hits.window is not None:  # the leg's ranking of the window's memories
            lists[WINDOW_LISTS[leg]] = hits.window
            weights[WINDOW_LISTS[leg]] = plan.weights.get(leg, 0.0) * cfg.time.window_leg
            flags.setdefault("window_lists", {})[leg] = len(hits.window)
    if lex is not None and cfg.fusion.adaptive and "bm25" in lists:
        weights["bm25"] *= _lexical_confidence(lex)
        flags["bm25_weight"] = round(weights["bm25"], 4)
    fused = fuse.rrf(lists, k=cfg.fusion.k, weights=weights, top_rank_bonus=cfg.fusion.top_rank_bonus)
    return Candidates(
        rows=fused.rows[: max(cfg.fusion.pool, plan.k)],  # asking for k never gets fewer than k candidates
        fused_score={int(r): float(s) for r, s in zip(fused.rows, fused.scores)},
        list_rank={name: {int(r): i for i, r in enumerate(rows, start=1)} for name, rows in lists.items()},
        graph_score={}, added=[],
        bm25_score={} if lex is None else {int(r): float(s) for r, s in zip(lex.rows, lex.scores)},
    )


def _lexical_confidence(lex: lexical.LexicalHits) -> float:
    """How much the BM25 list deserves its weight: near 1 when its top hits stand out,
    lower when scores are flat (no term separates the candidates)."""
    if len(lex.scores) < 2:
        return 1.0
    top = lex.scores[: min(10, len(lex.scores))]
    spread = float((top[0] - top[-1]) / top[0]) if top[0] > 0 else 0.0
    return float(np.clip(spread * 2.0, 0.25, 1.0))


def _expand(gen, pool_rows: np.ndarray, fused_score: dict[int, float], start: int, end: int,
            mask: np.ndarray | None, cfg: RetrievalConfig,
            reachable: np.ndarray | None = None) -> tuple[list[int], dict[int, float], dict[str, Any]]:
    """Personalized PageRank from the pool's head over the memory graph: the memories it
    adds (in scope, outside the pool: the tenant's rows, and ``reachable``, online
    writes in scope that the graph links), every candidate's graph score, and what it did."""
    g = cfg.graph
    seeds = pool_rows[: g.seeds]
    weights = np.array([fused_score[int(r)] for r in seeds])
    result = expand.ppr(gen.graph, seeds, weights, damping=g.damping, max_hops=g.max_hops, max_nodes=g.max_nodes,
                        iterations=g.iterations, tolerance=g.tolerance, max_degree=g.max_degree)
    # Memories: the tenant's rows, and rows numbered past them (a Serve replica's online
    # writes: candidates, and those in scope that their session's node links).
    in_range = (result.nodes >= start) & (result.nodes < end)
    memory = in_range | np.isin(result.nodes, pool_rows)
    if reachable is not None:
        memory |= np.isin(result.nodes, reachable)
    nodes, scores, in_range = result.nodes[memory], result.scores[memory], in_range[memory]
    if mask is not None:  # the scope filter, over the tenant's rows; candidates are in scope already
        keep = ~in_range
        keep[in_range] = mask[nodes[in_range] - start]
        nodes, scores = nodes[keep], scores[keep]
    # Vectorised: the subgraph holds up to max_nodes memories, and a Python loop over
    # them would cost as much as PPR itself.
    non_seed = ~np.isin(nodes, seeds)
    mass = float(scores[non_seed].sum())
    total = float(scores.sum()) or 1.0
    if mass / total > g.max_mass and mass > 0:  # cap the share that non-seed memories carry
        scores = scores.copy()
        scores[non_seed] *= g.max_mass * total / mass
    fresh = (scores > 0) & ~np.isin(nodes, pool_rows)
    fresh_nodes, fresh_scores = nodes[fresh], scores[fresh]
    added = [int(n) for n in fresh_nodes[np.lexsort((fresh_nodes, -fresh_scores))][: g.max_new]]
    # Graph proximity is read only for the candidates: the pool and what expansion added.
    wanted = np.isin(nodes, np.concatenate([pool_rows, np.array(added, dtype=np.int64)]))
    score_of = {int(n): float(s) for n, s in zip(nodes[wanted], scores[wanted])}
    info = {"method": result.method, "subgraph_nodes": result.subgraph_nodes, "added": len(added)}
    return added, score_of, info


def _late_interaction(plan: Plan, found: Candidates, gen: Any, wants_late: bool, timings: dict[str, float],
                      flags: dict[str, Any]) -> None:
    """The candidates' sentence vectors and their cosine with the query; with the
    query's tokens and the generation's, MaxSim (ColBERT late interaction) too."""
    found.vectors = np.asarray(gen.vectors[found.rows]).astype(np.float32, copy=False)  # stored as float16
    found.cosine = found.vectors @ plan.query_vector
    if plan.context:
        found.context_cosine = _context_cosine(found.vectors, plan.context)
    query_tokens = plan.tokens() if wants_late else None
    if query_tokens is not None:
        found.late_scores = late.maxsim(query_tokens, gen.late, found.rows)
        flags["late"] = int(np.count_nonzero(~np.isnan(found.late_scores)))
        timings.update((name, plan.timings_ms[name]) for name in ("embed_tokens", "wait_tokens")
                       if name in plan.timings_ms)


def _context_cosine(vectors: np.ndarray, context: Sequence[ContextTurn], *, unadapted: bool = False) -> np.ndarray:
    """Each candidate's cosine with the context turns, weighted by turn (``unadapted``:
    with the turns' vectors before the query adapter moved them)."""
    weights = np.array([t.weight for t in context])
    turns = np.stack([t.unadapted if unadapted and t.unadapted is not None else t.vector for t in context])
    return (vectors @ turns.T) @ weights / weights.sum()


def _match(plan: Plan, found: Candidates, *, decisive: bool, dense_ran: bool, filtered: bool,
           flags: dict[str, Any]) -> None:
    """``flags.match``: the closest candidate's cosine with the query (before any
    feedback moves it; for a follow-up, with its context turns where that is closer) and
    whether it is below ``dense.weak_match_below``: the memories in scope likely hold
    nothing on the question's topic (``filtered``: the scope's mask narrows the tenant by
    project, types, time or pinned). Never weak when BM25 found a decisive match (the store holds
    the query's words). Not read without a dense list (no query vector, a leg that did
    not answer, a lexically decisive query). Where the store's query adapter moved the
    vectors, the cosines are the encoder's own vectors', which the threshold was set on."""
    below = plan.config.dense.weak_match_below
    if below <= 0 or not len(found.rows) or not dense_ran:
        return
    assert found.cosine is not None and found.vectors is not None
    cosine, context = found.cosine, found.context_cosine
    if plan.unadapted is not None:
        cosine = found.vectors @ plan.unadapted
        context = _context_cosine(found.vectors, plan.context, unadapted=True) if plan.context else None
    best = float(np.max(cosine))
    if context is not None:
        best = max(best, float(np.max(context)))
    flags["match"] = {"weak": best < below and not decisive, "cosine": round(best, 4), "below": below,
                      "filtered": filtered}


def _query_feedback(plan: Plan, found: Candidates, flags: dict[str, Any]) -> None:
    """``rank.query_feedback``: the candidates' cosine taken again with the query vector
    moved towards the mean of the most similar candidates (Rocchio); the flags say how
    many were read. Only candidates that both the query's BM25 and its dense list hold
    are read (not its context turns' lists): the closest candidates by meaning alone can
    be a run of turns that share none of the question's words (docs/quality.md). With no
    such candidate (a lexically decisive query fuses no dense list; a leg off) the
    cosine stays the query's own and the flags say 0."""
    cfg = plan.config
    share = cfg.rank.query_feedback
    if share <= 0 or len(found.rows) < 2:
        return
    assert found.cosine is not None and found.vectors is not None
    dense_list, bm25_list = found.list_rank.get("dense", {}), found.list_rank.get("bm25", {})
    both = np.array([int(row) in dense_list and int(row) in bm25_list for row in found.rows], dtype=bool)
    flags["query_feedback"] = top_n = min(cfg.rank.query_feedback_top, int(both.sum()))
    if not top_n:
        return
    eligible = np.where(both, late.blend(found.cosine, found.late_scores, cfg.late.weight), -np.inf)
    top = np.argsort(-eligible, kind="stable")[:top_n]
    moved = plan.query_vector + share * found.vectors[top].mean(axis=0)
    found.cosine = found.vectors @ (moved / max(float(np.linalg.norm(moved)), 1e-12))


def _time_of(query: str, now: dt.datetime, cfg: RetrievalConfig, disabled: frozenset[str],
             flags: dict[str, Any]) -> tuple[when.TimeWindow | None, bool]:
    """The span of time ``query`` names, read against ``now``, and whether it asks for a
    time (both off with ``time.enabled`` false or "time" disabled); shown in the flags."""
    if not cfg.time.enabled or "time" in disabled:
        return None, False
    window, asks = when.query_window(query, now), when.asks_when(query)
    if window is not None or asks:
        flags["time"] = {"window": window.as_dict(now.tzinfo) if window is not None else None, "asks_when": asks}
    return window, asks


def _intent_of(query: str, cfg: RetrievalConfig, disabled: frozenset[str]) -> intent.Intent | None:
    """Whether ``query`` asks for code or for its history (None with "intent" disabled,
    or with neither ``rank.intent_boost`` nor ``rank.container_share`` on)."""
    if (cfg.rank.intent_boost <= 0 and cfg.rank.container_share <= 0) or "intent" in disabled:
        return None
    return intent.read(query)


def _intent_boost(plan: Plan, types: np.ndarray, ids: Any, flags: dict[str, Any]) -> np.ndarray | None:
    """Per candidate: 1 + ``rank.intent_boost`` for what the query's intent favours
    (:func:`intent.favoured`, by type and, for code, by id: ``ids`` are read for a
    question for code over a pool holding code), 1 for the rest; None (no change)
    without an intent or without code among the candidates. Shown in the flags as
    ``intent``."""
    if plan.intent is None or plan.config.rank.intent_boost <= 0:
        return None
    applied = bool(np.any(types == "code"))
    flags["intent"] = {"read": plan.intent, "applied": applied}
    if plan.intent == "code":
        flags["intent"]["tests"] = intent.asks_for_tests(plan.query)
    if not applied:
        return None
    ids = ids if plan.intent == "code" else [None] * len(types)  # ids are read only to tell tests apart
    return np.where(intent.favoured(plan.intent, plan.query, types, ids), 1.0 + plan.config.rank.intent_boost, 1.0)


def _wants_containers(plan: Plan) -> bool:
    """Whether code memories take a share of their container's score
    (``rank.container_share``): not for a question asking why."""
    return plan.config.rank.container_share > 0 and plan.intent != "history"


def _containers(plan: Plan, types: np.ndarray, ids: Any,
                flags: dict[str, Any]) -> tuple[list[str], list[str | None]] | None:
    """Each candidate's memory (a chunk's parent) and the nearest memory enclosing it
    among the candidates (:func:`~helix_ray.schema.code_containers`), or None when no
    candidate's container is a candidate. For a question for code, only the code its
    intent favours takes a share (not tests, unless it asks for them). Shown in the
    flags as ``containers``: how many candidates took a share of their container's score."""
    memories = [_parent(str(i)) or str(i) for i in ids]
    present = set(memories)
    asked = (intent.favoured(plan.intent, plan.query, types, ids) if plan.intent == "code"
             else np.ones(len(memories), dtype=bool))
    containers = [next((c for c in code_containers(m) if c in present), None) if wanted else None
                  for m, wanted in zip(memories, asked.tolist())]
    members = sum(c is not None for c in containers)
    if not members:
        return None
    flags["containers"] = members
    return memories, containers


def _time_boost(plan: Plan, rows: np.ndarray, cols: Any, gen: Any, flags: dict[str, Any]) -> np.ndarray | None:
    """Per candidate: (1 + window_boost · how far inside the query's window it was created)
    × (1 + when_boost if the question asks for a time and the memory states one). The
    flags' ``time.inside`` counts the candidates the window raised: 0 says it changed
    nothing (no memory of that time, or a ``now`` other than the asker's)."""
    if plan.window is None and not plan.asks_when:
        return None
    t = plan.config.time
    boost = np.ones(len(rows))
    if plan.window is not None and t.window_boost > 0:
        created = np.asarray(cols.created_at[rows], np.int64)
        inside = window_weights(plan.window, created)
        if t.stated_dates:
            inside = np.maximum(inside, [_states_date_in(plan.window, gen.text(int(r))[:TIME_TEXT_CHARS], int(c))
                                         for r, c in zip(rows, created)])
        boost *= 1.0 + t.window_boost * inside
        flags["time"] = {**flags.get("time", {}), "inside": int(np.count_nonzero(inside > 0))}
    if plan.asks_when and t.when_boost > 0:
        boost *= 1.0 + t.when_boost * np.array([_states_time(gen.text(int(r))[:TIME_TEXT_CHARS]) for r in rows],
                                                dtype=np.float64)
    return boost


def _speaker_boost(plan: Plan, rows: np.ndarray, types: np.ndarray, cols: Any, gen: Any,
                   flags: dict[str, Any]) -> np.ndarray | None:
    """Per candidate: 1 + ``rank.speaker_boost`` for a conversation turn (episodic, with a
    session) spoken by a speaker the query names, where the pool's turns have two or more
    speakers and the query names some but not all of them; None otherwise. Shown in the
    flags as ``speaker`` (the speakers named)."""
    if plan.config.rank.speaker_boost <= 0 or "speaker" in plan.disabled:
        return None
    sessions = cols.sessions[rows]
    speakers: list[str | None] = [None] * len(rows)
    for i in np.flatnonzero(types == "episodic").tolist():
        if sessions[i]:
            speakers[i] = scope.speaker_of(gen.text(int(rows[i])))
    present = {s for s in speakers if s is not None}
    named = scope.named_speakers(plan.query, present) if len(present) >= 2 else set()
    if not named or named == present:
        return None
    flags["speaker"] = sorted(named)
    return np.where([s in named for s in speakers], 1.0 + plan.config.rank.speaker_boost, 1.0)


def _boosts(*boosts: np.ndarray | None) -> np.ndarray | None:
    """The product of the per-candidate multipliers given (None: none given)."""
    given = [b for b in boosts if b is not None]
    return functools.reduce(np.multiply, given) if given else None


#: Characters of a memory read for whether it states a time (a chunk's or turn's opening).
TIME_TEXT_CHARS = 400


@functools.lru_cache(maxsize=65_536)
def _states_time(text: str) -> bool:
    return when.has_time(text)


@functools.lru_cache(maxsize=65_536)
def _stated_dates(text: str, created_us: int) -> tuple[tuple[dt.datetime, dt.datetime], ...]:
    """The windows of the days, weeks, months and years ``text`` states, read against when
    it was written ("last night" in a memory of 2 May is 1 May)."""
    written = dt.datetime.fromtimestamp(created_us / 1e6, dt.timezone.utc)
    return tuple(w for w in map(when.key_window, when.mentions(text, written)) if w is not None)


def _states_date_in(window: when.TimeWindow, text: str, created_us: int) -> float:
    """1.0 when ``text`` states a day, week, month or year that lies inside ``window``."""
    return float(any(window.start <= first and last <= window.end for first, last in _stated_dates(text, created_us)))


def window_weights(window: when.TimeWindow, created_us: np.ndarray) -> np.ndarray:
    """:meth:`TimeWindow.weight` of each creation time (epoch µs), vectorised: 1 inside
    the core window, falling linearly to 0 at the soft edges, 0 outside."""
    def us(moment: dt.datetime) -> float:
        try:
            return moment.timestamp() * 1e6
        except (OverflowError, ValueError, OSError):  # an open end (datetime.min / max)
            return -np.inf if moment.year < 1970 else np.inf

    start, core_start, core_end, end = (us(m) for m in (window.start, window.core_start, window.core_end, window.end))
    t = created_us.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rising = np.where(core_start > start, (t - start) / (core_start - start), 1.0)
        falling = np.where(end > core_end, (end - t) / (end - core_end), 1.0)
    weight = np.where(t < core_start, rising, np.where(t >= core_end, falling, 1.0))
    return np.where((t >= start) & (t < end), np.clip(weight, 0.0, 1.0), 0.0)


def _lexical_share(cfg: Any, n_tokens: np.ndarray) -> float | np.ndarray:
    """Per candidate, the share of its similarity that its BM25 score carries
    (``rank.lexical_weight``, more for the part of a long memory the encoders never read)."""
    w, window = cfg.lexical_weight, cfg.lexical_beyond_tokens
    if not window:
        return w
    unread = 1.0 - np.minimum(1.0, window / np.maximum(np.asarray(n_tokens, dtype=np.float64), 1.0))
    return w + (1.0 - w) * unread


def _rank(plan: Plan, found: Candidates, cols: Any, last_access_overlay: AccessOverlay | None,
          gen: Any, flags: dict[str, Any]) -> rank.Ranked:
    """Score the candidates by type-weighted signals (similarity, recency, salience,
    confidence, graph), times the time, intent and speaker boosts, code memories taking a
    share of their container's score; recency reads the newest of the generation's and
    the overlay's last access."""
    cfg, rows = plan.config, found.rows
    types = np.asarray(cols.types[rows])
    # Ids (a read per candidate) only where code is among the candidates and a rule reads them.
    code = bool(np.any(types == "code"))
    ids = cols.ids[rows] if code and (plan.intent == "code" or _wants_containers(plan)) else None
    assert found.cosine is not None  # filled by the late-interaction stage
    last_access = cols.last_accessed_at[rows].copy()
    if cfg.rank.recency_from_creation:
        last_access = np.where(last_access > 0, last_access, cols.created_at[rows])
    if last_access_overlay:
        for i, r in enumerate(rows):
            seen = last_access_overlay.get(int(r))
            if seen is not None and seen > last_access[i]:
                last_access[i] = seen
    return rank.rank(
        types=types, cosine=late.blend(found.cosine, found.late_scores, cfg.late.weight),
        fused=np.array([found.fused_score.get(int(r), 0.0) for r in rows]),
        last_access_us=last_access, salience=cols.salience[rows], confidence=cols.confidence[rows],
        graph=np.array([found.graph_score.get(int(r), 0.0) for r in rows]),
        projects=cols.projects[rows], pinned=cols.pinned[rows], now_us=plan.now_us, config=cfg.rank,
        project=plan.scope.project if plan.scope.project_mode == "prefer" else None,
        disabled=frozenset(d for d in plan.disabled if d in rank.SIGNALS),
        lexical=np.array([found.bm25_score.get(int(r), 0.0) for r in rows])
        if found.bm25_score and (cfg.rank.lexical_weight or cfg.rank.lexical_beyond_tokens) else None,
        lexical_share=_lexical_share(cfg.rank, cols.n_tokens[rows]),
        context=found.context_cosine, context_share=cfg.context.similarity_share,
        boost=_boosts(_time_boost(plan, rows, cols, gen, flags), _intent_boost(plan, types, ids, flags),
                      _speaker_boost(plan, rows, types, cols, gen, flags)),
        parents=[_parent(str(i)) for i in cols.ids[rows]] if cfg.rank.chunk_support > 0 else None,
        containers=_containers(plan, types, ids, flags) if ids is not None and _wants_containers(plan) else None,
    )


def _rerank(plan: Plan, found: Candidates, order: list[int], gen: Any, flags: dict[str, Any]) -> list[int]:
    """The cross-encoder re-orders the head of the ranked order (``rerank.depth``)."""
    head = order[: plan.config.rerank.depth]
    order, _ = rerank.rerank(plan.query, order, [gen.text(int(found.rows[i])) for i in head], plan.config.rerank)
    flags["reranked"] = len(head)
    return order


def _drop_repeats(plan: Plan, found: Candidates, order: list[int], gen: Any, cols: Any) -> list[int]:
    """The order without near-duplicates (MinHash) and without the chunks beyond each
    source document's cap."""
    cfg = plan.config
    if "dedup" not in plan.disabled:
        order, dups = diversify.drop_near_duplicates(order, np.asarray(gen.minhash[found.rows]),
                                                     cfg.diversity.dedup_threshold)
        found.dropped_by.update({i: "near_duplicate" for i in dups})
    rows = np.asarray(found.rows, dtype=np.int64)
    docs = [_parent(str(i)) or d for i, d in zip(cols.ids[rows], cols.documents[rows])]
    order, capped = diversify.cap_per_document(order, docs, cfg.diversity.max_per_document)
    found.dropped_by.update({i: "document_cap" for i in capped})
    return order


def _diversify(plan: Plan, found: Candidates, order: list[int], reranked: bool, cols: Any,
               flags: dict[str, Any]) -> list[int]:
    """The k candidates kept: MMR (after the best of each session, in ``session`` mode)
    over the order, or its head when diversity is off."""
    cfg, k, rows = plan.config, plan.k, found.rows
    mode = cfg.diversity.mode
    if mode == "auto":
        mode = "session" if diversify.is_aggregation(plan.query) else "mmr"
    mmr_ran = not ("mmr" in plan.disabled or mode == "none")
    if not mmr_ran:
        selected = order[:k]
    else:
        assert found.ranked is not None and found.vectors is not None  # filled by the late and rank stages
        relevance = rank.minmax(found.ranked.scores)
        if reranked:  # the cross-encoder's order is the relevance MMR trades off
            relevance = np.zeros(len(rows))
            relevance[np.array(order)] = 1.0 - np.arange(len(order)) / len(order)
        similarity = found.vectors @ found.vectors.T
        seed = diversify.session_first(order, [cols.sessions[int(r)] for r in rows], k) if mode == "session" else []
        selected = diversify.mmr(order, relevance, similarity, cfg.diversity.mmr_lambda, k, picked=seed)
    flags["diversity"] = mode if mmr_ran else "none"
    chosen = set(selected)
    found.dropped_by.update({i: ("mmr" if mmr_ran else "k") for i in order if i not in chosen})
    return selected


def _pack(plan: Plan, found: Candidates, selected: list[int], gen: Any,
          cols: Any) -> tuple[list[pack.Packed], list[RecallItem]]:
    """Fit the kept candidates into the token budget (lost-in-the-middle order): what was
    packed, and the result's items."""
    cfg, rows = plan.config, found.rows
    assert found.ranked is not None  # filled by the rank stage
    ranked = found.ranked
    items = [pack.PackItem(row=i, text=gen.text(int(rows[i])), n_tokens=int(cols.n_tokens[rows[i]]))
             for i in selected]
    packed = pack.pack(items, plan.budget_tokens, separator_tokens=cfg.pack.separator_tokens,
                       encoding_name=cfg.pack.encoding)
    shown: set[int] = set()  # generation rows whose text a widened chunk took in
    if cfg.pack.widen_chunks:
        packed, shown = _widen(plan, packed, gen, cols, rows)
    packed_set = {p.row for p in packed}
    found.dropped_by.update({i: "budget" if int(rows[i]) not in shown else "in_neighbour"
                             for i in selected if i not in packed_set})
    result_items = []
    for p in packed:
        r = int(rows[p.row])
        result_items.append(RecallItem(
            id=str(cols.ids[r]), text=p.text, type=str(cols.types[r]), rank=p.rank,
            score=round(float(ranked.scores[p.row]), 6), n_tokens=p.n_tokens, truncated=p.truncated,
            created_at=iso(cols.created_at[r]), session_id=cols.sessions[r], project=cols.projects[r],
            signals={s: round(float(ranked.signals[s][p.row]), 4) for s in rank.SIGNALS},
            parent=_parent(str(cols.ids[r])),
        ))
    return packed, result_items


def _widen(plan: Plan, packed: list[pack.Packed], gen: Any, cols: Any,
           rows: np.ndarray) -> tuple[list[pack.Packed], set[int]]:
    """Packed chunks widened with their neighbouring chunks while the budget has room:
    best items first, the next chunk's own text appended, then the previous chunk put in
    front; and the generation rows of the neighbours taken in. Only neighbours stored
    next to each other in the generation (as ingest writes a memory's chunks) are read; a
    chunk whose neighbours are elsewhere, or that a Serve replica holds in its delta
    (written since the last compaction), stays as it is."""
    cfg = plan.config.pack
    left = plan.budget_tokens - sum(p.n_tokens + cfg.separator_tokens for p in packed)
    base = gen if hasattr(gen, "memories") else getattr(gen, "base", None)  # Serve: the generation under its delta
    if left <= 0 or base is None or not any("#chunk" in str(cols.ids[int(rows[p.row])]) for p in packed):
        return packed, set()
    metadata = base.metadata
    size = base.size  # rows past it are the delta's: their chunks stay as they are
    taken = {int(rows[p.row]) for p in packed}
    count = token_counter(cfg.encoding)

    def own_from(row: int) -> int | None:
        place = json.loads(metadata[row] or "{}").get("chunk") or {}
        return place.get("own_from") if isinstance(place.get("own_from"), int) else None

    out, held = list(packed), set(taken)
    for i in sorted(range(len(out)), key=lambda i: out[i].rank):
        p, row = out[i], int(rows[out[i].row])
        match = CHUNK_ID.match(str(cols.ids[row]))
        if match is None or p.truncated or row >= size:
            continue
        parent, n, text = match.group("parent"), int(match.group("n")), p.text
        for step in (1, -1):
            near = row + step
            if not 0 <= near < size or near in taken or str(cols.ids[near]) != chunk_id(parent, n + step):
                continue
            start = own_from(near if step == 1 else row)
            if start is None:
                continue
            wider = text + "\n" + gen.text(near)[start:] if step == 1 else gen.text(near) + "\n" + text[start:]
            n_tokens = count(wider)
            if n_tokens - out[i].n_tokens <= left:
                left -= n_tokens - out[i].n_tokens
                out[i] = dataclasses.replace(out[i], text=wider, n_tokens=n_tokens)
                text = wider
                taken.add(near)
    return out, taken - held


class _Laps:
    """Stage timings: each call records, under its name, the milliseconds since the last."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.clock = timings, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round((now - self.clock) * 1000.0, 3)
        self.clock = now


def _nothing_found(plan: Plan, gen: Any, timings: dict[str, float], flags: dict[str, Any],
                   started: float) -> RecallResult:
    """The result of a recall without candidates (skipped, out of scope, or empty legs)."""
    plan.drop_tokens()
    timings["total"] = elapsed_ms(started)
    return RecallResult(plan.query, plan.user, [], 0, plan.budget_tokens, timings, flags,
                        gen.number if gen is not None else None, empty_explain() if plan.explain else None)


def _parent(memory_id: str) -> str | None:
    """:func:`~helix_ray.schema.parent_of`, without a regex for the ids that are no chunk."""
    return parent_of(memory_id) if "#chunk" in memory_id else None


