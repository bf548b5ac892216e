"""Forgetting a user in a store the single writer holds: ``DELETE /v1/users/{user}``
and ``helix forget-user`` both call :func:`forget_user` on the
:class:`~helix_ray.live.writer.WriterCore` that owns the database.

1. Under both of the writer's locks (``_compacting`` too: a compaction's pipeline reads
   the database through a cursor of the writer's connection), all at once: the user's
   API keys leave ``keys.json``, so their key fails from the next request; their rows
   leave the database (:func:`helix_ray.store.erase.forget_user`); their entries leave
   the delta, published again as one new segment, and the older snapshots that list
   their writes are deleted; their ids leave the recent-access file; the database file
   is copied into a fresh one, so no freed block keeps their bytes.
2. The query adapter goes if it was fitted on their queries.
3. With ``compact``: a compaction publishes a generation without their rows (it runs
   even when the delta is empty, and publishes nothing when the current generation
   holds none of them); then every other generation and delta snapshot is
   deleted, ``erased`` is emptied (no generation left holds those ids) and the database
   copied once more. Without it, the next compaction or ingest leaves their rows out.

With a mirror, every push from the forget on keeps no older generation or snapshot there,
until one completes (:func:`helix_ray.store.mirror.mark_forgotten`); ``mirror_stale`` in
the answer says the mirror may still hold the user's data (its push failed, or there was
no mirror to push to).

A user the store holds nothing of (no row, key or generation row: most likely a
mistyped id) is a :class:`~helix_ray.errors.NotFound`, and nothing changes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.compute as pc

from helix_ray.errors import NotFound
from helix_ray.live.delta_format import drop_history
from helix_ray.recall import adapter
from helix_ray.store import erase
from helix_ray.store.generation import Generation
from helix_ray.store.keys import KeyStore
from helix_ray.store.mirror import mark_forgotten
from helix_ray.store.publish import prune

if TYPE_CHECKING:
    from helix_ray.live.writer import WriterCore

#: The database counts that show the store held something of a user (``ids``: their
#: memories and online writes).
HELD = ("ids", "entities", "feedback", "access_log", "inbox_lines", "quarantine")


def forget_user(core: WriterCore, user: str, *, compact: bool = True) -> dict[str, Any]:
    """Erase ``user`` from the store ``core`` writes; return what went (the fields of
    ``UserForgotten``, the answer of ``DELETE /v1/users/{user}``)."""
    with core._forgetting:
        with core._compacting, core._lock:
            counts = erase.forget_user(core.store, user, db=core.db)  # checks the id (422) before anything
            keys = KeyStore(core.store).forget(user)
            served, edges = _served(core, user)
            if not keys and not served and not any(counts[k] for k in HELD):
                raise NotFound(f"Got user {user!r}; this store holds nothing of that user: no memories, online "
                               "writes, feedback, recall hits or API keys, and no rows in the served generation. "
                               "Check the id (GET /v1/stats with an admin key counts each user's memories).")
            mark_forgotten(core.store)  # every push keeps no history at the mirror until one completes
            core.forgotten[user] = int(time.time() * 1_000_000)
            core.entries = {i: e for i, e in core.entries.items() if e["user"] != user}
            core.unfoldable &= {e["seq"] for e in core.entries.values()}
            # The user's tombstones stay until a generation without their rows is
            # published: they hide the rows the user deleted, which the current one holds.
            core._publish(rewrite=True)
            drop_history(core.store)
            mirror_clean = core.push_mirror(history=False)  # nor older snapshots at the mirror
            core._load_recent_accesses()  # the log's hits of their ids were blanked
            _rewrite_database(core)
        removed = adapter.forget_user(core.store, user)
        if compact:
            mirror_clean = _compact_without(core, user)
        return {"user": user, "memories": counts["memories"], "chunks": counts["chunks"],
                "expansions": counts["expansions"], "entities": counts["entities"], "edges": edges,
                "duplicates": counts["duplicates"], "feedback": counts["feedback"],
                "access_rows": counts["access_log"], "online_writes": counts.get("serve_log", 0),
                "inbox_lines": counts["inbox_lines"], "quarantined": counts["quarantine"], "keys": keys,
                "adapter_removed": removed, "compacted": compact, "generation": core.generation,
                "mirror_stale": not mirror_clean}


def _served(core: WriterCore, user: str) -> tuple[bool, int]:
    """Whether the current generation holds rows of ``user``, in its files or its
    segments (a user forgotten without ``compact`` is served until the next generation),
    and how many of its graph's edges touch their memories and entities: every edge lies
    within one tenant, so half the sum of their nodes' degrees. Those edges leave with
    the generation that leaves the rows out."""
    if core.generation is None:
        return False, 0
    generation = Generation.open_current(core.store)
    segments = generation.segment_rows()
    served = user in generation.partitions or (segments is not None and user in segments.column("user").to_pylist())
    start, end = generation.partitions.get(user, (0, 0))
    entities = generation.entities
    nodes = np.concatenate([np.arange(start, end, dtype=np.int64), entities.filter(
        pc.equal(entities.column("user"), user)).column("node").to_numpy().astype(np.int64)])
    degrees = np.diff(np.asarray(generation.graph.indptr))
    return served, int(degrees[nodes].sum()) // 2


def _compact_without(core: WriterCore, user: str) -> bool:
    """A generation without the forgotten rows (a compaction that runs even when the
    delta is empty; it publishes nothing when the current one already holds none of
    them), then every other generation and delta snapshot deleted and ``erased`` emptied
    in a database file copied once more.

    Deleting the generation before it at once: a replica that still maps it until it
    has opened the new one (views keep the newest two) reads its pages from the mapping,
    which outlives the deleted files (Linux unlink semantics); a request pinned to it
    after that is answered again on the new one (503 at worst, with ``Retry-After``)."""
    mark_forgotten(core.store)  # the compaction's push keeps no older generation at the mirror
    core.compact(rebuild=True)
    with core._compacting, core._lock:
        core.tombstones = {i: t for i, t in core.tombstones.items() if t.user != user}
        core._publish()
        drop_history(core.store)
        prune(core.store, keep=1)
        mirror_clean = core.push_mirror(history=False)  # nor older generations at the mirror
        core.db.con.execute("DELETE FROM erased")
        _rewrite_database(core)
    return mirror_clean


def _rewrite_database(core: WriterCore) -> None:
    """Close the writer's connection, copy the database into a fresh file
    (:func:`erase.rewrite_database`) and open that one; the connection is open again
    also when the copy fails. Under ``_compacting`` and ``_lock``."""
    core.db.close()
    try:
        erase.rewrite_database(core.store)
    finally:
        core.db = core._open_database()
