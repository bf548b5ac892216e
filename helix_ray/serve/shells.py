"""The deployment shells, as plain classes (no Ray import): each loads its state once and
calls the query-path stages of :class:`helix_ray.recall.pipeline.Recaller`.

=============== ======================================= ==================================
shell           state                                   per request
=============== ======================================= ==================================
EmbedderShell   embedder, router                        ``Recaller.plan`` → :class:`Plan`
DenseShell      generations (mmap), delta snapshots     ``Recaller.dense_leg`` + delta cosine
BM25Shell       generations (mmap), delta snapshots     ``Recaller.lexical_leg`` + delta BM25
RankerShell     generations (mmap), delta snapshots     ``Recaller.finish`` over generation + delta
WriterShell     the store's DuckDB file (one writer)    add / patch / delete / compact / forget
=============== ======================================= ==================================

Between replicas travel the :class:`Plan` (the checked request, its config and the
query vector), and the legs' :class:`LegResult` — row ids and scores, the generation
and delta version they came from. Never texts, never the generation.
The work over a generation and its delta is :mod:`helix_ray.live.recall`'s (an open
:class:`helix_ray.Memory` calls the same functions), the Writer's is
:class:`helix_ray.live.writer.WriterCore`'s. :mod:`helix_ray.serve.deployments` turns
these classes into Serve deployments.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helix_ray.config import IngestConfig, RetrievalConfig
from helix_ray.embedder import DIM, get_embedder
from helix_ray.errors import StoreError
from helix_ray.live.access_log import AccessTail, accesses_path
from helix_ray.live.compactor import Compactor
from helix_ray.live.recall import dense_over, elapsed_ms, finish_over, lexical_over
from helix_ray.live.views import StoreViews
from helix_ray.recall import adapter
from helix_ray.recall.pipeline import Plan, Recaller
from helix_ray.recall.warm import WARM_QUERY
from helix_ray.runtime import usable_cores
from helix_ray.serve.errors import ReplicaError, boundary
from helix_ray.store.generation import Generation
from helix_ray.store.mirror import CacheSync, open_mirror
from helix_ray.store.pointer import Pointer

log = logging.getLogger(__name__)

#: How often replicas look at the store's ``CURRENT`` (seconds).
WATCH_INTERVAL_S = 0.5


class StaleLegs(StoreError):
    """The two legs of one request ran on different generations."""


@dataclass(frozen=True)
class LegResult:
    """What a retriever leg returns: its hits and where they come from."""

    generation: int
    delta_version: int
    hits: Any  # dense.DenseHits | lexical.LexicalHits | None
    ms: float
    error: str | None = None  # the leg failed: the Ranker goes on without it and flags it


def _expect(ingest: IngestConfig | None) -> dict[str, Any]:
    return {"expect_embedder": (ingest or IngestConfig()).embedder.name, "expect_dim": DIM}


def query_threads() -> int:
    """onnxruntime threads per replica for encoding queries while other requests wait in
    it (``HELIX_QUERY_THREADS``, default 1). A query is a few dozen tokens: more threads
    barely shorten it, and their spinning takes the cores other replicas need (docs/benchmarks.md)."""
    return int(os.environ.get("HELIX_QUERY_THREADS", "1"))


def query_threads_alone() -> int:
    """onnxruntime threads for a query a replica runs with no other request in it
    (``HELIX_QUERY_THREADS_ALONE``, default 1: no second encoder). 2 encodes a query a
    little faster on an idle core, but onnxruntime's second thread spins for most of the
    request and after it, so the served latency does not change while the replica's CPU
    per request grows (docs/benchmarks.md). 0 or the busy count: one encoder only; never
    more than :func:`usable_cores`."""
    return int(os.environ.get("HELIX_QUERY_THREADS_ALONE", "1"))


def host_idle() -> bool:
    """True when no thread of this host is runnable but the caller's: the fourth field of
    ``/proc/loadavg`` counts the runnable threads right now (Linux; elsewhere False). A
    read costs ~10 µs. Another replica working, a client encoding, an onnxruntime thread
    spinning: each is a runnable thread, and a second encoder thread would wait for it."""
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return False
    return running <= 1


def served_folder(store: str | Path, mirror: str | None = None, mirror_cache: str | None = None,
                  interval_s: float = WATCH_INTERVAL_S) -> Path:
    """The folder a replica reads the store from: ``store`` itself, or with a ``mirror``
    URI this host's cache of it (``mirror_cache``, default under the host's temporary
    folder), synced every ``interval_s`` seconds (:class:`CacheSync`)."""
    if mirror is None:
        return Path(store)
    return CacheSync.start(mirror, mirror_cache, interval_s).cache


class EmbedderShell:
    """Checks, embeds and routes a request: ``Recaller.plan``. Needs no generation; given
    the store, it reads the current manifest (one ``stat`` per request) so it encodes the
    query's late-interaction tokens only when the generation has passage tokens.

    When ``query_threads_alone()`` differs from ``query_threads()`` (``widens``), a
    ``plan(..., alone=True)`` — the caller knows no other request is in its replica —
    encodes with a second, wider encoder, built on the first such call."""

    def __init__(self, ingest: IngestConfig | None = None, store: str | Path | None = None, *,
                 mirror: str | None = None, mirror_cache: str | None = None):
        if store is not None:
            store = served_folder(store, mirror, mirror_cache)
        config = (ingest or IngestConfig()).embedder
        cores = usable_cores()
        threads, alone = min(query_threads(), cores), min(query_threads_alone(), cores)
        embedder = get_embedder(config, threads)
        self._encoders = {False: embedder}  # the wider one is built by the first plan(alone=True)
        self._wide = (config, alone) if alone > threads else None
        self.widens = self._wide is not None
        self.recaller = Recaller(None, embedder, threads=threads)
        self._has_late = Pointer(Path(store) / "CURRENT", _generation_has_late) if store is not None else None
        # The store's query adapter, read again when `helix adapt` replaces it.
        self._adapter = adapter.watch(store, embedder.name) if store is not None else None
        # Before the replica reports healthy: the encoders' first runs (and the token
        # encoder's load, when the generation has passage tokens) are not a request's.
        embedder.embed_queries([WARM_QUERY])
        if self._has_late is not None and self._has_late.read():
            self.recaller.token_encoder.encode_query(WARM_QUERY)

    @boundary
    def plan(self, query: str, *, user: str, config: RetrievalConfig, alone: bool = False, resolve: bool = True,
             **request: Any) -> Plan:
        """``resolve``: wait here for tokens encoded on the second core (the Embedder
        deployment's plan crosses a hop; an error is this replica's). The compact and
        inline graphs pass False and wait at the late stage."""
        if self._adapter is not None:
            self.recaller.adapter = self._adapter.read()
        if self._has_late is not None and not self._has_late.read():
            request["disabled"] = frozenset(request.get("disabled", ())) | {"late"}
        # The second core goes to the query's token encoder when the plan runs one beside
        # the sentence vector; a wider sentence encoder would spin against it (docs/benchmarks.md).
        alone = alone and not self.recaller.overlaps_tokens(config, frozenset(request.get("disabled", ())))
        if alone and self._wide is not None and True not in self._encoders:
            self._encoders[True] = get_embedder(*self._wide)
        # The inline graph's plan() runs on the event loop without yielding; the split
        # graph's Embedder may run plans in a thread pool, but it never passes alone=True.
        self.recaller.embedder = self._encoders.get(alone, self._encoders[False])
        plan = self.recaller.plan(query, user=user, config=config, **request)
        if resolve:
            plan.tokens()
        return plan


def _generation_has_late(current: Path) -> bool:
    try:
        return bool(Generation.open_current(current.parent).manifest.get("late"))
    except (StoreError, OSError):
        return True  # unknown: encode, the Ranker decides


class _StoreShell:
    role = "all"

    def __init__(self, store: str | Path, ingest: IngestConfig | None = None,
                 watch_interval_s: float = WATCH_INTERVAL_S, *, mirror: str | None = None,
                 mirror_cache: str | None = None):
        store = served_folder(store, mirror, mirror_cache, watch_interval_s)
        self.views = StoreViews(store, role=self.role, **_expect(ingest))
        if self.views.latest is None:
            raise StoreError(
                f"Store {store} has no published generation (no CURRENT file). Start the application with "
                "`helix serve` (or `build_app` with `create`), which publishes an empty one for a new store, "
                "or run `helix ingest`."
            )
        self.watch_interval_s = watch_interval_s
        self._watcher: asyncio.Task | None = None

    def _ensure_watching(self) -> None:
        """Start the ``CURRENT`` watcher on the replica's event loop (first request)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self.views.watch(self.watch_interval_s))


class DenseShell(_StoreShell):
    role = "dense"

    @boundary
    async def search(self, plan: Plan, generation: int | None = None) -> LegResult:
        self._ensure_watching()
        clock = time.perf_counter()
        view = await self.views.generation(generation)
        assert view is not None  # __init__ refused a store without a generation
        delta = self.views.delta_for(view)
        if plan.skip:  # the router decided no memory is needed
            return LegResult(view.number, delta.version, None, 0.0)
        try:
            hits = dense_over(self.views.recaller(view, delta), delta, plan)
        except Exception as exc:  # noqa: BLE001 - recall goes on with the other leg, flagged
            log.exception("dense leg failed")
            return LegResult(view.number, delta.version, None, elapsed_ms(clock), f"{type(exc).__name__}: {exc}")
        return LegResult(view.number, delta.version, hits, elapsed_ms(clock))


class BM25Shell(_StoreShell):
    role = "bm25"

    @boundary
    async def search(self, plan: Plan, generation: int | None = None) -> LegResult:
        self._ensure_watching()
        clock = time.perf_counter()
        view = await self.views.generation(generation)
        assert view is not None  # __init__ refused a store without a generation
        delta = self.views.delta_for(view)
        if plan.skip:
            return LegResult(view.number, delta.version, None, 0.0)
        try:
            hits = lexical_over(self.views.recaller(view, delta), delta, plan)
        except Exception as exc:  # noqa: BLE001 - recall goes on with the other leg, flagged
            log.exception("bm25 leg failed")
            return LegResult(view.number, delta.version, None, elapsed_ms(clock), f"{type(exc).__name__}: {exc}")
        return LegResult(view.number, delta.version, hits, elapsed_ms(clock))


class RankerShell(_StoreShell):
    role = "ranker"

    def __init__(self, store: str | Path, ingest: IngestConfig | None = None,
                 watch_interval_s: float = WATCH_INTERVAL_S, *, mirror: str | None = None,
                 mirror_cache: str | None = None):
        super().__init__(store, ingest, watch_interval_s, mirror=mirror, mirror_cache=mirror_cache)
        self._accesses = AccessTail(accesses_path(self.views.store))

    @boundary
    async def finish(self, plan: Plan, lexical: LegResult | None, dense: LegResult | None) -> dict[str, Any]:
        """Fuse, expand, rank, diversify and pack over the generation the legs used and
        this replica's newest delta snapshot; returns ``RecallResult.as_dict()``."""
        self._ensure_watching()
        legs = [leg for leg in (lexical, dense) if leg is not None]
        numbers = {leg.generation for leg in legs}
        if len(numbers) > 1:
            raise StaleLegs(f"The legs searched different generations {sorted(numbers)} (a swap in progress); "
                            "the ingress runs them again on the newer one.")
        view = await self.views.generation(numbers.pop() if numbers else None)
        assert view is not None  # __init__ refused a store without a generation
        delta = self.views.delta_for(view)
        timings = {}
        if lexical is not None:
            timings["bm25"] = lexical.ms
        if dense is not None:
            timings["dense"] = dense.ms
        result = finish_over(self.views.recaller(view, delta, joined=True), delta, plan,
                             lexical.hits if lexical else None, dense.hits if dense else None,
                             leg_timings_ms=timings, accessed=self._accesses.read())
        out = result.as_dict()
        out["delta_version"] = delta.version
        for name, leg in (("bm25", lexical), ("dense", dense)):
            if leg is not None and leg.error:
                out["flags"].setdefault("degraded", []).append(f"{name} leg failed ({leg.error}); answered without it")
        delta_ids = self.views.pending_ids(view)
        for item in out["items"]:
            item["origin"] = "delta" if item["id"] in delta_ids else "generation"
        return out


class PipelineShell:
    """The whole recall graph in one replica (``ServeArgs.graph`` "compact", and inside the
    ingress for "inline"): the Embedder, both legs and the Ranker shells called in-process,
    so a request pays one hop instead of four. The split graph scales each stage on its own; on a small host
    every hop costs more than most stages (docs/benchmarks.md), and this is the faster shape.
    Like :meth:`Recaller.recall`, a lexically decisive query skips the dense leg."""

    def __init__(self, store: str | Path, ingest: IngestConfig | None = None,
                 watch_interval_s: float = WATCH_INTERVAL_S, *, mirror: str | None = None,
                 mirror_cache: str | None = None):
        store = served_folder(store, mirror, mirror_cache, watch_interval_s)  # one cache for the four shells
        self.embedder = EmbedderShell(ingest, store)
        self.bm25 = BM25Shell(store, ingest, watch_interval_s)
        self.dense = DenseShell(store, ingest, watch_interval_s)
        self.ranker = RankerShell(store, ingest, watch_interval_s)
        self._inflight = 0  # requests inside this replica's recall (they interleave at the legs' awaits)

    @boundary
    async def recall(self, query: str, *, user: str, config: RetrievalConfig, **request: Any) -> dict[str, Any]:
        self._inflight += 1
        try:
            return await self._recall(query, user=user, config=config, **request)
        finally:
            self._inflight -= 1

    async def _recall(self, query: str, *, user: str, config: RetrievalConfig, **request: Any) -> dict[str, Any]:
        # Alone in the replica, and no other thread of the host running: the wider query
        # encoder (the other core is idle).
        alone = self._inflight == 1 and self.embedder.widens and host_idle()
        plan = self.embedder.plan(query, user=user, config=config, alone=alone, resolve=False, **request)
        try:
            return await self._legs_and_finish(plan)
        finally:
            plan.drop_tokens()  # a stage that raised or answered before the late stage

    async def _legs_and_finish(self, plan: Plan) -> dict[str, Any]:
        lexical = await self.bm25.search(plan)
        strong = lexical.hits is not None and Recaller.strong(plan, lexical.hits)
        dense = None if strong else await self.dense.search(plan, lexical.generation)
        try:
            return await self.ranker.finish(plan, lexical, dense)
        except ReplicaError as exc:
            if exc.kind != "StaleLegs":
                raise
        # A swap landed between the two legs: both again on the newest generation.
        newer = max(leg.generation for leg in (lexical, dense) if leg is not None)
        lexical = await self.bm25.search(plan, newer)
        dense = None if strong else await self.dense.search(plan, newer)
        out = await self.ranker.finish(plan, lexical, dense)
        out["flags"].setdefault("degraded", []).append(f"legs realigned on generation {newer} during a swap")
        return out


class WriterShell:
    """The one writer: :class:`helix_ray.live.writer.WriterCore` plus a background
    :class:`Compactor` (every ``compact_interval_s`` seconds when anything is pending,
    or as soon as ``compact_max_pending`` entries are). With a ``mirror`` URI it pushes
    the store there after every change replicas read (:mod:`helix_ray.store.mirror`)."""

    def __init__(self, store: str | Path, ingest: IngestConfig | None = None, *, compact_interval_s: float = 600.0,
                 compact_max_pending: int = 2000, compact_runner: str = "local", mirror: str | None = None):
        from helix_ray.live.writer import WriterCore  # loads duckdb: only the Writer replica needs it

        self.core = WriterCore(store, ingest=ingest, compact_runner=compact_runner,
                               mirror=open_mirror(mirror) if mirror is not None else None)
        self.core.load_encoders()  # before the replica reports healthy, not in the first write
        self.compactor = Compactor(self.core, interval_s=compact_interval_s, max_pending=compact_max_pending)
        self._stop = self.compactor.stop_event  # set: no further background compaction

    @boundary
    def add(self, records: list[dict[str, Any]], user: str | None, single: bool = False) -> dict[str, Any]:
        return self.core.add(records, user=user, single=single)

    @boundary
    def patch(self, memory_id: str, fields: dict[str, Any], user: str | None) -> dict[str, Any]:
        return self.core.patch(memory_id, fields, user=user)

    @boundary
    def delete(self, memory_id: str, user: str | None) -> dict[str, Any]:
        return self.core.delete(memory_id, user=user)

    @boundary
    def accessed(self, hits: list[tuple[str, str, int]]) -> dict[str, Any]:
        return self.core.accessed(hits)

    @boundary
    def feedback(self, query: str, memory_ids: list[str], user: str | None) -> dict[str, Any]:
        return self.core.feedback(query, memory_ids, user=user)

    @boundary
    def adapt(self, users: list[str] | None, force: bool) -> dict[str, Any]:
        return self.core.adapt(users=users, force=force)

    @boundary
    def compact(self, rebuild: bool = False) -> dict[str, Any]:
        return self.core.compact(rebuild=rebuild)

    @boundary
    def forget_user(self, user: str, compact: bool) -> dict[str, Any]:
        return self.core.forget_user(user, compact=compact)

    @boundary
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    @boundary
    def user_stats(self, user: str) -> dict[str, Any]:
        return self.core.user_stats(user)

    @boundary
    def patch_settings(self, patch: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        return self.core.patch_settings(patch, base)

    @boundary
    def reset_settings(self) -> dict[str, Any]:
        return self.core.reset_settings()

    def __del__(self) -> None:
        """Serve's shutdown hook: stop compacting and close the DuckDB file cleanly."""
        self._stop.set()
        try:
            self.core.close()
        except Exception:  # noqa: BLE001 - already closed, or the interpreter is exiting
            pass
