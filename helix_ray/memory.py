"""The front door: :class:`Memory` opens (or creates) a store, ingests, writes and recalls.

>>> mem = Memory("stores/atlas")
>>> mem.ingest(["helix_ray/samples/atlas/memories.jsonl"])
>>> mem.add([{"text": "We pinned uvicorn to 0.30 after the keep-alive bug.", "user": "dana"}])
>>> result = mem.recall("why did we pick NATS?", user="dana", budget_tokens=512)
>>> print(result.context())

A :class:`Memory` holds its store's DuckDB file (DuckDB allows one writing process) and,
from its first write on (or from the start: ``open_writer``), the store's
:class:`~helix_ray.live.writer.WriterCore`, the Writer ``helix serve`` runs; the
``Memory`` objects of one store in one process share both
(:mod:`helix_ray.shared_store`), so opening it again (a notebook cell run twice) is
safe. A ``Memory`` that only recalls changes nothing in the store but the access log.
:meth:`Memory.add`, :meth:`~Memory.patch` and :meth:`~Memory.delete` go through the
Writer's write path (:mod:`helix_ray.live.writes`): validated, chunked, embedded, logged
durably in ``serve_log`` and published to the delta segment before they return; the next
recall finds them, and after a crash the next Writer replays the log. A background
compaction folds the delta into the next generation (:meth:`Memory.compact` folds it
now). Recall reads the memory-mapped generation and the delta, as the served path does
(:func:`helix_ray.live.recall.recall_over`); the accesses it records go to DuckDB from a
background thread, off the query path.

Opening a store with a generation warms it in the background (``warm=True``, see
:mod:`helix_ray.recall.warm`): the encoders load and one question runs through every
stage, then the generation's files are read into the page cache. A recall that comes
before the first part is done waits for it rather than loading everything a second time.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from helix_ray.config import IngestConfig, RetrievalConfig
from helix_ray.embedder import DIM, get_embedder
from helix_ray.errors import DiskFull, InvalidArgument, StoreError
from helix_ray.recall import adapter
from helix_ray.recall.threads import encoder_threads
from helix_ray.schema import MemoryRecord
from helix_ray.shared_store import open_shared
from helix_ray.store.generation import current_generation_number, generation_counts

if TYPE_CHECKING:
    from helix_ray.live.views import StoreViews
    from helix_ray.live.writer import WriterCore

log = logging.getLogger(__name__)

#: The ``Memory`` objects of this process not closed yet: closed at exit, so that their
#: last recall hits are logged and the database is closed (a script or notebook that
#: never calls close() would lose the hits, and DuckDB's types would be reported leaked).
_OPEN_MEMORIES: "weakref.WeakSet[Memory]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for mem in list(_OPEN_MEMORIES):
        mem.close()


#: Background compaction of an open Memory: at least this often while writes are
#: pending (seconds), or as soon as :data:`COMPACT_MAX_PENDING` are. A compaction rebuilds
#: the generation's indexes (seconds per 10^5 memories), so a notebook pays it seldom.
COMPACT_INTERVAL_S = 300.0
COMPACT_MAX_PENDING = 1000


@dataclass(frozen=True)
class Written:
    """What a write made durable: the ids it wrote (as given or derived; a long text is
    stored as chunks ``<id>#chunk<n>`` under its id), the delta snapshot that holds it
    and the generation that snapshot lies over; ``replaced``: those of an add's ids that
    named a live memory already, whose earlier version the write replaced."""

    ids: tuple[str, ...]
    delta_version: int
    generation: int | None
    replaced: tuple[str, ...] = ()


class Memory:
    """A store opened in this process: ingest, write, recall, feedback. It holds the
    store's DuckDB file (one writing process per store); the ``Memory`` objects of one
    store in this process share it and its Writer. Its methods may be called from
    several threads."""

    def __init__(
        self,
        store: str | Path,
        *,
        retrieval: RetrievalConfig | None = None,
        ingest: IngestConfig | None = None,
        record_access: bool = True,
        warm: bool = True,
        compact_interval_s: float | None = COMPACT_INTERVAL_S,
        compact_max_pending: int = COMPACT_MAX_PENDING,
        open_writer: bool = False,
    ):
        """``compact_interval_s``: fold pending writes into a generation in the
        background at least this often (seconds), or once ``compact_max_pending`` are
        pending; None: only on :meth:`compact` (and before :meth:`ingest`). One
        background compaction runs per store: the first ``Memory`` of the store that asks
        for one sets its interval. ``ingest``: also the Writer's config, when this
        ``Memory`` is the store's first to write. ``open_writer``: open the Writer now
        (its log replayed, its passage encoders loaded, the background compaction
        started) rather than at the first write, so that write costs what the others do
        (a long-running process that writes, as ``helix mcp``)."""
        self.store = Path(store)
        self.retrieval_config = retrieval or RetrievalConfig()
        self.ingest_config = ingest or IngestConfig()
        # Raises DatabaseHeld when another process holds the DuckDB file.
        self._shared = open_shared(self.store, self.ingest_config)
        self.db = self._shared.db  # shared by this store's Memory objects: use it under _db_lock
        self._db_lock = self._shared.db_lock
        self._views: StoreViews | None = None  # the generations and delta snapshots recall reads
        self._recaller: Any = None  # a Recaller, opened by the first recall (or the warm-up)
        self._recaller_lock = threading.Lock()  # one Recaller built at a time; guards _views
        self._open_lock = threading.Lock()  # one thread opens a new generation of _views at a time
        self._warm = threading.Event()  # set when the warm-up's question is answered (or there is none)
        self._adapter = adapter.watch(self.store, self.ingest_config.embedder.name)  # re-read when replaced
        self._overlay = self._shared.overlay  # id → last access (µs) since the generation was built
        self._record_access = record_access
        self._closed = threading.Event()
        self._shared.after_compaction[id(self)] = self._compacted
        if compact_interval_s is not None:
            self._shared.compact_in_background(compact_interval_s, compact_max_pending)
        if open_writer:
            try:
                self._core().load_encoders()
            except BaseException:
                self.close()  # the store's DuckDB file is not left held
                raise
        _OPEN_MEMORIES.add(self)
        if warm and current_generation_number(self.store) is not None:
            threading.Thread(target=self._warm_up, name="helix-warm", daemon=True).start()
        else:
            self._warm.set()

    # ------------------------------------------------------------------ ingest
    def ingest(self, sources: Sequence[str | Path] | str | Path, *, format: str = "auto", runner: str = "local",
               show_progress: bool = False, since: str | None = None, max_commits: int | None = None,
               repo_name: str | None = None, doc_name: str | None = None):
        """Run the ingest pipeline over files or folders; returns its report. ``format``
        ``"code"`` reads a source tree, ``"git"`` a repository's commits (``since``,
        ``max_commits``: which ones), as memories of ``ingest.validation.default_user``
        whose ids name the repository ``repo_name`` (default: its folder's name); a
        ``"markdown"`` source's sections have ids naming the document set ``doc_name``
        (``md:<user>/<docs>/<path>#<slug>``; default: the folder's name). Writes
        still in the delta are folded first (a compaction), so an ingested record is not
        hidden by an earlier write of its id; writes made meanwhile wait for the end and
        are newer than what it ingests."""
        from helix_ray.ingest.run import ingest  # the ingest pipeline: a recall-only Memory never loads it

        if isinstance(sources, (str, Path)):
            sources = [sources]
        core = self._core()
        # No compaction, write or access flush from the fold to the end of the ingest: a
        # write left in the delta would hide the ingested record of its id, and the
        # next compaction would write it over that record. Both locks are re-entrant:
        # the fold (a compaction) takes them again.
        with core._compacting, self._db_lock:
            try:
                self._fold()
            except Exception as exc:
                pending = self._shared.pending_writes()
                raise (DiskFull if isinstance(exc, DiskFull) else StoreError)(
                    f"Cannot ingest into {self.store}: the {pending} pending writes could not be folded into a "
                    f"generation first ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}), so "
                    "nothing was ingested. The writes stay durable and recallable in the delta. Fix the cause, "
                    "then call ingest again (Memory.compact() tries the fold alone).") from exc
            report = ingest(list(sources), self.store, fmt=format, config=self.ingest_config, runner=runner,
                            show_progress=show_progress, db=self.db, since=since, max_commits=max_commits,
                            repo_name=repo_name, doc_name=doc_name)
        if report.published:
            self._overlay.clear()
        return report

    # ------------------------------------------------------------------ writes
    def add(self, records: Iterable[dict[str, Any] | MemoryRecord]) -> Written:
        """Write memories given in Python (dicts or :class:`MemoryRecord`, each naming
        its ``user``) through the Writer: validated, a long text chunked, embedded, then
        durable (logged in the store's DuckDB file) and in the delta before this
        returns; the next :meth:`recall` finds them, a restart replays them, and a
        compaction folds them into the next generation. A record with the id of an
        existing memory replaces it (the answer's ``replaced`` names those ids). More than the Writer's batch (1,000) are written
        in batches, each durable as it returns; for a bulk load, :meth:`ingest` a file."""
        from helix_ray.live.inputs import MAX_BATCH

        rows = [_plain(r.to_row() if isinstance(r, MemoryRecord) else r) for r in records]
        if not rows:
            raise InvalidArgument("records", [], "give at least one memory record")
        for row in rows:
            if isinstance(row, dict) and not row.get("source"):
                row["source"] = "api"
        core = self._core()
        self._ensure_generation()
        ids: list[str] = []
        replaced: list[str] = []
        out: dict[str, Any] = {}
        for start in range(0, len(rows), MAX_BATCH):
            out = core.add(rows[start:start + MAX_BATCH], user=None)
            ids += out["ids"]
            replaced += out["replaced"]
        return Written(tuple(ids), out["delta_version"], out["generation"], tuple(replaced))

    def patch(self, memory_id: str, *, user: str | None = None, **fields: Any) -> Written:
        """Change ``fields`` of memory ``memory_id`` (any of text, type, project,
        session_id, salience, confidence, pinned, metadata, source): a new version,
        durable and recallable as :meth:`add`'s. A memory stored as chunks changes as a
        whole. ``user``: refuse unless it is that user's memory."""
        out = self._core().patch(memory_id, fields, user=user)
        return Written((out["id"],), out["delta_version"], out["generation"])

    def delete(self, memory_id: str, *, user: str | None = None) -> Written:
        """Delete memory ``memory_id`` (all of its chunks, when it is stored as chunks):
        durable before this returns, and never recalled again. ``user``: refuse unless
        it is that user's memory."""
        out = self._core().delete(memory_id, user=user)
        return Written((out["id"],), out["delta_version"], out["generation"])

    def compact(self) -> dict[str, Any]:
        """Fold the pending writes (and deletions) into the next generation now; returns
        what happened (``published``, ``generation``, ``folded``, ...). The background
        compaction does this on its own; recall sees the same memories before and after."""
        self._check_open()
        return self._shared.compact()

    def _fold(self) -> dict[str, Any]:
        core = self._core()
        self._flush_now()  # the hits so far reach the generation's recency columns
        return core.compact()

    def _core(self) -> WriterCore:
        """The store's Writer, opened by the first call of any of its ``Memory`` objects."""
        self._check_open()
        return self._shared.core()

    def _check_open(self) -> None:
        """A closed ``Memory`` acts no more (the store's other ones may still be open)."""
        if self._closed.is_set():
            raise StoreError(f"Got a call on a closed Memory of {self.store}; a closed Memory cannot be used again. "
                             f"Open the store again: Memory({str(self.store)!r}).")

    def _compacted(self, report: dict[str, Any]) -> None:
        """After a compaction of this process published (:meth:`SharedStore.compact`, which
        holds the Writer's compaction lock throughout): open the new generation and warm it
        here, while recall goes on over the one the compaction started from, then swap. A
        recall does not meet a cold generation."""
        views = self._views
        if views is None or self._closed.is_set():
            return  # nothing opened yet: the first recall opens the current generation
        try:
            with self._open_lock:
                view = views.prepare()  # reads only CURRENT and the new generation's files
            if view is None:
                return
            recaller = self._open_recaller(view.generation)
            with self._recaller_lock:
                delta = views.delta_for(view)  # the segments' rows joined with the newest snapshot
                views.recaller(view, delta), views.recaller(view, delta, joined=True)
            # What the generation makes on first use (BM25, columns, graph, the sessions'
            # index, the segment rows' terms), as a replica warms it, without a question:
            # asking one holds this process's GIL as long as a recall does, beside the
            # recalls it serves.
            view.warm("all")
            delta.analyse(view.generation.bm25.analyzer)
            with self._recaller_lock:
                if views.latest is None or view.number > views.latest:
                    views.install(view)
                    self._recaller = recaller
        except Exception:  # noqa: BLE001 - the next recall opens it, and reports what it finds
            log.warning("could not open generation %s after the compaction; the next recall will",
                        report.get("generation"), exc_info=True)

    def _ensure_generation(self) -> None:
        """A new store's first write: an empty generation for the delta to lie over."""
        if current_generation_number(self.store) is None:
            from helix_ray.ingest.run import initialise

            with self._db_lock:
                initialise(self.store, config=self.ingest_config, db=self.db)

    # ------------------------------------------------------------------ recall
    @property
    def recaller(self):
        """The :class:`Recaller` over the current generation (without the delta): its
        encoders, router and adapter plan every recall."""
        return self._current()[0]

    def _current(self):
        """The recaller, the generation view and the newest delta snapshot, the
        generation opened again when ``CURRENT`` moved (one ``stat`` when it did not)."""
        from helix_ray.live.views import StoreViews  # loads the recall stages (scipy): at the first recall

        with self._recaller_lock:
            if self._views is None:
                # No files read here: the warm-up reads them in the background.
                self._views = StoreViews(self.store, role=None, expect_embedder=self.ingest_config.embedder.name,
                                         expect_dim=DIM)
            elif not self._serves_folding_base():
                with self._open_lock:
                    self._views.refresh_now()
            views = self._views
            view = views.generations.get(views.latest) if views.latest is not None else None
            generation = view.generation if view is not None else None
            if self._recaller is None or self._recaller.generation is not generation:
                self._recaller = self._open_recaller(generation)
            recaller = self._recaller
            delta = views.delta_for(view) if view is not None else None
        recaller.adapter = self._adapter.read()  # `helix adapt` while open: the next recall uses it
        return recaller, view, delta

    def _serves_folding_base(self) -> bool:
        """Whether a compaction of this process is running and this Memory serves the
        generation it started from (or a newer one): recall may go on reading it, with the
        delta, which holds every write being folded until the next compaction, while
        :meth:`_compacted` opens and warms what the compaction publishes."""
        base = self._shared.folding_from
        latest = self._views.latest if self._views is not None else None
        return base is not None and self._recaller is not None and latest is not None and latest >= base

    def _open_recaller(self, generation):
        from helix_ray.recall.pipeline import Recaller  # loads scipy: on the first recall, not at import

        # Half the cores per query encoder when the two run side by side.
        threads = encoder_threads(generation, self.retrieval_config)
        embedder = get_embedder(self.ingest_config.embedder, threads)
        old = self._recaller  # the router's 30 reference questions, encoded again only for another encoder
        router = old._router if old is not None and old.embedder is embedder else None
        return Recaller(generation, embedder, self.retrieval_config, threads=threads, router=router)

    def _warm_up(self) -> None:
        """The background warm-up: one question through every stage, then the page cache."""
        from helix_ray.recall.warm import ROLE_FILES, read_through, warm_recaller

        generation = None
        try:
            recaller = self.recaller
            generation = recaller.generation
            warm_recaller(recaller)
        except Exception:  # noqa: BLE001 - a store that cannot open says so at the first recall
            log.debug("warm-up could not open the store", exc_info=True)
        finally:
            self._warm.set()
        if generation is not None and not self._closed.is_set():
            self._index_sessions(generation)
            read_through(generation.path, ROLE_FILES["all"])

    def _index_sessions(self, generation) -> None:
        """Index the sessions of the generation's large tenants now, in a background
        thread, as a ranker replica does while it warms: else a recall over the first
        written turn of such a tenant's session makes the index (0.4 s at 10^6 rows)."""
        views = self._views
        if views is not None:
            views.sessions.index_large_tenants(generation)

    def ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the warm-up's question to be answered; True
        once it is (at once when the store was opened with ``warm=False`` or has no
        generation). Recall never needs this: it waits by itself."""
        return self._warm.wait(timeout)

    def feedback(self, query: str, *, user: str, memory_ids: Sequence[str] | str) -> int:
        """Say which recalled memories answered ``query`` for ``user``: labelled queries
        that ``helix adapt --from-feedback`` fits the store's query adapter on. Returns
        how many ids were recorded."""
        query, ids = adapter.check_feedback(query, memory_ids)
        if not isinstance(user, str) or not user:
            raise InvalidArgument("user", user, "give the user who asked (a non-empty string)")
        core = self._core()
        with self._db_lock:
            foreign = [m for m in ids if core.owner(m) != user]  # a write in the delta is the user's too
            if foreign:
                raise InvalidArgument("memory_ids", foreign[:5], f"user {user!r} has no memories with these ids; give "
                                      "ids from this user's recall results")
            self.db.add_feedback(user, query, ids)
        return len(ids)

    def feedback_pairs(self, users: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The labelled queries given so far (of ``users`` only, if given), oldest first:
        what :func:`helix_ray.recall.adapter.fit_pairs` takes. Use this, not ``self.db``:
        the access-log thread shares the DuckDB connection, which refuses a second caller."""
        self._check_open()
        with self._db_lock:
            return self.db.feedback_pairs(users)

    def recall(self, query: str, *, user: str, budget_tokens: int | None = None, k: int | None = None,
               project: str | None = None, types: Sequence[str] | str | None = None, since: Any = None,
               until: Any = None, explain: bool = False, **options: Any):
        """Recall ``user``'s memories for ``query``, over the generation and the writes
        not folded into it yet; see :meth:`Recaller.recall`."""
        from helix_ray.recall.pipeline import IdAccessOverlay  # loads scipy: on the first recall, not at import
        from helix_ray.live.recall import recall_over

        self._check_open()
        self._warm.wait()
        recaller, view, delta = self._current()
        request = dict(budget_tokens=budget_tokens, k=k, project=project, types=types, since=since, until=until,
                       explain=explain, **options)
        if view is None or delta is None or (not len(delta) and not delta.tombstones):
            overlay = None
            if self._overlay and recaller.columns is not None:
                overlay = IdAccessOverlay(recaller.columns.ids, self._overlay)
            result = recaller.recall(query, user=user, last_access_overlay=overlay, **request)
        else:
            with self._recaller_lock:  # the views' caches are not for two threads at once
                views = self._views
                assert views is not None  # _current opened them
                legs = views.recaller(view, delta), views.recaller(view, delta, joined=True)
            result = recall_over(*legs, delta, recaller, query, user=user, accessed=self._overlay, **request)
        if self._record_access and result.items:
            now = dt.datetime.now(dt.timezone.utc)
            micros = int(now.timestamp() * 1_000_000)
            for item in result.items:
                self._overlay[item.id] = micros
                self._shared.accesses.put((item.id, user, now))
        return result

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        self._check_open()
        self._flush_now()
        with self._db_lock:
            counts = self.db.counts()
        counts["pending_writes"] = self._shared.pending_writes()  # not in a generation yet
        counts["generation"] = number = current_generation_number(self.store)
        counts["edges"] = 0 if number is None else generation_counts(self.store, number)["edges"]  # the graph's
        found = self._adapter.read()  # None: recall uses raw vectors
        counts["query_adapter"] = None if found is None else {
            "queries": found.pairs, "ridge": found.ridge, "created_at": found.created_at}
        counts["store"] = str(self.store)
        return counts

    def user_stats(self, user: str) -> dict[str, Any]:
        """What one user may see of the store (``GET /v1/stats`` with that user's key):
        ``user_memories`` (``{user: count}`` of the stored ones) and ``pending_writes``
        (that user's writes and deletions no generation holds yet). Opens the Writer."""
        return self._core().user_stats(user)

    def quarantine(self, limit: int = 100) -> list[dict[str, Any]]:
        self._check_open()
        with self._db_lock:
            return self.db.quarantine(limit)

    def close(self) -> None:
        """Close this ``Memory``; the store's last one open in this process stops the
        background compaction (one running ends first), records the last accesses and
        closes the DuckDB file. Pending writes stay in the log: the next Writer replays
        them. The store's other ``Memory`` objects go on working. One still open when
        the process exits is closed then."""
        with self._recaller_lock:  # closed once, also from two threads
            if self._closed.is_set():
                return
            self._closed.set()
        _OPEN_MEMORIES.discard(self)
        self._shared.after_compaction.pop(id(self), None)
        self._shared.release()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _flush_now(self) -> None:
        """Log the recall hits not yet logged (the store's, from all its ``Memory`` objects)."""
        self._shared.flush_accesses()


def _plain(record: Any) -> Any:
    """A record as the Writer takes one over HTTP: JSON values (times as ISO strings)."""
    if not isinstance(record, dict):
        return record  # the Writer says what it needs
    return json.loads(json.dumps(record, default=_json_default, ensure_ascii=False))


def _json_default(value: Any) -> str:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    raise TypeError(f"cannot serialise {type(value).__name__}")
