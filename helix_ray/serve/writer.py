"""The single writer of a served store (no Ray here; the Writer deployment wraps it).

DuckDB allows one writing process: while the server runs, this object owns the store's
``helix.duckdb`` and every write goes through it. A write is, in order:

1. validated and normalised by the ingest rules (:func:`helix_ray.ingest.normalize.normalise_one`;
   a bad record is a 422 naming the record and the reason, and nothing is written);
2. expanded, embedded, annotated and signed by the ingest stage functions
   (:class:`helix_ray.ingest.stages.Expand`, ``Embed``, ``Annotate``, MinHash);
3. made durable: an fsynced JSONL file in ``inbox/`` (what ``Memory.add`` writes) and a
   committed row per memory in the ``serve_log`` table of the store's DuckDB file
   (with its vector, so a restarted writer rebuilds the delta without re-embedding);
4. published to the replicas as a new delta snapshot (:mod:`helix_ray.serve.delta`).

Only then is the request answered. :meth:`WriterCore.compact` folds the delta into the
next generation with the ingest pipeline itself (``pipelines.ingest.ingest`` on one
JSONL file of the live entries, with this writer's DuckDB connection), then marks what
the new generation holds as folded.

``serve_log`` is created here, next to the tables of :mod:`helix_ray.store.db`:
``seq`` orders every put and delete; ``folded_into`` is the generation that absorbed a
put, or below which a delete's tombstone still applies.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.config import IngestConfig, deep_merge
from helix_ray.errors import InvalidArgument, StoreError
from helix_ray.schema import DERIVED_ID, MEMORY_SCHEMA, content_hash
from helix_ray.serve.delta import (
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
from helix_ray.serve.errors import Conflict, Forbidden, NotFound

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
SETTINGS_FILE = "serve-settings.json"
MAX_BATCH = 1000
#: A DELETE meeting a compaction's write of the same row waits and tries again, ~5 s in all.
DELETE_TRIES = 9
#: Compaction inputs kept in ``inbox/folded/`` (newest first), for an operator to look at.
KEEP_FOLDED = 50
#: Inbox file names: a served write's copy, a compaction's input.
SERVED_PREFIX = "serve-"
COMPACTION_PREFIX = "compact-"
#: Fields a PATCH may change; id and user are the memory's identity.
PATCHABLE = ("text", "type", "project", "session_id", "salience", "confidence", "pinned", "metadata", "source")
_RECORD_FIELDS = [f.name for f in MEMORY_SCHEMA]


#: Recent hits the replicas read before compaction folds them: the newest this many ids
#: (a few MB of JSON); older ones reach recency at the next compaction (the access log
#: keeps them all).
MAX_RECENT_ACCESSES = 50_000


#: Past this size the access file is rewritten as one line of the latest hit per id.
ACCESSES_REWRITE_BYTES = 8 * 1024 * 1024


def accesses_path(store: Path) -> Path:
    """Recall hits the current generation has not folded yet, as JSON lines of
    ``{memory id: epoch µs}``: appended a batch per line, so a replica reads only what
    was added since it last looked (:class:`AccessTail`); rewritten whole (a new file,
    by rename) after a start or a compaction, or once it grows past
    :data:`ACCESSES_REWRITE_BYTES`. The latest time per id wins."""
    return Path(store) / "delta" / "ACCESSES.jsonl"


def merge_accesses(into: dict[str, int], lines: bytes) -> dict[str, int]:
    """``into`` with the hits of complete JSON lines ``lines`` (the latest per id); a
    line that does not parse (a writer that crashed mid-line) is skipped."""
    for line in lines.splitlines():
        try:
            batch = json.loads(line)
        except ValueError:
            continue
        if not isinstance(batch, dict):
            continue
        for memory_id, micros in batch.items():
            if isinstance(micros, int) and micros > into.get(memory_id, 0):
                into[memory_id] = micros
    return into


def read_accesses(store: Path) -> dict[str, int]:
    """The whole access file of ``store``, as the replicas see it."""
    try:
        return merge_accesses({}, accesses_path(store).read_bytes())
    except FileNotFoundError:
        return {}


class AccessTail:
    """A replica's view of the access file: each :meth:`read` costs one ``stat`` when
    nothing changed, and the appended lines only when the Writer added some (a whole
    new file after a rewrite). The dict it returns is replaced, never changed, once a
    rewrite shows (a request may still hold the one before)."""

    def __init__(self, path: Path):
        self.path = path
        self._inode: int | None = None
        self._offset = 0
        self.accessed: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._inode, self._offset, self.accessed = None, 0, {}
            return self.accessed
        if st.st_ino == self._inode and st.st_size == self._offset:
            return self.accessed
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())  # the file opened, should it have been replaced since the stat
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset, self.accessed = st.st_ino, 0, {}
                fh.seek(self._offset)
                chunk = fh.read(st.st_size - self._offset)
        except FileNotFoundError:
            return self.accessed
        complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        merge_accesses(self.accessed, chunk[:complete])
        self._offset += complete
        return self.accessed


def settings_path(store: Path) -> Path:
    return Path(store) / SETTINGS_FILE


def read_settings(store: Path) -> dict[str, Any]:
    """The live retrieval overrides set through ``PATCH /v1/settings`` ({} if none)."""
    try:
        return json.loads(settings_path(store).read_text())
    except FileNotFoundError:
        return {}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, (dt.datetime, dt.date)) else value


def _micros(value: dt.datetime) -> int:
    return int(value.timestamp() * 1_000_000)


def _not_another_memorys_derived_id(raw: dict[str, Any], row: dict[str, Any], where: str) -> None:
    """An id given in the derived ids' shape must be this memory's own (its user and
    text). Ids are one space across users: otherwise a user could write under the id
    another user's text would get — and learn from the 409 that that user holds exactly
    that text, or take the id so that the other user's write of it fails."""
    given = raw.get("id")
    if isinstance(given, str) and DERIVED_ID.fullmatch(given) and given != content_hash(row["text"], row["user"]):
        raise InvalidArgument(f"{where}.id", given,
                              "an id of 20 lowercase hexadecimal characters is the one Helix derives from the "
                              "memory's user and text, and this is not that memory's",
                              "Leave id out (it is derived), give an id of another shape, or change an existing "
                              "memory's text with PATCH /v1/memories/{id}.")


class WriterCore:
    """Owns the store's DuckDB file, the inbox and the delta segment."""

    def __init__(self, store: str | Path, *, ingest: IngestConfig | None = None, compact_runner: str = "local"):
        from helix_ray.embedder import DIM
        from helix_ray.ingest import stages
        from helix_ray.store.db import StoreDB

        self.store = Path(store)
        self.config = ingest or IngestConfig()
        self.compact_runner = compact_runner
        self.db = StoreDB(self.store)  # raises StoreError when another process holds the file
        self.db.con.execute(LOG_DDL)
        self.dim = DIM
        self._lock = threading.RLock()
        self._compacting = threading.Lock()
        self._transform = stages.Transform(self.config)  # ingest's stages 4–7a, the same for a write
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
        self._replay()
        self._publish(rewrite=True)  # one segment of every live entry: the files of before are not trusted
        self.recent_accesses: dict[str, int] = {}  # id → last access (epoch µs) not yet in a generation
        self._load_recent_accesses()
        self._warn_if_tokens_missing()

    def _warn_if_tokens_missing(self) -> None:
        """Late interaction on, and a generation built without token vectors: the next
        compaction encodes every memory's tokens (once; later ones carry them). Measured:
        on 10^5 memories and two cores it had not finished after 5 minutes, and recall
        ran at half speed meanwhile (docs/operations.md). Said at start, with the fix."""
        from helix_ray.store.generation import Generation

        if not self.config.late_interaction.enabled or self.generation is None:
            return
        current = Generation.open_current(self.store)
        if current.size and not current.manifest.get("late"):
            log.warning(
                "Generation %d of %s holds no late-interaction token vectors, and this server's ingest settings "
                "have late_interaction.enabled: its first compaction will encode the tokens of all %s memories "
                "(minutes per 10^5 memories on two cores; writes are served from the delta meanwhile). To serve "
                "the store as it was built, give an ingest config with `late_interaction: {enabled: false}` "
                "(`helix serve --ingest-config FILE`).", current.number, self.store, f"{current.size:,}")

    # ---------------------------------------------------------------- state
    @property
    def generation(self) -> int | None:
        from helix_ray.store.generation import current_generation_number

        return current_generation_number(self.store)

    def _num_perm(self) -> int:
        from helix_ray.store.generation import Generation

        if self.generation is not None:
            manifest = Generation.open_current(self.store).manifest
            return int((manifest.get("minhash") or {}).get("num_perm") or self.config.dedup.num_perm)
        return self.config.dedup.num_perm

    def _drop_superseded(self, ids: list[str] | None = None) -> None:
        """Delete the log's unfolded puts that a later row of the same id (a put or a
        delete) replaced, of ``ids`` (None: every id); in the caller's transaction.

        They are never needed again, and left in place they came back: compaction prunes
        a folded row once an older generation holds it, and the replay after a restart
        then found the unfolded put under it — a memory written and deleted between two
        compactions, or the text a PATCH replaced, was live again (and folded into the
        next generation)."""
        where = "" if ids is None else " AND a.id IN (SELECT unnest(?::VARCHAR[]))"
        self.db.con.execute(
            "DELETE FROM serve_log AS a WHERE a.op = 'put' AND a.folded_into IS NULL" + where
            + " AND EXISTS (SELECT 1 FROM serve_log AS b WHERE b.id = a.id AND b.seq > a.seq)",
            [] if ids is None else [sorted(set(ids))])

    def _replay(self) -> None:
        """Rebuild the delta from ``serve_log`` (after a restart)."""
        current = self.generation or 0
        self._drop_superseded()  # a log written before they were deleted as they were replaced
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
        # What a generation older than the current one absorbed is no longer needed.
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
        ordered = sorted(entries, key=lambda e: e["seq"])
        num_perm = ordered[0]["minhash"].shape[0] if ordered else self._num_perm()
        schema = delta_schema(self.dim, num_perm)
        cols = entry_columns(ordered)
        cols["folded_into"] = [NOT_FOLDED] * len(ordered)  # the manifest says what is folded
        cols["vector"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([e["vector"] for e in ordered]) if ordered else np.zeros(0, np.float32),
                     pa.float32()), self.dim)
        cols["minhash"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.concatenate([e["minhash"] for e in ordered]) if ordered else np.zeros(0, np.uint32),
                     pa.uint32()), num_perm)
        table = pa.table({name: cols[name] for name in schema.names}, schema=schema)
        return write_segment(self.store, table), np.array([e["seq"] for e in ordered], dtype=np.int64)

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
        return self.version

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

    def _not_found(self, memory_id: str, user: str | None) -> str:
        """The 404's sentence: a memory of this user deleted since the last compaction
        is said to be (another user's is not)."""
        gone = self.tombstones.get(memory_id)
        if gone is not None and (user is None or gone.user == user):
            return (f"Got id={memory_id!r}; that memory was deleted. A delete is final: to bring it back, "
                    "POST /v1/memories it again.")
        who = f" for user {user!r}" if user is not None else ""
        return (f"Got id={memory_id!r}; there is no such memory{who}. Check the id (ids are returned by "
                "POST /v1/memories and by recall).")

    def _record(self, memory_id: str) -> dict[str, Any] | None:
        entry = self.entries.get(memory_id)
        if entry is not None:
            return dict(entry["record"])
        if memory_id in self.tombstones:
            return None
        row = self.db.row(
            'SELECT id, text, type, "user", project, session_id, epoch_us(created_at), epoch_us(last_accessed_at), '
            "access_count, salience, confidence, pinned, source, metadata FROM memories WHERE id = ? AND NOT deleted",
            [memory_id])
        if row is None:
            return None
        record = dict(zip(_RECORD_FIELDS, row))
        utc = dt.timezone.utc
        record["created_at"] = dt.datetime.fromtimestamp(record["created_at"] / 1e6, tz=utc)
        if record["last_accessed_at"] is not None:
            record["last_accessed_at"] = dt.datetime.fromtimestamp(record["last_accessed_at"] / 1e6, tz=utc)
        return record

    # ---------------------------------------------------------------- writes
    def add(self, records: list[dict[str, Any]], *, user: str | None, single: bool = False) -> dict[str, Any]:
        """Validate, embed and durably write ``records`` (each a memory object);
        ``user`` is the API key's user (None when auth is off: each record names its own).
        ``single``: the caller sent one object, not a list (its errors name ``memory``)."""
        if not records:
            raise InvalidArgument("memories", [], "give at least one memory")
        if len(records) > MAX_BATCH:
            raise InvalidArgument("memories", f"<{len(records)} records>", f"a batch holds at most {MAX_BATCH}",
                                  "Split it into several requests.")
        rows = [self._validate(raw, user, where="memory" if single else f"memories[{n}]")
                for n, raw in enumerate(records)]
        for n, (raw, row) in enumerate(zip(records, rows)):
            _not_another_memorys_derived_id(raw, row, "memory" if single else f"memories[{n}]")
        first: dict[str, int] = {}
        for n, row in enumerate(rows):  # the last one silently won
            if first.setdefault(row["id"], n) != n:
                raise InvalidArgument(f"memories[{n}].id", row["id"],
                                      f"memories[{first[row['id']]}] of this batch has that id already (an id left "
                                      "out is derived from user and text: the same text twice)",
                                      "Give each memory of a batch its own id, or send the later version alone.")
        with self._lock:
            for n, row in enumerate(rows):
                owner = self.owner(row["id"])
                if owner is not None and owner != row["user"]:
                    where = "the memory" if single else f"memories[{n}]"
                    raise Conflict(f"Got id={row['id']!r} in {where}; that id belongs to another user's memory. "
                                   "Leave id out (one is derived from user and text) or choose another.")
            self._write(rows)
            return {"ids": [r["id"] for r in rows], "delta_version": self.version, "generation": self.generation}

    def patch(self, memory_id: str, fields: dict[str, Any], *, user: str | None) -> dict[str, Any]:
        unknown = sorted(set(fields) - set(PATCHABLE))
        if unknown or not fields:
            raise InvalidArgument("fields", sorted(fields), f"a PATCH changes one or more of {', '.join(PATCHABLE)}")
        with self._lock:
            record = self._record(memory_id)
            if record is None or (user is not None and record["user"] != user):
                raise NotFound(self._not_found(memory_id, user))
            merged = {k: _iso(record.get(k)) for k in _RECORD_FIELDS if record.get(k) is not None}
            merged.update(fields)
            if "text" in fields and "salience" not in fields:
                merged.pop("salience", None)  # derived from the text: derive it again
            row = self._validate(merged, record["user"], where="memory")
            self._write([row])
            return {"id": memory_id, "delta_version": self.version, "generation": self.generation}

    def delete(self, memory_id: str, *, user: str | None) -> dict[str, Any]:
        import duckdb  # here: the ingress imports this module for settings_path alone

        with self._lock:
            owner = self.owner(memory_id)
            if owner is None or (user is not None and owner != user):
                raise NotFound(self._not_found(memory_id, user))
            self.seq += 1
            for attempt in range(DELETE_TRIES):
                self.db.con.begin()
                try:
                    self.db.con.execute(
                        "INSERT INTO serve_log (seq, op, id, \"user\", written_at) VALUES (?, 'delete', ?, ?, now())",
                        [self.seq, memory_id, owner])
                    self._drop_superseded([memory_id])
                    self.db.delete([memory_id])  # a generation row: the next generation drops it
                    self.db.con.commit()
                    break
                except duckdb.TransactionException as exc:
                    # A compaction's pipeline writing the same row at this moment (it runs
                    # outside the lock, on a connection of its own): once it has, again.
                    self.db.con.rollback()
                    if attempt == DELETE_TRIES - 1:
                        raise StoreError(f"Could not delete {memory_id!r} now: a compaction is writing that memory "
                                         f"({str(exc).splitlines()[0][:120]}). Nothing was deleted; retry in a few "
                                         "seconds.") from None
                    time.sleep(min(0.05 * 2 ** attempt, 1.0))
                except BaseException:
                    self.db.con.rollback()
                    raise
            self.entries.pop(memory_id, None)
            self.tombstones[memory_id] = Tombstone(memory_id, owner, None)
            self._publish()
            return {"id": memory_id, "deleted": True, "delta_version": self.version, "generation": self.generation}

    def accessed(self, hits: list[tuple[str, str, int]]) -> dict[str, Any]:
        """Append recall hits ``(memory id, user, epoch µs)`` to the access log (the
        ingress batches them); the next compaction or ingest folds them into
        ``last_accessed_at`` and ``access_count``, the recency signal's input. Until
        then the replicas read them from :func:`accesses_path` (the latest per id), so
        recency moves for served recalls as it does for an open ``Memory``."""
        utc = dt.timezone.utc
        rows = [(str(i), str(u), dt.datetime.fromtimestamp(int(t) / 1e6, tz=utc)) for i, u, t in hits]
        with self._lock:
            self.db.log_access(rows)
            fresh: dict[str, int] = {}
            for memory_id, _, micros in hits:
                if int(micros) > self.recent_accesses.get(str(memory_id), 0):
                    self.recent_accesses[str(memory_id)] = fresh[str(memory_id)] = int(micros)
            self._publish_accesses(fresh)
        return {"recorded": len(rows)}

    def _load_recent_accesses(self) -> None:
        """After a start or a compaction: the log's hits the current generation has not
        folded (its manifest says how far it did)."""
        from helix_ray.store.generation import ACCESS_WATERMARK, Generation

        after = 0
        if self.generation is not None:
            after = int(Generation.open_current(self.store).manifest.get(ACCESS_WATERMARK, 0))
        summary, _ = self.db.access_summary(after)
        self.recent_accesses = {i: int(t.timestamp() * 1_000_000) for i, (t, _) in summary.items()}
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
                    with open(path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(fresh, separators=(",", ":")) + "\n")
                return
        if len(self.recent_accesses) > MAX_RECENT_ACCESSES:  # the newest ones; the log keeps every hit
            newest = sorted(self.recent_accesses.items(), key=lambda kv: kv[1])[-MAX_RECENT_ACCESSES:]
            self.recent_accesses = dict(newest)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, json.dumps(self.recent_accesses, separators=(",", ":")) + "\n")
        (path.parent / "ACCESSES.json").unlink(missing_ok=True)  # the one-object file of earlier versions

    def feedback(self, query: Any, memory_ids: Any, *, user: str | None) -> dict[str, Any]:
        """Record which memories answered ``query`` for ``user`` (labelled queries for
        ``helix adapt --from-feedback``). Ids must be that user's memories."""
        from helix_ray.recall.adapter import check_feedback

        query, ids = check_feedback(query, memory_ids)
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
        from helix_ray.embedder import get_embedder
        from helix_ray.recall import adapter

        with self._lock:
            pairs = self.db.feedback_pairs(users)
        adapter.require_feedback(pairs, users, how="POST /v1/feedback")
        return adapter.fit_store(self.store, pairs, embedder=get_embedder(self.config.embedder), force=force)

    def _validate(self, raw: Any, user: str | None, *, where: str) -> dict[str, Any]:
        from helix_ray.ingest.normalize import Rejected, normalise_one

        if not isinstance(raw, dict):
            raise InvalidArgument(where, raw, "each memory must be a JSON object with at least 'text'")
        raw = dict(raw)
        if user is not None:
            given = raw.get("user")
            if given not in (None, "", user):
                raise Forbidden(f"Got user={given!r} in {where}; this API key writes only user {user!r}'s "
                                "memories. Leave user out or use that user's key.")
            raw["user"] = user
        try:
            return normalise_one(raw, self.config.validation, default_time=dt.datetime.now(dt.timezone.utc))
        except Rejected as why:
            code, _, sentence = str(why).partition(": ")
            raise InvalidArgument(where, {k: raw.get(k) for k in ("id", "text", "type", "user") if k in raw},
                                  f"it was rejected ({code}): {sentence}") from None

    def _write(self, rows: list[dict[str, Any]]) -> None:
        from helix_ray.ingest.dedup import signatures

        latest = {r["id"]: r for r in rows}  # a repeated id within a batch: the later record wins
        rows = list(latest.values())
        batch = {"seq": np.arange(len(rows)), "text": np.array([r["text"] for r in rows], dtype=object),
                 "type": np.array([r["type"] for r in rows], dtype=object)}
        batch = self._transform(batch)
        vectors = np.asarray(batch["vector"], np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        num_perm = self._num_perm()
        sigs = signatures([r["text"] for r in rows], num_perm=num_perm, shingle=self.config.dedup.shingle)
        # Late-interaction tokens, so a fresh write is scored like a stored memory (None: off).
        late_codes = [bytes(x) for x in batch["late_codes"]] if "late_codes" in batch else [None] * len(rows)
        late_scales = [bytes(x) for x in batch["late_scales"]] if "late_scales" in batch else [None] * len(rows)
        lexical_texts = []
        for row, expansions in zip(rows, batch["expansions"]):
            queries = json.loads(str(expansions))
            lexical_texts.append(row["text"] + ("\n" + "\n".join(queries) if queries else ""))

        # 1. the inbox file, as Memory.add writes it (ingest-ready records)
        inbox = self.store / "inbox"
        inbox.mkdir(parents=True, exist_ok=True)
        path = inbox / f"{SERVED_PREFIX}{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(_ingest_record(row), ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        # 2. the log rows in DuckDB, one transaction
        first = self.seq + 1
        seqs = list(range(first, first + len(rows)))
        table = pa.table({
            "seq": pa.array(seqs, pa.int64()),
            "op": ["put"] * len(rows),
            "id": [r["id"] for r in rows],
            "user": [r["user"] for r in rows],
            "record": [json.dumps(_json_record(r), ensure_ascii=False) for r in rows],
            "lexical": lexical_texts,
            "n_tokens": pa.array([int(x) for x in batch["n_tokens"]], pa.int32()),
            "vector": pa.array([v.tolist() for v in vectors], pa.list_(pa.float32())),
            "minhash": pa.array([s.tolist() for s in sigs], pa.list_(pa.uint32())),
            "late_codes": pa.array(late_codes, pa.binary()),
            "late_scales": pa.array(late_scales, pa.binary()),
            "computed_by": [self._fingerprint] * len(rows),
        })
        self.db.con.begin()
        try:
            self.db.con.register("incoming_serve_log", table)
            self.db.con.execute(
                'INSERT INTO serve_log (seq, op, id, "user", record, lexical, n_tokens, vector, minhash, written_at, '
                'folded_into, late_codes, late_scales, computed_by) SELECT seq, op, id, "user", record, lexical, '
                "n_tokens, vector, minhash, now(), NULL, late_codes, late_scales, computed_by FROM incoming_serve_log")
            self.db.con.unregister("incoming_serve_log")
            self._drop_superseded([r["id"] for r in rows])
            self.db.con.commit()
        except BaseException:
            self.db.con.rollback()
            raise
        self.seq = seqs[-1]
        # 3. the delta, then a snapshot the replicas read
        for seq, row, lex, n_tokens, vector, sig, codes, scales in zip(
                seqs, rows, lexical_texts, batch["n_tokens"], vectors, sigs, late_codes, late_scales):
            self.tombstones.pop(row["id"], None)
            self.entries[row["id"]] = self._entry(seq, _json_record(row), lex, int(n_tokens), vector, sig, None,
                                                  codes, scales, self._fingerprint)
        self._publish()

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

    def compact(self) -> dict[str, Any]:
        """Fold the live delta (and the deletions since the last compaction) into the
        next generation with the ingest pipeline; return what happened.

        The pipeline runs on a snapshot, outside the writer's lock: writes, PATCHes,
        DELETEs, accesses and stats go on while it builds (it rebuilds every index, minutes
        at 10^5 memories, and every write used to wait for it). What changed meanwhile
        stays in the delta, over the new generation, until the next compaction."""
        from pipelines.ingest import ingest
        from helix_ray.store.generation import Generation

        with self._compacting:  # one at a time: the background thread, POST /v1/admin/compact
            with self._lock:
                started = time.perf_counter()
                self._mark_open_deletes()
                pending = [e for e in self.entries.values() if e["folded_into"] == NOT_FOLDED]
                open_tombstones = [t for t in self.tombstones.values() if t.applies_below is None]
                if not pending and not open_tombstones:
                    self.last_compaction = {"published": False, "reason": "nothing to compact",
                                            "generation": self.generation}
                    return self.last_compaction
                upto = self.seq  # the log rows this compaction folds
                inbox = self.store / "inbox"
                inbox.mkdir(parents=True, exist_ok=True)
                before = sorted(p for p in inbox.glob("*.jsonl"))
                source = inbox / (f"{COMPACTION_PREFIX}{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-"
                                  f"{uuid.uuid4().hex[:6]}.jsonl")
                with open(source, "w", encoding="utf-8") as fh:
                    for entry in sorted(pending, key=lambda e: e["seq"]):
                        fh.write(json.dumps(_ingest_record(entry["record"]), ensure_ascii=False) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                db = self.db.sibling()  # a DuckDB connection is not for two threads at once
            try:
                report = ingest([source], self.store, fmt="jsonl", config=self.config, runner=self.compact_runner,
                                show_progress=False, db=db, computed=self._computed(pending))
            except BaseException:
                # The input is a copy of serve_log's pending rows, which stay there: a failed
                # try leaves nothing behind (every retry wrote one more copy of them all).
                source.unlink(missing_ok=True)
                raise
            finally:
                db.close()
            with self._lock:
                number = report.generation
                folded = 0
                if report.published and number is not None:
                    # Deleted while it ran (also if written again since): the pipeline may
                    # have written the row as live.
                    late = [row[0] for row in self.db.con.execute(
                        "SELECT DISTINCT id FROM serve_log WHERE op = 'delete' AND seq > ?", [upto]).fetchall()]
                    if late:
                        self.db.delete(late)
                    folded = self._mark_folded(Generation.open_current(self.store), pending, number)
                    for t in open_tombstones:
                        if self.tombstones.get(t.id) is t:  # not written again (or deleted again) since
                            self.tombstones[t.id] = Tombstone(t.id, t.user, number)
                    self.db.con.execute("UPDATE serve_log SET folded_into = ? WHERE op = 'delete' "
                                        "AND folded_into IS NULL AND seq <= ?", [number, upto])
                    # Entries and tombstones of earlier compactions: every replica has moved on.
                    self.entries = {i: e for i, e in self.entries.items()
                                    if e["folded_into"] == NOT_FOLDED or e["folded_into"] >= number}
                    self.tombstones = {i: t for i, t in self.tombstones.items()
                                       if t.applies_below is None or t.applies_below >= number}
                    self.db.con.execute("DELETE FROM serve_log WHERE folded_into IS NOT NULL AND folded_into < ?",
                                        [number])
                    self._publish()
                    self._load_recent_accesses()  # what the new generation folded leaves the file
                # Tried and not folded; of the earlier ones, only those still pending (a seq
                # replaced or deleted since is gone from the delta: it kept growing here).
                live = {e["seq"] for e in self.entries.values() if e["folded_into"] == NOT_FOLDED}
                self.unfoldable = (self.unfoldable | {e["seq"] for e in pending
                                                      if e["folded_into"] == NOT_FOLDED}) & live
                self._retire_inbox(inbox, before, source, published=bool(report.published))
                self.last_compaction = {
                    "published": bool(report.published), "generation": number, "folded": folded,
                    "kept_in_delta": len(pending) - folded, "deletions": len(open_tombstones),
                    "seconds": round(time.perf_counter() - started, 3), "ingest": report.as_dict(),
                }
                return self.last_compaction

    def _computed(self, pending: list[dict[str, Any]]) -> dict[str, Any]:
        """What the writes already computed (their vectors, token vectors and
        expansions), for compaction to take instead of computing it again: only those
        made under this writer's ingest config (a log row older than its ``computed_by``, or
        under another config, is computed again). The expansions are read back from the
        lexical text: the text, then a query a line (a query holding a newline comes back
        as two, which index the same lexical text); :class:`stages.Reuse` takes them only
        from an LLM expander (the offline one runs again, on the compaction's batch)."""
        from helix_ray.ingest.stages import Computed

        out = {}
        for e in pending:
            text, lexical = e["text"], e["lexical"]
            if e["computed_by"] == self._fingerprint and lexical.startswith(text):
                queries = lexical[len(text) + 1:].split("\n") if len(lexical) > len(text) else []
                out[e["id"]] = Computed(text, json.dumps(queries), e["vector"], e["late_codes"], e["late_scales"])
        return out

    @staticmethod
    def _retire_inbox(inbox: Path, before: list[Path], source: Path, *, published: bool) -> None:
        """After a compaction: the inbox files of the writes it covered, and its own input.

        A served write's file (``serve-*``) is a copy of what ``serve_log`` holds until a
        generation does; once one is published, the files of the writes before the
        compaction are deleted (they were kept for ever: a file per write, 3,061 after a
        10-minute soak, docs/benchmarks.md). Any other file (``Memory.add``'s, left by an
        ingest that failed) and the compaction's input move to ``inbox/folded/``, as do the
        served files when nothing was published (``serve_log`` keeps those writes pending);
        of the inputs, and of those served files, the newest :data:`KEEP_FOLDED` each stay."""
        done = inbox / "folded"
        done.mkdir(exist_ok=True)
        for path in [*before, source]:
            if published and path.name.startswith(SERVED_PREFIX):
                path.unlink(missing_ok=True)
            else:
                shutil.move(str(path), done / path.name)
        for prefix in (COMPACTION_PREFIX, SERVED_PREFIX):  # served ones land here when nothing was published
            kept = sorted(done.glob(f"{prefix}*.jsonl"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
            for old in kept[KEEP_FOLDED:]:
                old.unlink(missing_ok=True)

    def _mark_folded(self, gen, pending: list[dict[str, Any]], number: int) -> int:
        """Mark the pending entries generation ``number`` holds as they are (same text
        and fields), or dropped as a near-duplicate of another memory."""
        table = gen.memories
        ids = [e["id"] for e in pending]
        where = pc.index_in(pa.array(ids, pa.string()), value_set=table.column("id")).to_pylist()
        known = self.db.known_hashes()
        dropped = self.db.dropped_as_duplicates([e["id"] for e, row in zip(pending, where) if row is None])

        folded = []
        for entry, row in zip(pending, where):
            record = entry["record"]
            if row is not None:
                held = {k: table.column(k)[row].as_py() for k in ("text", "type", "project", "session_id", "pinned")}
                same = all(held[k] == record.get(k) for k in held) and \
                    abs(table.column("salience")[row].as_py() - record["salience"]) < 1e-6 and \
                    abs(table.column("confidence")[row].as_py() - record["confidence"]) < 1e-6
            else:  # not in the generation: folded only if ingest dropped it as a duplicate
                seen = known.get(entry["id"])
                same = bool(seen and (seen[1] or entry["id"] in dropped) and seen[0] == content_hash(record["text"], ""))
            if same:
                entry["folded_into"] = number
                folded.append(entry["seq"])
        if folded:
            self.db.con.executemany("UPDATE serve_log SET folded_into = ? WHERE seq = ?", [[number, s] for s in folded])
        return len(folded)

    # ---------------------------------------------------------------- settings
    def patch_settings(self, patch: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """Merge ``patch`` into the live overrides, check the result, persist it."""
        with self._lock:
            from helix_ray.serve.api import check_settings

            merged = deep_merge(read_settings(self.store), patch)
            check_settings(base, merged, patch)  # raises InvalidArgument, naming the bad key
            _atomic_write(settings_path(self.store), json.dumps(merged, indent=1, sort_keys=True))
            return merged

    def reset_settings(self) -> dict[str, Any]:
        with self._lock:
            settings_path(self.store).unlink(missing_ok=True)
            return {}

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
            }

    def user_stats(self, user: str) -> dict[str, Any]:
        """What a user's own key may see: that user's memories in the database and the
        writes (adds, patches, deletes) not yet folded into a generation."""
        with self._lock:
            row = self.db.row('SELECT count(*) FROM memories WHERE NOT deleted AND "user" = ?', [user])
            pending = sum(1 for e in self.entries.values()
                          if e["folded_into"] == NOT_FOLDED and e["record"].get("user") == user)
            deletes = sum(1 for t in self.tombstones.values() if t.applies_below is None and t.user == user)
            return {"user_memories": {user: int(row[0]) if row else 0}, "pending_writes": pending + deletes}

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


def _json_record(row: dict[str, Any]) -> dict[str, Any]:
    """A normalised row as JSON-ready values (times as ISO strings)."""
    return {k: _iso(v) for k, v in row.items()}


def _ingest_record(row: dict[str, Any]) -> dict[str, Any]:
    """The record as ingest reads it back: the memory fields, no derived ones."""
    out = {k: _iso(row.get(k)) for k in _RECORD_FIELDS if row.get(k) is not None}
    if isinstance(out.get("metadata"), str):
        out["metadata"] = json.loads(out["metadata"])
    return out


__all__ = ["WriterCore", "read_settings", "settings_path", "PATCHABLE", "MAX_BATCH"]

