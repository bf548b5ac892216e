"""A written conversation turn's session context (``IngestConfig.session_context``), as
ingest gives a turn it embeds (:func:`helix_ray.ingest.assemble.session_context`): the
sentence vector of an episodic memory with a session becomes ``unit(v + w · v_prev)``,
``v_prev`` the stored vector of the latest earlier turn of its (user, session): one
written before it in the same call, a live delta entry, a segment row or a row of the
current generation. A turn that arrives after a later turn of its session keeps its own
vector, as ingest leaves it.

The log, the delta and the next generation hold the mixed vector: compaction takes a
write's outputs as they are (a :class:`~helix_ray.ingest.stages.Computed` vector is
final) and mixes only what it embeds itself, so no turn is mixed twice.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

Session = tuple[str, str]  # (user, session id)
Turn = tuple[int, np.ndarray]  # (created_at in epoch µs, the stored vector)


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


def mix_written(core: WriterCore, rows: list[dict[str, Any]], vectors: np.ndarray) -> None:
    """Give the turns among ``rows`` (validated records, about to be written) their
    session's context: ``vectors`` (unit float32 rows, in ``rows``' order) mixed in
    place, each turn in (created_at, arrival) order."""
    weight = core.config.session_context
    sessions = [session_of(r) for r in rows]
    wanted = {s for s in sessions if s is not None}
    if weight <= 0 or not wanted:
        return
    last = stored_tails(core, wanted, writing={r["id"] for r in rows})
    created = [micros(r["created_at"]) for r in rows]
    for i in sorted(range(len(rows)), key=lambda i: (created[i], i)):
        key = sessions[i]
        if key is None:
            continue
        seen = last.get(key)
        if seen is not None and seen[0] > created[i]:
            continue  # arrived after a later turn of its session: left as it is
        if seen is not None:
            mixed = vectors[i] + weight * np.asarray(seen[1], np.float32)
            vectors[i] = mixed / max(float(np.linalg.norm(mixed)), 1e-12)
        last[key] = (created[i], vectors[i])


def stored_tails(core: WriterCore, wanted: set[Session], writing: set[str]) -> dict[Session, Turn]:
    """The latest stored turn of each ``wanted`` session: among the live delta entries,
    then (ids the delta does not hold, deletes, or ``writing``) the current generation's
    segment rows and base rows."""
    tails: dict[Session, Turn] = {}

    def offer(key: Session, created: int, vector: Any) -> None:
        if key in wanted and (key not in tails or created >= tails[key][0]):
            tails[key] = (created, vector)

    for entry in core.entries.values():
        key = session_of(entry)
        if key is not None and entry["id"] not in writing:
            offer(key, int(entry["created_at"]), entry["vector"])
    generation = core.base()
    if generation is None:
        return tails
    hidden = writing | set(core.entries) | set(core.tombstones)
    segment = generation.segment_rows()
    if segment is not None and segment.num_rows:
        for row, vector in _matching(segment, wanted, hidden):
            offer((str(row["user"]), str(row["session_id"])), micros(row["created_at"]), vector)
    hidden |= set(generation.dead)
    for user, session in wanted:
        span = generation.partitions.get(user)
        if span is None or span[1] <= span[0]:
            continue
        start = span[0]
        offsets = core.session_rows.offsets(generation, user, session)
        rows = generation.memories.select(["id", "type", "created_at"]).take(pa.array(start + offsets, pa.int64()))
        for row, offset in zip(rows.to_pylist(), offsets.tolist()):
            if row["type"] == "episodic" and row["id"] not in hidden:
                offer((user, session), micros(row["created_at"]), generation.vectors[start + offset])
    return tails


def _matching(segment: pa.Table, wanted: set[Session], hidden: set[str]) -> list[tuple[dict[str, Any], Any]]:
    """The segment rows of ``wanted`` sessions (episodic, not ``hidden``), each with its vector."""
    sessions = pa.array(sorted({s for _, s in wanted}), pa.string())
    keep = pc.and_(pc.fill_null(pc.is_in(segment.column("session_id"), value_set=sessions), False),
                   pc.equal(segment.column("type"), "episodic"))
    rows = segment.filter(keep)
    out = []
    for row, vector in zip(rows.select(["id", "user", "session_id", "created_at"]).to_pylist(),
                           rows.column("vector").to_pylist()):
        if row["id"] not in hidden and (row["user"], row["session_id"]) in wanted:
            out.append((row, np.asarray(vector, np.float32)))
    return out


class SessionRows:
    """Where a session's rows sit in a tenant's range of a generation. A tenant of
    :data:`INDEX_FROM` rows or more is indexed at its first lookup, and the index kept
    until the generation changes: a lookup is then a dict get, where a scan of its
    sessions would cost each written turn 16 ms at 10^6 memories (the index, 0.3 s once).
    A smaller tenant's sessions are scanned (0.4 ms at 25,000)."""

    def __init__(self) -> None:
        self._generation: int | None = None
        self._users: dict[str, tuple[dict[str, int], np.ndarray, np.ndarray]] = {}

    def offsets(self, generation: Any, user: str, session: str) -> np.ndarray:
        """The offsets, in ``user``'s range of ``generation``, of the rows of ``session``."""
        start, end = generation.partitions[user]
        column = generation.memories.column("session_id").slice(start, end - start)
        if end - start < INDEX_FROM:
            return np.flatnonzero(pc.fill_null(pc.equal(column, session), False).to_numpy(zero_copy_only=False))
        if self._generation != generation.number:
            self._generation, self._users = generation.number, {}
        index = self._users.get(user)
        if index is None:
            index = self._users[user] = _by_session(column)
        names, order, bounds = index
        k = names.get(session)
        return order[bounds[k]:bounds[k + 1]] if k is not None else np.zeros(0, np.int64)


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
