"""The ingest pipeline: sources → a published store generation.

Stage order (each stage a function of :mod:`helix_ray.ingest`; :func:`_stages` runs them):

1. read sources                      ┐ Ray Data, one task per source
2. validate and normalise            ┘ (bad rows → quarantine, with reason and position)
   ── barrier: MinHash-LSH dedup needs every signature of the tenant ──
3. exact and near-duplicate removal  (driver; against the previous generation too:
                                      what a run takes from it is in :mod:`.previous`)
4. doc2query expansion               ┐ Ray Data, streaming, only for memories that are
5. embed (actor pool, batched):      │ new or changed: old ones keep their vectors
   sentence vector + token vectors   │ (:mod:`.stages`)
7a. entities, token counts, BM25 terms ┘
   (a conversation turn takes in its session's previous turn: its words as an
    expansion line, then its vector: :mod:`.sessions`)
   ── barrier: indexes and graph need every row ──
7b. graph edges (mentions, sessions, temporal, semantic kNN)        ┐ :mod:`.assemble`
    HNSW indexes built and searched for the kNN, then the graph     │ units of work (:mod:`.dense`, :mod:`.graph`)
7c. carried over, not recomputed: the previous generation's rows    │
    keep their entities, BM25 terms, kNN lists and HNSW entries     ┘ (:mod:`.carry`)
6. quantize (int8 and binary) and    ┐ atomic; the previous generation keeps serving
8. write and publish the generation  ┘ on failure; codes made from the final vectors
                                       (:mod:`helix_ray.store.generation`)

``runner="ray"`` runs stages 1–2 and 4–7a on Ray Data (a local Ray it starts, or the
cluster named by ``RAY_ADDRESS``) and 7b's units of work (HNSW, the graph) as Ray tasks, wired in
:mod:`pipelines.ingest` and imported only then (:func:`_ray_job`); ``runner="local"``
runs the same functions in this process, for tests and small online batches.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Container, Iterable, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa

from helix_ray.config import IngestConfig
from helix_ray.errors import InvalidArgument, StoreError, is_disk_full
from helix_ray.heap import trim_heap
from helix_ray.index.bm25 import expansions_of
from helix_ray.ingest import stages
from helix_ray.ingest.assemble import NextRows, assemble, collect, memory_table
from helix_ray.ingest.sessions import context_lines, previous_turns, session_context
from helix_ray.ingest.dedup import find_duplicates, signatures
from helix_ray.ingest.dense import LocalTasks, Tasks, work_folder
from helix_ray.ingest.graph import tenant_codes
from helix_ray.ingest.ids import MARKDOWN_PREFIX, legacy_markdown_ids, user_part
from helix_ray.ingest.incoming import Incoming
from helix_ray.ingest.names import SourceName, check_names, one_folder_per_name, source_names
from helix_ray.ingest.previous import (OldThenNew, carried_over, fold_accesses, has_deletions, held_by,
                                       keep_folded_accesses, open_previous, retagged)
from helix_ray.ingest.progress import NoProgress, Progress, shown
from helix_ray.ingest.repo_ids import RepoScope
from helix_ray.ingest.sources import FORMATS, source_items
from helix_ray.schema import parent_of
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import ACCESS_WATERMARK, Generation, current_generation_number
from helix_ray.store.mirror import Mirror, open_mirror, push
from helix_ray.store.publish import GenerationData, file_array, prune, publish, set_current
from helix_ray.store.space import disk_full
from helix_ray.tables import take_rows

log = logging.getLogger(__name__)

BATCH = 256  # rows per transform call, on either runner (the embedder sorts within it by length)


@dataclasses.dataclass
class IngestReport:
    """What one ingest run did. ``embedded`` counts passages sent to the embedder;
    ``reused`` those whose vectors came with the run instead (a compaction's writes)."""

    run_id: str = ""
    read: int = 0  # records, each chunk of a long text counted
    chunks: int = 0  # of ``read``: chunks of long texts
    chunked: int = 0  # the long texts those chunks split
    accepted: int = 0
    quarantined: int = 0
    duplicates: int = 0
    unchanged: int = 0
    kept_deleted: int = 0  # a user deleted them; the source gives them again unchanged
    new: int = 0
    updated: int = 0
    retagged: int = 0  # of ``updated``: same text, other fields changed (no re-embedding)
    removed: int = 0  # code or sections a tree or Markdown folder read again no longer holds (deleted)
    renamed: int = 0  # memories stored under ids of an older form (not naming their user, or document set), renamed
    embedded: int = 0
    reused: int = 0
    total_memories: int = 0
    generation: int | None = None
    published: bool = False
    pruned: list[int] = dataclasses.field(default_factory=list)  # generation folders deleted after publishing
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    quarantine_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    mirrored: dict[str, Any] | None = None  # what was pushed to the mirror, when one was given
    work_units: dict[str, int] = dataclasses.field(default_factory=dict)  # per node id: index builds, searches, the graph

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TransformFeed(Protocol):
    """Stages 4, 5 and 7a on Ray Data, started before their input exists
    (``pipelines.ingest._TransformFeed``)."""

    def start(self, max_rows: int) -> None: ...

    def run(self, table: pa.Table) -> Iterator[dict[str, np.ndarray]]: ...


@dataclasses.dataclass
class Run:
    """What the steps of one ingest run share."""

    store: Path
    db: StoreDB  # the store's writer
    config: IngestConfig
    report: IngestReport
    runner: str = "local"
    crash_after: str | None = None  # a generation file after which publishing raises (tests)
    computed: dict[str, stages.Computed] = dataclasses.field(default_factory=dict)  # see :func:`ingest`
    feed: TransformFeed | None = None  # runner="ray": started while stage 3 runs
    tasks: Tasks = dataclasses.field(default_factory=LocalTasks)  # the units of work (:mod:`.dense`, the graph)
    progress: Progress = dataclasses.field(default_factory=NoProgress)
    empty_ok: bool = False  # publish a generation even when no record was read (:func:`initialise`)
    scopes: tuple[RepoScope, ...] = ()  # the trees and histories read (:func:`sources.source_items`)
    quarantined: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # this run's, as stored
    named: tuple[SourceName, ...] = ()  # names of folders to record with the run's records (:mod:`.names`)
    absorbed: set[str] = dataclasses.field(default_factory=set)  # ids taken from the previous generation's segments
    documents: tuple[tuple[str, str, str], ...] = ()  # Markdown read whole: (docs, "" or "<file>#", folder)


@dataclasses.dataclass
class Accepted:
    """Stages 1–2's outcome besides the records to store (an :class:`Incoming`)."""

    quarantined: list[dict[str, Any]]  # as rows of the store's quarantine
    validated: int  # records that passed validation, before id conflicts were held back


@dataclasses.dataclass
class Changes:
    """Stage 3, first part: how the accepted records differ from what the store holds."""

    previous: Generation | None
    fresh: np.ndarray  # rows of the run's :class:`Incoming` (int64): new memories and new versions of stored ones
    replaced: set[str]  # ids of the stored memories that ``fresh`` holds new versions of
    retagged: dict[str, dict[str, Any]]  # same text, other fields: id → new field values
    old_rows: pa.Table  # the previous generation's rows that stay (:func:`previous.carried_over`)
    old_index: np.ndarray  # their row numbers there
    folded: int  # the access log position the new generation has folded up to
    superseded: list[str] = dataclasses.field(default_factory=list)  # chunks (or a whole) a new version drops


@dataclasses.dataclass
class Deduplicated:
    """Stage 3, second part: what near-duplicate removal keeps, among the old rows
    (``Changes.old_rows``) then the fresh ones (``Changes.fresh``)."""

    sigs: np.ndarray  # MinHash signatures of every old row, then of every fresh one
    links: list[tuple[str, str, float]]  # (dropped id, kept id, Jaccard similarity)
    keep_old: np.ndarray  # the old rows kept, ascending (int64)
    keep_new: np.ndarray  # the fresh rows kept, by their place in ``Changes.fresh``, ascending (int64)
    dropped: pa.Table  # fresh records dropped, as the store's database keeps them (:func:`memory_table`)
    dropped_old_ids: list[str]  # stored memories dropped (a new record is preferred)


@contextmanager
def timed(report: IngestReport, name: str) -> Iterator[None]:
    """Adds the block's wall time to ``report.seconds[name]`` (when it does not raise)."""
    start = time.perf_counter()
    yield
    report.seconds[name] = round(report.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


@contextmanager
def stage(run: Run, name: str) -> Iterator[None]:
    """Stage ``name`` of ``run``: shown by its progress, timed in its report (:func:`timed`)."""
    run.progress.stage(name)
    with timed(run.report, name):
        yield


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
    since: str | None = None,
    max_commits: int | None = None,
    repo_name: str | None = None,
    doc_name: str | None = None,
    mirror: str | None = None,
) -> IngestReport:
    """Ingest ``sources`` into ``store`` and publish a new generation if anything changed.

    ``db`` is the store's open writer when the caller already holds one (a
    :class:`helix_ray.Memory`); otherwise this run opens the store's DuckDB file itself.
    ``computed`` (by memory id) holds stage 4–5 outputs made earlier under this
    ``config`` (the server's, for its online writes): a new memory whose text is the
    same is not expanded, embedded nor token-encoded again. ``show_progress`` shows the
    run on stderr: a bar on a terminal, else a line per stage (:mod:`.progress`).
    ``since`` and ``max_commits``: which commits a ``git`` source gives (the newest
    ``max_commits`` made on or after ``since``). ``repo_name`` names the repository of a
    ``code`` or ``git`` source in its memories' ids (``code:<user>/<repo>:...``; default:
    its folder's name); their user is ``config.validation.default_user``. ``doc_name``
    names the document set of a ``markdown`` source in its sections' ids
    (``md:<user>/<docs>/<path>#<slug>``; default: the folder's name, for a file its
    folder's). A name taken by default that the store records for another folder of the
    same user is refused before anything is written; a name given moves to the folder
    read (:mod:`.names`).

    ``mirror`` (a URI, :func:`helix_ray.store.mirror.open_mirror`): after the run, the
    store's current generation, delta and small files are pushed there, also when the
    run published nothing new (so a run repeated after a failed push completes it).
    """
    config = config or IngestConfig()
    store = Path(store)
    target = open_mirror(mirror) if mirror is not None else None  # a bad URI is refused before any work
    if runner not in ("ray", "local"):
        raise InvalidArgument("runner", runner, "allowed runners are 'ray' and 'local'")
    if fmt not in FORMATS:
        raise InvalidArgument("format", fmt, f"allowed formats are {', '.join(FORMATS)}")
    items: list[dict[str, Any]] = []
    scopes: list[RepoScope] = []
    for source in sources:  # each must exist: source_items says so
        tasks, scope = source_items(source, fmt, user=config.validation.default_user, repo_name=repo_name,
                                    since=since, max_commits=max_commits, doc_name=doc_name)
        items += tasks
        scopes += [scope] if scope else []
    if not items:
        raise InvalidArgument("sources", [], "give at least one file or folder to ingest")
    names = source_names(items, scopes, user=config.validation.default_user, doc_name_given=doc_name is not None,
                         repo_name_given=repo_name is not None)
    one_folder_per_name(names)

    report = IngestReport()
    try:
        with _writer(store, db) as db:
            named = tuple(check_names(db, names))  # before the run's first record
            with _recorded_run(db, report, [i["path"] for i in items]), shown(report, show_progress) as progress:
                run = Run(store, db, config, report, runner=runner, crash_after=crash_after,
                          computed=computed or {}, progress=progress, scopes=tuple(scopes), named=named,
                          documents=_documents(items))
                if runner == "local":
                    _stages(run, items)
                else:
                    _ray_job().run_stages(run, items, _stages)
            if target is not None:
                _push(store, target, report)
    except Exception as exc:
        if is_disk_full(exc):  # CURRENT moves last: the previous generation is still the current one
            raise disk_full(store, "ingesting") from exc
        raise
    return report


def _push(store: Path, mirror: Mirror, report: IngestReport) -> None:
    """The store's current state to ``mirror``, recorded in ``report.mirrored`` (a
    store with no generation yet has nothing to push)."""
    if current_generation_number(store) is None:
        return
    try:
        pushed = push(store, mirror)
    except (OSError, StoreError) as exc:
        raise StoreError(f"Generation {report.generation} is current in {store}, but pushing it to the mirror "
                         f"{mirror.uri} failed ({type(exc).__name__}: {exc}); the mirror still serves what it "
                         "served. Run the same `helix ingest ... --mirror` again: it publishes nothing new and "
                         "pushes.") from exc
    report.mirrored = {"uri": mirror.uri, "generation": pushed.generation, "uploaded": pushed.uploaded,
                       "copied": pushed.copied, "delta_version": pushed.delta_version}


def _ray_job() -> ModuleType:
    """The Ray Data job wiring (:mod:`pipelines.ingest`), for ``runner="ray"`` only.

    The one place the library reaches the top-level ``pipelines`` package, and only when
    a run asks for Ray: a local ingest (a :class:`helix_ray.Memory`, the server's
    writer, the tests) imports neither it nor Ray Data."""
    import pipelines.ingest

    return pipelines.ingest


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
                _stages(Run(store, db, config, report, empty_ok=True), [])
    number = current_generation_number(store)
    assert number is not None  # published above, or by another writer's roll-forward
    return number


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


# ----------------------------------------------------------------------------- the steps


def _stages(run: Run, items: list[dict[str, str]]) -> None:
    """Stages 1–8 of one run (the picture at the top of this module): a new generation
    published and recorded, or, when nothing changed, only the quarantine and the names
    of the folders read (``run.named``) recorded."""
    # The run's files, until the record has read what it keeps: the records read, the
    # new rows and their vectors as they come, the sorted rows, terms and signatures,
    # the HNSW indexes (:func:`assemble`).
    with work_folder(run.store) as work:
        _steps(run, items, work)


def _steps(run: Run, items: list[dict[str, str]], work: Path) -> None:
    """:func:`_stages`, their files in ``work``."""
    report, config = run.report, run.config
    with stage(run, "read_validate"):
        incoming, accepted = _accept(run, _read_validate(run, items), work / "records.arrow")
    trim_heap()  # each step gives back what it let go: the next one's arrays need not fit in its leftovers
    run.quarantined = accepted.quarantined
    _absorb_segments(run, incoming)

    with stage(run, "dedup"):
        changes = _changes(run, incoming)
        if _nothing_to_publish(run, accepted, changes):
            report.total_memories = len(changes.old_index)
            report.generation = current_generation_number(run.store)
            run.db.add_quarantine(accepted.quarantined, report.run_id)
            _record_names(run)
            return
        kept = _deduplicate(run, changes, incoming, work)
    trim_heap()

    # The new rows that stay; a row's place among them is its ``seq`` (:func:`collect`).
    todo = incoming.pending(changes.fresh[kept.keep_new], work / "new-rows.arrow")
    changes.fresh = np.zeros(0, np.int64)  # not a slice: a view would keep the whole array
    del incoming
    trim_heap()
    new_ids = todo.column("id").combine_chunks()
    reuse = {k: run.computed[i] for k, i in enumerate(new_ids.to_pylist()) if i in run.computed} \
        if run.computed else {}
    report.reused = len(reuse)
    report.embedded = todo.num_rows - len(reuse)
    new_cols = _expand_embed_annotate(run, todo, reuse, changes, kept, work)
    trim_heap()

    # Old rows keep their vectors; sorted so each tenant is one range.
    with stage(run, "assemble"):
        rows = NextRows(changes.previous, changes.old_rows, changes.old_index, kept.keep_old, todo, new_cols,
                        kept.sigs, kept.keep_new)
        del todo
        # assemble takes the signatures into their sorted copy (a view of them here would keep them all)
        kept.sigs = kept.sigs[:0].copy()
        data = assemble(rows, run.db, config, work=work, tasks=run.tasks)
        report.work_units = dict(run.tasks.units)
    trim_heap()
    data.extra[ACCESS_WATERMARK] = changes.folded
    report.total_memories = data.memories.num_rows

    with stage(run, "publish"):
        number = _publish(run, data)
    memories, entities = data.memories, data.entities
    del data  # the vectors, signatures, terms, graph and kNN lists are written: the record needs none
    trim_heap()
    with stage(run, "record"):
        _record(run, number, memories, entities, new_ids, rows.new_cols, changes, kept, accepted.quarantined)
    _make_current(run, number)


def _read_validate(run: Run, items: list[dict[str, str]]) -> Iterator[dict[str, Any]]:
    """Stages 1–2: every record of ``items``, ``{"ok", "payload", "minhash"}`` (see
    :func:`read_validate_sign`), as they come."""
    if run.runner == "ray":
        return _ray_job().read_validate(items, run.config)
    return (r for item in items for r in read_validate_sign(item, config=run.config))


def read_validate_sign(item: dict[str, Any], *, config: IngestConfig) -> list[dict[str, Any]]:
    """Stages 1–2 for one source: its records read and validated
    (:func:`stages.read_and_validate`), each valid one with its MinHash signature for
    stage 3 as ``minhash``, the uint32 values' bytes (``b""`` for a quarantine row): as
    JSON numbers a signature is 1.4 KB of text to parse and 5 KB of Python ints."""
    out = stages.read_and_validate(item, config=config)
    ok = [i for i, r in enumerate(out) if r["ok"]]
    sigs = signatures([json.loads(out[i]["payload"])["text"] for i in ok], num_perm=config.dedup.num_perm,
                      shingle=config.dedup.shingle)
    for r in out:
        r["minhash"] = b""
    for i, sig in zip(ok, sigs):
        out[i]["minhash"] = np.asarray(sig, np.uint32).tobytes()
    return out


def _accept(run: Run, out: Iterable[dict[str, Any]], path: Path) -> tuple[Incoming, Accepted]:
    """The valid records, as columns (written to ``path`` and mapped), with the id of
    each that can be stored as given in ``Incoming.index``; the report's read counts.
    Decodes ``out`` as it comes, a block of records at a time (:class:`Incoming`)."""
    read = chunks = 0
    chunked: set[str] = set()  # the long texts read, by parent id
    quarantined: list[dict[str, Any]] = []

    def valid() -> Iterator[tuple[dict[str, Any], bytes]]:
        nonlocal read, chunks
        for r in out:
            read += 1
            if r["ok"]:
                row = stages.decode_row(r["payload"])
                parent = parent_of(row["id"])
                if parent is not None:
                    chunks += 1
                    chunked.add(parent)
                yield row, r["minhash"]
            else:
                quarantined.append(json.loads(r["payload"]))

    incoming = Incoming.gather(valid(), run.config.dedup.num_perm, path)
    # An id given twice in the input: the later record wins, the earlier is quarantined
    # whole. An id that is another user's memory: quarantined (ingest never moves a
    # memory between tenants; the server's writes refuse it the same way).
    # The same id for two users in one ingest: the first keeps it, as the store's
    # memories keep theirs.
    latest, users = incoming.index, incoming.shared("user")
    for at, memory_id in enumerate(incoming.values("id")):
        earlier = latest.get(memory_id)
        if earlier is not None and users[earlier] != users[at]:
            quarantined.append(_held_back(incoming.rows([at])[0], "id_conflict",
                                          f"id {memory_id!r} is given earlier in this ingest to a memory of user "
                                          f"{users[earlier]!r}, not {users[at]!r}; give this record another id (or "
                                          "none: one is derived)"))
            continue
        if earlier is not None:
            quarantined.append(_held_back(incoming.rows([earlier])[0], "duplicate_id", "the same id is given again "
                                          "later in this ingest; the later record is kept"))
        latest[memory_id] = at
    # the ids kept and their users, as columns (a Python tuple each would be ~70 MB at 10^6)
    ids_users = take_rows(incoming.table.select(["id", "user"]), np.fromiter(latest.values(), np.int64, len(latest)))
    for memory_id, owner in run.db.foreign_ids(ids_users).items():
        at = latest.pop(memory_id)
        quarantined.append(_held_back(incoming.rows([at])[0], "id_conflict", f"id {memory_id!r} is a memory of user "
                                      f"{owner!r}, not {users[at]!r}; give this record another id (or none: one is "
                                      "derived)"))
    del ids_users
    report = run.report
    report.read = read
    report.chunks, report.chunked = chunks, len(chunked)
    report.quarantined = len(quarantined)
    report.accepted = len(latest)
    for q in quarantined:
        reason = q["reason"].split(":", 1)[0]
        report.quarantine_reasons[reason] = report.quarantine_reasons.get(reason, 0) + 1
    return incoming, Accepted(quarantined, len(incoming))


def _absorb_segments(run: Run, incoming: Incoming) -> None:
    """The rows a previous generation of format 2 holds in segments (folded writes:
    :mod:`helix_ray.live.fold`) join this run's records, so that the generation it
    publishes holds them in its own files: each as its write logged it, with the outputs
    the write computed, never compared by text (the base may hold an older version). A
    record this run read with the same id wins; an id deleted since is left out."""
    previous = open_previous(run.store, run.config)
    rows = previous.segment_rows() if previous is not None else None
    if previous is None or rows is None or not rows.num_rows:
        return
    deleted = run.db.deleted_ids()
    fingerprint = stages.fingerprint(run.config)
    num_perm = run.config.dedup.num_perm
    latest = incoming.index
    absorbed: list[dict[str, Any]] = []
    sigs: list[Any] = []
    for r in rows.to_pylist():
        if r["id"] in deleted:
            continue
        run.absorbed.add(r["id"])  # a record read for it too is new all the same: the base's text is older
        if r["id"] in latest:
            continue
        if r.get("record") is None:
            raise StoreError(f"Generation {previous.number} of {run.store} holds a segment row without its record "
                             f"(id {r['id']!r}): the segment is damaged. Restore the store from a backup.")
        row = stages.decode_row(r["record"])
        latest[r["id"]] = len(incoming) + len(absorbed)
        absorbed.append(row)
        sigs.append(r["minhash"] if len(r["minhash"]) == num_perm else signatures(
            [row["text"]], num_perm=num_perm, shingle=run.config.dedup.shingle)[0])
        queries = expansions_of(r["text"], r["lexical"])
        if r.get("computed_by") == fingerprint and queries is not None and r["id"] not in run.computed:
            run.computed[r["id"]] = stages.Computed(r["text"], json.dumps(queries),
                                                    np.asarray(r["vector"], np.float32), r.get("late_codes"),
                                                    r.get("late_scales"))
    if absorbed:
        incoming.append(absorbed, sigs)
    run.report.accepted = len(latest)


def _held_back(row: dict[str, Any], code: str, sentence: str) -> dict[str, Any]:
    """A validated record that cannot be stored as given, as a quarantine row (the whole
    record kept, so nothing is lost)."""
    record = {k: v for k, v in row.items() if k not in ("minhash", "content_hash")}
    return {"source": row.get("source"), "position": f"id {row['id']}", "reason": f"{code}: {sentence}",
            "raw": json.dumps(record, default=str, ensure_ascii=False, sort_keys=True)}


def _changes(run: Run, incoming: Incoming) -> Changes:
    """What is new, changed or re-tagged against the store, and the previous generation's
    rows that stay. Starts the Ray transform stage as soon as some records need it."""
    report, config = run.report, run.config
    known = run.db.known_hashes()
    previous = open_previous(run.store, config)
    fresh, replaced, same_text = _compare(run, incoming, known, previous)
    superseded = superseded_parts(incoming, known, run.db.owners)
    moved = renamed(run, incoming, known)
    gone = sorted((set(vanished(run, incoming.index, known)) | set(sections_gone(run, incoming.index, known)))
                  - set(moved))
    report.removed, report.renamed = len(gone), len(moved)
    superseded = sorted(set(superseded) | set(gone) | set(moved))
    replaced |= set(superseded)  # not carried over: the memory's new version does not hold them
    ids = incoming.row_ids()
    if run.computed:
        text = incoming.reader("text", fresh)
        run.computed = {ids[at]: got for k, at in enumerate(fresh.tolist())
                        if (got := run.computed.get(ids[at])) is not None and _reusable(got, text(k), config)}
    if run.feed is not None and len(fresh) > len(run.computed):
        run.feed.start(len(fresh) - len(run.computed))  # the embedding actors start while dedup runs
    # Same text, other fields changed (a PATCH of type or salience, a re-tagged
    # record): the carried-over row takes the new fields and keeps its embedding.
    retags = retagged(previous, take_rows(incoming.table, same_text))
    report.unchanged += len(same_text) - len(retags)
    report.updated += len(retags)
    report.retagged = len(retags)

    old_rows, old_index, folded, accesses = carried_over(previous, run.db, replaced, retags)
    # New versions keep their memory's hits: only the rows these touch become dicts.
    touched = [at for at in fresh.tolist() if ids[at] in replaced or ids[at] in accesses] \
        if replaced or accesses else []
    if touched:
        rows = incoming.rows(touched)
        keep_folded_accesses(rows, previous, replaced)
        fold_accesses(rows, accesses)
        incoming.fix(touched, rows, ("access_count", "last_accessed_at"))
    return Changes(previous, fresh, replaced, retags, old_rows, old_index, folded, superseded)


def superseded_parts(incoming: Incoming, known: dict[str, tuple[str, bool]],
                     owners: Callable[[list[str]], dict[str, str]]) -> list[str]:
    """Stored memories that a memory written again whole leaves behind: the chunks of a
    text now shorter (or chunked otherwise), or its whole earlier version when it is now
    stored as chunks (``<id>#chunk<n>``: :func:`helix_ray.schema.parent_of`). Only for a
    memory whose new version is here complete (its whole row, or every chunk), and only
    the writer's own: a chunk written back alone (a compaction of a PATCH of one chunk)
    supersedes nothing. ``owners``: id → user of the live ones among some ids."""
    counts: dict[str, int] = {}
    complete: dict[str, str] = {}  # parent → user
    latest, users = incoming.index, incoming.shared("user")
    metadata: list[str] | None = None  # read once a chunk is met
    for i, at in latest.items():
        parent = parent_of(i)
        if parent is None:
            complete[i] = users[at]
            continue
        counts[parent] = counts.get(parent, 0) + 1
        metadata = metadata if metadata is not None else incoming.values("metadata")
        of = (json.loads(metadata[at]).get("chunk") or {}).get("of")
        if counts[parent] == of:
            complete[parent] = users[at]
    stale = [i for i, (_, deleted) in known.items()
             if not deleted and i not in latest and (parent_of(i) or i) in complete]
    mine = owners(stale)
    return sorted(i for i in stale if mine.get(i) == complete[parent_of(i) or i])


def vanished(run: Run, latest: Container[str], known: dict[str, tuple[str, bool]]) -> list[str]:
    """Stored code memories that a source tree read whole (``run.scopes``) no longer
    holds: the symbol was renamed or deleted, or its file removed. They are deleted, not
    left to be recalled as if the code still said so. Only the ingesting user's (under
    an id of today or of a store made before ids named their user:
    :class:`~helix_ray.ingest.repo_ids.RepoScope`), and not those of a file present but
    not read this time (skipped, or quarantined whole)."""
    trees = [scope for scope in run.scopes if scope.whole is not None]
    if not trees:
        return []
    unreadable = tuple(str(q.get("position") or "").removesuffix(", whole file") for q in run.quarantined
                       if str(q.get("position") or "").endswith(", whole file"))
    live = [i for i, (_, deleted) in known.items() if not deleted and i not in latest]
    stale: dict[str, str] = {}  # id → the user whose tree it is in
    for scope in trees:
        covered, kept = scope.covered(), scope.kept(unreadable)
        stale.update((i, scope.user) for i in live if i.startswith(covered) and not i.startswith(kept))
    owners = run.db.owners(list(stale))
    return sorted(i for i, user in stale.items() if owners.get(i) == user)


def _documents(items: Sequence[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """The Markdown a run reads whole (:attr:`Run.documents`): per task, its document
    set's name as ids write it, ``""`` for a folder or ``"<file>#"`` for one file, and
    the folder its files' paths are read from."""
    out = []
    for item in items:
        if item["format"] == "markdown":
            path = Path(item["path"])
            out.append((user_part(json.loads(item["options"])["name"]), "" if path.is_dir() else f"{path.name}#",
                        str(path if path.is_dir() else path.parent)))
    return tuple(out)


def sections_gone(run: Run, latest: dict[str, int], known: dict[str, tuple[str, bool]]) -> list[str]:
    """Stored Markdown sections that the folders and files this run read whole
    (``run.documents``) no longer hold: the heading was removed or renamed, or its file
    deleted. They are deleted, as a source tree's removed code is (:func:`vanished`).
    For ``--user``, all of that user's sections of what was read; for a user only front
    matter names, those of the files the run gave them. Never those of a file with a
    record quarantined this time (bad UTF-8 or front matter, a section refused: the
    file is present, only not read whole), nor a stored section whose recorded file is
    not the one its id reads as (an id of an older form, read from another folder)."""
    if not run.documents:
        return []
    given = run.config.validation.default_user
    covered: set[str] = set()
    for docs, part, _ in run.documents:
        if given:
            covered.add(f"{MARKDOWN_PREFIX}{user_part(given)}/{docs}/{part}")
    for i in latest:  # md:<user>/<docs>/<file>#...: the files each user was given
        if i.startswith(MARKDOWN_PREFIX):
            user, _, rest = i[len(MARKDOWN_PREFIX):].partition("/")
            docs, _, section = rest.partition("/")
            if any(docs == d for d, _, _ in run.documents):
                covered.add(f"{MARKDOWN_PREFIX}{user}/{docs}/{section.partition('#')[0]}#")
    unreadable = set()
    for q in run.quarantined:
        source = Path(str(q.get("source") or ""))
        for _, _, folder in run.documents:
            if source.is_relative_to(folder):
                unreadable.add(source.relative_to(folder).as_posix())
    stale = [i for i, (_, deleted) in known.items() if not deleted and i.startswith(tuple(covered))
             and i not in latest] if covered else []
    found = []
    for i, (user, file) in run.db.files(stale).items():
        if isinstance(file, str) and file not in unreadable and any(
                i.startswith(f"{MARKDOWN_PREFIX}{user_part(user)}/{docs}/{file}#") for docs, _, _ in run.documents):
            found.append(i)
    return sorted(found)


def renamed(run: Run, incoming: Incoming, known: dict[str, tuple[str, bool]]) -> list[str]:
    """Stored memories of a store made before derived ids named their user
    (``code:<folder>:<path>::<symbol>``, ``git:<folder>:<sha12>``, ``md:<path>#<slug>``),
    or Markdown ids their document set (``md:<user>/<path>#<slug>``), that this run
    gives again under their ids of today: deleted, so that a memory is not
    recalled twice. Only those of the user who gives them again (another user's stay
    theirs until they read the source again). A chunk counts by its memory: the new
    version may be cut otherwise."""
    given = {parent_of(i) or i for i in incoming.index}
    found: dict[str, str] = {}  # old id → its user
    for scope in run.scopes:
        for i, (_, deleted) in known.items():
            if not deleted and i.startswith(scope.legacy):
                now = scope.current(i)
                if (parent_of(now) or now) in given:
                    found[i] = scope.user
    owners = run.db.owners(list(found))
    return sorted([i for i, user in found.items() if owners.get(i) == user] + _renamed_sections(incoming, known, run.db))


def _renamed_sections(incoming: Incoming, known: dict[str, tuple[str, bool]], db: StoreDB) -> list[str]:
    """The stored Markdown sections of :func:`renamed`: ``md:<user>/<path>#<slug>`` and
    ``md:<path>#<slug>`` of the user whose ``md:<user>/<docs>/<path>#<slug>`` this run
    gives, read from the same file (its path in the folder read). The file tells an id of
    an older form from one of today's that reads alike (``md:dev/notes/x.md#s`` is dev's
    x.md of notes today, and before, dev's notes/x.md or anyone's dev/notes/x.md)."""
    sections: dict[str, tuple[str, str]] = {}  # old id → (user, file) of the section given again
    latest, users, metadata = incoming.index, incoming.shared("user"), incoming.values("metadata")
    for i, at in latest.items():
        file = json.loads(metadata[at]).get("file")
        if not isinstance(file, str):
            continue
        for old in legacy_markdown_ids(parent_of(i) or i, users[at], file):
            sections[old] = (users[at], file)
    if not sections:
        return []
    found = {i: sections[parent_of(i) or i] for i, (_, deleted) in known.items()
             if not deleted and i not in latest and (parent_of(i) or i) in sections}
    stored = db.files(list(found))
    return [i for i, section in found.items() if stored.get(i) == section]


def _compare(run: Run, incoming: Incoming, known: dict[str, tuple[str, bool]],
             previous: Generation | None) -> tuple[np.ndarray, set[str], list[int]]:
    """The accepted records that are new or have a new text (their rows in ``incoming``,
    int64, and the ids these replace), and those whose text the store holds (``known``: id →
    (content hash, deleted))."""
    latest = incoming.index
    dropped_before = run.db.dropped_as_duplicates([i for i in latest if i in known])
    fresh: list[int] = []
    replaced: set[str] = set()
    same_text: list[int] = []
    held = held_by(previous, [i for i in latest if i in known or i in run.absorbed])
    # The content hashes of the records whose id the store knows (a first ingest reads
    # none: at a million records, 0.1 GB of Python strings); the column is never fixed.
    known_at = np.fromiter((at for memory_id, at in latest.items() if memory_id in known), np.int64)
    hashes = dict(zip(known_at.tolist(), take_rows(incoming.table.column("content_hash"), known_at).to_pylist()))
    withdrawn = _still_withdrawn(run, latest, known, hashes)
    for memory_id, at in latest.items():
        if (parent_of(memory_id) or memory_id) in withdrawn:
            run.report.kept_deleted += 1
            continue
        if memory_id in run.absorbed:  # a folded write: new, or a new version of what the base holds
            if memory_id in held:
                replaced.add(memory_id)
                run.report.updated += 1
            else:
                run.report.new += 1
            fresh.append(at)
            continue
        seen = known.get(memory_id)
        if seen is not None and seen[1]:  # deleted, now given again: it comes back
            seen = None
        if seen is not None and memory_id not in held and memory_id not in dropped_before:
            seen = None  # restored: recorded by a run whose generation never became current
        if seen is not None and seen[0] == hashes[at]:
            same_text.append(at)
            continue
        if seen is not None:
            run.report.updated += 1
            replaced.add(memory_id)
        else:
            run.report.new += 1
        fresh.append(at)
    return np.array(fresh, np.int64), replaced, same_text


def _still_withdrawn(run: Run, latest: dict[str, int], known: dict[str, tuple[str, bool]],
                     hashes: dict[int, str]) -> set[str]:
    """The memories (parent ids) a user deleted that this run gives again unchanged, to
    leave deleted: every record of the memory (itself, or each of its chunks) names a
    deleted, withdrawn memory of the same text. A changed text is a new version, which
    comes back whole. A compaction's records were written again by a user, which
    reinstated them (:meth:`StoreDB.reinstate`)."""
    if not run.db.any_withdrawn():  # no pass over every record read for a store with none
        return set()
    deleted = [i for i in latest if (seen := known.get(i)) is not None and seen[1]]
    withdrawn = run.db.withdrawn(deleted)
    if not withdrawn:
        return set()
    unchanged: dict[str, bool] = {}
    for memory_id, at in latest.items():
        parent = parent_of(memory_id) or memory_id
        same = memory_id in withdrawn and known[memory_id][0] == hashes.get(at)
        unchanged[parent] = unchanged.get(parent, True) and same
    return {parent for parent, same in unchanged.items() if same}


def _reusable(got: stages.Computed, text: str, config: IngestConfig) -> bool:
    """Whether ``got`` holds stage 4–5 outputs for a record's ``text`` as it is now."""
    return got.text == text and (got.late_codes is not None or not config.late_interaction.enabled)


def _nothing_to_publish(run: Run, accepted: Accepted, changes: Changes) -> bool:
    """Whether the store's generation stays as it is: no record is new, changed nor
    re-tagged, no row left it, and it holds no segments (a store without a generation
    gets one when records were read, empty if all were duplicates, or when
    :func:`initialise` asks)."""
    return not len(changes.fresh) and not changes.retagged \
        and (changes.previous is not None or not (accepted.validated or run.empty_ok)) \
        and not has_deletions(changes.previous, changes.old_index) \
        and not (changes.previous is not None and changes.previous.segment_files)  # segments: always rebuilt


#: Signatures gathered into dedup's array at a time.
SIG_BLOCK = 65536


def _deduplicate(run: Run, changes: Changes, incoming: Incoming, work: Path) -> Deduplicated:
    """Stage 3: near-duplicate removal over the rows that stay and the fresh ones, by
    MinHash-LSH within each tenant (:func:`find_duplicates`). Every row's signature goes
    into one file of ``work``, mapped until :func:`assemble` has sorted them."""
    config, fresh, old_rows, previous = run.config, changes.fresh, changes.old_rows, changes.previous
    n_old = old_rows.num_rows

    # Per row, the old ones then the fresh ones: the tenant as a number (an array, as
    # LSH hashes it), and the id and the group never paired read when asked for (only
    # for the rows that share an LSH band with another, and the dropped ones): no
    # Python list of every row's values.
    tenants = tenant_codes(pa.chunked_array(
        [*old_rows.column("user").chunks, *take_rows(incoming.table.column("user"), fresh).chunks], pa.string()))[1]
    old_ids, old_sources = old_rows.column("id"), old_rows.column("source")
    new_ids, new_sources = incoming.reader("id", fresh), incoming.reader("source", fresh)
    all_ids = OldThenNew(lambda i: old_ids[i].as_py(), new_ids, n_old, len(fresh))
    parents = OldThenNew(lambda i: never_paired(old_ids[i].as_py(), old_sources[i].as_py()),
                         lambda k: never_paired(new_ids(k), new_sources(k)), n_old, len(fresh))
    old_sigs = previous.minhash if previous is not None and len(changes.old_index) else np.zeros(
        (0, config.dedup.num_perm), np.uint32)
    old_at = changes.old_index
    if n_old and old_sigs.shape[1:] != (config.dedup.num_perm,):  # dedup.num_perm changed: sign the old rows again
        log.info("dedup.num_perm is %d, the previous generation's signatures have %d: signing its %d "
                 "memories again", config.dedup.num_perm, old_sigs.shape[1], n_old)
        old_sigs = signatures(old_rows.column("text").to_pylist(), num_perm=config.dedup.num_perm,
                              shingle=config.dedup.shingle)
        old_at = np.arange(n_old)
    # The old rows' signatures, then the fresh rows', into the one array of every row's,
    # a block at a time (a gather of all at once is a copy of them all in the heap).
    sigs = file_array(work / "dedup-minhash.npy", np.uint32, (n_old + len(fresh), config.dedup.num_perm))
    for lo in range(0, n_old, SIG_BLOCK):
        taken = old_at[lo:lo + SIG_BLOCK]
        sigs[lo:lo + len(taken)] = old_sigs[taken]
    for lo in range(0, len(fresh), SIG_BLOCK):
        rows = fresh[lo:lo + SIG_BLOCK]
        sigs[n_old + lo:n_old + lo + len(rows)] = incoming.sigs[rows]
    del old_sigs
    incoming.sigs = np.zeros((0, config.dedup.num_perm), np.uint32)
    # Dedup reads the text and preference of the rows that share an LSH band with
    # another: read from the tables when asked for.
    pinned, created, texts = (old_rows.column(name) for name in ("pinned", "created_at", "text"))
    new_pinned, new_created, new_texts = (incoming.reader(name, fresh) for name in ("pinned", "created_at", "text"))
    preference = OldThenNew(lambda i: (bool(pinned[i].as_py()), created[i].as_py(), i),
                            lambda k: (bool(new_pinned(k)), new_created(k), n_old + k), n_old, len(fresh))
    dropped = find_duplicates(
        tenants, sigs, preference, threshold=config.dedup.threshold,
        texts=OldThenNew(lambda i: texts[i].as_py(), new_texts, n_old, len(fresh)),
        shingle=config.dedup.shingle,
        settled=n_old,  # the previous generation's rows: deduplicated when it was built
        parents=parents,
    )
    keep = np.ones(n_old + len(fresh), bool)
    keep[np.array([i for i, _, _ in dropped], np.int64)] = False
    links = [(all_ids[i], all_ids[j], s) for i, j, s in dropped]
    run.report.duplicates = len(links)
    return Deduplicated(
        sigs=sigs, links=links,
        keep_old=np.flatnonzero(keep[:n_old]), keep_new=np.flatnonzero(keep[n_old:]),
        dropped=memory_table(incoming.pending(fresh[~keep[n_old:]]), None),
        dropped_old_ids=[all_ids[i] for i in np.flatnonzero(~keep[:n_old]).tolist()],
    )


def never_paired(memory_id: str, source: str) -> str | None:
    """The group of memories that are never near-duplicates of each other, or None:
    the code memories and commits read from one repository (two functions with the same
    body are still two functions, at two places), and the chunks of one memory."""
    return source if source.startswith(("code:", "git:")) else parent_of(memory_id)


def _expand_embed_annotate(run: Run, todo: pa.Table, reuse: dict[int, stages.Computed],
                           changes: Changes, kept: Deduplicated, work: Path) -> dict[str, Any]:
    """Stages 4, 5 and 7a for the new or changed memories (``todo``; ``reuse``: by
    ``seq``, those whose outputs came with the run), as columns in ``todo``'s order
    (:func:`collect`). The vectors are float16 from the start, what the generation
    stores, written into a file of ``work`` as they come rather than held (0.75 GB at a
    million memories)."""
    config = run.config
    with stage(run, "expand_embed_annotate"):
        turns = previous_turns(todo, changes.old_rows, kept.keep_old) \
            if config.session_context > 0 or config.session_context_words else None
        inputs = todo.select(list(TRANSFORM_INPUT))
        if turns is not None and config.session_context_words:
            inputs = inputs.append_column("context", context_lines(todo, changes.old_rows, turns,
                                                                   work / "new-contexts.arrow"))
        reused = _run_local_batches(inputs, sorted(reuse), [stages.Reuse(config, reuse)])
        # Each batch goes into the columns as it arrives: held all at once, the batches
        # (vectors, token blobs) would be more than the columns themselves.
        transformed = _transform(run, inputs, [k for k in range(todo.num_rows) if k not in reuse])
        new_cols = collect(itertools.chain(transformed, reused), todo.num_rows, config,
                           work=work)
    if turns is not None and config.session_context > 0:
        new_cols["vector"] = session_context(new_cols["vector"], turns, changes.previous, changes.old_index,
                                             config.session_context, given=frozenset(reuse))
    return new_cols


#: The columns the transform stages read (:mod:`.stages`), with ``seq``.
TRANSFORM_INPUT = ("text", "type", "metadata")


def _transform(run: Run, inputs: pa.Table, seqs: list[int]) -> Iterator[dict[str, np.ndarray]]:
    """Stages 4, 5 and 7a for rows ``seqs`` of ``inputs`` (:data:`TRANSFORM_INPUT`, and
    ``context`` when the run gives turns their previous turn's words), their batches as
    they come."""
    if not seqs:
        return
    if run.runner == "local":
        for batch in _run_local_batches(inputs, seqs, [stages.Transform(run.config)]):
            run.progress.advance(len(batch["seq"]))
            yield batch
        return
    assert run.feed is not None
    at = pa.array(seqs, pa.int64())
    yield from run.feed.run(take_rows(inputs, seqs).add_column(0, "seq", at))


def _run_local_batches(inputs: pa.Table, seqs: list[int], transforms: Sequence[Any]) -> Iterator[dict[str, np.ndarray]]:
    """``transforms`` run in this process over rows ``seqs`` of ``inputs`` (as
    :func:`_transform` takes them), ``BATCH`` at a time."""
    for start in range(0, len(seqs), BATCH):
        chunk = seqs[start : start + BATCH]
        rows = take_rows(inputs, chunk)
        batch = {"seq": np.array(chunk, dtype=object)}
        batch.update((k, np.array(rows.column(k).to_pylist(), dtype=object)) for k in inputs.column_names)
        for fn in transforms:
            batch = fn(batch)
        yield batch


def _publish(run: Run, data: GenerationData) -> int:
    """Stages 6 and 8: the generation's folder written, not yet current."""
    config = run.config
    return publish(
        run.store, data,
        hnsw_connectivity=config.hnsw_connectivity,
        hnsw_expansion_add=config.hnsw_expansion_add,
        crash_after=run.crash_after,
        dense_indexes=data.extra.pop("_dense_indexes", None),
        hnsw_min_rows=config.hnsw_min_rows,
        hnsw_threads=config.hnsw_threads,
        bm25_analyzer=stages.bm25_analyzer(config),
        make_current=False,  # after the database has recorded it (_record)
    )


def _record(run: Run, number: int, memories: pa.Table, entities: pa.Table, ids: pa.Array,
            new_cols: dict[str, Any], changes: Changes, kept: Deduplicated, quarantined: list[dict[str, Any]]) -> None:
    """The database records, in one transaction, what published generation ``number``
    holds: the new and changed memories (``ids``, their stage outputs ``new_cols``), the
    re-tagged and the dropped ones, expansions, duplicate links, the quarantine, the
    graph's entities (its edges are only in the generation's files); and the names of
    the folders read. What DuckDB's allocator keeps after each large insert goes back to
    the system before the next (:meth:`StoreDB.release_memory`)."""
    db, report = run.db, run.report
    db.con.begin()
    try:
        db.upsert_memories(memories, report.run_id, ids=ids)  # the new rows as the generation holds them
        db.release_memory()
        if changes.retagged:
            db.upsert_memories(memories, report.run_id, ids=pa.array(list(changes.retagged), pa.string()))
        if kept.dropped.num_rows:
            db.upsert_memories(kept.dropped, report.run_id)
            db.delete(kept.dropped.column("id").to_pylist())
        if kept.dropped_old_ids:
            db.delete(kept.dropped_old_ids)
        if changes.superseded:
            db.delete(changes.superseded)
        db.upsert_expansions(ids, new_cols["expansions"], run.config.doc2query.backend)
        db.release_memory()
        db.add_duplicates(kept.links, report.run_id)
        db.add_quarantine(quarantined, report.run_id)
        db.replace_entities(entities.select(["user", "key", "df"]), number)
        _record_names(run)
        db.record_generation(number, report.run_id)
        db.con.commit()
    except BaseException:
        db.con.rollback()
        raise
    db.release_memory()


def _record_names(run: Run) -> None:
    """The folders this run read under names new to the store, or given to them now."""
    run.db.record_source_names([(n.user, n.kind, n.name, n.folder) for n in run.named], run.report.run_id)


def _make_current(run: Run, number: int) -> None:
    """Readers switch to generation ``number`` here, once the database has recorded it:
    a failure earlier leaves the previous generation current and the database as it was
    (the unused folder is pruned later). After a crash between the database's commit and
    this switch, the next run makes the recorded generation current first
    (:func:`roll_forward`)."""
    set_current(run.store, number)
    run.report.generation = number
    run.report.published = True
    run.report.pruned = prune(run.store, keep=run.config.keep_generations)
