"""The ingest pipeline: sources → a published store generation.

Stage order (each stage is a function in :mod:`helix_ray.ingest`):

1. read sources                      ┐ Ray Data, one task per source
2. validate and normalise            ┘ (bad rows → quarantine, with reason and position)
   ── barrier: MinHash-LSH dedup needs every signature of the tenant ──
3. exact and near-duplicate removal  (driver; against the previous generation too)
4. doc2query expansion               ┐ Ray Data, streaming, only for memories that are
5. embed (actor pool, batched):      │ new or changed: old ones keep their vectors
   sentence vector + token vectors   │
7. entities, token counts            ┘
   (a conversation turn's vector takes in its session's previous turn: session_context)
   ── barrier: indexes and graph need every row ──
7b. graph edges (mentions, sessions, temporal, semantic kNN)
7c. carried over, not recomputed: the previous generation's rows keep their
    entities, BM25 terms, kNN lists and HNSW entries (:mod:`helix_ray.ingest.carry`)
6. quantize (int8 and binary) and    ┐ atomic; the previous generation keeps serving
8. write and publish the generation  ┘ on failure; codes made from the final vectors

``runner="ray"`` runs stages 1–2 and 4–7 on Ray Data (a local Ray it starts, or the
cluster named by ``RAY_ADDRESS``); ``runner="local"`` runs the same functions in this
process, for tests and small online batches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.config import IngestConfig
from helix_ray.errors import InvalidArgument, StoreError
from helix_ray.ingest import carry, stages
from helix_ray.ingest.dedup import find_duplicates
from helix_ray.ingest.graph import build_graph, edges_table, tenant_codes
from helix_ray.ingest.sources import FORMATS, detect_format
from helix_ray.recall.lexical import Analyzer, lexical_text
from helix_ray.schema import GENERATION_SCHEMA
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import (
    ACCESS_WATERMARK,
    Generation,
    GenerationData,
    current_generation_number,
    partitions_of,
    prune,
    publish,
    set_current,
)

log = logging.getLogger(__name__)

BATCH = 256  # rows per transform call (the embedder sorts within it by length)
BLOCK = 256  # rows per Ray Data block (a multiple of BATCH; blocks are the actors' unit of work)
ACTOR_MEMORY = 1792 * 1024**2  # what one embedding actor holds (two models, arenas; 1.4 GiB at 100k): told to Ray


@dataclasses.dataclass
class IngestReport:
    """What one ingest run did. ``embedded`` counts passages sent to the embedder;
    ``reused`` those whose vectors came with the run instead (a compaction's writes)."""

    run_id: str = ""
    read: int = 0
    accepted: int = 0
    quarantined: int = 0
    duplicates: int = 0
    unchanged: int = 0
    new: int = 0
    updated: int = 0
    retagged: int = 0  # of ``updated``: same text, other fields changed (no re-embedding)
    embedded: int = 0
    reused: int = 0
    total_memories: int = 0
    generation: int | None = None
    published: bool = False
    pruned: list[int] = dataclasses.field(default_factory=list)  # generation folders deleted after publishing
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    quarantine_reasons: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextmanager
def _timed(report: IngestReport, name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    report.seconds[name] = round(report.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


def _run_local_batches(rows: list[dict[str, Any]], transforms: Sequence[Any]) -> Iterator[dict[str, np.ndarray]]:
    for start in range(0, len(rows), BATCH):
        chunk = rows[start : start + BATCH]
        batch = {k: np.array([r[k] for r in chunk], dtype=object) for k in ("seq", "text", "type")}
        for fn in transforms:
            batch = fn(batch)
        yield batch


def ingest(
    sources: Sequence[str | Path],
    store: str | Path,
    *,
    fmt: str = "auto",
    config: IngestConfig | None = None,
    runner: str = "ray",
    show_progress: bool = True,
    crash_after: str | None = None,
    db: StoreDB | None = None,
    computed: dict[str, stages.Computed] | None = None,
) -> IngestReport:
    """Ingest ``sources`` into ``store`` and publish a new generation if anything changed.

    ``db`` is the store's open writer when the caller already holds one (a
    :class:`helix_ray.Memory`); otherwise this run opens the store's DuckDB file itself.
    ``computed`` (by memory id) holds stage 4–5 outputs made earlier under this
    ``config`` (the server's, for its online writes): a new memory whose text is the
    same is not expanded, embedded nor token-encoded again.
    """
    config = config or IngestConfig()
    store = Path(store)
    if runner not in ("ray", "local"):
        raise InvalidArgument("runner", runner, "allowed runners are 'ray' and 'local'")
    if fmt not in FORMATS:
        raise InvalidArgument("format", fmt, f"allowed formats are {', '.join(FORMATS)}")
    items = []
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise InvalidArgument("source", str(path), "it must be an existing file or folder")
        items.append({"path": str(path.resolve()), "format": detect_format(path) if fmt == "auto" else fmt})
    if not items:
        raise InvalidArgument("sources", [], "give at least one file or folder to ingest")

    report = IngestReport()
    with _writer(store, db) as db, _recorded_run(db, report, [i["path"] for i in items]):
        _ingest(items, store, db, config, runner, show_progress, crash_after, report, computed or {})
    return report


@contextmanager
def _writer(store: Path, db: StoreDB | None) -> Iterator[StoreDB]:
    """The store's writer (``db``, or the DuckDB file opened here and closed after),
    with a generation a crash left recorded but not current made current first."""
    own = db is None
    db = db or StoreDB(store)
    try:
        roll_forward(store, db)
        yield db
    finally:
        if own:
            db.close()


@contextmanager
def _recorded_run(db: StoreDB, report: IngestReport, sources: list[str]) -> Iterator[None]:
    """One row of the store's ``ingest_runs`` around the block: failed if it raises,
    else published or unchanged as ``report`` says."""
    report.run_id = run_id = db.start_run(sources)
    try:
        yield
    except BaseException:
        db.finish_run(run_id, report.as_dict(), None, "failed")
        raise
    db.finish_run(run_id, report.as_dict(), report.generation, "published" if report.published else "unchanged")


def initialise(store: str | Path, *, config: IngestConfig | None = None, db: StoreDB | None = None) -> int:
    """The store's current generation; for a store that has none yet, first publish an
    empty one (no memories, every index file in place), so a server can serve the store
    and take online writes before anything was ingested. Like :func:`ingest`, this
    opens the store's DuckDB file unless ``db`` (its open writer) is given."""
    config = config or IngestConfig()
    store = Path(store)
    number = current_generation_number(store)
    if number is not None:
        return number
    with _writer(store, db) as db:
        if current_generation_number(store) is None:  # the roll-forward found none either
            recorded, held = db.recorded_generation(), db.counts()["memories"]
            if recorded is not None or held:
                raise StoreError(
                    f"Store {store} has no current generation, but its database records generation {recorded} and "
                    f"{held} memories: its generation files are missing. An empty generation would hide them; "
                    "restore the store's generations/ folder, or ingest the sources again into a new store.")
            report = IngestReport()
            with _recorded_run(db, report, []):
                _stages([], store, db, config, "local", None, report, None, {}, empty_ok=True)
    number = current_generation_number(store)
    assert number is not None  # published above, or by another writer's roll-forward
    return number


def _ingest(items, store: Path, db: StoreDB, config: IngestConfig, runner: str, show_progress: bool,
            crash_after: str | None, report: IngestReport, computed: dict[str, stages.Computed]) -> None:
    if runner == "local":
        _stages(items, store, db, config, runner, crash_after, report, None, computed)
        return
    from helix_ray.runtime import ensure_ray
    import ray

    with _timed(report, "ray_start"):
        ensure_ray()
    ray.data.DataContext.get_current().enable_progress_bars = show_progress
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    feed = _TransformFeed(config)
    try:
        _stages(items, store, db, config, runner, crash_after, report, feed, computed)
    except BaseException:
        feed.abort()
        raise
    feed.close()


def _stages(items, store: Path, db: StoreDB, config: IngestConfig, runner: str, crash_after: str | None,
            report: IngestReport, feed: _TransformFeed | None, computed: dict[str, stages.Computed], *,
            empty_ok: bool = False) -> None:
    # ---- 1–2: read, validate, normalise (+ MinHash signatures for stage 3)
    with _timed(report, "read_validate"):
        if runner == "ray":
            import ray

            ds = ray.data.from_items(items).flat_map(
                _read_validate_sign,  # type: ignore[arg-type]  # ray's UDF type does not model fn_kwargs
                fn_kwargs={"config": config}, num_cpus=0.25,
            )
            out = ds.take_all()
        else:
            out = [r for item in items for r in _read_validate_sign(item, config=config)]
    quarantined = [json.loads(r["payload"]) for r in out if not r["ok"]]
    incoming = [stages.decode_row(r["payload"]) for r in out if r["ok"]]
    # An id given twice in the input: the later record wins, the earlier is quarantined
    # whole. An id that is another user's memory: quarantined (ingest never moves a
    # memory between tenants; the server's writes refuse it the same way).
    # The same id for two users in one ingest: the first keeps it, as the store's
    # memories keep theirs (the later one replaced the first user's record before).
    latest: dict[str, dict[str, Any]] = {}
    for row in incoming:
        earlier = latest.get(row["id"])
        if earlier is not None and earlier["user"] != row["user"]:
            quarantined.append(_held_back(row, "id_conflict", f"id {row['id']!r} is given earlier in this ingest "
                                          f"to a memory of user {earlier['user']!r}, not {row['user']!r}; give this "
                                          "record another id (or none: one is derived)"))
            continue
        if earlier is not None:
            quarantined.append(_held_back(earlier, "duplicate_id", "the same id is given again later in "
                                          "this ingest; the later record is kept"))
        latest[row["id"]] = row
    for memory_id, owner in db.foreign_ids([(r["id"], r["user"]) for r in latest.values()]).items():
        row = latest.pop(memory_id)
        quarantined.append(_held_back(row, "id_conflict", f"id {memory_id!r} is a memory of user {owner!r}, not "
                                      f"{row['user']!r}; give this record another id (or none: one is derived)"))
    report.read = len(out)
    report.quarantined = len(quarantined)
    report.accepted = len(latest)
    for q in quarantined:
        reason = q["reason"].split(":", 1)[0]
        report.quarantine_reasons[reason] = report.quarantine_reasons.get(reason, 0) + 1

    # ---- 3: what is new, and dedup against itself and the previous generation
    with _timed(report, "dedup"):
        known = db.known_hashes()
        previous = _open_previous(store, config)
        dropped_before = db.dropped_as_duplicates([i for i in latest if i in known])
        fresh, replaced = [], set()
        same_text = []
        held = _held_by(previous, [r["id"] for r in latest.values() if r["id"] in known])
        for row in latest.values():
            seen = known.get(row["id"])
            if seen is not None and seen[1]:  # deleted, now given again: it comes back
                seen = None
            if seen is not None and row["id"] not in held and row["id"] not in dropped_before:
                seen = None  # restored: recorded by a run whose generation never became current
            if seen is not None and seen[0] == row["content_hash"]:
                same_text.append(row)
                continue
            if seen is not None:
                report.updated += 1
                replaced.add(row["id"])
            else:
                report.new += 1
            fresh.append(row)
        computed = {r["id"]: computed[r["id"]] for r in fresh if _reusable(r, computed, config)}
        if feed is not None and len(fresh) > len(computed):
            feed.start(len(fresh) - len(computed))  # the embedding actors start while dedup runs
        # Same text, other fields changed (a PATCH of type or salience, a re-tagged
        # record): the carried-over row takes the new fields and keeps its embedding.
        retagged = _retagged(previous, same_text)
        report.unchanged += len(same_text) - len(retagged)
        report.updated += len(retagged)
        report.retagged = len(retagged)

        old_rows, old_index, folded, accesses = _carried_over(previous, db, replaced, retagged)
        _keep_folded_accesses(fresh, previous, replaced)
        _fold_accesses(fresh, accesses)
        if not fresh and not retagged and (previous is not None or not (incoming or empty_ok)) \
                and not _has_deletions(previous, old_index):
            report.total_memories = len(old_index)
            report.generation = current_generation_number(store)
            db.add_quarantine(quarantined, report.run_id)
            return

        n_old = old_rows.num_rows
        users = old_rows.column("user").to_pylist() + [r["user"] for r in fresh]
        all_ids = old_rows.column("id").to_pylist() + [r["id"] for r in fresh]
        old_sigs = previous.minhash[old_index] if previous is not None and len(old_index) else np.zeros(
            (0, config.dedup.num_perm), np.uint32)
        if old_sigs.shape[1:] != (config.dedup.num_perm,):  # dedup.num_perm changed since: sign the old rows again
            from helix_ray.ingest.dedup import signatures

            log.info("dedup.num_perm is %d, the previous generation's signatures have %d: signing its %d "
                     "memories again", config.dedup.num_perm, old_sigs.shape[1], n_old)
            old_sigs = signatures(old_rows.column("text").to_pylist(), num_perm=config.dedup.num_perm,
                                  shingle=config.dedup.shingle)
        sigs = np.concatenate([old_sigs, np.array([r["minhash"] for r in fresh], np.uint32).reshape(
            len(fresh), config.dedup.num_perm)])
        # Dedup reads the text and preference of the new rows and of the old rows that
        # share an LSH band with one: old ones are read from the table when asked for.
        pinned, created, texts = (old_rows.column(name) for name in ("pinned", "created_at", "text"))
        preference = _OldThenNew(lambda i: (bool(pinned[i].as_py()), created[i].as_py(), i),
                                 [(bool(r["pinned"]), r["created_at"], n_old + j) for j, r in enumerate(fresh)], n_old)
        dropped = find_duplicates(
            users, sigs, preference, threshold=config.dedup.threshold,
            texts=_OldThenNew(lambda i: texts[i].as_py(), [r["text"] for r in fresh], n_old),
            shingle=config.dedup.shingle,
            settled=n_old,  # the previous generation's rows: deduplicated when it was built
        )
        drop = {i for i, _, _ in dropped}
        links = [(all_ids[i], all_ids[j], s) for i, j, s in dropped]
        report.duplicates = len(links)

    keep_old = [i for i in range(n_old) if i not in drop]
    keep_new = [i for i in range(len(fresh)) if n_old + i not in drop]
    dropped_rows = [fresh[i] for i in range(len(fresh)) if n_old + i in drop]
    dropped_old_ids = [all_ids[i] for i in range(n_old) if i in drop]
    todo = [dict(fresh[i], seq=k) for k, i in enumerate(keep_new)]
    reuse = {r["seq"]: computed[r["id"]] for r in todo if r["id"] in computed}
    report.reused = len(reuse)
    report.embedded = len(todo) - len(reuse)

    # ---- 4, 5, 7: expand, embed, annotate (new or changed memories only)
    with _timed(report, "expand_embed_annotate"):
        batches = list(_transform([r for r in todo if r["seq"] not in reuse], config, runner, feed))
        if reuse:
            batches += _run_local_batches([r for r in todo if r["seq"] in reuse], [stages.Reuse(config, reuse)])
    new_cols = _collect(batches, len(todo), config)
    del batches  # their token blobs are the largest thing the driver holds (~27 KB a memory)
    if config.session_context > 0:
        new_cols["vector"] = _session_context(todo, new_cols["vector"], old_rows.take(pa.array(keep_old, pa.int64())),
                                              previous, old_index[keep_old] if keep_old else None,
                                              config.session_context)

    # ---- assemble: old rows keep their vectors; sort so each tenant is one range
    with _timed(report, "assemble"):
        data, node_names = _assemble(previous, old_rows, old_index, keep_old, todo, new_cols, sigs, keep_new,
                                     n_old, db, config)
    data.extra[ACCESS_WATERMARK] = folded
    report.total_memories = data.memories.num_rows

    with _timed(report, "publish"):
        number = publish(
            store, data,
            hnsw_connectivity=config.hnsw_connectivity,
            hnsw_expansion_add=config.hnsw_expansion_add,
            crash_after=crash_after,
            dense_indexes=data.extra.pop("_dense_indexes", None),
            hnsw_min_rows=config.hnsw_min_rows,
            hnsw_threads=config.hnsw_threads,
            bm25_analyzer=_analyzer(config),
            make_current=False,  # after the database has recorded it (below)
        )

    # ---- the database records what the published generation holds
    with _timed(report, "record"):
        db.con.begin()
        try:
            tables = _memory_table(todo, new_cols)
            db.upsert_memories(tables, report.run_id)
            if retagged:
                held = data.memories.filter(pc.is_in(data.memories.column("id"), pa.array(list(retagged), pa.string())))
                db.upsert_memories(held, report.run_id)
            if dropped_rows:
                db.upsert_memories(_memory_table(dropped_rows, None), report.run_id)
                db.delete([r["id"] for r in dropped_rows])
            if dropped_old_ids:
                db.delete(dropped_old_ids)
            db.upsert_expansions(
                [r["id"] for r in todo], [json.loads(x) for x in new_cols["expansions"]],
                config.doc2query.backend,
            )
            db.add_duplicates(links, report.run_id)
            db.add_quarantine(quarantined, report.run_id)
            db.replace_graph(data.entities.select(["user", "key", "df"]),
                             edges_table(data.graph, node_names), number)
            db.record_generation(number, report.run_id)
            db.con.commit()
        except BaseException:
            db.con.rollback()
            raise
    # Readers switch only now: a failure above leaves the previous generation current and
    # the database as it was (the unused folder is pruned later). After a crash between
    # the commit and this line, the next run makes the recorded generation current first
    # (:func:`roll_forward`).
    set_current(store, number)
    report.generation = number
    report.published = True
    report.pruned = prune(store, keep=config.keep_generations)


def _read_validate_sign(item: dict[str, Any], *, config: IngestConfig) -> list[dict[str, Any]]:
    from helix_ray.ingest.dedup import signatures

    out = stages.read_and_validate(item, config=config)
    ok = [i for i, r in enumerate(out) if r["ok"]]
    rows = [json.loads(out[i]["payload"]) for i in ok]
    sigs = signatures([r["text"] for r in rows], num_perm=config.dedup.num_perm, shingle=config.dedup.shingle)
    for i, row, sig in zip(ok, rows, sigs):
        row["minhash"] = sig.tolist()
        out[i] = {"ok": True, "payload": json.dumps(row)}
    return out


def roll_forward(store: Path, db: StoreDB) -> int | None:
    """Make current the newest generation the database has recorded, when a crash came
    between recording it and flipping ``CURRENT`` (its folder was written and fsynced
    before the record). Returns the generation it moved to, or None."""
    recorded = db.recorded_generation()
    current = current_generation_number(store) or 0
    if recorded is None or recorded <= current:
        return None
    try:
        set_current(store, recorded)
    except StoreError as exc:  # its folder is gone
        log.warning("the database records generation %d of %s, but: %s", recorded, store, exc)
        return None
    log.warning("made generation %d of %s current: an earlier ingest recorded it and stopped before "
                "switching to it", recorded, store)
    return recorded


def _held_by(previous: Generation | None, ids: list[str]) -> set[str]:
    """Those of ``ids`` that the previous generation holds."""
    if previous is None or not ids:
        return set()
    found = pc.is_in(pa.array(ids, pa.string()), value_set=previous.memories.column("id")).to_pylist()
    return {i for i, hit in zip(ids, found) if hit}


def _held_back(row: dict[str, Any], code: str, sentence: str) -> dict[str, Any]:
    """A validated record that cannot be stored as given, as a quarantine row (the whole
    record kept, so nothing is lost)."""
    record = {k: v for k, v in row.items() if k not in ("minhash", "content_hash")}
    return {"source": row.get("source"), "position": f"id {row['id']}", "reason": f"{code}: {sentence}",
            "raw": json.dumps(record, default=str, ensure_ascii=False, sort_keys=True)}


def _open_previous(store: Path, config: IngestConfig) -> Generation | None:
    if current_generation_number(store) is None:
        return None
    from helix_ray.embedder import DIM

    return Generation.open_current(store, expect_embedder=config.embedder.name, expect_dim=DIM)


#: Record fields that can change without the text: compared on re-ingest, taken over
#: by the carried-over row (times and access counts are the store's, not the record's).
RETAG_FIELDS = ("type", "project", "session_id", "salience", "confidence", "pinned", "metadata", "source")


def _retagged(previous: Generation | None, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """id → new field values, for rows whose text the previous generation holds with
    other values in :data:`RETAG_FIELDS`."""
    out = {}
    for row, old in _previous_values(previous, rows, RETAG_FIELDS):
        new = {k: row.get(k) for k in RETAG_FIELDS}
        if any(not _same_value(k, old[k], new[k]) for k in RETAG_FIELDS):
            out[row["id"]] = new
    return out


def _previous_values(previous: Generation | None, rows: list[dict[str, Any]],
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
    held = table.take(pa.array([i for _, i in found], pa.int64())).select(list(columns)).to_pylist()
    return [(row, old) for (row, _), old in zip(found, held)]


def _same_value(key: str, old: Any, new: Any) -> bool:
    if key in ("salience", "confidence"):
        return new is not None and abs(float(old) - float(new)) < 1e-6  # float32 in the table
    if key == "metadata":
        return json.loads(old or "{}") == (json.loads(new) if isinstance(new, str) else (new or {}))
    return old == new


def _carried_over(previous: Generation | None, db: StoreDB, replaced: set[str],
                  retagged: dict[str, dict[str, Any]] | None = None
                  ) -> tuple[pa.Table, np.ndarray, int, dict[str, tuple[Any, int]]]:
    """Rows of the previous generation that stay (a table in the generation's schema,
    in its order, and their row numbers there): not replaced, not deleted since;
    re-tagged ones with their new field values; the access log folded into their
    ``last_accessed_at`` and ``access_count`` — the part of it the previous generation
    had not folded — and the log position the new generation has folded up to, with
    that part of the log per id (for the rows that are not carried over: see
    :func:`_fold_accesses`). Only the rows a re-tag or an access changes become Python
    dicts; the others are taken as they are (at 10^5 rows the round trip of every row
    through dicts took ~1.5 s of a compaction)."""
    accesses, folded = db.access_summary(previous.manifest.get(ACCESS_WATERMARK, 0) if previous else 0)
    if previous is None:
        return GENERATION_SCHEMA.empty_table(), np.zeros(0, np.int64), folded, accesses
    deleted = db.deleted_ids()
    table = _in_generation_schema(previous.memories)
    ids = table.column("id").to_pylist()
    index = np.array([i for i, mid in enumerate(ids) if mid not in replaced and mid not in deleted], np.int64)
    kept = table.take(pa.array(index, pa.int64()))
    changed = [k for k, i in enumerate(index) if (retagged and ids[i] in retagged) or ids[i] in accesses]
    if not changed:
        return kept, index, folded, accesses
    rows = kept.take(pa.array(changed, pa.int64())).to_pylist()
    for row in rows:
        if retagged and row["id"] in retagged:
            row.update(retagged[row["id"]])
    _fold_accesses(rows, accesses)
    unchanged = np.setdiff1d(np.arange(len(index)), changed)
    spliced = pa.concat_tables([kept.take(pa.array(unchanged, pa.int64())),
                                pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA)])
    back = np.argsort(np.concatenate([unchanged, np.asarray(changed, np.int64)]), kind="stable")
    return spliced.take(pa.array(back, pa.int64())), index, folded, accesses


def _in_generation_schema(table: pa.Table) -> pa.Table:
    """``table`` with :data:`GENERATION_SCHEMA`'s columns in its order: a generation
    written before a column existed gets it as nulls (as ``Table.from_pylist`` with the
    schema would)."""
    if table.schema.equals(GENERATION_SCHEMA):
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in GENERATION_SCHEMA]
    return pa.Table.from_arrays(columns, schema=GENERATION_SCHEMA)


class _OldThenNew(Sequence):
    """A sequence of ``n_old`` values computed on demand (``old(i)``: read from the
    carried rows' table) then the new rows' values (a list)."""

    def __init__(self, old: Callable[[int], Any], new: list[Any], n_old: int):
        self.old, self.new, self.n_old = old, new, n_old

    def __len__(self) -> int:
        return self.n_old + len(self.new)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.old(i) if i < self.n_old else self.new[i - self.n_old]


def _fold_accesses(rows: list[dict[str, Any]], accesses: dict[str, tuple[Any, int]]) -> None:
    """Recall hits of the access log into ``last_accessed_at`` / ``access_count``: for
    carried-over rows and for new versions of a memory alike (a memory recalled and
    then edited keeps its hits)."""
    for row in rows:
        seen = accesses.get(row["id"])
        if seen is not None:
            if row.get("last_accessed_at") is None or seen[0] > row["last_accessed_at"]:
                row["last_accessed_at"] = seen[0]
            row["access_count"] = int(row.get("access_count") or 0) + int(seen[1])


def _keep_folded_accesses(rows: list[dict[str, Any]], previous: Generation | None, replaced: set[str]) -> None:
    """A new version of a memory keeps the hits its previous version had folded: its
    ``access_count`` and ``last_accessed_at`` are at least the previous generation's (an
    edited record brings 0 and none, and a PATCH's record is read from the database,
    which never holds the folded hits)."""
    mine = [r for r in rows if r["id"] in replaced]
    for row, old in _previous_values(previous, mine, ("access_count", "last_accessed_at")):
        row["access_count"] = max(int(row.get("access_count") or 0), int(old["access_count"] or 0))
        if old["last_accessed_at"] is not None and (row.get("last_accessed_at") is None
                                                    or old["last_accessed_at"] > row["last_accessed_at"]):
            row["last_accessed_at"] = old["last_accessed_at"]


def _has_deletions(previous: Generation | None, kept_index: np.ndarray) -> bool:
    return previous is not None and len(kept_index) != previous.size


def _reusable(row: dict[str, Any], computed: dict[str, stages.Computed], config: IngestConfig) -> bool:
    """Whether ``computed`` holds stage 4–5 outputs for ``row``'s text as it is now."""
    got = computed.get(row["id"])
    return got is not None and got.text == row["text"] and \
        (got.late_codes is not None or not config.late_interaction.enabled)


def _transform(todo: list[dict[str, Any]], config: IngestConfig, runner: str, feed: _TransformFeed | None):
    if not todo:
        return
    if runner == "local":
        yield from _run_local_batches(todo, [stages.Transform(config)])
        return
    assert feed is not None
    yield from feed.run(pa.table({
        "seq": pa.array([r["seq"] for r in todo], pa.int64()),
        "text": [r["text"] for r in todo],
        "type": [r["type"] for r in todo],
    }))


class _TransformFeed:
    """Stages 4, 5 and 7a on Ray Data, started before their input exists.

    The embedding actors take seconds to start (a new worker process, Ray Data's and
    Helix's imports, two models), idle time on a small ingest if they start when their
    stage begins. So :meth:`start` runs as soon as the driver knows some rows are new:
    the actors start while the driver deduplicates (stage 3); :meth:`run` then hands the
    stage the rows to transform, :meth:`close` ends it unfed (dedup left nothing to
    embed) and :meth:`abort` after an error elsewhere. Started before read + validate
    instead, the actors' start-up took the two cores from the read task and saved nothing
    (docs/benchmarks.md).

    The stage reads its input from a :class:`_Mailbox`: one read task per ``BLOCK``
    rows there could be (the new rows, counted before dedup drops any), run one at a
    time, each waiting for the rows and returning its block, or nothing past the last.
    So every block is exactly a ``BLOCK``-row slice, the actors see the same
    ``BATCH``-row batches as the local runner, and both runners produce identical
    vectors (the int8 model quantizes activations per batch). The read tasks ask Ray for
    no CPU: the actors may hold every core.
    """

    def __init__(self, config: IngestConfig):
        import threading

        self.config = config
        self.thread: threading.Thread | None = None
        self.mailbox: Any = None  # a Ray actor handle of _Mailbox
        self.stop = threading.Event()
        self.batches: list[dict[str, np.ndarray]] = []
        self.error: BaseException | None = None

    def start(self, max_rows: int) -> None:
        import threading

        import ray

        config = self.config
        self.mailbox = ray.remote(num_cpus=0)(_Mailbox).remote()
        blocks = max(1, -(-max_rows // BLOCK))
        actors, memory = _embed_actors(config, blocks)
        ds = ray.data.read_datasource(_mailbox_source(self.mailbox, blocks), override_num_blocks=blocks,
                                      num_cpus=0, concurrency=1) \
            .map_batches(stages.Transform, fn_constructor_args=(config, config.embed_actor_threads),
                         batch_size=BATCH, num_cpus=config.embed_actor_cpus, memory=memory,
                         compute=ray.data.ActorPoolStrategy(size=actors))
        self.thread = threading.Thread(target=self._drain, args=(ds,), name="helix-transform", daemon=True)
        self.thread.start()

    def _drain(self, ds) -> None:
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                if self.stop.is_set():
                    break  # aborted: leaving the iterator shuts the execution down
                if len(batch.get("seq", ())):
                    self.batches.append(batch)
        except BaseException as exc:  # re-raised in the driver's thread by run()
            self.error = exc

    def run(self, table: pa.Table) -> list[dict[str, np.ndarray]]:
        import ray

        # The blocks go to the object store once; the mailbox holds their references.
        order = _longest_first(table.column("text").to_pylist(), BLOCK, self.config.embedder.batch_size)
        self._publish([ray.put(table.slice(i, BLOCK)) for i in order])
        if self.error is not None:
            raise self.error
        batches, self.batches = self.batches, []
        return batches

    def close(self) -> None:
        """End the stage unfed (nothing was left to embed)."""
        if self.thread is not None:
            self._publish([])
            if self.error is not None:
                log.warning("the unused transform stage failed: %s", self.error)

    def abort(self) -> None:
        """End the stage after an error elsewhere, without waiting for the actors to
        start: the mailbox goes, so every read task fails at once."""
        if self.thread is not None:
            import ray

            self.stop.set()
            ray.kill(self.mailbox, no_restart=True)
            self.thread.join(timeout=60)
            if self.thread.is_alive():
                log.warning("the transform stage did not stop within 60 s of an ingest error; it ends with Ray")
            self.thread = None

    def _publish(self, refs: list) -> None:
        assert self.thread is not None
        # In a list: Ray would resolve references passed as arguments themselves.
        self.mailbox.publish.remote([refs])
        self.thread.join()
        self.thread = None


class _Mailbox:
    """The rows of :class:`_TransformFeed`, as ``BLOCK``-row object references: read task
    ``k`` waits for them and takes the ``k``-th (a Ray actor, asking for no CPU)."""

    def __init__(self) -> None:
        import asyncio

        self.ready = asyncio.Event()
        self.refs: list = []

    async def publish(self, refs: list) -> None:
        self.refs = refs[0]
        self.ready.set()

    async def block(self, k: int) -> list:
        await self.ready.wait()
        return self.refs[k:k + 1]


def _longest_first(texts: list[str], block: int, model_batch: int) -> list[int]:
    """The offsets of ``block``-row slices of ``texts``, costliest first: the actors take
    blocks in this order, so the last ones out are the cheapest and the actors finish
    close together (longest-processing-time-first). Which rows make a block does not
    change, so neither do the vectors — provided a short last slice stays last: the
    actor stage bundles blocks until it has a batch's rows, so a short block sent early
    would be merged with the next one into other batches.

    The cost of a block is what the embedder pads it to: its texts sorted by length, in
    batches of ``model_batch``, each as long as its longest text (characters stand in
    for tokens)."""
    def cost(i: int) -> int:
        lengths = sorted(len(t) for t in texts[i:i + block])
        return sum(len(lengths[j:j + model_batch]) * lengths[min(j + model_batch, len(lengths)) - 1]
                   for j in range(0, len(lengths), model_batch))

    starts = list(range(0, len(texts), block))
    short = [starts.pop()] if len(texts) % block else []
    return sorted(starts, key=lambda i: (-cost(i), i)) + short


def _mailbox_source(mailbox, blocks: int):
    """A Ray Data datasource of ``blocks`` read tasks, task ``k`` returning the ``k``-th
    block of ``mailbox`` (ray.data imported here: ``helix --help`` and the local runner
    never need it)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def read(k: int):
        import ray

        for ref in ray.get(mailbox.block.remote(k)):
            yield ray.get(ref)

    class MailboxSource(Datasource):
        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(functools.partial(read, k), meta) for k in range(blocks)]

    return MailboxSource()


def _session_context(todo: list[dict[str, Any]], vectors: np.ndarray, old_rows: pa.Table,
                     previous: Generation | None, old_positions: np.ndarray | None, weight: float) -> np.ndarray:
    """``IngestConfig.session_context``: each new conversation turn's vector becomes
    ``unit(v + weight · v_prev)``, ``v_prev`` the stored vector of the latest earlier
    turn of its (user, session) — an old row or a new one, in (created_at, arrival) order.
    Old rows keep their vectors, so a conversation ingested turn by turn is mixed as one
    ingested at once (when its turns arrive in order)."""
    def key(row: dict[str, Any]) -> tuple[str, str] | None:
        if row.get("type") != "episodic" or not row.get("session_id"):
            return None
        return str(row["user"]), str(row["session_id"])

    last: dict[tuple[str, str], tuple[Any, np.ndarray]] = {}  # session → (time, vector) of its last turn
    wanted = {k for k in map(key, todo) if k is not None}  # only these sessions' old turns matter
    if previous is not None and old_positions is not None and wanted:
        latest_old: dict[tuple[str, str], tuple[Any, int]] = {}
        sessions = old_rows.column("session_id")
        candidates = np.flatnonzero(pc.is_in(sessions, value_set=pa.array(sorted({s for _, s in wanted}),
                                                                           sessions.type)).to_numpy(zero_copy_only=False))
        rows = old_rows.select(["type", "session_id", "user", "created_at"]).take(pa.array(candidates, pa.int64()))
        for i, row in zip(candidates.tolist(), rows.to_pylist()):
            k = key(row)
            if k is not None and (k not in latest_old or row["created_at"] >= latest_old[k][0]):
                latest_old[k] = (row["created_at"], i)
        last = {k: (t, np.asarray(previous.vectors[old_positions[i]], np.float32))
                for k, (t, i) in latest_old.items()}
    out = np.array(vectors, dtype=np.float32, copy=True)
    for i in sorted(range(len(todo)), key=lambda i: (todo[i]["created_at"], i)):
        k = key(todo[i])
        if k is None:
            continue
        seen = last.get(k)
        if seen is not None and seen[0] > todo[i]["created_at"]:
            continue  # arrived after a later turn of its session: left as it is
        if seen is not None:
            mixed = out[i] + weight * seen[1]
            out[i] = mixed / max(float(np.linalg.norm(mixed)), 1e-12)
        last[k] = (todo[i]["created_at"], out[i])
    return out


def _embed_actors(config: IngestConfig, n_blocks: int) -> tuple[int, int]:
    """How many embedding actors, and the memory each tells Ray it holds: no more actors
    than blocks, nor than the cluster's memory fits (one at least, asking for what is
    there: Ray would otherwise never place it)."""
    import ray

    room = int(ray.cluster_resources().get("memory", 0))
    fits = max(1, room // ACTOR_MEMORY)
    actors = max(1, min(config.embed_actors, n_blocks, fits))
    if actors < config.embed_actors and actors < n_blocks:
        log.warning("embed_actors=%d but this Ray's memory (%.1f GiB) fits %d embedding actor(s) of %.1f GiB; "
                    "running %d", config.embed_actors, room / 1024**3, fits, ACTOR_MEMORY / 1024**3, actors)
    return actors, min(ACTOR_MEMORY, room)


def _collect(batches: list[dict[str, np.ndarray]], n: int, config: IngestConfig) -> dict[str, Any]:
    from helix_ray.embedder import DIM

    if not batches:
        from helix_ray.token_encoder import empty_tokens

        late = empty_tokens() if config.late_interaction.enabled else None
        return {"vector": np.zeros((0, DIM), np.float32), "expansions": [], "entities": [],
                "n_tokens": np.zeros(0, np.int32), "late": late}
    seq = np.concatenate([np.asarray(b["seq"], np.int64) for b in batches])
    order = np.argsort(seq, kind="stable")
    if len(seq) != n or not np.array_equal(seq[order], np.arange(n)):
        raise RuntimeError(f"the transform stages returned {len(seq)} rows for {n} inputs")

    def cat(key: str, dtype=None) -> Any:
        return np.concatenate([np.asarray(b[key], dtype=dtype) for b in batches])[order]

    late = None
    if "late_codes" in batches[0]:
        from helix_ray.token_encoder import from_blobs

        late = from_blobs([bytes(x) for x in cat("late_codes", object)], [bytes(x) for x in cat("late_scales", object)])
    return {
        "vector": np.stack(list(cat("vector", np.float32))) if cat("vector", np.float32).ndim == 1
        else cat("vector", np.float32),
        "expansions": [str(x) for x in cat("expansions", object)],
        "entities": [str(x) for x in cat("entities", object)],
        "n_tokens": cat("n_tokens", np.int32),
        "late": late,
    }


def _memory_table(rows: list[dict[str, Any]], cols: dict[str, Any] | None) -> pa.Table:
    names = [f.name for f in GENERATION_SCHEMA]
    data = {name: [r.get(name) for r in rows] for name in names if name != "n_tokens"}
    if cols is None:
        from helix_ray.recall.pack import token_counter

        count = token_counter()
        data["n_tokens"] = [count(r["text"]) for r in rows]
    else:
        data["n_tokens"] = [int(x) for x in cols["n_tokens"]]
    return pa.table({n: data[n] for n in names}, schema=GENERATION_SCHEMA)


def _assemble(previous, old_rows, old_index, keep_old, todo, new_cols, sigs, keep_new, n_old, db,
              config: IngestConfig):
    """The next generation's rows, sorted so that each tenant is one range, with what
    they carry: the previous generation's rows keep their vectors, and their entities,
    BM25 terms and nearest neighbours where it holds them (:mod:`helix_ray.ingest.carry`)."""
    from helix_ray.embedder import DIM

    old_table = old_rows.take(pa.array(keep_old, pa.int64())) if keep_old else GENERATION_SCHEMA.empty_table()
    previous_rows = old_index[keep_old] if keep_old else np.zeros(0, np.int64)
    new_table = _memory_table(todo, new_cols)
    table = pa.concat_tables([old_table, new_table])
    old_vectors = np.asarray(previous.vectors[previous_rows]) if keep_old else np.zeros((0, DIM), np.float32)
    vectors = np.concatenate([old_vectors, new_cols["vector"]]).astype(np.float32)
    minhash = np.concatenate([sigs[keep_old], sigs[[n_old + i for i in keep_new]]]) if len(sigs) else sigs
    old_texts = old_table.column("text").to_pylist()
    analyzer = _analyzer(config)
    new_lexical = [lexical_text(r["text"], json.loads(x)) for r, x in zip(todo, new_cols["expansions"])]
    old_lexical = None
    if not carry.terms_carried(previous, analyzer):
        old_ids = old_table.column("id").to_pylist()
        old_exp = db.expansions_for(old_ids)
        old_lexical = [lexical_text(t, old_exp.get(i, [])) for i, t in zip(old_ids, old_texts)]
    terms = carry.terms(previous, previous_rows, old_lexical, new_lexical, analyzer)
    ents = pa.concat_arrays([carry.mentions(previous, previous_rows, old_texts),
                             pa.array([json.loads(x) for x in new_cols["entities"]], carry.MENTIONS_TYPE)])

    # Group by tenant, then time, then arrival: a tenant is a contiguous row range.
    users = table.column("user").to_pylist()
    created = table.column("created_at").cast(pa.int64()).to_numpy()
    take = np.lexsort((np.arange(len(users)), created, tenant_codes(users)[1])).astype(np.int64)
    order = take.tolist()
    table = table.take(pa.array(take))
    vectors, minhash, terms = vectors[take], minhash[take], terms.take(take)
    previous_row = np.concatenate([previous_rows, np.full(len(todo), -1, np.int64)])[take]
    late = _late_tokens(previous, previous_rows, old_table, new_cols, config)
    if late is not None and not np.array_equal(take, np.arange(len(take))):
        late = late.take(take)  # the unsorted block is freed here: nothing else holds it
    ents = ents.take(pa.array(take))
    users = [users[i] for i in order]
    parts = {p["user"]: (p["start"], p["end"]) for p in partitions_of(users)}

    knn, all_knn, dense_indexes, removed = _semantic_knn(vectors, parts, previous, previous_row, config)
    sessions = table.column("session_id").to_pylist()
    metadata_turns = _turns(table.column("metadata"))
    created_sorted = created[take]
    order_keys = list(zip(created_sorted.tolist(), metadata_turns.tolist()))  # creation time, then turn
    graph, entities = build_graph(
        users=users, sessions=sessions, order_keys=order_keys, entity_lists=ents, knn=knn,
        partitions=parts, config=config.graph,
    )
    node_names = table.column("id").to_pylist() + [
        f"{u}|{k}" for u, k in zip(entities.column("user").to_pylist(), entities.column("key").to_pylist())]
    data = GenerationData(
        memories=table, vectors=vectors, minhash=minhash, terms=terms, graph=graph,
        entities=entities, embedder=config.embedder.name, dim=DIM,
        extra={"doc2query": config.doc2query.backend, "_dense_indexes": dense_indexes,
               "carry": {"mentions": carry.MENTIONS_VERSION, "dense_removed": removed}},
        late=late, mentions=ents, knn=all_knn,
    )
    return data, node_names


def _turns(metadata: pa.ChunkedArray) -> np.ndarray:
    """Each row's ``metadata["turn"]`` (0 when absent or not a whole number ≥ 0, as rows
    validated before ``normalise_one`` checked it may hold: one such row failed every
    compaction): parsed only where the JSON text names a "turn" (at 10^5 rows, parsing
    every row took 0.25 s of a compaction)."""
    turns = np.zeros(len(metadata), np.int64)
    named = np.flatnonzero(pc.fill_null(pc.match_substring(metadata, '"turn"'), False).to_numpy(zero_copy_only=False))
    for i, text in zip(named.tolist(), metadata.take(pa.array(named, pa.int64())).to_pylist()):
        turn = json.loads(text).get("turn")
        if isinstance(turn, int) and not isinstance(turn, bool) and 0 <= turn <= np.iinfo(np.int64).max:
            turns[i] = turn
    return turns


def _analyzer(config: IngestConfig) -> Analyzer:
    return Analyzer(stemmer=config.lexical.stemmer or None, split_identifiers=config.lexical.split_identifiers)


def _semantic_knn(vectors: np.ndarray, parts: dict[str, tuple[int, int]], previous: Generation | None,
                  previous_row: np.ndarray, config: IngestConfig):
    """Each tenant's k nearest memories (the graph's semantic edges), from an HNSW index
    over its int8 vectors when it is large enough to get one (kept for the dense leg),
    else exactly. A memory carried over keeps its list unless a neighbour left; it meets
    only the new memories; an HNSW index is carried too (:func:`carry.dense_index`).
    Returns the per-tenant lists for the graph, all rows' lists (N, k + 1) to store (None
    when ``graph.knn`` is 0), the HNSW indexes, and the tombstones each carried index holds."""
    from helix_ray.embedder import DIM
    from helix_ray.store.generation import build_hnsw, quantize_int8

    width = config.graph.knn + 1 if config.graph.knn > 0 else 0  # 0: no semantic edges
    now = carry.moved_to(previous.size, previous_row) if previous is not None else None
    before = carry.previous_knn(previous, width, now) if width else None
    large = [u for u, (start, end) in parts.items() if end - start >= config.hnsw_min_rows]
    int8 = quantize_int8(vectors) if large else None
    knn, dense_indexes, removed = {}, {}, {}
    all_n = np.full((len(vectors), width), -1, np.int64)
    all_s = np.zeros((len(vectors), width), np.float32)
    for user, (start, end) in parts.items():
        k = min(width, end - start)
        search = similarity = None
        if user in large:
            assert int8 is not None
            carried = carry.dense_index(previous, user, start, end, int8, previous_row, now,
                                        connectivity=config.hnsw_connectivity,
                                        expansion_add=config.hnsw_expansion_add, threads=config.hnsw_threads)
            if carried is not None:
                index, removed[user] = carried
            else:
                index = build_hnsw(int8[start:end], start, DIM, connectivity=config.hnsw_connectivity,
                                   expansion_add=config.hnsw_expansion_add, threads=config.hnsw_threads)
            dense_indexes[user] = index

            def search(rows: np.ndarray, index=index, k=k) -> tuple[np.ndarray, np.ndarray]:
                matches = index.search(int8[rows], k, threads=0)
                return matches.keys.astype(np.int64), 1.0 - matches.distances.astype(np.float32)

            def similarity(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:  # as usearch's i8 cosine
                a, b = int8[rows].astype(np.float32), int8[candidates].astype(np.float32)
                a /= np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
                b /= np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
                return a @ b.T

        if not width:
            continue
        all_n[start:end], all_s[start:end] = carry.tenant_knn(
            vectors, start, end, k, width, previous=before, previous_row=previous_row, search=search,
            similarity=similarity)
        if k > 1:
            knn[user] = (all_n[start:end, :k], all_s[start:end, :k])
    return knn, (all_n, all_s) if width else None, dense_indexes, removed


def _late_tokens(previous, old_rows: np.ndarray, old_table: pa.Table, new_cols: dict[str, Any],
                 config: IngestConfig):
    """Token vectors of old rows then new rows (the unsorted concatenation), or None when
    late interaction is off. Old rows keep the previous generation's tokens; a previous
    generation built without them has its rows encoded now (once: the next run reuses)."""
    from helix_ray.token_encoder import PassageTokens, from_blobs, get_token_encoder, to_blobs

    if not config.late_interaction.enabled or new_cols.get("late") is None:
        return None
    old = None
    if len(old_rows) and previous is not None and previous.late is not None:
        old = previous.late.take(old_rows)
    elif len(old_rows):
        encoder = get_token_encoder(config.late_interaction.max_tokens)
        old = from_blobs(*to_blobs(encoder.encode_passages(old_table.column("text").to_pylist())))
    new = new_cols.pop("late")  # from here on only the assembled block holds the new tokens
    return PassageTokens.concat([p for p in (old, new) if p is not None])
