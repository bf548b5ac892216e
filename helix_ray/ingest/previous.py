"""What an ingest run takes from the previous generation: which of its rows stay (not
replaced, not deleted since), which of those a re-ingest re-tags, and the recall hits of
the access log folded into ``last_accessed_at`` / ``access_count``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.config import IngestConfig
from helix_ray.embedder import DIM
from helix_ray.ingest.assemble import in_generation_schema
from helix_ray.schema import DATED, FILE_SAVED, GENERATION_SCHEMA
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import ACCESS_WATERMARK, Generation, current_generation_number
from helix_ray.tables import take_rows

#: Record fields that can change without the text: compared on re-ingest, taken over
#: by the carried-over row (times and access counts are the store's, not the record's).
RETAG_FIELDS = ("type", "project", "session_id", "salience", "confidence", "pinned", "metadata", "source")


def open_previous(store: Path, config: IngestConfig) -> Generation | None:
    """The store's current generation, or None for a store that has none yet; it must
    have been built with ``config``'s embedder."""
    if current_generation_number(store) is None:
        return None
    return Generation.open_current(store, expect_embedder=config.embedder.name, expect_dim=DIM)


def held_by(previous: Generation | None, ids: list[str]) -> set[str]:
    """Those of ``ids`` that the previous generation holds."""
    if previous is None or not ids:
        return set()
    found = pc.is_in(pa.array(ids, pa.string()), value_set=previous.memories.column("id")).to_pylist()
    return {i for i, hit in zip(ids, found) if hit}


def retagged(previous: Generation | None, rows: pa.Table, block: int = 65536) -> dict[str, dict[str, Any]]:
    """id → new field values, for ``rows`` (a table with ``id``, ``created_at`` and
    :data:`RETAG_FIELDS`) that the previous generation holds with other values in
    :data:`RETAG_FIELDS`, or with another ``created_at`` where the text states its time
    (a Markdown section's ``metadata.dated``: a journal re-dated, or read before its
    days were); compared ``block`` rows at a time."""
    out: dict[str, dict[str, Any]] = {}
    if previous is None or not rows.num_rows:
        return out
    where = pc.index_in(rows.column("id"), value_set=previous.memories.column("id"))
    held = pc.is_valid(where)
    new = rows.filter(held).select(["id", "created_at", *RETAG_FIELDS])
    old = take_rows(previous.memories.select(["created_at", *RETAG_FIELDS]), where.filter(held))
    for lo in range(0, new.num_rows, block):
        for n, o in zip(new.slice(lo, block).to_pylist(), old.slice(lo, block).to_pylist()):
            redated = n["created_at"] != o["created_at"] and _states_time(n["metadata"])
            if redated or any(not _same_value(k, o[k], n[k]) for k in RETAG_FIELDS):
                out[n["id"]] = {k: n[k] for k in RETAG_FIELDS} | ({"created_at": n["created_at"]} if redated else {})
    return out


def _states_time(metadata: Any) -> bool:
    """Whether a record's ``created_at`` is one its text states (:data:`DATED`), not a
    file's modification time, which a re-ingest does not take again."""
    meta = json.loads(metadata) if isinstance(metadata, str) else (metadata or {})
    return isinstance(meta, dict) and meta.get(DATED) not in (None, FILE_SAVED)


def previous_values(previous: Generation | None, rows: list[dict[str, Any]],
                    columns: Sequence[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(row, its ``columns`` in the previous generation) for each of ``rows`` whose id
    the previous generation holds."""
    if previous is None or not rows:
        return []
    table = previous.memories
    where = pc.index_in(pa.array([r["id"] for r in rows], pa.string()), value_set=table.column("id")).to_pylist()
    found = [(row, i) for row, i in zip(rows, where) if i is not None]
    if not found:
        return []
    held = take_rows(table.select(list(columns)), [i for _, i in found]).to_pylist()
    return [(row, old) for (row, _), old in zip(found, held)]


def _same_value(key: str, old: Any, new: Any) -> bool:
    if key in ("salience", "confidence"):
        return new is not None and abs(float(old) - float(new)) < 1e-6  # float32 in the table
    if key == "metadata":
        return json.loads(old or "{}") == (json.loads(new) if isinstance(new, str) else (new or {}))
    return old == new


def carried_over(previous: Generation | None, db: StoreDB, replaced: set[str],
                 retagged: dict[str, dict[str, Any]] | None = None
                 ) -> tuple[pa.Table, np.ndarray, int, dict[str, tuple[Any, int]]]:
    """Rows of the previous generation that stay (a table in the generation's schema,
    in its order, and their row numbers there): not replaced, not deleted since;
    re-tagged ones with their new field values; the access log folded into their
    ``last_accessed_at`` and ``access_count`` — the part of it the previous generation
    had not folded — and the log position the new generation has folded up to, with
    that part of the log per id (for the rows that are not carried over: see
    :func:`fold_accesses`). Only the rows a re-tag or an access changes become Python
    dicts; the others are taken as they are, since a round trip of every row through
    dicts would cost a compaction of a large store most of its time."""
    accesses, folded = db.access_summary(previous.manifest.get(ACCESS_WATERMARK, 0) if previous else 0)
    if previous is None:
        return GENERATION_SCHEMA.empty_table(), np.zeros(0, np.int64), folded, accesses
    deleted = db.deleted_ids()
    table = in_generation_schema(previous.memories)
    ids = table.column("id").to_pylist()
    index = np.array([i for i, mid in enumerate(ids) if mid not in replaced and mid not in deleted], np.int64)
    kept = take_rows(table, index)
    changed = [k for k, i in enumerate(index) if (retagged and ids[i] in retagged) or ids[i] in accesses]
    if not changed:
        return kept, index, folded, accesses
    rows = take_rows(kept, changed).to_pylist()
    for row in rows:
        if retagged and row["id"] in retagged:
            row.update(retagged[row["id"]])
    fold_accesses(rows, accesses)
    unchanged = np.setdiff1d(np.arange(len(index)), changed)
    spliced = pa.concat_tables([take_rows(kept, unchanged),
                                pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA)])
    back = np.argsort(np.concatenate([unchanged, np.asarray(changed, np.int64)]), kind="stable")
    return take_rows(spliced, back), index, folded, accesses


def fold_accesses(rows: list[dict[str, Any]], accesses: dict[str, tuple[Any, int]]) -> None:
    """Recall hits of the access log into ``last_accessed_at`` / ``access_count``: for
    carried-over rows and for new versions of a memory alike (a memory recalled and
    then edited keeps its hits)."""
    for row in rows:
        seen = accesses.get(row["id"])
        if seen is not None:
            if row.get("last_accessed_at") is None or seen[0] > row["last_accessed_at"]:
                row["last_accessed_at"] = seen[0]
            row["access_count"] = int(row.get("access_count") or 0) + int(seen[1])


def keep_folded_accesses(rows: list[dict[str, Any]], previous: Generation | None, replaced: set[str]) -> None:
    """A new version of a memory keeps the hits its previous version had folded: its
    ``access_count`` and ``last_accessed_at`` are at least the previous generation's (an
    edited record brings 0 and none, and a PATCH's record is read from the database,
    which never holds the folded hits)."""
    mine = [r for r in rows if r["id"] in replaced]
    for row, old in previous_values(previous, mine, ("access_count", "last_accessed_at")):
        row["access_count"] = max(int(row.get("access_count") or 0), int(old["access_count"] or 0))
        if old["last_accessed_at"] is not None and (row.get("last_accessed_at") is None
                                                    or old["last_accessed_at"] > row["last_accessed_at"]):
            row["last_accessed_at"] = old["last_accessed_at"]


def has_deletions(previous: Generation | None, kept_index: np.ndarray) -> bool:
    """Whether rows of ``previous`` are not carried over (``kept_index``: those that are)."""
    return previous is not None and len(kept_index) != previous.size


class OldThenNew(Sequence):
    """A sequence of ``n_old`` values then ``n_new``, each read when asked for: ``old(i)``
    from the carried rows' table, ``new(k)`` from the new rows'."""

    def __init__(self, old: Callable[[int], Any], new: Callable[[int], Any], n_old: int, n_new: int):
        self.old, self.new, self.n_old, self.n_new = old, new, n_old, n_new

    def __len__(self) -> int:
        return self.n_old + self.n_new

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.old(i) if i < self.n_old else self.new(i - self.n_old)
