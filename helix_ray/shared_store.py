"""What every :class:`helix_ray.Memory` of one store in this process shares.

DuckDB lets a process open the same file twice, so two ``Memory`` objects on one store
(a notebook cell run again: the old object lives on in its threads) raise nothing, yet
two Writers would each keep their own log sequence, delta and compaction, and undo each
other's writes. One :class:`SharedStore` per store folder (its resolved path) holds
what must be single: the DuckDB connection and its lock, the Writer
(:class:`~helix_ray.live.writer.WriterCore`), the background compaction and the recall
hits not yet logged. The first :func:`open_shared` creates it, the last
:meth:`SharedStore.release` closes it.

The Writer is created by the first write, compaction, ingest or feedback: a ``Memory``
that only recalls reads the generation and the delta snapshot already published (every
acknowledged write is) and changes nothing in the store but the access log. That first
use replays writes a crash left logged but not published.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from helix_ray.config import IngestConfig
from helix_ray.errors import GenerationDamaged
from helix_ray.live.compactor import Compactor
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import folded_accesses

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

log = logging.getLogger(__name__)

_OPEN: dict[Path, "SharedStore"] = {}
_OPEN_LOCK = threading.Lock()


def open_shared(store: Path, ingest: IngestConfig) -> "SharedStore":
    """The shared state of ``store``, opened if no ``Memory`` of this process holds it
    (raises :class:`~helix_ray.store.db.DatabaseHeld` when another process does).
    ``ingest``: the Writer's config, when this opens it."""
    key = Path(store).resolve()
    while True:
        with _OPEN_LOCK:
            shared = _OPEN.get(key)
            if shared is None:
                shared = _OPEN[key] = SharedStore(Path(store), key, ingest)
            if not shared.closing.is_set():
                shared.refs += 1
                if ingest != shared.ingest and not shared.started:
                    shared.ingest = ingest  # the Writer opens with the newest Memory's config
                elif ingest != shared.ingest:
                    log.warning("%s is open in this process already, and its Writer runs with another ingest "
                                "config: this Memory's writes go through that Writer. To write with this config, "
                                "close the store's other Memory objects first (or restart the process).", store)
                return shared
        shared.closed.wait()  # the last Memory is closing it (a compaction may be ending): then a new one


class SharedStore:
    """One store's database connection, Writer, compaction and recall hits, shared by
    the open ``Memory`` objects of this process (see the module's docstring)."""

    def __init__(self, store: Path, key: Path, ingest: IngestConfig):
        self.store, self.key, self.ingest = store, key, ingest
        self.db = StoreDB(store)  # raises DatabaseHeld when another process holds the file
        self.db_lock = threading.RLock()  # one caller of the connection at a time (the Writer's lock)
        self.refs = 0
        self._core: WriterCore | None = None
        self._core_lock = threading.Lock()  # one Writer created
        self.compactor: Compactor | None = None
        self._compaction: tuple[float, int] | None = None  # the first (interval, max pending) asked for
        #: While :meth:`compact` runs, the generation it started from: what it publishes
        #: holds what the delta showed beside that one, so a ``Memory`` that serves it may
        #: go on reading it until it has opened and warmed the new one (Memory._current).
        self.folding_from: int | None = None
        #: Called after a compaction published (each open Memory opens the new generation).
        self.after_compaction: dict[int, Callable[[dict[str, Any]], None]] = {}
        self.overlay: dict[str, int] = self._unfolded_accesses()  # id → last access (µs) since the generation
        self.accesses: queue.Queue = queue.Queue()
        self.closing = threading.Event()  # the last Memory closed: no new one joins
        self.closed = threading.Event()  # the database is closed
        self._access_log = threading.Thread(target=self._flush_accesses, name="helix-access-log", daemon=True)
        self._access_log.start()

    def _unfolded_accesses(self) -> dict[str, int]:
        """The access log's hits the current generation has not folded, the latest per
        id (epoch µs): what earlier processes recalled since the last compaction, so
        recency reads them here too (each `helix recall` is a new process). Recency takes
        the newer of a row's folded access and this, so with a manifest that does not
        read (recall falls back to an older generation) the whole log is as right."""
        try:
            after = folded_accesses(self.store)
        except (GenerationDamaged, ValueError, TypeError):
            after = 0
        return self.db.last_accesses(after)

    # ------------------------------------------------------------------ the Writer
    @property
    def started(self) -> bool:
        """Whether the Writer is open (a write, compaction, ingest or feedback came)."""
        return self._core is not None

    def core(self) -> WriterCore:
        """The store's Writer, created (its log replayed into a new delta snapshot) at
        the first call; the background compaction starts with it when one was asked for."""
        with self._core_lock:
            if self._core is None:
                from helix_ray.live.writer import WriterCore  # loads the ingest stages: at the first write

                with self.db_lock:
                    # The token warning comes with the first compaction that needs it.
                    self._core = WriterCore(self.store, ingest=self.ingest, warn_tokens=False, db=self.db,
                                            lock=self.db_lock)
                if self._compaction is not None:
                    self._start_compactor(*self._compaction)
            return self._core

    def compact_in_background(self, interval_s: float, max_pending: int) -> None:
        """Run a background compaction once the Writer is open (one per store: the first
        interval asked for holds until the last ``Memory`` closes)."""
        with self._core_lock:
            if self._compaction is None:
                self._compaction = (interval_s, max_pending)
                if self._core is not None:
                    self._start_compactor(interval_s, max_pending)

    def _start_compactor(self, interval_s: float, max_pending: int) -> None:
        assert self._core is not None
        self.compactor = Compactor(self._core, interval_s=interval_s, max_pending=max_pending, compact=self.compact)

    def compact(self) -> dict[str, Any]:
        """A compaction of the store's pending writes (``Memory.compact`` and the
        background compactor both run this): the recall hits so far flushed, the writes
        folded, and each open ``Memory`` given what it published before the next
        compaction or ingest may start (both take the Writer's compaction lock)."""
        from helix_ray.store.generation import current_generation_number

        self.flush_accesses()
        core = self.core()
        with core._compacting:
            self.folding_from = current_generation_number(self.store)
            try:
                report = core.compact()
                if report.get("published"):
                    for after in list(self.after_compaction.values()):
                        after(report)
            finally:
                self.folding_from = None
        return report

    def pending_writes(self) -> int:
        """Writes and deletions no generation holds yet: the Writer's count, or, before
        it opens, the log's (each id's last row, when no compaction folded it)."""
        if self._core is not None:
            return self._core.pending() + self._core.open_tombstones()
        with self.db_lock:
            if self.db.row("SELECT count(*) FROM information_schema.tables WHERE table_name = 'serve_log'") == (0,):
                return 0
            row = self.db.row("SELECT count(*) FROM serve_log AS a WHERE a.folded_into IS NULL AND NOT EXISTS "
                              "(SELECT 1 FROM serve_log AS b WHERE b.id = a.id AND b.seq > a.seq)")
        return int(row[0]) if row else 0

    # ------------------------------------------------------------------ access log
    def flush_accesses(self) -> None:
        hits: list[tuple[str, str, dt.datetime]] = []
        while True:
            try:
                hits.append(self.accesses.get_nowait())
            except queue.Empty:
                break
        if hits:
            with self.db_lock:
                self.db.log_access(hits)

    def _flush_accesses(self) -> None:
        while not self.closing.wait(1.0):
            self.flush_accesses()

    # ------------------------------------------------------------------ close
    def release(self) -> None:
        """One ``Memory`` closed; the last one stops the background compaction (one
        running ends first), logs the last recall hits and closes the database. Pending
        writes stay in the log: the next Writer replays them."""
        with _OPEN_LOCK:
            self.refs -= 1
            if self.refs > 0:
                return
            self.closing.set()
        try:
            if self.compactor is not None:
                self.compactor.stop(timeout_s=60)
            self._access_log.join(timeout=5)
            self.flush_accesses()
            if self._core is not None:
                self._core.close()  # after a compaction still running (up to a minute)
            else:
                with self.db_lock:
                    self.db.close()
        finally:
            with _OPEN_LOCK:
                del _OPEN[self.key]
            self.closed.set()


__all__ = ["SharedStore", "open_shared"]
