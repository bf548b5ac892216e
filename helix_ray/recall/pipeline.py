"""The query path, in flow order: embed → scope/route → (the store's query adapter, if
any) → BM25 ∥ dense → RRF → graph expansion → late interaction → ranking → diversity →
packing. Pure Python over a memory-mapped generation; imports no Ray (the Serve
deployments call these same functions).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from helix_ray.config import RetrievalConfig
from helix_ray.recall import dense, diversify, expand, fuse, late, lexical, pack, rank, rerank, scope
from helix_ray.recall.embed import embed_query

STAGES = ("embed", "route", "bm25", "dense", "fuse", "expand", "late", "rank", "diversify", "pack")


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
class RecallItem:
    id: str
    text: str
    type: str
    rank: int  # 1-based rank after ranking and diversity (before lost-in-the-middle order)
    score: float
    n_tokens: int
    truncated: bool
    created_at: str
    session_id: str | None
    project: str | None
    signals: dict[str, float] = field(default_factory=dict)


_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(RecallItem) if f.name != "signals")


@dataclass(frozen=True)
class RecallResult:
    query: str
    user: str
    items: list[RecallItem]  # final (packed, lost-in-the-middle) order
    total_tokens: int
    budget_tokens: int
    timings_ms: dict[str, float]
    flags: dict[str, Any]
    generation: int | None
    explain: Any = None  # polars.DataFrame when explain=True

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; a copy (the caller may add to its flags and timings).
        Written out rather than ``dataclasses.asdict``, which deep-copies field by field
        and cost ~0.4 ms per request in a Serve replica (docs/benchmarks.md)."""
        out: dict[str, Any] = {
            "query": self.query, "user": self.user,
            "items": [{**{name: getattr(item, name) for name in _ITEM_FIELDS}, "signals": dict(item.signals)}
                      for item in self.items],
            "total_tokens": self.total_tokens, "budget_tokens": self.budget_tokens,
            "timings_ms": dict(self.timings_ms),
            "flags": {k: list(v) if isinstance(v, (list, tuple)) else dict(v) if isinstance(v, dict) else v
                      for k, v in self.flags.items()},
            "generation": self.generation,
        }
        if self.explain is not None:
            out["explain"] = self.explain.to_dicts()
        return out

    def context(self, separator: str = "\n\n") -> str:
        """The packed memories as one string, in final order."""
        return separator.join(item.text for item in self.items)


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
    # The query's token encoding while it still runs on another core (see Recaller.plan):
    # (tokens, encoder ms). Read the tokens through tokens(), which waits for it.
    pending_tokens: Future | None = field(default=None, repr=False, compare=False)

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
            self.timings_ms["wait_tokens"] = _ms(clock)
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
        return dict(self.__dict__)


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


class _BlasOnCaller:
    """While a recall runs, numpy's and scipy's BLAS compute on the calling thread
    alone. The query path's products are small (MMR, MaxSim, a few hundred rows), and an
    idle OpenBLAS worker spins for a while after each call on the other core: the very
    core the query's token encoder runs on. Measured in-process on a LoCoMo store (2
    cores): recall p50 19 ms with BLAS threads, 13 ms without (docs/benchmarks.md).

    OpenBLAS's thread count is the process's. The recall that enters when no other holds
    the limit sets it (~10 µs) and, when it leaves, restores the caller's setting and gives
    up threadpoolctl's control; a recall that starts on another thread meanwhile runs
    under that limit and never sets or restores anything (a restore from it would put
    back the limit itself, for good)."""

    def __init__(self) -> None:
        self._local = threading.local()  # this thread's nesting depth
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread whose recall set the limit
        self._limiter: Any = None
        self._controller: Any = None

    def __enter__(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        with self._lock:
            if self._owner is not None:
                return
            if self._controller is None:
                from threadpoolctl import ThreadpoolController

                self._controller = ThreadpoolController()  # numpy and scipy are loaded by now
            limiter = self._controller.limit(limits=1, user_api="blas")
            limiter.__enter__()  # threadpoolctl's ownership count: released by __exit__
            self._owner, self._limiter = threading.current_thread(), limiter

    def __exit__(self, *exc: Any) -> None:
        self._local.depth -= 1
        if self._local.depth:
            return
        with self._lock:
            if self._owner is threading.current_thread():
                limiter, self._limiter, self._owner = self._limiter, None, None
                limiter.__exit__(None, None, None)  # restores the limits, then gives up the control


_blas_on_caller = _BlasOnCaller()


def _one_blas_thread(method: Any) -> Any:
    """Run ``method`` inside :data:`_blas_on_caller`."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _blas_on_caller:
            return method(*args, **kwargs)

    return wrapped


def encoder_threads(generation: Any, config: RetrievalConfig | None = None) -> int | None:
    """onnxruntime threads for an in-process recaller's two query encoders: half the
    cores each when the query's tokens will be encoded alongside its sentence vector (a
    generation with token vectors, late interaction on, two cores or more), so the two do
    not spin against each other (measured on 2 cores: one each); otherwise None,
    onnxruntime's default (every core)."""
    from helix_ray.runtime import usable_cores

    late_on = _late_on(config or RetrievalConfig()) and generation is not None and generation.late is not None
    cores = usable_cores()
    return cores // 2 if late_on and cores > 1 else None


def _late_on(cfg: RetrievalConfig, disabled: frozenset[str] = frozenset()) -> bool:
    """The late-interaction stage is switched on (whether the generation has tokens aside)."""
    return cfg.late.enabled and cfg.late.weight > 0 and "late" not in disabled


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _token_pool() -> ThreadPoolExecutor:
    """The threads that encode queries' late-interaction tokens alongside the rest of
    their recall (one per core beyond the caller's; created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from helix_ray.runtime import usable_cores

            _pool = ThreadPoolExecutor(max(1, usable_cores() - 1), thread_name_prefix="helix-query-tokens")
        return _pool


def _encode_tokens(encoder: Any, query: str) -> tuple[np.ndarray, float]:
    clock = time.perf_counter()
    return encoder.encode_query(query).astype(np.float16), _ms(clock)


class Recaller:
    """Holds what recall needs between queries: the generation, the embedder, the router.

    :meth:`recall` runs every stage in order. The stages are also exposed in the groups a
    distributed deployment needs — :meth:`plan` (check, embed, route), :meth:`lexical_leg`,
    :meth:`dense_leg` (independent of each other) and :meth:`finish` (fuse, expand, rank,
    diversify, pack) — and ``recall`` is exactly their composition.
    """

    _overlap_tokens = False  # set by __init__ (subclasses that skip it never overlap)

    def __init__(self, generation, embedder, config: RetrievalConfig | None = None, token_encoder=None,
                 threads: int | None = None, adapter=None):
        self.generation = generation
        self.embedder = embedder
        self.adapter = adapter  # a QueryAdapter (stage 1b) or None
        self.config = config or RetrievalConfig()
        self._router: scope.Router | None = None
        self._token_encoder = token_encoder
        self._threads = threads  # onnxruntime threads of the query token encoder (None: default)
        # Encode a query's tokens on another thread while the sentence vector and the legs
        # run here: only when the two encoders' threads fit in the cores together (with
        # onnxruntime's default, every core each, overlapping was slower: docs/benchmarks.md).
        from helix_ray.runtime import usable_cores

        self._overlap_tokens = bool(threads) and 2 * (threads or 0) <= usable_cores()

    @property
    def token_encoder(self):
        """Loaded on first use: only :meth:`plan` encodes query tokens."""
        if self._token_encoder is None:
            from helix_ray.token_encoder import get_token_encoder

            self._token_encoder = get_token_encoder(threads=self._threads)
        return self._token_encoder

    def _wants_late(self, cfg: RetrievalConfig, disabled: frozenset[str]) -> bool:
        """Late interaction is on and the generation has token vectors (a replica that
        holds no generation, such as the Serve Embedder, cannot tell: it encodes)."""
        return _late_on(cfg, disabled) and (self.generation is None or self.generation.late is not None)

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

    @_one_blas_thread
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
        now: dt.datetime | None = None,
        last_access_overlay: AccessOverlay | None = None,
        disabled: frozenset[str] = frozenset(),
        config: RetrievalConfig | None = None,
    ) -> RecallResult:
        """Recall memories of ``user`` for ``query``, packed into ``budget_tokens``.

        ``disabled`` turns stages off for ablations: any of "dense", "bm25", "graph",
        "late", "mmr", "recency", "strong_signal", "router", "dedup", "rerank".
        """
        started = time.perf_counter()
        plan = self.plan(query, user=user, budget_tokens=budget_tokens, k=k, project=project, types=types,
                         since=since, until=until, pinned=pinned, project_mode=project_mode, explain=explain,
                         now=now, disabled=disabled, config=config)
        lex = dense_hits = None
        legs: dict[str, float] = {}
        try:
            if not plan.skip and self._has_scope(plan):
                clock = time.perf_counter()
                lex = self.lexical_leg(plan)
                legs["bm25"] = _ms(clock)
                clock = time.perf_counter()
                dense_hits = None if self.strong(plan, lex) else self.dense_leg(plan)
                legs["dense"] = _ms(clock)
            return self.finish(plan, lex, dense_hits, last_access_overlay=last_access_overlay, started=started,
                               leg_timings_ms=legs)
        finally:
            plan.drop_tokens()  # a leg or finish that raised, or returned before the late stage

    # ------------------------------------------------------------------ stages 1–2
    @_one_blas_thread
    def plan(self, query: str, *, user: str, budget_tokens: int | None = None, k: int | None = None,
             project: str | None = None, types: Sequence[str] | str | None = None, since: Any = None,
             until: Any = None, pinned: bool | None = None, project_mode: str = "filter", explain: bool = False,
             now: dt.datetime | None = None, disabled: frozenset[str] = frozenset(),
             config: RetrievalConfig | None = None, query_vector: np.ndarray | None = None) -> Plan:
        """Check the request, embed the query (unless ``query_vector`` is given) and route."""
        cfg = config or self.config
        budget_tokens = cfg.default_budget_tokens if budget_tokens is None else budget_tokens
        k = cfg.default_k if k is None else k
        sc = scope.make_scope(query=query, user=user, budget_tokens=budget_tokens, k=k, project=project,
                              types=types, since=since, until=until, pinned=pinned, project_mode=project_mode)
        timings: dict[str, float] = {}
        flags: dict[str, Any] = {"router_skip": False, "strong_signal_skip": False, "degraded": []}
        clock = time.perf_counter()
        query_tokens = pending = None
        has_memories = self.generation is None or user in self.generation.partitions  # else nothing to re-score
        if has_memories and self._wants_late(cfg, frozenset(disabled)):
            # The token encoder (~2x the sentence encoder's time: 32 positions) is needed
            # only at the late-interaction stage: on a second core it runs alongside the
            # sentence embedding and the legs instead of before them.
            if self._overlap_tokens:
                pending = _token_pool().submit(_encode_tokens, self.token_encoder, query)
            else:
                query_tokens, _ = _encode_tokens(self.token_encoder, query)
        try:
            encoded = own_vector = query_vector is None
            if query_vector is None:
                query_vector = embed_query(self.embedder, query)
            if encoded or query_tokens is not None:  # the query-encoding stage (tokens: unless overlapped)
                timings["embed"] = _ms(clock)
            clock = time.perf_counter()
            if "router" not in disabled:
                route = self.router.route(query, query_vector, cfg.router)
                flags["route"] = {"skip": route.skip, "reason": route.reason,
                                  "no_memory_similarity": round(route.no_memory_similarity, 4),
                                  "memory_similarity": round(route.memory_similarity, 4)}
                flags["router_skip"] = route.skip
            timings["route"] = _ms(clock)
            if own_vector and self.adapter is not None:  # after routing: the router's prototypes are raw vectors
                query_vector = self.adapter.apply(query_vector)
                flags["query_adapter"] = True
            weights = {name: (0.0 if name in disabled else w) for name, w in cfg.fusion.weights.items()}
            if not any(weights.values()):
                weights = {"dense": 1.0, "bm25": 0.0}
            now = now or dt.datetime.now(dt.timezone.utc)
            now_us = int((now if now.tzinfo else now.replace(tzinfo=dt.timezone.utc)).timestamp() * 1_000_000)
            plan = Plan(query, user, sc, cfg, k, budget_tokens, explain, frozenset(disabled), now_us, weights,
                        query_vector, flags, timings, query_tokens, pending)
        except BaseException:
            if pending is not None:
                pending.cancel()  # the plan is never built: nothing will wait for them
            raise
        if plan.skip:
            plan.drop_tokens()  # no stage will read them
        return plan

    #: The stages a plan without a query vector leaves out: those that read the vector.
    NO_VECTOR = frozenset({"dense", "late", "router"})

    def plan_without_vector(self, query: str, *, user: str, config: RetrievalConfig | None = None,
                            disabled: frozenset[str] = frozenset(), **request: Any) -> Plan:
        """A plan for the lexical leg alone, for when no query vector can be had (the Serve
        Embedder has no live replica): checked as :meth:`plan` does, with the dense leg,
        late interaction and the router off, and the similarity signal made of the fused
        (BM25) rank alone (``similarity_blend`` 0: there is no cosine); needs no model."""
        from helix_ray.embedder import DIM

        cfg = config or self.config
        cfg = cfg.model_copy(update={"rank": cfg.rank.model_copy(update={"similarity_blend": 0.0})})
        return self.plan(query, user=user, config=cfg, disabled=frozenset(disabled) | self.NO_VECTOR,
                         query_vector=np.zeros(DIM, dtype=np.float32), **request)

    def _has_scope(self, plan: Plan) -> bool:
        return self.generation is not None and plan.user in self.generation.partitions

    def _mask(self, plan: Plan) -> np.ndarray | None:
        start, end = self.generation.partitions[plan.user]
        return scope.build_mask(self.generation.scope_columns, start, end, plan.scope)

    # ------------------------------------------------------------------ stage 3
    def lexical_leg(self, plan: Plan) -> lexical.LexicalHits | None:
        """BM25 top-k inside the scope; None when its list weight is 0."""
        if plan.weights.get("bm25", 0) <= 0 or not self._has_scope(plan):
            return None
        start, end = self.generation.partitions[plan.user]
        lx = plan.config.lexical
        return lexical.search(self.generation.bm25, plan.query, start=start, end=end, mask=self._mask(plan),
                              top_k=lx.top_k, strong_score=lx.strong_signal_score, strong_gap=lx.strong_signal_gap)

    @_one_blas_thread
    def dense_leg(self, plan: Plan) -> dense.DenseHits | None:
        """Dense top-k inside the scope; None when its list weight is 0."""
        if plan.weights.get("dense", 0) <= 0 or not self._has_scope(plan):
            return None
        return dense.search(self.generation, plan.user, plan.query_vector, mask=self._mask(plan),
                            config=plan.config.dense)

    @staticmethod
    def strong(plan: Plan, lex: lexical.LexicalHits | None) -> bool:
        """Whether the strong-lexical-signal short-circuit applies to this request."""
        return bool(lex is not None and lex.strong_signal and plan.config.lexical.strong_signal_skip
                    and "strong_signal" not in plan.disabled)

    # ------------------------------------------------------------------ stages 4–8
    @_one_blas_thread
    def finish(self, plan: Plan, lex: lexical.LexicalHits | None, dense_hits: dense.DenseHits | None, *,
               last_access_overlay: AccessOverlay | None = None, started: float | None = None,
               leg_timings_ms: Mapping[str, float] | None = None) -> RecallResult:
        """Fuse the legs' lists, expand, rank, diversify and pack."""
        cfg, gen, cols = plan.config, self.generation, self.columns
        started = time.perf_counter() if started is None else started
        timings = dict(plan.timings_ms)
        flags = dict(plan.flags)
        budget_tokens, k, query_vector = plan.budget_tokens, plan.k, plan.query_vector
        if plan.skip or not self._has_scope(plan):
            plan.drop_tokens()
            if gen is not None and not plan.skip:
                flags["empty_scope"] = "no memories for this user"
            timings["total"] = _ms(started)
            return RecallResult(plan.query, plan.user, [], 0, budget_tokens, timings, flags,
                                gen.number if gen is not None else None, _empty_explain() if plan.explain else None)
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
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now_ = time.perf_counter()
            timings[name] = round((now_ - clock) * 1000.0, 3)
            clock = now_

        weights = dict(plan.weights)
        lists: dict[str, np.ndarray] = {}
        if lex is not None:
            lists["bm25"] = lex.rows
        if dense_hits is not None:
            lists["dense"] = dense_hits.rows
        if lex is not None and cfg.fusion.adaptive and "bm25" in lists:
            weights["bm25"] *= _lexical_confidence(lex)
            flags["bm25_weight"] = round(weights["bm25"], 4)
        fused = fuse.rrf(lists, k=cfg.fusion.k, weights=weights, top_rank_bonus=cfg.fusion.top_rank_bonus)
        pool_rows = fused.rows[: max(cfg.fusion.pool, k)]  # asking for k never gets fewer than k candidates
        fused_score = {int(r): float(s) for r, s in zip(fused.rows, fused.scores)}
        list_rank = {name: {int(r): i for i, r in enumerate(rows, start=1)} for name, rows in lists.items()}
        lap("fuse")

        graph_score: dict[int, float] = {}
        added: list[int] = []
        if cfg.graph.enabled and "graph" not in plan.disabled and not strong and len(pool_rows):
            added, graph_score, flags["graph"] = _expand(gen, pool_rows, fused_score, start, end, mask, cfg)
        lap("expand")

        rows = np.concatenate([pool_rows, np.array(added, dtype=np.int64)]).astype(np.int64)
        if len(rows) == 0:
            plan.drop_tokens()
            timings["total"] = _ms(started)
            return RecallResult(plan.query, plan.user, [], 0, budget_tokens, timings, flags, gen.number,
                                _empty_explain() if plan.explain else None)
        vectors = np.asarray(gen.vectors[np.sort(rows)])[np.argsort(np.argsort(rows))]
        cosine = vectors @ query_vector
        late_scores = None
        query_tokens = plan.tokens() if self._wants_late(cfg, plan.disabled) else None
        if query_tokens is not None:
            late_scores = late.maxsim(query_tokens, gen.late, rows)
            flags["late"] = int(np.count_nonzero(~np.isnan(late_scores)))
            timings.update((name, plan.timings_ms[name]) for name in ("embed_tokens", "wait_tokens")
                           if name in plan.timings_ms)
        lap("late")
        last_access = cols.last_accessed_at[rows].copy()
        if cfg.rank.recency_from_creation:
            last_access = np.where(last_access > 0, last_access, cols.created_at[rows])
        if last_access_overlay:
            for i, r in enumerate(rows):
                seen = last_access_overlay.get(int(r))
                if seen is not None and seen > last_access[i]:
                    last_access[i] = seen
        ranked = rank.rank(
            types=cols.types[rows], cosine=late.blend(cosine, late_scores, cfg.late.weight),
            fused=np.array([fused_score.get(int(r), 0.0) for r in rows]),
            last_access_us=last_access, salience=cols.salience[rows], confidence=cols.confidence[rows],
            graph=np.array([graph_score.get(int(r), 0.0) for r in rows]),
            projects=cols.projects[rows], pinned=cols.pinned[rows], now_us=plan.now_us, config=cfg.rank,
            project=plan.scope.project if plan.scope.project_mode == "prefer" else None,
            disabled=frozenset(d for d in plan.disabled if d in rank.SIGNALS),
        )
        lap("rank")

        dropped_by: dict[int, str] = {}
        order = [int(i) for i in ranked.order]
        reranked = cfg.rerank.enabled and "rerank" not in plan.disabled and len(order) > 1
        if reranked:
            head = order[: cfg.rerank.depth]
            order, _ = rerank.rerank(plan.query, order, [gen.text(int(rows[i])) for i in head], cfg.rerank)
            flags["reranked"] = len(head)
            lap("rerank")
        if "dedup" not in plan.disabled:
            order, dups = diversify.drop_near_duplicates(order, np.asarray(gen.minhash[np.sort(rows)])[
                np.argsort(np.argsort(rows))], cfg.diversity.dedup_threshold)
            dropped_by.update({i: "near_duplicate" for i in dups})
        docs = [cols.documents[int(r)] for r in rows]
        order, capped = diversify.cap_per_document(order, docs, cfg.diversity.max_per_document)
        dropped_by.update({i: "document_cap" for i in capped})
        mode = cfg.diversity.mode
        if mode == "auto":
            mode = "session" if diversify.is_aggregation(plan.query) else "mmr"
        mmr_ran = not ("mmr" in plan.disabled or mode == "none")
        if not mmr_ran:
            selected = order[:k]
        else:
            relevance = rank.minmax(ranked.scores)
            if reranked:  # the cross-encoder's order is the relevance MMR trades off
                relevance = np.zeros(len(rows))
                relevance[np.array(order)] = 1.0 - np.arange(len(order)) / len(order)
            similarity = vectors @ vectors.T
            seed = diversify.session_first(order, [cols.sessions[int(r)] for r in rows], k) if mode == "session" else []
            selected = diversify.mmr(order, relevance, similarity, cfg.diversity.mmr_lambda, k, picked=seed)
        flags["diversity"] = mode if mmr_ran else "none"
        chosen = set(selected)
        dropped_by.update({i: ("mmr" if mmr_ran else "k") for i in order if i not in chosen})
        lap("diversify")

        items = [pack.PackItem(row=i, text=gen.text(int(rows[i])), n_tokens=int(cols.n_tokens[rows[i]]))
                 for i in selected]
        packed = pack.pack(items, budget_tokens, separator_tokens=cfg.pack.separator_tokens,
                           encoding_name=cfg.pack.encoding)
        packed_set = {p.row for p in packed}
        dropped_by.update({i: "budget" for i in selected if i not in packed_set})
        result_items = []
        for p in packed:
            r = int(rows[p.row])
            result_items.append(RecallItem(
                id=str(cols.ids[r]), text=p.text, type=str(cols.types[r]), rank=p.rank,
                score=round(float(ranked.scores[p.row]), 6), n_tokens=p.n_tokens, truncated=p.truncated,
                created_at=_iso(cols.created_at[r]), session_id=cols.sessions[r], project=cols.projects[r],
                signals={s: round(float(ranked.signals[s][p.row]), 4) for s in rank.SIGNALS},
            ))
        lap("pack")
        timings["total"] = round((time.perf_counter() - started) * 1000.0, 3)
        total = sum(p.n_tokens for p in packed) + cfg.pack.separator_tokens * len(packed)
        table = None
        if plan.explain:
            final_position = {p.row: n for n, p in enumerate(packed, start=1)}
            table = _explain(rows, cols, list_rank, fused_score, graph_score, cosine, late_scores, ranked,
                             dropped_by, final_position, set(added))
        return RecallResult(plan.query, plan.user, result_items, total, budget_tokens, timings, flags, gen.number,
                            table)


def _lexical_confidence(lex: lexical.LexicalHits) -> float:
    """How much the BM25 list deserves its weight: near 1 when its top hits stand out,
    lower when scores are flat (no term separates the candidates)."""
    if len(lex.scores) < 2:
        return 1.0
    top = lex.scores[: min(10, len(lex.scores))]
    spread = float((top[0] - top[-1]) / top[0]) if top[0] > 0 else 0.0
    return float(np.clip(spread * 2.0, 0.25, 1.0))


def _expand(gen, pool_rows: np.ndarray, fused_score: dict[int, float], start: int, end: int,
            mask: np.ndarray | None, cfg: RetrievalConfig) -> tuple[list[int], dict[int, float], dict[str, Any]]:
    g = cfg.graph
    seeds = pool_rows[: g.seeds]
    weights = np.array([fused_score[int(r)] for r in seeds])
    result = expand.ppr(gen.graph, seeds, weights, damping=g.damping, max_hops=g.max_hops, max_nodes=g.max_nodes,
                        iterations=g.iterations, tolerance=g.tolerance, max_degree=g.max_degree)
    memory = (result.nodes >= start) & (result.nodes < end)
    nodes, scores = result.nodes[memory], result.scores[memory]
    if mask is not None:
        keep = mask[nodes - start]
        nodes, scores = nodes[keep], scores[keep]
    # Vectorised: at 10^6 the subgraph holds up to max_nodes memories, and Python loops
    # over them cost as much as PPR itself.
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


def _iso(micros: int) -> str:
    return dt.datetime.fromtimestamp(int(micros) / 1_000_000, tz=dt.timezone.utc).isoformat()


_EXPLAIN_COLUMNS = ("id", "origin", "dense_rank", "bm25_rank", "rrf_score", "cosine", "late_maxsim", "graph_ppr",
                    "similarity", "recency", "salience", "confidence", "graph", "score", "final_position",
                    "dropped_by")


def _empty_explain():
    import polars as pl

    return pl.DataFrame({c: [] for c in _EXPLAIN_COLUMNS})


def _explain(rows, cols, list_rank, fused_score, graph_score, cosine, late_scores, ranked, dropped_by,
             final_position, added):
    import polars as pl

    n = len(rows)
    data = {
        "id": [str(cols.ids[int(r)]) for r in rows],
        "origin": ["graph" if int(r) in added else "fused" for r in rows],
        "dense_rank": [list_rank.get("dense", {}).get(int(r)) for r in rows],
        "bm25_rank": [list_rank.get("bm25", {}).get(int(r)) for r in rows],
        "rrf_score": [fused_score.get(int(r), 0.0) for r in rows],
        "cosine": [float(c) for c in cosine],
        "late_maxsim": [None] * n if late_scores is None else [None if np.isnan(v) else float(v)
                                                               for v in late_scores],
        "graph_ppr": [graph_score.get(int(r), 0.0) for r in rows],
        **{s: [float(v) for v in ranked.signals[s]] for s in rank.SIGNALS},
        "score": [float(v) for v in ranked.scores],
        "final_position": [final_position.get(i) for i in range(n)],
        "dropped_by": [dropped_by.get(i) for i in range(n)],
    }
    return pl.DataFrame(data).sort("score", descending=True)
