"""A conversation turn's session context at ingest: which stored turn comes before each
new turn of a session, and what the new turn takes from it.

A turn is an episodic memory with a session. Its previous turn is the latest earlier
turn of its (user, session), an old row of the previous generation or a new one, in
(created_at, arrival) order. Two settings read it:

- ``IngestConfig.session_context``: the turn's sentence vector mixes in the previous
  turn's (:func:`session_context`).
- ``IngestConfig.session_context_words``: the previous turn's text is one more line of
  the turn's doc2query expansions, so BM25 finds a reply by the words of what it replies
  to (:func:`context_lines`; :func:`helix_ray.ingest.stages.with_context`). Not
  between the chunks of a long memory: they overlap already, and a chunked memory is no
  turn of a dialogue.

A turn written through the Writer gets the same when it is written
(:mod:`helix_ray.live.session_context`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.schema import CHUNK_ID
from helix_ray.store.generation import Generation
from helix_ray.store.publish import mapped_parts
from helix_ray.tables import take_rows

#: The columns :func:`_turns` reads.
TURN_COLUMNS = ("type", "user", "session_id", "created_at")

#: Rows of context lines made at a time.
BLOCK = 16384


@dataclasses.dataclass
class PreviousTurns:
    """For the new rows of a run: ``order``, the turns among them in (time, arrival)
    order; per row, the turn before it, a new row (``new``) or an old row (``old``,
    a position in the old rows given), −1 in both where there is none: not a turn, its
    session's first, or a turn that arrived after a later turn of its session."""

    order: np.ndarray
    new: np.ndarray
    old: np.ndarray


def previous_turns(todo: pa.Table, old_rows: pa.Table, keep_old: np.ndarray) -> PreviousTurns:
    """The previous turn of each row of ``todo`` (:data:`PENDING_SCHEMA`), among its own
    rows and rows ``keep_old`` (ascending) of ``old_rows``, the previous generation's
    rows that stay (an old turn is its position in ``old_rows``)."""
    at, keys, times, pairs = _turns(todo)
    last: dict[int, tuple[int, int, bool]] = {}  # session → (time, row, an old row?) of its last turn
    if len(keep_old) and len(at):  # only these sessions' old turns matter
        sessions = old_rows.column("session_id")
        candidates = np.flatnonzero(pc.is_in(sessions, value_set=pairs[1].cast(sessions.type))
                                    .to_numpy(zero_copy_only=False))
        candidates = candidates[np.isin(candidates, keep_old, assume_unique=True)]
        old_at, old_keys, old_times, _ = _turns(take_rows(old_rows.select(list(TURN_COLUMNS)), candidates), pairs)
        for j, k, t in zip(old_at.tolist(), old_keys.tolist(), old_times.tolist()):
            if k >= 0 and (k not in last or t >= last[k][0]):
                last[k] = (t, int(candidates[j]), True)
    new = np.full(todo.num_rows, -1, np.int64)
    old = np.full(todo.num_rows, -1, np.int64)
    order = np.lexsort((at, times))  # by time, then arrival
    walked = []
    key_of = keys.tolist()
    for n in order.tolist():
        i, k, t = int(at[n]), key_of[n], int(times[n])
        seen = last.get(k)
        if seen is not None and seen[0] > t:
            continue  # arrived after a later turn of its session: no context
        if seen is not None:
            (old if seen[2] else new)[i] = seen[1]
        last[k] = (t, i, False)
        walked.append(i)
    return PreviousTurns(np.array(walked, np.int64), new, old)


def session_context(vectors: np.ndarray, turns: PreviousTurns, previous: Generation | None,
                    old_positions: np.ndarray, weight: float,
                    given: frozenset[int] = frozenset()) -> np.ndarray:
    """``IngestConfig.session_context``: each new conversation turn's vector (row i of the
    run's new rows) becomes ``unit(v + weight · v_prev)``, ``v_prev`` the stored vector
    of its previous turn (``turns``; old row j's is row ``old_positions[j]`` of
    ``previous``).
    The rows at positions ``given`` came with their vectors (a write's, mixed when it was
    written: :mod:`helix_ray.live.session_context`): they stay as they are, and the turns
    after them mix them in.
    Old rows keep their vectors, so a conversation ingested turn by turn is mixed as one
    ingested at once (when its turns arrive in order): each turn is mixed in float32 and
    stored as ``vectors`` hold it (float16, as the generation does), and the next turn
    mixes in the stored value, as it would from the previous generation. Mixes
    ``vectors`` in place and returns them: a copy would be 0.75 GB at a million
    memories."""
    for i in turns.order.tolist():  # a turn's previous new turn is mixed before it
        if i in given:
            continue
        if turns.new[i] >= 0:
            before = np.asarray(vectors[turns.new[i]])
        elif turns.old[i] >= 0 and previous is not None:
            before = np.asarray(previous.vectors[old_positions[turns.old[i]]])
        else:
            continue
        mixed = vectors[i].astype(np.float32) + weight * before.astype(np.float32)
        vectors[i] = mixed / max(float(np.linalg.norm(mixed)), 1e-12)
    return vectors


def context_lines(todo: pa.Table, old_rows: pa.Table, turns: PreviousTurns, path: Path) -> pa.ChunkedArray:
    """``IngestConfig.session_context_words``: for each row of ``todo``, its previous
    turn's text (null where it has none, and for a chunk or a turn after one), written
    to ``path`` a block at a time and mapped from it: the texts of a million turns are
    not held in the heap."""
    texts = pa.chunked_array([*todo.column("text").chunks, *old_rows.column("text").chunks], pa.string())
    chunk_new = is_chunk(todo.column("id"))
    source = np.where(turns.new >= 0, turns.new, np.where(turns.old >= 0, todo.num_rows + turns.old, -1))
    source[chunk_new] = -1
    source[(turns.new >= 0) & chunk_new[np.maximum(turns.new, 0)]] = -1
    from_old = np.flatnonzero(turns.old >= 0)
    source[from_old[is_chunk(take_rows(old_rows.column("id"), turns.old[from_old]))]] = -1

    def blocks() -> Iterator[pa.Table]:
        for lo in range(0, todo.num_rows, BLOCK):
            part = source[lo:lo + BLOCK]
            has = part >= 0
            lines = take_rows(texts, part[has]).combine_chunks()
            column = pc.replace_with_mask(pa.nulls(len(part), pa.string()), pa.array(has), lines)
            yield pa.table({"context": column})

    return mapped_parts(blocks(), pa.schema([("context", pa.string())]), path).column("context")


def is_chunk(ids: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Which of ``ids`` are a chunk's (``<id>#chunk<n>``, as :data:`helix_ray.schema.CHUNK_ID` reads it)."""
    matched = pc.match_substring_regex(ids, "(?s)" + CHUNK_ID.pattern)
    return np.asarray(pc.fill_null(matched, False).to_numpy(zero_copy_only=False), bool)


def _turns(rows: pa.Table, pairs: tuple[pa.Array, pa.Array] | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[pa.Array, pa.Array]]:
    """The conversation turns among ``rows`` (episodic, with a session): their row
    numbers, their (user, session) keys, and creation times (microseconds); then the
    distinct users and sessions that number the keys. A key is a number, ``u · S + s``
    for the user's place ``u`` among ``pairs[0]`` and the session's ``s`` among the
    ``S`` of ``pairs[1]`` (the turns' own when ``pairs`` is None; −1 for a turn whose
    user or session is not there): a Python tuple of two strings per turn would be
    ~0.3 GB at a million turns."""
    sessions = rows.column("session_id")
    is_turn = pc.and_(pc.equal(rows.column("type"), "episodic"), pc.not_equal(pc.fill_null(sessions, ""), ""))
    at = np.flatnonzero(pc.fill_null(is_turn, False).to_numpy(zero_copy_only=False)).astype(np.int64)
    turns = take_rows(rows.select(["user", "session_id", "created_at"]), at)
    user, session = turns.column("user"), turns.column("session_id")
    if pairs is None:
        pairs = (pc.unique(user), pc.unique(session))
    u, s = (pc.fill_null(pc.index_in(column, value_set=values.cast(column.type)), -1).to_numpy(zero_copy_only=False)
            .astype(np.int64) for column, values in zip((user, session), pairs))
    keys = np.where((u >= 0) & (s >= 0), u * len(pairs[1]) + s, -1)
    return at, keys, turns.column("created_at").cast(pa.int64()).to_numpy(), pairs
