"""The single writer of a store (no Ray here; the Writer deployment and an open
:class:`helix_ray.Memory` wrap it).

DuckDB allows one writing process: while the server runs, :class:`WriterCore` owns the
store's ``helix.duckdb`` and every write goes through it. It holds the delta (the live
entries and tombstones no generation holds yet), rebuilds it from ``serve_log`` after a
restart, and publishes a new delta snapshot after each change. The work itself is in
the modules of each concern:

================================== ==================================================
:mod:`helix_ray.live.writes`       POST, PATCH, DELETE: validate, embed, make durable
:mod:`helix_ray.live.compaction`   fold the delta into the next generation
:mod:`helix_ray.live.forget`       erase a user from the database, delta and generations
:mod:`helix_ray.live.access_log`   the recent recall hits the replicas read
:mod:`helix_ray.live.settings`     the live retrieval overrides
:mod:`helix_ray.live.delta_format` the delta's segment files and manifests
================================== ==================================================

``serve_log`` is created here, next to the tables of :mod:`helix_ray.store.db`:
``seq`` orders every put and delete; ``folded_into`` is the generation that absorbed a
put, or below which a delete's tombstone still applies.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from helix_ray.config import IngestConfig
from helix_ray.embedder import DIM, get_embedder
from helix_ray.errors import Conflict, InvalidArgument, NotFound
from helix_ray.ingest import stages
from helix_ray.live import compaction, fold, forget, settings, writes
from helix_ray.live.access_log import accesses_path, append_accesses, rewrite_accesses
from helix_ray.live.delta_format import (
    MERGE_SMALL_AT,
    NOT_FOLDED,
    SMALL_SEGMENT,
    Tombstone,
    current_delta_version,
    delta_schema,
    entry_columns,
    publish_manifest,
    write_segment,
)
from helix_ray.live.session_context import SessionRows
from helix_ray.heap import trim_heap
from helix_ray.recall import adapter
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import ACCESS_WATERMARK, Generation, current_generation_number, open_good_generation
from helix_ray.store.mirror import Mirror, forget_pending, push

log = logging.getLogger(__name__)

LOG_DDL = """
CREATE TABLE IF NOT EXISTS serve_log (
    seq BIGINT PRIMARY KEY, op VARCHAR NOT NULL, id VARCHAR NOT NULL, "user" VARCHAR NOT NULL,
    record VARCHAR, lexical VARCHAR, n_tokens INTEGER, vector FLOAT[], minhash UINTEGER[],
    written_at TIMESTAMPTZ NOT NULL, folded_into INTEGER
);
ALTER TABLE serve_log ADD COLUMN IF NOT EXISTS late_codes BLOB;
ALTER TABLE serve_log ADD COLUMN IF NOT EXISTS late_scales BLOB;
ALTER TABLE serve_log ADD COLUMN IF NOT EXISTS computed_by VARCHAR;
"""

#: Recent hits the replicas read before compaction folds them: the newest this many ids
#: (a few MB of JSON); older ones reach recency at the next compaction (the access log
#: keeps them all).
MAX_RECENT_ACCESSES = 50_000

#: Past this size the access file is rewritten as one line of the latest hit per id.
ACCESSES_REWRITE_BYTES = 8 * 1024 * 1024


def _micros(value: dt.datetime) -> int:
    return int(value.timestamp() * 1_000_000)


@dataclass(frozen=True)
class MirrorBehind:
    """The mirror does not hold the store as it is: a push failed and none has succeeded
    since. The Compactor's thread pushes again (:meth:`WriterCore.retry_mirror`), so the
    mirror catches up without waiting for the next change."""

    since: float  #: when the first of these failed pushes ran (epoch seconds)
    failures: int  #: failed pushes in a row
    last_try: float  #: when the last one ran (``time.monotonic()`` seconds): retries back off from it
    history: bool  #: False: the push owed keeps no older generation or snapshot there (a user was forgotten)
    error: str  #: what the last one raised

    def as_dict(self) -> dict[str, Any]:
        return {"behind_since": dt.datetime.fromtimestamp(self.since, dt.timezone.utc).isoformat(),
                "failed_pushes": self.failures, "last_error": self.error}


class WriterCore:
    """Owns the store's DuckDB file, the inbox and the delta segment."""

    def __init__(self, store: str | Path, *, ingest: IngestConfig | None = None, compact_runner: str = "local",
                 warn_tokens: bool = True, db: StoreDB | None = None, lock: threading.RLock | None = None,
                 mirror: Mirror | None = None):
        """``warn_tokens``: say at start when the first compaction would encode every
        memory's token vectors (:meth:`_warn_if_tokens_missing`); False: say it at the
        first compaction that does. ``db``, ``lock``: a connection to the store's
        database already open in this process and the lock its callers take (an open
        ``Memory``'s); :meth:`close` closes it. ``mirror``: pushed to after every delta
        snapshot (a compaction's generation comes with its snapshot), access-log
        update, settings change and fitted adapter (:mod:`helix_ray.store.mirror`)."""
        self.store = Path(store)
        self.mirror = mirror
        #: Set while the mirror lags the store (its last push failed); None when it is current.
        self.mirror_behind: MirrorBehind | None = None
        self.config = ingest or IngestConfig()
        self.compact_runner = compact_runner
        self.db = self._open_database(db)  # raises DatabaseHeld when another process holds the file
        self.dim = DIM
        self._lock = lock if lock is not None else threading.RLock()
        # Re-entrant: Memory.ingest holds it across the fold (a compaction) and the ingest.
        self._compacting = threading.RLock()
        self._tokens_warned = False
        self._forgetting = threading.Lock()  # one erasure at a time: each ends by emptying ``erased``
        #: user → when they were forgotten (epoch µs): recall hits made before it and
        #: reported after it (the ingress sends them in batches) are not logged.
        self.forgotten: dict[str, int] = {}
        self._good_of: tuple[int, Generation | None] | None = None  # (CURRENT's number, the generation read)
        self.session_rows = SessionRows()  # a written turn's session in the generation (session_context)
        self._stages: stages.Transform | None = None  # ingest's stages 4–7a, built by the first put
        self._fingerprint = stages.fingerprint(self.config)  # a put's outputs are reused under the same one
        self.entries: dict[str, dict[str, Any]] = {}
        self.tombstones: dict[str, Tombstone] = {}
        self.version = current_delta_version(self.store)
        last = self.db.row("SELECT coalesce(max(seq), 0) FROM serve_log")
        assert last is not None  # an aggregate without GROUP BY returns exactly one row
        self.seq = int(last[0])
        self.last_compaction: dict[str, Any] | None = None
        #: Entries a compaction left in the delta: a change ingest does not see as one (a
        #: PATCH of fields other than the text keeps the content hash; see docs/architecture.md).
        self.unfoldable: set[int] = set()
        #: The segment files of the live snapshot, each with the seqs it holds.
        self.segments: list[tuple[str, np.ndarray]] = []
        from helix_ray.ingest.run import roll_forward  # the ingest pipeline: loaded only now

        roll_forward(self.store, self.db)  # a generation recorded, then a crash before CURRENT moved
        self._replay()
        self._publish(rewrite=True)  # one segment of every live entry: files left by an earlier run are not trusted
        self.recent_accesses: dict[str, int] = {}  # id → last access (epoch µs) not yet in a generation
        self._load_recent_accesses()
        if warn_tokens:
            self.warn_tokens_once()

    @property
    def _transform(self) -> stages.Transform:
        """The ingest stages a put runs (the encoders load with the first one: an open
        ``Memory`` that only recalls never loads the passage encoders)."""
        self.load_encoders()
        assert self._stages is not None
        return self._stages

    def load_encoders(self) -> None:
        """Load the passage encoders now rather than at the first write: a server's Writer
        does it at start, so its first write costs what the others do."""
        if self._stages is None:
            self._stages = stages.Transform(self.config, terms=False)  # the delta analyses BM25

    def warn_tokens_once(self) -> None:
        """:meth:`_warn_if_tokens_missing`, the first time only (at start, or at the
        first compaction that has something to fold)."""
        if not self._tokens_warned:
            self._tokens_warned = True
            self._warn_if_tokens_missing()

    def _warn_if_tokens_missing(self) -> None:
        """Late interaction on, and a generation built without token vectors: the next
        compaction encodes every memory's tokens (once; later ones carry them), which is
        slow on a large store and slows recall meanwhile (docs/benchmarks.md). Said at
        start, with the fix."""
        if not self.config.late_interaction.enabled or self.generation is None:
            return
        manifest = self._manifest()
        size = int((manifest.get("counts") or {}).get("memories") or 0)
        if size and not manifest.get("late"):
            log.warning(
                "Generation %d of %s holds no late-interaction token vectors, and these ingest settings have "
                "late_interaction.enabled: the first compaction will encode the tokens of all %s memories (minutes "
                "per 10^5 memories on two cores; writes are recalled from the delta meanwhile). To keep the store "
                "as it was built, give an ingest config with `late_interaction: {enabled: false}` (`helix serve "
                "--ingest-config FILE`; in Python, `Memory(store, ingest=IngestConfig(late_interaction={'enabled': "
                "False}))`).", manifest.get("generation"), self.store, f"{size:,}")

    def _open_database(self, db: StoreDB | None = None) -> StoreDB:
        db = db if db is not None else StoreDB(self.store)
        db.con.execute(LOG_DDL)
        return db

    # ---------------------------------------------------------------- state
    @property
    def generation(self) -> int | None:
        return current_generation_number(self.store)

    def base(self) -> Generation | None:
        """The generation recall reads: the current one, or the newest whole one when it
        is damaged (:func:`open_good_generation`); None when there is none. Opened again
        only when ``CURRENT`` moves."""
        number = self.generation
        if number is None:
            return None
        if self._good_of is None or self._good_of[0] != number:
            self._good_of = (number, open_good_generation(self.store))
        return self._good_of[1]

    def _manifest(self) -> dict[str, Any]:
        """The manifest of :meth:`base`; {} when there is none."""
        good = self.base()
        return good.manifest if good is not None else {}

    def _num_perm(self) -> int:
        return int((self._manifest().get("minhash") or {}).get("num_perm") or self.config.dedup.num_perm)

    def _drop_superseded(self, ids: list[str] | None = None) -> None:
        """Delete the log's unfolded puts that a later row of the same id (a put or a
        delete) replaced, of ``ids`` (None: every id); in the caller's transaction.

        They are never needed again, and left in place they would come back: compaction
        prunes a folded row once an older generation holds it, and the replay after a
        restart would then find the unfolded put under it — a memory written and deleted
        between two compactions, or the text a PATCH replaced, would be live again (and
        folded into the next generation)."""
        where = "" if ids is None else " AND a.id IN (SELECT unnest(?::VARCHAR[]))"
        self.db.con.execute(
            "DELETE FROM serve_log AS a WHERE a.op = 'put' AND a.folded_into IS NULL" + where
            + " AND EXISTS (SELECT 1 FROM serve_log AS b WHERE b.id = a.id AND b.seq > a.seq)",
            [] if ids is None else [sorted(set(ids))])

    def _replay(self) -> None:
        """Rebuild the delta from ``serve_log`` (after a restart)."""
        current = self.generation or 0
        self._drop_superseded()  # a log may hold replaced puts (one written by an earlier version)
        cur = self.db.con.execute(
            'SELECT seq, op, id, "user", record, lexical, n_tokens, vector, minhash, folded_into, late_codes, '
            "late_scales, computed_by FROM serve_log ORDER BY seq")
        for seq, op, mid, user, record, lexical_text, n_tokens, vector, minhash, folded, codes, scales, by \
                in cur.fetchall():
            if op == "put":
                self.tombstones.pop(mid, None)
                row = json.loads(record)
                self.entries[mid] = self._entry(seq, row, lexical_text, n_tokens, np.asarray(vector, np.float32),
                                                np.asarray(minhash, np.uint32), folded, codes, scales, by)
            else:
                self.entries.pop(mid, None)
                self.tombstones[mid] = Tombstone(mid, user, folded)
        # What a generation older than the current one absorbed is not needed.
        self.entries = {i: e for i, e in self.entries.items()
                        if e["folded_into"] == NOT_FOLDED or e["folded_into"] >= current}
        self.tombstones = {i: t for i, t in self.tombstones.items()
                           if t.applies_below is None or t.applies_below >= current}
        self._mark_open_deletes()

    def _mark_open_deletes(self) -> None:
        """Mark the database row of every id whose last word is a delete no compaction
        has applied yet. Idempotent. A compaction's pipeline, running outside the lock,
        may have written such a row as live (a DELETE answered while it ran); the repair
        after it is in memory until then, so a restart or a failed compaction in between
        relies on this (at start and before each compaction)."""
        ids = [t.id for t in self.tombstones.values() if t.applies_below is None]
        if ids:
            self.db.delete(ids)

    def _entry(self, seq: int, row: dict[str, Any], lexical_text: str, n_tokens: int, vector: np.ndarray,
               minhash: np.ndarray, folded: int | None, late_codes: bytes | None = None,
               late_scales: bytes | None = None, computed_by: str | None = None) -> dict[str, Any]:
        created = row["created_at"]
        created = dt.datetime.fromisoformat(created) if isinstance(created, str) else created
        return {
            "seq": int(seq), "id": row["id"], "user": row["user"], "text": row["text"], "lexical": lexical_text,
            "type": row["type"], "project": row.get("project"), "session_id": row.get("session_id"),
            "created_at": _micros(created), "salience": float(row["salience"]),
            "confidence": float(row["confidence"]), "pinned": bool(row["pinned"]), "n_tokens": int(n_tokens),
            "vector": vector, "minhash": minhash, "folded_into": NOT_FOLDED if folded is None else int(folded),
            "record": row, "late_codes": None if late_codes is None else bytes(late_codes),
            "late_scales": None if late_scales is None else bytes(late_scales), "computed_by": computed_by,
        }

    def _segment(self, entries: list[dict[str, Any]]) -> tuple[str, np.ndarray]:
        """A new segment file of ``entries``, in seq order."""
        table = self.segment_table(entries)
        return write_segment(self.store, table), table.column("seq").to_numpy().astype(np.int64)

    def segment_table(self, entries: list[dict[str, Any]]) -> pa.Table:
        """``entries`` as rows of the delta's files (:func:`delta_schema`), in seq order:
        what a delta segment file and a generation's segment hold."""
        ordered = sorted(entries, key=lambda e: e["seq"])
        num_perm = ordered[0]["minhash"].shape[0] if ordered else self._num_perm()
        schema = delta_schema(self.dim, num_perm)
        cols = entry_columns(ordered)
        cols["folded_into"] = [NOT_FOLDED] * len(ordered)  # the manifest says what is folded
        cols["record"] = [json.dumps(e["record"], ensure_ascii=False) for e in ordered]
        cols["vector"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([e["vector"] for e in ordered]) if ordered else np.zeros(0, np.float32),
                     pa.float32()), self.dim)
        cols["minhash"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([e["minhash"] for e in ordered]) if ordered else np.zeros(0, np.uint32),
                     pa.uint32()), num_perm)
        return pa.table({name: cols[name] for name in schema.names}, schema=schema)

    def _publish(self, rewrite: bool = False) -> int:
        """Publish a new snapshot of the live entries; return its version.

        The live entries no listed segment holds (what this change wrote, and anything an
        earlier publish that failed left out) go to a new segment of their own. Small
        segments are merged once :data:`MERGE_SMALL_AT` of them pile up, so a write costs a
        file of its own entries plus, now and then, one of a few hundred. ``rewrite`` (a
        start), or files holding more dead entries than live ones, put every live entry
        in one new segment."""
        by_seq = {e["seq"]: e for e in self.entries.values()}
        live = np.fromiter(by_seq, dtype=np.int64, count=len(by_seq))
        segments, held = self._live_segments(live)
        listed = sum(len(seqs) for _, seqs in segments)
        if rewrite or listed - int(held.sum()) > max(len(live), SMALL_SEGMENT):
            segments = [self._segment(list(by_seq.values()))] if len(live) else []
        else:
            covered = np.concatenate([seqs for _, seqs in segments]) if segments else np.zeros(0, np.int64)
            missing = live[~np.isin(live, covered)]
            if len(missing):
                segments.append(self._segment([by_seq[int(q)] for q in missing]))
                held = np.append(held, len(missing))
            small = [s for s, n in zip(segments, held) if n < SMALL_SEGMENT]
            if len(small) >= MERGE_SMALL_AT:
                names = {name for name, _ in small}
                merged = self._segment([by_seq[int(q)] for _, seqs in small for q in seqs if int(q) in by_seq])
                segments = [s for s in segments if s[0] not in names] + [merged]
        listed_seqs = np.concatenate([seqs for _, seqs in segments]) if segments else np.zeros(0, np.int64)
        dead = listed_seqs[~np.isin(listed_seqs, live)]
        folded = {e["seq"]: e["folded_into"] for e in by_seq.values() if e["folded_into"] != NOT_FOLDED}
        self.version += 1
        publish_manifest(self.store, self.version, [name for name, _ in segments], dead=dead.tolist(),
                         folded=folded, tombstones=self.tombstones.values())
        self.segments = segments
        self.push_mirror()
        return self.version

    def push_mirror(self, *, history: bool = True) -> bool:
        """Make the mirror (if any) hold the store as it is now (``history=False``: and
        nothing older: a user was forgotten). Under ``_lock``: one push at a time, each of
        the store as it is when it starts. A push that fails is logged, not raised (the
        change is durable here) and recorded in :attr:`mirror_behind`; the next change
        or the Compactor's retry (:meth:`retry_mirror`) pushes again, keeping no history
        if the failed one was to keep none. Returns whether the mirror holds no forgotten
        user's data (true without a mirror while no forget is pending)."""
        if self.mirror is None:
            return not forget_pending(self.store)
        owed = self.mirror_behind
        history = history and (owed is None or owed.history)
        try:
            push(self.store, self.mirror, history=history)
        except Exception as exc:  # noqa: BLE001 - object storage away must not fail a durable write
            failures = owed.failures + 1 if owed is not None else 1
            self.mirror_behind = MirrorBehind(since=owed.since if owed is not None else time.time(),
                                              failures=failures, last_try=time.monotonic(), history=history,
                                              error=f"{type(exc).__name__}: {exc}")
            log.exception("could not push %s to the mirror %s (%d failed pushes in a row); it is pushed again "
                          "in the background and with the next change", self.store, self.mirror.uri, failures)
            if forget_pending(self.store) or not history:
                log.error("the mirror %s still holds copies of a forgotten user's data until a push to it "
                          "succeeds", self.mirror.uri)
            return False
        if owed is not None:
            log.info("the mirror %s holds the store again, after %d failed pushes", self.mirror.uri, owed.failures)
        self.mirror_behind = None
        return True

    def retry_mirror(self) -> bool:
        """Push again when the last push failed (:attr:`mirror_behind`); the Compactor's
        thread calls it. Returns whether the mirror now holds the store (true when it
        was not behind)."""
        with self._lock:
            if self.mirror_behind is None:
                return True
            self.push_mirror()
            return self.mirror_behind is None

    def _live_segments(self, live: np.ndarray) -> tuple[list[tuple[str, np.ndarray]], np.ndarray]:
        """The listed segments that still hold a live entry, and how many each holds (one
        ``isin`` over every listed seq, not one per segment)."""
        if not self.segments:
            return [], np.zeros(0, np.int64)
        listed = np.concatenate([seqs for _, seqs in self.segments])
        owner = np.repeat(np.arange(len(self.segments)), [len(seqs) for _, seqs in self.segments])
        held = np.bincount(owner[np.isin(listed, live)], minlength=len(self.segments))
        keep = np.flatnonzero(held > 0)
        return [self.segments[i] for i in keep], held[keep]

    def owner(self, memory_id: str) -> str | None:
        """The user a live memory belongs to, or None if there is no such memory."""
        entry = self.entries.get(memory_id)
        if entry is not None:
            return entry["user"]
        if memory_id in self.tombstones:
            return None
        return self.db.owners([memory_id]).get(memory_id)

    # ---------------------------------------------------------------- writes
    def add(self, records: list[dict[str, Any]], *, user: str | None, single: bool = False) -> dict[str, Any]:
        """Validate, embed and durably write ``records`` (:func:`writes.add`)."""
        return writes.add(self, records, user=user, single=single)

    def patch(self, memory_id: str, fields: dict[str, Any], *, user: str | None) -> dict[str, Any]:
        return writes.patch(self, memory_id, fields, user=user)

    def delete(self, memory_id: str, *, user: str | None) -> dict[str, Any]:
        return writes.delete(self, memory_id, user=user)

    def accessed(self, hits: list[tuple[str, str, int]]) -> dict[str, Any]:
        """Append recall hits ``(memory id, user, epoch µs)`` to the access log (the
        ingress batches them); the next compaction or ingest folds them into
        ``last_accessed_at`` and ``access_count``, the recency signal's input. Until
        then the replicas read them from :func:`accesses_path` (the latest per id), so
        recency moves for served recalls as it does for an open ``Memory``."""
        utc = dt.timezone.utc
        with self._lock:
            if self.forgotten:
                hits = [(i, u, t) for i, u, t in hits if int(t) > self.forgotten.get(str(u), -1)]
            rows = [(str(i), str(u), dt.datetime.fromtimestamp(int(t) / 1e6, tz=utc)) for i, u, t in hits]
            self.db.log_access(rows)
            fresh: dict[str, int] = {}
            for memory_id, _, micros in hits:
                if int(micros) > self.recent_accesses.get(str(memory_id), 0):
                    self.recent_accesses[str(memory_id)] = fresh[str(memory_id)] = int(micros)
            self._publish_accesses(fresh)
            self.push_mirror()
        return {"recorded": len(rows)}

    def _load_recent_accesses(self) -> None:
        """After a start or a compaction: the log's hits the current generation has not
        folded (its manifest says how far it did)."""
        after = 0
        if self.generation is not None:
            after = int(self._manifest().get(ACCESS_WATERMARK, 0))
        self.recent_accesses = self.db.last_accesses(after)
        self._publish_accesses()

    def _publish_accesses(self, fresh: dict[str, int] | None = None) -> None:
        """Append ``fresh`` hits as one line; None (a start, a compaction), too many ids
        or too big a file: rewrite the file as one line of every recent hit."""
        path = accesses_path(self.store)
        if fresh is not None and len(self.recent_accesses) <= MAX_RECENT_ACCESSES:
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = None
            if size is not None and size < ACCESSES_REWRITE_BYTES:
                if fresh:
                    append_accesses(path, fresh)
                return
        if len(self.recent_accesses) > MAX_RECENT_ACCESSES:  # the newest ones; the log keeps every hit
            newest = sorted(self.recent_accesses.items(), key=lambda kv: kv[1])[-MAX_RECENT_ACCESSES:]
            self.recent_accesses = dict(newest)
        rewrite_accesses(path, self.recent_accesses)

    def feedback(self, query: Any, memory_ids: Any, *, user: str | None) -> dict[str, Any]:
        """Record which memories answered ``query`` for ``user`` (labelled queries for
        ``helix adapt --from-feedback``). Ids must be that user's memories."""
        query, ids = adapter.check_feedback(query, memory_ids)
        if user is None:
            raise InvalidArgument("user", None, "feedback must name its user when the server runs without API keys")
        with self._lock:
            foreign = [m for m in ids if self.owner(m) != user]
            if foreign:
                raise NotFound(f"Got memory_ids {foreign[:5]} in feedback; user {user!r} has no memories with "
                               "those ids. Give ids from this user's recall results.")
            self.db.add_feedback(user, query, ids)
        return {"recorded": len(ids)}

    def adapt(self, *, users: list[str] | None = None, force: bool = False) -> dict[str, Any]:
        """``helix adapt --from-feedback`` inside the server (this replica holds the
        database): fit the store's query adapter on the recorded feedback — of ``users``
        only, if given — and save it when cross-validation shows a gain (or ``force``).
        The recall replicas pick a saved adapter up with their next request."""
        with self._lock:
            pairs = self.db.feedback_pairs(users)
        try:
            adapter.require_feedback(pairs, users, how="POST /v1/feedback")
        except InvalidArgument as exc:
            if users == []:  # names no user: the request's own mistake (422)
                raise
            raise Conflict(str(exc)) from None  # a valid request the store has no feedback for yet (409)
        out = adapter.fit_store(self.store, pairs, embedder=get_embedder(self.config.embedder), force=force)
        with self._lock:
            self.push_mirror()
        return out

    # ---------------------------------------------------------------- compaction
    def pending(self) -> int:
        with self._lock:  # the compactor thread asks while requests write
            return sum(1 for e in self.entries.values() if e["folded_into"] == NOT_FOLDED)

    def open_tombstones(self) -> int:
        """Deletions no compaction has applied to a generation yet."""
        with self._lock:
            return sum(1 for t in self.tombstones.values() if t.applies_below is None)

    def compactable(self) -> int:
        """Pending entries a compaction has not yet tried to fold (see :meth:`compact`)."""
        with self._lock:
            return sum(1 for e in self.entries.values()
                       if e["folded_into"] == NOT_FOLDED and e["seq"] not in self.unfoldable)

    def compact(self, *, rebuild: bool = False) -> dict[str, Any]:
        """Fold the live delta (and the deletions since the last compaction) into the
        next generation; return what happened. While :meth:`foldable`, as a segment
        (:func:`fold.fold`: the current generation's files linked, the writes added);
        otherwise, and with ``rebuild`` (even when the delta is empty), by rebuilding
        every file with the ingest pipeline (:func:`compaction.compact`), which also
        takes in the segments. Then the C heap is trimmed: the pipeline's arrays
        (vectors, index builds, the new generation opened to mark what it folded) are
        free by then, and glibc would keep their pages (100–160 MiB at 10^5 memories)
        for later allocations."""
        try:
            if not rebuild and self.foldable():
                folded = fold.fold(self)
                if folded is not None:
                    return folded
            return compaction.compact(self, rebuild=rebuild)
        finally:
            trim_heap()

    def foldable(self) -> bool:
        """Whether the next compaction adds the pending writes as a segment
        (``IngestConfig.fold``): the current generation opens whole, holds at least
        ``min_base_rows`` memories, and its segments would hold no more than
        ``max_rows`` rows nor ``max_share`` of them; and no forgotten user's rows wait
        for a rebuild to leave it."""
        rule = self.config.fold
        with self._lock:
            manifest = self._manifest()
            if not rule.max_rows or manifest.get("generation") != self.generation:  # none, or damaged
                return False
            counts = manifest.get("counts") or {}
            base = int(counts.get("memories") or 0)
            rows = int(counts.get("segment_rows") or 0) + sum(
                1 for e in self.entries.values() if e["folded_into"] == NOT_FOLDED)
            if base < rule.min_base_rows or rows > min(rule.max_rows, rule.max_share * base):
                return False
            return not self.db.erased_ids()

    def fold(self) -> dict[str, Any] | None:
        """Fold the pending writes and deletions into a segment of the next generation
        (:func:`fold.fold`): a cost of what is pending, not of the store's size. None
        when the store needs a rebuild instead (a forgotten user's rows in it)."""
        return fold.fold(self)

    # ---------------------------------------------------------------- erasure
    def forget_user(self, user: str, *, compact: bool = True) -> dict[str, Any]:
        """Erase ``user`` from the store: database, delta, keys, query adapter and, with
        ``compact``, every generation (:func:`forget.forget_user`)."""
        return forget.forget_user(self, user, compact=compact)

    # ---------------------------------------------------------------- settings
    def patch_settings(self, patch: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """Merge ``patch`` into the live overrides, check the result, persist it."""
        with self._lock:
            out = settings.patch_settings(self.store, patch, base)
            self.push_mirror()
            return out

    def reset_settings(self) -> dict[str, Any]:
        with self._lock:
            out = settings.reset_settings(self.store)
            self.push_mirror()
            return out

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = self.db.counts()
            return {
                "db": counts,
                "delta": {"version": self.version, "entries": len(self.entries), "pending": self.pending(),
                          "unfoldable": len(self.unfoldable), "tombstones": len(self.tombstones),
                          "log_seq": self.seq},
                "last_compaction": self.last_compaction,
                "mirror": self._mirror_state(),
            }

    def _mirror_state(self) -> dict[str, Any] | None:
        """The mirror's URI, whether it lags the store (and since when, after how many
        failed pushes) and whether it may still hold a forgotten user's data; None
        without a mirror."""
        if self.mirror is None:
            return None
        behind = self.mirror_behind
        return {"uri": self.mirror.uri, "behind": behind is not None,
                **(behind.as_dict() if behind is not None else {}),
                "forget_pending": forget_pending(self.store) or (behind is not None and not behind.history)}

    def user_stats(self, user: str) -> dict[str, Any]:
        """What a user's own key may see: that user's memories (those written and not yet
        folded too: :meth:`StoreDB.pending_new`) and the writes (adds, patches, deletes)
        not yet folded into a generation."""
        with self._lock:
            row = self.db.row('SELECT count(*) FROM memories WHERE NOT deleted AND "user" = ?', [user])
            new = sum(n for owner, _, n in self.db.pending_new() if owner == user)
            pending = sum(1 for e in self.entries.values()
                          if e["folded_into"] == NOT_FOLDED and e["record"].get("user") == user)
            deletes = sum(1 for t in self.tombstones.values() if t.applies_below is None and t.user == user)
            return {"user_memories": {user: (int(row[0]) if row else 0) + new}, "pending_writes": pending + deletes}

    def close(self) -> None:
        """Close the database, after a compaction that is running (its pipeline uses a
        cursor of this connection; up to a minute, then closed all the same)."""
        waited = self._compacting.acquire(timeout=60)
        try:
            with self._lock:
                self.db.close()
        finally:
            if waited:
                self._compacting.release()


__all__ = ["MirrorBehind", "WriterCore"]
