"""A written conversation turn's session context, as ingest gives a turn it embeds
(:mod:`helix_ray.ingest.sessions`). The previous turn of an episodic memory with a
session is its session's latest turn at or before its time: a row of the current
generation, a segment row, a live delta entry, or a turn written before it in the same
call, the one that arrived last among turns of the same time. With
``IngestConfig.session_context`` the turn's sentence vector becomes
``unit(v + w · v_prev)``, ``v_prev`` the previous turn's stored vector; with
``IngestConfig.session_context_words`` the previous turn's text is one more line of its
expansions (neither for a chunk or after one). A turn with no previous turn keeps its
own.

The log, the delta and the next generation hold the mixed vector: compaction takes a
write's outputs as they are (a :class:`~helix_ray.ingest.stages.Computed` vector is
final) and mixes only what it embeds itself, so no turn is mixed twice.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.schema import parent_of
from helix_ray.store.pointer import file_identity
from helix_ray.tables import take_rows

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

Session = tuple[str, str]  # (user, session id)
#: Where a stored turn comes from, in arrival order: of two turns of the same time, the
#: later source (and within one, the later row or seq) arrived later.
BASE, SEGMENT, ENTRY, CALL = range(4)


class Turn(NamedTuple):
    """What a turn after a stored turn takes from it."""

    vector: np.ndarray
    text: str
    chunk: bool  # a chunk of a long memory: no turn takes its words


def session_of(row: dict[str, Any]) -> Session | None:
    """The (user, session) whose context a memory takes: an episodic one with a session."""
    if row.get("type") != "episodic" or not row.get("session_id"):
        return None
    return str(row["user"]), str(row["session_id"])


def micros(value: Any) -> int:
    """A ``created_at`` (epoch microseconds, a datetime or an ISO string) in epoch
    microseconds."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    when = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1_000_000)


class Turns:
    """A session's stored turns in (time, source, order) order, each read only if it is
    the turn chosen."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[int], Turn]]] = []
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # times, and (source, order, part, index)

    def add(self, created: np.ndarray, source: int, order: np.ndarray, turn: Callable[[int], Turn]) -> None:
        """Turns created at ``created`` (µs) from ``source``, each with its ``order`` there;
        ``turn(i)``: what the i-th of them gives the turn after it."""
        if len(created):
            self._parts.append((np.asarray(created, np.int64), np.full(len(created), source, np.int64),
                                np.asarray(order, np.int64), turn))
            self._sorted = None

    def latest(self, at: int) -> tuple[tuple[int, int, int], Turn] | None:
        """The latest turn created at or before ``at``: its (time, source, order), and it."""
        if not self._parts:
            return None
        if self._sorted is None:
            created = np.concatenate([p[0] for p in self._parts])
            source = np.concatenate([p[1] for p in self._parts])
            order = np.concatenate([p[2] for p in self._parts])
            where = np.concatenate([np.arange(len(p[0])) for p in self._parts])
            part = np.concatenate([np.full(len(p[0]), k) for k, p in enumerate(self._parts)])
            rank = np.lexsort((order, source, created))
            self._sorted = (created[rank], np.stack([source[rank], order[rank], part[rank], where[rank]], 1))
        created, info = self._sorted
        i = int(np.searchsorted(created, at, side="right")) - 1
        if i < 0:
            return None
        came_from, rank_there, part_of, index = (int(x) for x in info[i])
        return (int(created[i]), came_from, rank_there), self._parts[part_of][3](index)


def written_context(core: WriterCore, rows: list[dict[str, Any]], vectors: np.ndarray,
                    replaced: Iterable[str] = ()) -> list[str | None]:
    """Give the turns among ``rows`` (validated records, about to be written) their
    session's context, in (created_at, arrival) order: ``vectors`` (unit float32 rows,
    in ``rows``' order) mixed in place, and each row's previous turn's text returned
    (None where it takes none). ``replaced``: ids the same write deletes (a memory's
    earlier chunks), never a previous turn."""
    weight, words = core.config.session_context, core.config.session_context_words
    sessions = [session_of(r) for r in rows]
    contexts: list[str | None] = [None] * len(rows)
    if (weight <= 0 and not words) or not any(sessions):
        return contexts
    created = [micros(r["created_at"]) for r in rows]
    times: dict[Session, set[int]] = {}
    for key, at in zip(sessions, created):
        if key is not None:
            times.setdefault(key, set()).add(at)
    stored = stored_turns(core, times, writing={r["id"] for r in rows} | set(replaced))
    made: dict[Session, tuple[tuple[int, int, int], Turn]] = {}  # the call's latest turn
    for i in sorted(range(len(rows)), key=lambda i: (created[i], i)):
        key = sessions[i]
        if key is None:
            continue
        chunk = parent_of(rows[i]["id"]) is not None
        candidates = [t for t in (stored[key].latest(created[i]), made.get(key)) if t is not None]
        if candidates:
            _, previous = max(candidates, key=lambda t: t[0])
            if weight > 0:
                mixed = vectors[i] + weight * previous.vector
                vectors[i] = mixed / max(float(np.linalg.norm(mixed)), 1e-12)
            if words and not chunk and not previous.chunk:
                contexts[i] = previous.text
        made[key] = ((created[i], CALL, i), Turn(vectors[i], rows[i]["text"], chunk))
    return contexts


def stored_turns(core: WriterCore, times: dict[Session, set[int]], writing: set[str]) -> dict[Session, Turns]:
    """For each session of ``times`` (the times of the call's turns in it), the stored
    turns that may precede them: its live delta entries and segment rows, and of its
    base rows the latest at or before each time. Of one id only the version recall
    reads counts (an entry over a segment row over a base row), and none of
    ``writing``, deleted or of a forgotten user."""
    turns = {key: Turns() for key in times}
    by_session: dict[Session, list[dict[str, Any]]] = {}
    for entry in core.entries.values():
        key = session_of(entry)
        if key in turns and entry["id"] not in writing:
            by_session.setdefault(key, []).append(entry)
    for key, entries in by_session.items():
        turns[key].add(np.array([int(e["created_at"]) for e in entries], np.int64), ENTRY,
                       np.array([int(e["seq"]) for e in entries], np.int64), _entry_turn(entries))
    generation = core.base()
    if generation is None:
        return turns
    hidden = writing | set(core.entries) | set(core.tombstones) | core.db.erased_ids()
    segment = core.session_rows.segment(generation)
    if segment is not None:
        _segment_turns(segment, turns, pa.array(sorted(hidden), pa.string()))
    dead = pa.array(sorted(hidden | set(generation.dead)), pa.string())
    for (user, session), at in times.items():
        span = generation.partitions.get(user)
        if span is None or span[1] <= span[0]:
            continue
        rows = span[0] + core.session_rows.offsets(generation, user, session)
        table = take_rows(generation.memories.select(["id", "type", "created_at"]), rows)
        keep = _visible_turns(table, dead)
        rows = rows[keep]
        created = table.column("created_at").cast(pa.timestamp("us", "UTC")).cast(pa.int64()).to_numpy()[keep]
        picked = _latest_at(created, at)
        turns[(user, session)].add(created[picked], BASE, rows[picked],
                                   _row_turn(generation, rows[picked], table.column("id"), np.flatnonzero(keep)[picked]))
    return turns


def _latest_at(created: np.ndarray, times: Iterable[int]) -> np.ndarray:
    """For each of ``times``, the position in ``created`` (ascending rows) of the latest
    time at or before it, the last row of that time: one pass each, no sort."""
    picked = set()
    for at in times:
        before = np.flatnonzero(created <= at)
        if len(before):
            latest = created[before].max()
            picked.add(int(before[created[before] == latest][-1]))
    return np.array(sorted(picked), np.int64)


def _visible_turns(table: pa.Table, hidden: pa.Array) -> np.ndarray:
    """Which rows of ``table`` are episodic and not ``hidden`` (by id)."""
    keep = pc.and_(pc.equal(table.column("type"), "episodic"),
                   pc.invert(pc.is_in(table.column("id"), value_set=hidden)))
    return np.asarray(pc.fill_null(keep, False).to_numpy(zero_copy_only=False), bool)


def _segment_turns(segment: pa.Table, turns: dict[Session, Turns], hidden: pa.Array) -> None:
    """The segment rows (episodic, with a session: :meth:`SessionRows.segment`) of the
    sessions in ``turns``, but ``hidden`` ids."""
    for user in {u for u, _ in turns}:
        own = segment.filter(pc.equal(segment.column("user"), user))
        for u, session in turns:
            if u != user:
                continue
            table = own.filter(pc.equal(own.column("session_id"), session))
            table = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=hidden)))
            if table.num_rows:
                turns[(user, session)].add(table.column("created_at").to_numpy(), SEGMENT,
                                           table.column("seq").to_numpy(), _segment_turn(table))


def _entry_turn(entries: list[dict[str, Any]]) -> Callable[[int], Turn]:
    return lambda i: Turn(np.asarray(entries[i]["vector"], np.float32), entries[i]["text"],
                          parent_of(entries[i]["id"]) is not None)


def _row_turn(generation: Any, rows: np.ndarray, ids: pa.ChunkedArray, at: np.ndarray) -> Callable[[int], Turn]:
    """Base rows ``rows`` of ``generation``, their ids ``ids[at]``."""
    return lambda i: Turn(np.asarray(generation.vectors[int(rows[i])], np.float32),
                          generation.memories.column("text")[int(rows[i])].as_py(),
                          parent_of(ids[int(at[i])].as_py()) is not None)


def _segment_turn(table: pa.Table) -> Callable[[int], Turn]:
    return lambda i: Turn(np.asarray(table.column("vector")[i].as_py(), np.float32), table.column("text")[i].as_py(),
                          parent_of(table.column("id")[i].as_py()) is not None)


class SessionRows:
    """Where a written turn's session sits in the generation.

    :meth:`offsets`: a session's rows in a tenant's range. A tenant of :data:`INDEX_FROM`
    rows or more is indexed at its first lookup (or by :meth:`index_large_tenants`), and
    the index kept while the generation's memories file is the same (a fold links it:
    only a rebuild makes a new one; 0.3 s at 10^6 memories, paid by the tenant's first
    written turn after that); the two newest files' indexes are kept, so the generation
    served until a swap keeps its own. A lookup is then a dict get, where a scan of its
    sessions would cost each written turn 16 ms at 10^6. A smaller tenant's sessions are
    scanned (0.4 ms at 25,000). :meth:`segment`: the generation's segment rows that are
    turns, read once per generation."""

    def __init__(self) -> None:
        # by memories file (device, inode, size, mtime), the newest last: each tenant's index
        self._indexes: OrderedDict[tuple[int, ...], dict[str, tuple[dict[str, int], np.ndarray, np.ndarray]]] = \
            OrderedDict()
        self._lock = threading.Lock()  # a replica's loader thread indexes while its event loop looks up
        self._segment: tuple[int, pa.Table | None] | None = None

    def offsets(self, generation: Any, user: str, session: str) -> np.ndarray:
        """The offsets, in ``user``'s range of ``generation``, of the rows of ``session``."""
        start, end = generation.partitions[user]
        if end - start < INDEX_FROM:
            column = generation.memories.column("session_id").slice(start, end - start)
            return np.flatnonzero(pc.fill_null(pc.equal(column, session), False).to_numpy(zero_copy_only=False))
        names, order, bounds = self._index(generation, user)
        k = names.get(session)
        return order[bounds[k]:bounds[k + 1]] if k is not None else np.zeros(0, np.int64)

    def index_large_tenants(self, generation: Any) -> None:
        """Index now the sessions of every tenant that :meth:`offsets` would index at its
        first lookup (a replica warming a generation: no request pays for it)."""
        for user, (start, end) in generation.partitions.items():
            if end - start >= INDEX_FROM:
                self._index(generation, user)

    def _index(self, generation: Any, user: str) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        file = file_identity(generation.path / "memories.arrow")
        with self._lock:
            users = self._indexes.get(file)
            if users is None:  # a rebuilt generation: the one before it is still served until the swap
                users = self._indexes[file] = {}
                while len(self._indexes) > 2:
                    self._indexes.popitem(last=False)
            index = users.get(user)
        if index is None:
            start, end = generation.partitions[user]
            index = _by_session(generation.memories.column("session_id").slice(start, end - start))
            with self._lock:
                index = users.setdefault(user, index)
        return index

    def segment(self, generation: Any) -> pa.Table | None:
        """The generation's segment rows that are conversation turns (episodic, with a
        session): id, user, session, time, seq, vector and text; None when it has none."""
        if self._segment is None or self._segment[0] != generation.number:
            rows = generation.segment_rows()
            if rows is not None:
                turn = pc.and_(pc.equal(rows.column("type"), "episodic"), pc.is_valid(rows.column("session_id")))
                rows = rows.filter(pc.fill_null(turn, False)).select(
                    ["id", "user", "session_id", "created_at", "seq", "vector", "text"])
            self._segment = (generation.number, rows if rows is not None and rows.num_rows else None)
        return self._segment[1]


#: The tenant size from which :class:`SessionRows` indexes the sessions.
INDEX_FROM = 100_000


def _by_session(column: pa.ChunkedArray) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
    """A session column as (session → code, the offsets ordered by code, each code's
    bounds in that order); rows without a session have none."""
    encoded = column.combine_chunks().dictionary_encode()
    codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(codes, kind="stable")
    names = {name: k for k, name in enumerate(encoded.dictionary.to_pylist())}
    bounds = np.searchsorted(codes[order], np.arange(len(names) + 1))
    return names, order, bounds
