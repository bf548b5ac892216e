"""Compaction: folding the Writer's delta into the next generation.

:func:`compact` writes the live delta's records to one JSONL file in ``inbox/`` and runs
the ingest pipeline itself on it (``helix_ray.ingest.run.ingest``, on a sibling of the
writer's DuckDB connection), outside the writer's lock; then, under the lock, it marks
what the new generation holds as folded (:func:`mark_folded`), applies the deletions
made meanwhile, prunes the log and publishes a new delta snapshot. The functions take
the :class:`~helix_ray.live.writer.WriterCore` whose state they change; its
``compact`` method is the entry point (see docs/architecture.md).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.index.bm25 import expansions_of
from helix_ray.live.delta_format import NOT_FOLDED, Tombstone
from helix_ray.live.writes import SERVED_PREFIX, write_inbox_file
from helix_ray.schema import content_hash
from helix_ray.store.generation import Generation

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

#: Compaction inputs kept in ``inbox/folded/`` (newest first), for an operator to look at.
KEEP_FOLDED = 50
#: Inbox file name of a compaction's input (a served write's is ``writes.SERVED_PREFIX``).
COMPACTION_PREFIX = "compact-"


def compact(core: WriterCore, *, rebuild: bool = False) -> dict[str, Any]:
    """Fold the live delta (and the deletions since the last compaction) into the
    next generation with the ingest pipeline; return what happened. ``rebuild``: run
    the pipeline even when the delta holds nothing, so that rows the database no
    longer lists (a forgotten user's, :mod:`helix_ray.store.erase`) leave the
    generation.

    The pipeline runs on a snapshot, outside the writer's lock: writes, PATCHes,
    DELETEs, accesses and stats go on while it builds (it rebuilds every index). What
    changed meanwhile stays in the delta, over the new generation, until the next
    compaction."""
    from helix_ray.ingest.run import ingest  # at call time (tests replace it); loads config (pydantic)

    with core._compacting:  # one at a time: the background thread, POST /v1/admin/compact
        with core._lock:
            started = time.perf_counter()
            core._mark_open_deletes()
            pending = [e for e in core.entries.values() if e["folded_into"] == NOT_FOLDED]
            open_tombstones = [t for t in core.tombstones.values() if t.applies_below is None]
            if not pending and not open_tombstones and not rebuild:
                core.last_compaction = {"published": False, "reason": "nothing to compact",
                                        "generation": core.generation}
                return core.last_compaction
            core.warn_tokens_once()  # this one may encode every memory's token vectors
            upto = core.seq  # the log rows this compaction folds
            inbox = core.store / "inbox"
            before = sorted(p for p in inbox.glob("*.jsonl"))
            source = write_inbox_file(core.store, COMPACTION_PREFIX,
                                      [e["record"] for e in sorted(pending, key=lambda e: e["seq"])],
                                      "writing the compaction's input file")
            db = core.db.sibling()  # a DuckDB connection is not for two threads at once
        try:
            report = ingest([source], core.store, fmt="jsonl", config=core.config, runner=core.compact_runner,
                            show_progress=False, db=db, computed=computed_outputs(core, pending))
        except BaseException:
            # The input is a copy of serve_log's pending rows, which stay there: a failed
            # try leaves nothing behind, so retries do not pile up copies of them.
            source.unlink(missing_ok=True)
            raise
        finally:
            db.close()
        with core._lock:
            number = report.generation
            folded = 0
            if report.published and number is not None:
                # Deleted while it ran (also if written again since): the pipeline may
                # have written the row as live.
                late = [row[0] for row in core.db.con.execute(
                    "SELECT DISTINCT id FROM serve_log WHERE op = 'delete' AND seq > ?", [upto]).fetchall()]
                if late:
                    core.db.delete(late)
                folded = mark_folded(core, Generation.open_current(core.store), pending, number)
                close_deletions(core, open_tombstones, number, upto)
                # Entries and tombstones of earlier compactions: every replica has moved on.
                core.entries = {i: e for i, e in core.entries.items()
                                if e["folded_into"] == NOT_FOLDED or e["folded_into"] >= number}
                core.tombstones = {i: t for i, t in core.tombstones.items()
                                   if t.applies_below is None or t.applies_below >= number}
                core.db.con.execute("DELETE FROM serve_log WHERE folded_into IS NOT NULL AND folded_into < ?",
                                    [number])
                core._publish()
                core._load_recent_accesses()  # what the new generation folded leaves the file
            elif number is not None and open_tombstones:
                # The pipeline dropped no row, so no generation row has these ids (each was
                # written and deleted between two compactions): their deletions are done.
                close_deletions(core, open_tombstones, number, upto)
                core._publish()
            # Tried and not folded; of the earlier ones, only those still pending (a seq
            # replaced or deleted since is gone from the delta).
            live = {e["seq"] for e in core.entries.values() if e["folded_into"] == NOT_FOLDED}
            core.unfoldable = (core.unfoldable | {e["seq"] for e in pending
                                                  if e["folded_into"] == NOT_FOLDED}) & live
            retire_inbox(inbox, before, source, published=bool(report.published))
            core.last_compaction = {
                "published": bool(report.published), "generation": number, "folded": folded,
                "kept_in_delta": len(pending) - folded, "deletions": len(open_tombstones),
                "seconds": round(time.perf_counter() - started, 3), "ingest": report.as_dict(),
            }
            return core.last_compaction


def close_deletions(core: WriterCore, tombstones: list[Tombstone], number: int, upto: int) -> None:
    """The deletions ``tombstones`` (logged at or before ``upto``) are applied as of
    generation ``number``, which holds none of their ids: each hides its id only below
    it, and their log rows count as folded into it."""
    for t in tombstones:
        if core.tombstones.get(t.id) is t:  # not written again (or deleted again) since
            core.tombstones[t.id] = Tombstone(t.id, t.user, number)
    core.db.con.execute("UPDATE serve_log SET folded_into = ? WHERE op = 'delete' "
                        "AND folded_into IS NULL AND seq <= ?", [number, upto])


def computed_outputs(core: WriterCore, pending: list[dict[str, Any]]) -> dict[str, Any]:
    """What the writes already computed (their vectors, token vectors and
    expansions), for compaction to take instead of computing it again: only those
    made under this writer's ingest config (a log row older than its ``computed_by``, or
    under another config, is computed again). The expansions are read back from the
    lexical text: the text, then a query a line (a query holding a newline comes back
    as two, which index the same lexical text); :class:`stages.Reuse` takes them only
    from an LLM expander (the offline one runs again, on the compaction's batch)."""
    from helix_ray.ingest.stages import Computed  # loads config (pydantic): this module does not

    out = {}
    for e in pending:
        queries = expansions_of(e["text"], e["lexical"])
        if e["computed_by"] == core._fingerprint and queries is not None:
            out[e["id"]] = Computed(e["text"], json.dumps(queries), e["vector"], e["late_codes"], e["late_scales"])
    return out


def retire_inbox(inbox: Path, before: list[Path], source: Path, *, published: bool) -> None:
    """After a compaction: the inbox files of the writes it covered, and its own input.

    A write's file (``serve-*``: served, or ``Memory.add``'s) is a copy of what
    ``serve_log`` holds until a generation does; once one is published, the files of
    the writes before the compaction are deleted (kept, there would be one file per
    write for ever). Any other file (a JSONL someone left there) and the compaction's
    input move to ``inbox/folded/``, as do the served files when nothing was published
    (``serve_log`` keeps those writes pending); of the inputs, and of those served
    files, the newest :data:`KEEP_FOLDED` each stay."""
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


def mark_folded(core: WriterCore, gen: Generation, pending: list[dict[str, Any]], number: int) -> int:
    """Mark the pending entries generation ``number`` holds as they are (same text
    and fields), or dropped as a near-duplicate of another memory."""
    table = gen.memories
    ids = [e["id"] for e in pending]
    where = pc.index_in(pa.array(ids, pa.string()), value_set=table.column("id")).to_pylist()
    known = core.db.known_hashes()
    dropped = core.db.dropped_as_duplicates([e["id"] for e, row in zip(pending, where) if row is None])

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
        core.db.con.executemany("UPDATE serve_log SET folded_into = ? WHERE seq = ?", [[number, s] for s in folded])
    return len(folded)
