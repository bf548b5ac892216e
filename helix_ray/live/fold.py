"""Folding the pending writes into a segment: the next generation is the current one's
files, hard-linked, plus the pending entries as the delta's files hold them
(:func:`helix_ray.store.publish.publish_segment`, format 2). A fold writes and records
what is pending, whatever the store's size. Recall searches a segment's rows as it
searches the delta's (:func:`helix_ray.live.delta.effective`); the next full compaction
(:mod:`helix_ray.live.compaction`: the ingest pipeline) takes them into a generation of
its own files, with their graph edges and index entries
(:func:`helix_ray.ingest.run.ingest` absorbs a previous generation's segments).

The order makes a crash at any point safe: the folder is written and fsynced first; then
one DuckDB transaction records the memories, their expansions, the log rows now folded
and the generation; then ``CURRENT`` moves (after a crash before it, the next Writer,
like the next ingest, first makes the recorded generation current:
:func:`helix_ray.ingest.run.roll_forward`); then the writer's state in memory.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from helix_ray.index.bm25 import expansions_of
from helix_ray.live.delta_format import NOT_FOLDED, Tombstone
from helix_ray.live.writes import SERVED_PREFIX
from helix_ray.store.generation import DEAD_SCHEMA, Generation
from helix_ray.store.publish import prune, publish_segment, set_current

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore


def fold(core: WriterCore) -> dict[str, Any] | None:
    """Fold the live delta's pending entries, and the deletions since the last
    compaction, into a segment of the next generation; return what happened (as
    :func:`helix_ray.live.compaction.compact` does, with ``"mode": "segment"``), or
    None, changing nothing, when a forgotten user's rows may still be in a generation
    (``erased``): only a rebuild removes them.

    Runs under the writer's lock: it costs what is pending (milliseconds per hundred
    entries), so writes wait that long."""
    from helix_ray.ingest import stages
    from helix_ray.ingest.assemble import memory_table

    with core._compacting, core._lock:
        started = time.perf_counter()
        core._mark_open_deletes()
        pending = [e for e in core.entries.values() if e["folded_into"] == NOT_FOLDED]
        open_tombstones = [t for t in core.tombstones.values() if t.applies_below is None]
        if not pending and not open_tombstones:
            core.last_compaction = {"published": False, "reason": "nothing to compact",
                                    "generation": core.generation, "mode": "segment"}
            return core.last_compaction
        if core.db.erased_ids():  # a user forgotten since the caller looked: a rebuild leaves them out
            return None
        current = Generation.open_current(core.store)  # a damaged one raises: a full compaction rebuilds
        upto = core.seq
        segment_rows = int(current.manifest["counts"].get("segment_rows") or 0)  # what fold.max_rows counts
        # Every pending entry is new to the segments: the log marks what a fold froze in the
        # transaction that records its generation, and a Writer rolls forward to that one.
        dead = dict(current.dead)
        for e in pending:  # a write hides the base row of its id, and the id's earlier segment rows
            dead[e["id"]] = max(dead.get(e["id"], -1), e["seq"])
        for t in open_tombstones:  # a delete hides every copy logged before it
            dead[t.id] = upto + 1
        number = publish_segment(core.store, core.segment_table(pending),
                                 pa.table({"id": list(dead), "seq": list(dead.values())}, schema=DEAD_SCHEMA),
                                 make_current=False)
        inbox = core.store / "inbox"
        served = sorted(inbox.glob(f"{SERVED_PREFIX}*.jsonl"))
        db = core.db
        db.con.begin()
        try:
            run_id = db.start_run(["delta"])
            rows = [stages.decode_row(json.dumps(e["record"])) for e in pending]
            db.upsert_memories(memory_table(rows, {"n_tokens": [e["n_tokens"] for e in pending]}), run_id)
            db.upsert_expansions([e["id"] for e in pending],
                                 [json.dumps(expansions_of(e["text"], e["lexical"]) or []) for e in pending],
                                 core.config.doc2query.backend)
            db.con.execute("UPDATE serve_log SET folded_into = ? WHERE seq IN (SELECT unnest(?::BIGINT[]))",
                           [number, [e["seq"] for e in pending]])
            db.con.execute("UPDATE serve_log SET folded_into = ? WHERE op = 'delete' AND folded_into IS NULL "
                           "AND seq <= ?", [number, upto])
            db.record_generation(number, run_id)
            db.finish_run(run_id, {"folded": len(pending), "deletions": len(open_tombstones)}, number, "published")
            db.con.commit()
        except BaseException:
            db.con.rollback()
            raise
        set_current(core.store, number)
        for e in pending:
            e["folded_into"] = number
        core.unfoldable -= {e["seq"] for e in pending}  # a segment holds them as written
        for t in open_tombstones:
            core.tombstones[t.id] = Tombstone(t.id, t.user, number)  # N's dead list hides the row from N on
        core.entries = {i: e for i, e in core.entries.items()
                        if e["folded_into"] == NOT_FOLDED or e["folded_into"] >= number}
        core.tombstones = {i: t for i, t in core.tombstones.items()
                           if t.applies_below is None or t.applies_below >= number}
        db.con.execute("DELETE FROM serve_log WHERE folded_into IS NOT NULL AND folded_into < ?", [number])
        core._publish()
        for path in served:  # their writes are in a generation now
            path.unlink(missing_ok=True)
        prune(core.store, keep=core.config.keep_generations)
        core.last_compaction = {
            "published": True, "generation": number, "folded": len(pending), "kept_in_delta": 0,
            "deletions": len(open_tombstones), "seconds": round(time.perf_counter() - started, 3),
            "mode": "segment", "segment_rows": segment_rows + len(pending),
        }
        return core.last_compaction
