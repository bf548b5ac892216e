"""The Writer's write path: POST, PATCH and DELETE of memories.

A write is, in order:

1. validated and normalised by the ingest rules (:func:`helix_ray.ingest.normalize.normalise_one`;
   a bad record is a 422 naming the record and the reason, and nothing is written);
2. expanded, embedded, annotated and signed by the ingest stage functions
   (:class:`helix_ray.ingest.stages.Transform`, MinHash); a conversation turn's vector
   takes in its session's previous turn, as at ingest (:mod:`helix_ray.live.session_context`);
3. made durable: an fsynced JSONL file in ``inbox/`` (ingest-ready records) and a
   committed row per memory in the ``serve_log`` table of the store's DuckDB file
   (with its vector, so a restarted writer rebuilds the delta without re-embedding);
4. published to the replicas as a new delta snapshot (:mod:`helix_ray.live.delta`).

Only then is the request (or ``Memory.add``) answered. The functions take the
:class:`~helix_ray.live.writer.WriterCore` that owns the state; its ``add``, ``patch``
and ``delete`` methods are the entry points.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa

from helix_ray.errors import Conflict, Forbidden, InvalidArgument, NotFound, StoreError, is_disk_full
from helix_ray.index.bm25 import lexical_text
from helix_ray.ingest.dedup import signatures
from helix_ray.ingest.stages import with_context
from helix_ray.live.delta_format import Tombstone
from helix_ray.live.inputs import MAX_BATCH
from helix_ray.live.session_context import written_context
from helix_ray.schema import CHUNK_ID, DERIVED_ID, MEMORY_SCHEMA, chunk_id, content_hash, parent_of
from helix_ray.store.db import in_family
from helix_ray.store.space import disk_full

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

#: A DELETE meeting a compaction's write of the same row waits and tries again, ~5 s in all.
DELETE_TRIES = 9
#: Inbox file name of a served write's copy (a compaction's input is ``compaction.COMPACTION_PREFIX``).
SERVED_PREFIX = "serve-"
#: Fields a PATCH may change; id and user are the memory's identity.
PATCHABLE = ("text", "type", "project", "session_id", "salience", "confidence", "pinned", "metadata", "source")
RECORD_FIELDS = [f.name for f in MEMORY_SCHEMA]


def add(core: WriterCore, records: list[dict[str, Any]], *, user: str | None, single: bool = False) -> dict[str, Any]:
    """Validate, embed and durably write ``records`` (each a memory object);
    ``user`` is the API key's user (None when auth is off: each record names its own).
    ``single``: the caller sent one object, not a list (its errors name ``memory``).
    The answer's ``replaced``: the ids written that named a live memory already (its
    earlier version, or all its earlier chunks, are gone)."""
    if not records:
        raise InvalidArgument("memories", [], "give at least one memory")
    if len(records) > MAX_BATCH:
        raise InvalidArgument("memories", f"<{len(records)} records>", f"a batch holds at most {MAX_BATCH}",
                              "Split it into several requests.")
    rows = [validate(core, raw, user, where="memory" if single else f"memories[{n}]")
            for n, raw in enumerate(records)]
    for n, (raw, row) in enumerate(zip(records, rows)):
        _not_another_memorys_derived_id(raw, row, "memory" if single else f"memories[{n}]")
    first: dict[str, int] = {}
    for n, row in enumerate(rows):  # a repeated id is refused, not won by the later record
        if first.setdefault(row["id"], n) != n:
            raise InvalidArgument(f"memories[{n}].id", row["id"],
                                  f"memories[{first[row['id']]}] of this batch has that id already (an id left "
                                  "out is derived from user and text: the same text twice)",
                                  "Give each memory of a batch its own id, or send the later version alone.")
    for n, (raw, row) in enumerate(zip(records, rows)):
        if CHUNK_ID.match(row["id"]) and raw.get("id") is not None:
            raise InvalidArgument("memory.id" if single else f"memories[{n}].id", row["id"],
                                  "ids ending in '#chunk<n>' name the chunks Helix stores a long memory as",
                                  "Give the memory's own id (without '#chunk<n>'): a long text is chunked "
                                  "for you, and PATCH and DELETE of that id act on all of its chunks.")
    with core._lock:
        stored, stale = _as_stored(core, rows)
        written = [*rows, *stored]  # the ids written, and the ids their chunks take: none another user's
        owners = _owners_of(core, [r["id"] for r in written])
        for row in written:
            owner = owners.get(row["id"])
            if owner is not None and owner != row["user"]:
                where = "the memory" if single else f"memories[{rows.index(_parent_row(rows, row))}]"
                raise Conflict(f"Got id={(parent_of(row['id']) or row['id'])!r} in {where}; that id belongs to "
                               "another user's memory. Leave id out (one is derived from user and text) or "
                               "choose another.")
        write_rows(core, stored, stale)
        return {"ids": [r["id"] for r in rows], "replaced": [r["id"] for r in rows if r["id"] in owners],
                "delta_version": core.version, "generation": core.generation}


def _parent_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    """The row of ``rows`` (as validated) that ``row`` (one of its chunks, or itself) stores."""
    parent = parent_of(row["id"])
    return next((r for r in rows if r["id"] in (row["id"], parent)), row)


def patch(core: WriterCore, memory_id: str, fields: dict[str, Any], *, user: str | None) -> dict[str, Any]:
    """Change ``fields`` of a memory: a new version, validated and written as a put. A
    memory stored as chunks changes as a whole: a new text is chunked again; other
    fields change on every chunk."""
    unknown = sorted(set(fields) - set(PATCHABLE))
    if unknown or not fields:
        raise InvalidArgument("fields", sorted(fields), f"a PATCH changes one or more of {', '.join(PATCHABLE)}")
    with core._lock:
        owner = _owner_of(core, memory_id)
        if owner is None or (user is not None and owner != user):
            raise NotFound(not_found(core, memory_id, user))
        ids = family(core, memory_id, owner)
        records = [r for r in (record_of(core, i) for i in ids) if r is not None]
        if not records:
            raise NotFound(not_found(core, memory_id, user))
        chunked = ids != [memory_id]
        if chunked and "text" not in fields:  # the same chunks, each with the new fields
            rows = [validate(core, _patched(record, fields), record["user"], where="memory") for record in records]
            write_rows(core, rows)  # publishes
        else:
            record = records[0]
            if chunked:  # the parent again, from its first chunk's fields
                record = {**record, "id": memory_id, "metadata": _without_chunk(record.get("metadata"))}
            merged = _patched(record, fields)
            if "text" in fields and "salience" not in fields:
                merged.pop("salience", None)  # derived from the text: derive it again
            stored, stale = _as_stored(core, [validate(core, merged, record["user"], where="memory")])
            write_rows(core, stored, stale)
        return {"id": memory_id, "delta_version": core.version, "generation": core.generation}


def _patched(record: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A stored record with ``fields`` changed, as a record to validate; a chunk keeps its
    place (``metadata.chunk``) whatever metadata the PATCH brings."""
    merged = {k: iso(record.get(k)) for k in RECORD_FIELDS if record.get(k) is not None}
    merged.update(fields)
    place = _metadata(record.get("metadata")).get("chunk")
    if place is not None and "metadata" in fields:
        merged["metadata"] = {**_metadata(fields["metadata"]), "chunk": place}
    return merged


def _metadata(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _without_chunk(value: Any) -> dict[str, Any]:
    return {k: v for k, v in _metadata(value).items() if k != "chunk"}


def family(core: WriterCore, memory_id: str, user: str) -> list[str]:
    """The live memories of ``user`` that ``memory_id`` is stored as: itself, or its
    chunks in order."""
    return families(core, [memory_id], user)[memory_id]


def families(core: WriterCore, memory_ids: list[str], user: str) -> dict[str, list[str]]:
    """:func:`family` of each of ``memory_ids``, with one scan of the database for them all."""
    wanted = set(memory_ids)
    found: dict[str, set[str]] = {i: set() for i in memory_ids}

    def take(i: str) -> None:
        parent = i if i in wanted else parent_of(i)
        if parent in wanted:
            found[parent].add(i)

    for i, entry in core.entries.items():
        if entry["user"] == user:
            take(i)
    # The ids themselves and their chunks (take() keeps the real chunk ids).
    rows = core.db.con.execute(
        'SELECT m.id FROM memories m, (SELECT unnest(?::VARCHAR[]) AS p) w WHERE NOT m.deleted AND m."user" = ? '
        f"AND {in_family('m.id', 'w.p')}", [sorted(wanted), user]).fetchall()
    for (i,) in rows:
        if i not in core.tombstones:
            take(i)
    return {p: sorted(ids, key=lambda i: (i != p, len(i), i)) for p, ids in found.items()}


def _owner_of(core: WriterCore, memory_id: str) -> str | None:
    """The user of a live memory or of a long memory's chunks; None if there is none."""
    return _owners_of(core, [memory_id]).get(memory_id)


def _owners_of(core: WriterCore, memory_ids: list[str]) -> dict[str, str]:
    """:func:`_owner_of` of each of ``memory_ids`` that has one, with one database query:
    the delta's entries first, its tombstones hide, then the database's live rows."""
    asked = list(dict.fromkeys(i for m in memory_ids for i in (m, chunk_id(m, 1))))
    found: dict[str, str] = {}
    for i in asked:
        entry = core.entries.get(i)
        if entry is not None:
            found[i] = entry["user"]
    found.update(core.db.owners([i for i in asked if i not in found and i not in core.tombstones]))
    return {m: found.get(m) or found[chunk_id(m, 1)] for m in memory_ids
            if m in found or chunk_id(m, 1) in found}


def _as_stored(core: WriterCore, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows to write for ``rows`` (a long text's chunks instead of itself) and the
    ids they leave stale: the memory's earlier chunks (or its whole earlier version) that
    the new version does not overwrite."""
    from helix_ray.ingest.normalize import split_long  # loads config (pydantic): this module does not

    stored: list[dict[str, Any]] = []
    stale: list[str] = []
    by_user: dict[str, list[str]] = {}
    for row in rows:
        by_user.setdefault(row["user"], []).append(row["id"])
    earlier = {(user, i): ids for user, wanted in by_user.items() for i, ids in families(core, wanted, user).items()}
    for row in rows:
        pieces = split_long(row, core.config.chunk)
        fresh = {p["id"] for p in pieces}
        stale += [i for i in earlier[(row["user"], row["id"])] if i not in fresh]
        stored += pieces
    return stored, stale


def delete(core: WriterCore, memory_id: str, *, user: str | None) -> dict[str, Any]:
    """Delete a memory of ``user`` (all of its chunks, when it is stored as chunks): a log
    row per memory, the database rows marked, tombstones."""
    with core._lock:
        owner = _owner_of(core, memory_id)
        if owner is None or (user is not None and owner != user):
            raise NotFound(not_found(core, memory_id, user))
        write_rows(core, [], family(core, memory_id, owner), withdrawn=True)
        return {"id": memory_id, "deleted": True, "delta_version": core.version, "generation": core.generation}


def validate(core: WriterCore, raw: Any, user: str | None, *, where: str) -> dict[str, Any]:
    """``raw`` normalised by the ingest rules, as the key's ``user`` may write it; a
    rejected record is a 422 naming ``where`` and the reason."""
    from helix_ray.ingest.normalize import Rejected, normalise_one  # loads config (pydantic): this module does not

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
        return normalise_one(raw, core.config.validation, default_time=dt.datetime.now(dt.timezone.utc),
                             ask_discount=core.config.ask_discount)
    except Rejected as why:
        code, _, sentence = str(why).partition(": ")
        raise InvalidArgument(where, {k: raw.get(k) for k in ("id", "text", "type", "user") if k in raw},
                              f"it was rejected ({code}): {sentence}") from None


def write_rows(core: WriterCore, rows: list[dict[str, Any]], deletes: list[str] | tuple[str, ...] = (), *,
               withdrawn: bool = False) -> None:
    """Transform ``rows`` (validated records), then make them, and the deletion of the
    live memories ``deletes`` (chunks a new version leaves behind, or a DELETE:
    ``withdrawn``, which an ingest of the unchanged source does not undo), durable and
    live together: the inbox file, the ``serve_log`` rows and database marks in one
    transaction, the delta entries and tombstones, then one new snapshot."""
    latest = {r["id"]: r for r in rows}  # a repeated id within a batch: the later record wins
    rows = list(latest.values())
    deletes = [i for i in dict.fromkeys(deletes) if i not in latest]
    owners = {i: core.owner(i) or "" for i in deletes}
    put = _Computed(core, rows, deletes) if rows else None
    if rows:  # 1. the inbox file (ingest-ready records)
        _write_inbox(core, rows)
    # 2. the log rows in DuckDB and the deleted rows marked, one transaction
    first = core.seq + 1
    seqs = list(range(first, first + len(rows)))
    dels = list(range(first + len(rows), first + len(rows) + len(deletes)))
    for attempt in range(DELETE_TRIES):
        core.db.con.begin()
        try:
            if put is not None:
                core.db.con.register("incoming_serve_log", put.table(seqs))
                core.db.con.execute(
                    'INSERT INTO serve_log (seq, op, id, "user", record, lexical, n_tokens, vector, minhash, '
                    "written_at, folded_into, late_codes, late_scales, computed_by) SELECT seq, op, id, \"user\", "
                    "record, lexical, n_tokens, vector, minhash, now(), NULL, late_codes, late_scales, computed_by "
                    "FROM incoming_serve_log")
                core.db.con.unregister("incoming_serve_log")
            for seq, memory_id in zip(dels, deletes):
                core.db.con.execute(
                    "INSERT INTO serve_log (seq, op, id, \"user\", written_at) VALUES (?, 'delete', ?, ?, now())",
                    [seq, memory_id, owners[memory_id]])
            core._drop_superseded([r["id"] for r in rows] + deletes)
            core.db.reinstate([r["id"] for r in rows])  # written again: a source may give it too
            if deletes:
                # generation rows: the next generation drops them
                core.db.delete(deletes, withdrawn_by={i: owners[i] for i in deletes} if withdrawn else None)
            core.db.con.commit()
            break
        except duckdb.TransactionException as exc:
            # A compaction's pipeline writing the same row at this moment (it runs
            # outside the lock, on a connection of its own): once it has, again.
            if is_disk_full(exc):  # a commit that failed to write its log has ended the transaction
                _rollback_if_open(core)
                raise disk_full(core.store, "logging the writes in the database") from exc
            core.db.con.rollback()
            if attempt == DELETE_TRIES - 1:
                raise StoreError(f"Could not write now: a compaction is writing {(deletes or [r['id'] for r in rows])[0]!r} "
                                 f"({str(exc).splitlines()[0][:120]}). Nothing was written or deleted; retry in a "
                                 "few seconds.") from None
            time.sleep(min(0.05 * 2 ** attempt, 1.0))
        except BaseException as exc:
            if is_disk_full(exc):
                _rollback_if_open(core)
                raise disk_full(core.store, "logging the writes in the database") from exc
            core.db.con.rollback()
            raise
    core.seq = first + len(rows) + len(deletes) - 1
    # 3. the delta, then a snapshot the replicas read
    if put is not None:
        for seq, row, entry in zip(seqs, rows, put.entries(seqs)):
            core.tombstones.pop(row["id"], None)
            core.entries[row["id"]] = entry
    for memory_id in deletes:
        core.entries.pop(memory_id, None)
        core.tombstones[memory_id] = Tombstone(memory_id, owners[memory_id], None)
    try:
        core._publish()
    except OSError as exc:  # logged already: the next write's snapshot (or a restart's) holds it
        if is_disk_full(exc):
            raise disk_full(core.store, "publishing the delta snapshot") from exc
        raise


def _rollback_if_open(core: WriterCore) -> None:
    try:
        core.db.con.rollback()
    except duckdb.Error:  # no transaction is open
        pass


def _write_inbox(core: WriterCore, rows: list[dict[str, Any]]) -> None:
    """The fsynced JSONL copy of ``rows`` in ``inbox/``."""
    write_inbox_file(core.store, SERVED_PREFIX, rows, "writing the inbox file")


def write_inbox_file(store: Path, prefix: str, rows: list[dict[str, Any]], doing: str) -> Path:
    """``rows`` as ingest reads them, one a line, in a new fsynced file of ``store``'s
    ``inbox/`` named ``prefix`` + the time; on a full disk, no part of it (a
    :class:`~helix_ray.errors.DiskFull` saying it was ``doing`` that)."""
    inbox = store / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    path = inbox / f"{prefix}{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.jsonl"
    lines = [json.dumps(ingest_record(row), ensure_ascii=False) + "\n" for row in rows]
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full(store, doing, need_bytes=sum(map(len, lines))) from exc
        raise
    return path


class _Computed:
    """What a put of ``rows`` computed (vectors, MinHash, late tokens, BM25 text): as the
    log's rows and as delta entries. ``deletes``: the ids the same write deletes."""

    def __init__(self, core: WriterCore, rows: list[dict[str, Any]], deletes: list[str]):
        self.core, self.rows = core, rows
        batch = {"seq": np.arange(len(rows)), "text": np.array([r["text"] for r in rows], dtype=object),
                 "type": np.array([r["type"] for r in rows], dtype=object)}
        batch = core._transform(batch)
        vectors = np.asarray(batch["vector"], np.float32)
        self.vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        contexts = written_context(core, rows, self.vectors, deletes)  # a conversation turn takes its session's context
        self.sigs = signatures([r["text"] for r in rows], num_perm=core._num_perm(), shingle=core.config.dedup.shingle)
        # Late-interaction tokens, so a fresh write is scored like a stored memory (None: off).
        n = len(rows)
        self.late_codes = [bytes(x) for x in batch["late_codes"]] if "late_codes" in batch else [None] * n
        self.late_scales = [bytes(x) for x in batch["late_scales"]] if "late_scales" in batch else [None] * n
        self.n_tokens = [int(x) for x in batch["n_tokens"]]
        self.lexical = []
        for row, expansions, context in zip(rows, batch["expansions"], contexts):
            self.lexical.append(lexical_text(row["text"], with_context(json.loads(str(expansions)), context)))

    def table(self, seqs: list[int]) -> pa.Table:
        rows = self.rows
        return pa.table({
            "seq": pa.array(seqs, pa.int64()),
            "op": ["put"] * len(rows),
            "id": [r["id"] for r in rows],
            "user": [r["user"] for r in rows],
            "record": [json.dumps(json_record(r), ensure_ascii=False) for r in rows],
            "lexical": self.lexical,
            "n_tokens": pa.array(self.n_tokens, pa.int32()),
            "vector": pa.array([v.tolist() for v in self.vectors], pa.list_(pa.float32())),
            "minhash": pa.array([s.tolist() for s in self.sigs], pa.list_(pa.uint32())),
            "late_codes": pa.array(self.late_codes, pa.binary()),
            "late_scales": pa.array(self.late_scales, pa.binary()),
            "computed_by": [self.core._fingerprint] * len(rows),
        })

    def entries(self, seqs: list[int]) -> list[Any]:
        core = self.core
        return [core._entry(seq, json_record(row), lex, n, vector, sig, None, codes, scales, core._fingerprint)
                for seq, row, lex, n, vector, sig, codes, scales in zip(
                    seqs, self.rows, self.lexical, self.n_tokens, self.vectors, self.sigs, self.late_codes,
                    self.late_scales)]


def record_of(core: WriterCore, memory_id: str) -> dict[str, Any] | None:
    """The live record of ``memory_id`` (the delta's, else the database's); None if none."""
    entry = core.entries.get(memory_id)
    if entry is not None:
        return dict(entry["record"])
    if memory_id in core.tombstones:
        return None
    row = core.db.row(
        'SELECT id, text, type, "user", project, session_id, epoch_us(created_at), epoch_us(last_accessed_at), '
        "access_count, salience, confidence, pinned, source, metadata FROM memories WHERE id = ? AND NOT deleted",
        [memory_id])
    if row is None:
        return None
    record = dict(zip(RECORD_FIELDS, row))
    utc = dt.timezone.utc
    record["created_at"] = dt.datetime.fromtimestamp(record["created_at"] / 1e6, tz=utc)
    if record["last_accessed_at"] is not None:
        record["last_accessed_at"] = dt.datetime.fromtimestamp(record["last_accessed_at"] / 1e6, tz=utc)
    return record


def not_found(core: WriterCore, memory_id: str, user: str | None) -> str:
    """The 404's sentence: a memory of this user deleted since the last compaction
    is said to be (another user's is not)."""
    gone = core.tombstones.get(memory_id)
    if gone is not None and (user is None or gone.user == user):
        return (f"Got id={memory_id!r}; that memory was deleted. A delete is final: to bring it back, "
                "write it again (helix add, MCP remember, POST /v1/memories or Memory.add).")
    who = f" for user {user!r}" if user is not None else ""
    return (f"Got id={memory_id!r}; there is no such memory{who}. Check the id: every write gives it (helix "
            "add, MCP remember, POST /v1/memories, Memory.add), and so does recall.")


def iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, (dt.datetime, dt.date)) else value


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


def json_record(row: dict[str, Any]) -> dict[str, Any]:
    """A normalised row as JSON-ready values (times as ISO strings)."""
    return {k: iso(v) for k, v in row.items()}


def ingest_record(row: dict[str, Any]) -> dict[str, Any]:
    """The record as ingest reads it back: the memory fields, no derived ones."""
    out = {k: iso(row.get(k)) for k in RECORD_FIELDS if row.get(k) is not None}
    if isinstance(out.get("metadata"), str):
        out["metadata"] = json.loads(out["metadata"])
    return out
