"""The front door: :class:`Memory` opens (or creates) a store, ingests, and recalls.

>>> mem = Memory("stores/atlas")
>>> mem.ingest(["helix_ray/samples/atlas/memories.jsonl"])
>>> result = mem.recall("why did we pick NATS?", user="dana", budget_tokens=512)
>>> print(result.context())

One :class:`Memory` is the single writer of its store's DuckDB file (DuckDB allows one
writing process). Recall reads only the memory-mapped generation; the accesses it
records go to DuckDB from a background thread, off the query path.

Opening a store with a generation warms it in the background (``warm=True``, see
:mod:`helix_ray.recall.warm`): the encoders load and one question runs through every
stage, then the generation's files are read into the page cache. A recall that comes
before the first part is done waits for it rather than loading everything a second time.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

from helix_ray.config import IngestConfig, RetrievalConfig
from helix_ray.embedder import DIM, get_embedder
from helix_ray.errors import InvalidArgument, is_disk_full
from helix_ray.recall import adapter
from helix_ray.recall.threads import encoder_threads
from helix_ray.schema import MemoryRecord
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import current_generation_number, open_good_generation
from helix_ray.store.space import disk_full

log = logging.getLogger(__name__)


class Memory:
    def __init__(
        self,
        store: str | Path,
        *,
        retrieval: RetrievalConfig | None = None,
        ingest: IngestConfig | None = None,
        record_access: bool = True,
        warm: bool = True,
    ):
        self.store = Path(store)
        self.retrieval_config = retrieval or RetrievalConfig()
        self.ingest_config = ingest or IngestConfig()
        self.db = StoreDB(self.store)
        self._db_lock = threading.Lock()
        self._recaller: Any = None  # a Recaller, opened by the first recall (or the warm-up)
        self._recaller_lock = threading.Lock()  # one Recaller built at a time
        self._warm = threading.Event()  # set when the warm-up's question is answered (or there is none)
        self._adapter = adapter.watch(self.store, self.ingest_config.embedder.name)  # re-read when replaced
        self._overlay: dict[str, int] = {}  # id → last access (µs) since the generation was built
        self._accesses: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._writer = None
        if record_access:
            self._writer = threading.Thread(target=self._flush_accesses, name="helix-access-log", daemon=True)
            self._writer.start()
        if warm and current_generation_number(self.store) is not None:
            threading.Thread(target=self._warm_up, name="helix-warm", daemon=True).start()
        else:
            self._warm.set()

    # ------------------------------------------------------------------ ingest
    def ingest(self, sources: Sequence[str | Path] | str | Path, *, format: str = "auto", runner: str = "local",
               show_progress: bool = False, since: str | None = None, max_commits: int | None = None,
               repo_name: str | None = None):
        """Run the ingest pipeline over files or folders; returns its report. ``format``
        ``"code"`` reads a source tree, ``"git"`` a repository's commits (``since``,
        ``max_commits``: which ones), as memories of ``ingest.validation.default_user``
        whose ids name the repository ``repo_name`` (default: its folder's name)."""
        from helix_ray.ingest.run import ingest  # the ingest pipeline: a recall-only Memory never loads it

        if isinstance(sources, (str, Path)):
            sources = [sources]
        self._flush_now()
        with self._db_lock:
            report = ingest(list(sources), self.store, fmt=format, config=self.ingest_config, runner=runner,
                            show_progress=show_progress, db=self.db, since=since, max_commits=max_commits,
                            repo_name=repo_name)
        if report.published:
            with self._recaller_lock:
                self._recaller = None  # the next recall opens the new generation
            self._overlay.clear()
        return report

    def add(self, records: Iterable[dict[str, Any] | MemoryRecord], *, runner: str = "local"):
        """Ingest records given in Python. They are first written durably to the store's
        ``inbox/`` (fsynced JSONL), so an acknowledged add survives a crash mid-ingest."""
        rows = [r.to_row() if isinstance(r, MemoryRecord) else dict(r) for r in records]
        # A fixed source: the default, the inbox file's name, is new at each call and would
        # count the same record added again as updated.
        for row in rows:
            if not row.get("source"):
                row["source"] = "api"
        if not rows:
            raise InvalidArgument("records", [], "give at least one memory record")
        inbox = self.store / "inbox"
        inbox.mkdir(parents=True, exist_ok=True)
        path = inbox / f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.jsonl"
        try:
            with open(path, "w", encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row, default=_json_default, ensure_ascii=False) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            path.unlink(missing_ok=True)  # a part of the records is no write
            if is_disk_full(exc):
                raise disk_full(self.store, "writing the inbox file",
                                need_bytes=len(json.dumps(rows, default=str))) from exc
            raise
        return self.ingest([path], format="jsonl", runner=runner)

    # ------------------------------------------------------------------ recall
    @property
    def recaller(self):
        with self._recaller_lock:
            if self._recaller is None:
                self._recaller = self._open_recaller()
            recaller = self._recaller
        recaller.adapter = self._adapter.read()  # `helix adapt` while open: the next recall uses it
        return recaller

    def _open_recaller(self):
        from helix_ray.recall.pipeline import Recaller  # loads scipy: on the first recall, not at import

        # None before the first ingest; a damaged current generation falls back to the previous one
        generation = open_good_generation(self.store, expect_embedder=self.ingest_config.embedder.name,
                                          expect_dim=DIM)
        # Half the cores per query encoder when the two run side by side.
        threads = encoder_threads(generation, self.retrieval_config)
        embedder = get_embedder(self.ingest_config.embedder, threads)
        return Recaller(generation, embedder, self.retrieval_config, threads=threads)

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
            read_through(generation.path, ROLE_FILES["all"])

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
        with self._db_lock:
            owners = self.db.owners(ids)
            foreign = [m for m in ids if owners.get(m) != user]
            if foreign:
                raise InvalidArgument("memory_ids", foreign[:5], f"user {user!r} has no memories with these ids; give "
                                      "ids from this user's recall results")
            self.db.add_feedback(user, query, ids)
        return len(ids)

    def feedback_pairs(self, users: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The labelled queries given so far (of ``users`` only, if given), oldest first:
        what :func:`helix_ray.recall.adapter.fit_pairs` takes. Use this, not ``self.db``:
        the access-log thread shares the DuckDB connection, which refuses a second caller."""
        with self._db_lock:
            return self.db.feedback_pairs(users)

    def recall(self, query: str, *, user: str, budget_tokens: int | None = None, k: int | None = None,
               project: str | None = None, types: Sequence[str] | str | None = None, since: Any = None,
               until: Any = None, explain: bool = False, **options: Any):
        """Recall ``user``'s memories for ``query``; see :meth:`Recaller.recall`."""
        from helix_ray.recall.pipeline import IdAccessOverlay  # loads scipy: on the first recall, not at import

        self._warm.wait()
        recaller = self.recaller
        overlay = None
        if self._overlay and recaller.columns is not None:
            overlay = IdAccessOverlay(recaller.columns.ids, self._overlay)
        result = recaller.recall(query, user=user, budget_tokens=budget_tokens, k=k, project=project, types=types,
                                 since=since, until=until, explain=explain, last_access_overlay=overlay, **options)
        if self._writer is not None and result.items:
            now = dt.datetime.now(dt.timezone.utc)
            micros = int(now.timestamp() * 1_000_000)
            for item in result.items:
                self._overlay[item.id] = micros
                self._accesses.put((item.id, user, now))
        return result

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        self._flush_now()
        with self._db_lock:
            counts = self.db.counts()
        counts["generation"] = current_generation_number(self.store)
        found = self._adapter.read()  # None: recall uses raw vectors
        counts["query_adapter"] = None if found is None else {
            "queries": found.pairs, "ridge": found.ridge, "created_at": found.created_at}
        counts["store"] = str(self.store)
        return counts

    def quarantine(self, limit: int = 100) -> list[dict[str, Any]]:
        with self._db_lock:
            return self.db.quarantine(limit)

    def close(self) -> None:
        self._closed.set()
        if self._writer is not None:
            self._writer.join(timeout=5)
        self._flush_now()
        with self._db_lock:
            self.db.close()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ access log
    def _drain(self) -> list[tuple[str, str, dt.datetime]]:
        hits = []
        while True:
            try:
                hits.append(self._accesses.get_nowait())
            except queue.Empty:
                return hits

    def _flush_now(self) -> None:
        hits = self._drain()
        if hits:
            with self._db_lock:
                self.db.log_access(hits)

    def _flush_accesses(self) -> None:
        while not self._closed.wait(1.0):
            self._flush_now()


def _json_default(value: Any) -> str:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    raise TypeError(f"cannot serialise {type(value).__name__}")
