"""Building the next generation (a :class:`GenerationData`) from the rows an ingest run
keeps: the previous generation's rows that stay, with their vectors, then the new ones
with the outputs of stages 4–7a; sorted so that each tenant is one range, with its graph
(stage 7b) and what the previous generation hands on (stage 7c, :mod:`helix_ray.ingest.carry`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.config import IngestConfig
from helix_ray.embedder import DIM
from helix_ray.index.bm25 import TermsOfWords, lexical_text
from helix_ray.ingest import carry, dense
from helix_ray.ingest.dense import VECTORS, Tasks
from helix_ray.ingest.graph import GraphInputs, build_graph_files, load_graph_files, tenant_codes
from helix_ray.ingest.stages import bm25_analyzer
from helix_ray.schema import GENERATION_SCHEMA, PENDING_SCHEMA
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation
from helix_ray.store.late import SegmentedTokens, TokenRows
from helix_ray.store.publish import (GenerationData, HnswSettings, file_array, mapped_parts, mapped_table,
                                     partitions_of, save_npy_blocks)
from helix_ray.token_encoder import PassageTokens, empty_tokens, from_blobs, get_token_encoder, to_blobs
from helix_ray.tokens import token_counter
from helix_ray.tables import take_rows


#: Rows sorted into a file at a time (the vectors, the MinHash signatures).
SORT_BLOCK = 16384


@dataclasses.dataclass
class NextRows:
    """The rows of the next generation, before they are sorted: ``old_rows[keep_old]``
    then ``todo``.

    ``old_rows`` are the previous generation's rows that stay (its schema, its order) and
    ``old_index`` their row numbers there; ``keep_old`` those of them deduplication kept.
    ``todo`` are the new or changed records deduplication kept (``keep_new``: their
    positions among all the run's new records), as columns (:data:`PENDING_SCHEMA`; None
    once :func:`assemble` has taken them), and
    ``new_cols`` their stage 4–7a outputs (:func:`collect`). ``sigs`` holds the MinHash
    signatures of every old row, then of every new record."""

    previous: Generation | None
    old_rows: pa.Table
    old_index: np.ndarray
    keep_old: np.ndarray  # int64, ascending
    todo: pa.Table | None
    new_cols: dict[str, Any]
    sigs: np.ndarray
    keep_new: np.ndarray  # int64, ascending

    @property
    def n_old(self) -> int:
        return len(self.old_rows)


def assemble(rows: NextRows, db: StoreDB, config: IngestConfig, *, work: Path,
             tasks: Tasks | None = None) -> GenerationData:
    """The next generation's rows, sorted so that each tenant is one range, with what
    they carry: the previous generation's rows keep their vectors, and their entities,
    BM25 terms and nearest neighbours where it holds them (:mod:`helix_ray.ingest.carry`).
    The HNSW indexes are built and searched, and then the graph built, by ``tasks`` (here in
    turn when None), their files left in ``work`` for publish to move into the generation
    (:mod:`helix_ray.ingest.dense`, :func:`helix_ray.ingest.graph.build_graph_files`).

    Lets go of what the driver no longer needs as soon as it is in its final form, since
    it all grows with the store (at a million memories, 0.75 GB of unsorted float16
    vectors): takes ``rows.todo`` into the table and ``rows.sigs`` into their sorted
    copy, ``vector`` and ``entities`` out of ``rows.new_cols`` once used, sorts the
    vectors before the columns, and drops each per-row Python list once done with it.
    What is final — the sorted vectors, rows, terms and signatures, and the expansions
    the record reads — is written to ``work`` a block at a time and mapped from there."""
    tasks = tasks or dense.LocalTasks()
    previous, new_cols, keep_old = rows.previous, rows.new_cols, rows.keep_old
    old_table = take_rows(rows.old_rows, keep_old) if len(keep_old) else GENERATION_SCHEMA.empty_table()
    previous_rows = rows.old_index[keep_old]
    if rows.todo is None:
        raise ValueError("assemble takes the new rows once: rows.todo is None")
    new_table = with_token_counts(rows.todo, new_cols["n_tokens"])
    rows.todo = None  # the table holds its columns
    n_new = new_table.num_rows
    table = pa.concat_tables([old_table, new_table])
    del new_table
    sigs = rows.sigs  # of every old row, then of every new record: gathered once they are sorted
    rows.sigs = sigs[:0].copy()  # taken: the sorted ones are a copy
    sig_rows = np.concatenate([np.asarray(keep_old, np.int64), rows.n_old + np.asarray(rows.keep_new, np.int64)])
    old_texts = old_table.column("text")  # read as Python strings only where the old rows' outputs are not carried
    analyzer = bm25_analyzer(config)
    old_lexical = None
    if not carry.terms_carried(previous, analyzer):
        old_ids = old_table.column("id").to_pylist()
        old_exp = db.expansions_for(old_ids)
        old_lexical = [lexical_text(t, old_exp.get(i, [])) for i, t in zip(old_ids, old_texts.to_pylist())]
    terms = carry.terms(previous, previous_rows, old_lexical, new_cols.pop("terms"), analyzer,
                        new_file=lambda n: file_array(work / "new-terms.npy", np.int32, (n,)))
    del old_lexical
    # The old rows' entity lists, then the new ones' (collect maps them from the work folder)
    new_ents = new_cols.pop("entities")
    ents = pa.chunked_array([carry.mentions(previous, previous_rows, old_texts), *new_ents.chunks],
                            carry.MENTIONS_TYPE)
    del new_ents

    late = _late_tokens(previous, previous_rows, old_table, new_cols, config, db)
    del old_table, old_texts  # the old rows' unsorted columns: the sorted ones are copies

    # Group by tenant, then time, then arrival: a tenant is a contiguous row range.
    created = table.column("created_at").cast(pa.int64()).to_numpy()
    tenants, row_tenant = tenant_codes(table.column("user"))
    take = np.lexsort((np.arange(len(created)), created, row_tenant)).astype(np.int64)
    row_tenant = row_tenant[take]  # the graph's tenant of each sorted row
    # The vectors first: the unsorted ones go before the columns are sorted.
    vectors = _sorted_vectors(previous, previous_rows, new_cols.pop("vector"), take, work / VECTORS)
    minhash, minhash_file = sigs, None
    if len(sigs):  # sorted into a file as the vectors are
        save_npy_blocks(work / "minhash.npy", np.uint32, (len(take), *sigs.shape[1:]),
                        (sigs[sig_rows[take[lo:lo + SORT_BLOCK]]] for lo in range(0, len(take), SORT_BLOCK)))
        minhash_file = work / "minhash.npy"
        minhash = np.load(minhash_file, mmap_mode="r")
    del sigs, sig_rows
    # The sorted rows and terms are final: written to the work folder a block at a time
    # and mapped from it until publish and the record have read them (at a million
    # memories ~0.5 GB and ~0.3 GB that the heap does not hold, nor a sorted copy of).
    table = mapped_table(table, work / "rows.arrow", order=take)
    terms = terms.take(take, empty=lambda n: file_array(work / "terms.npy", np.int32, (n,)))
    previous_row = np.concatenate([previous_rows, np.full(n_new, -1, np.int64)])[take]
    if late is not None:
        late = late.take(take)  # pointers only: publish gathers the new rows' tokens
    ents = mapped_table(pa.table({"entities": ents}), work / "mentions.arrow", order=take).column("entities")
    parts = {p["user"]: (p["start"], p["end"]) for p in partitions_of(table.column("user"))}

    all_knn, dense_indexes, removed = _semantic_knn(vectors, parts, previous, previous_row, config, work, tasks)
    # The graph is built by a unit of work from the files the rows, mentions and kNN
    # lists are in, and mapped from the files it writes: the driver never holds its edges.
    inputs = GraphInputs(work / "rows.arrow", work / "mentions.arrow",
                         (work / KNN_FILES[0], work / KNN_FILES[1]) if all_knn is not None else None)
    build = functools.partial(
        build_graph_files, inputs, work / "graph",
        order_keys=[created[take], turns_of(table.column("metadata"))],  # creation time, then turn
        partitions=parts, tenant_rows=(tenants, row_tenant), config=config.graph)
    graph, entities = load_graph_files(next(iter(tasks.map(build, [()]))))
    return GenerationData(
        memories=table, vectors=vectors, minhash=minhash, terms=terms, graph=graph,
        entities=entities, embedder=config.embedder.name, dim=DIM,
        extra={"doc2query": config.doc2query.backend, "_dense_indexes": dense_indexes,
               "carry": {"mentions": carry.MENTIONS_VERSION, "dense_removed": removed}},
        late=late, mentions=ents, knn=all_knn, vectors_file=work / VECTORS, minhash_file=minhash_file,
        knn_files=inputs.knn,
    )


def collect(batches: Iterable[dict[str, np.ndarray]], n: int, config: IngestConfig, *,
            work: Path | None = None) -> dict[str, Any]:
    """The transform stages' batches (in any order) as columns in ``seq`` order, one
    row per input: ``vector`` (float16, what the generation stores; given ``work``, a
    writable memory map of its ``new-vectors.npy``), ``expansions`` (Arrow strings: each row's JSON
    list), ``entities`` (Arrow lists of entity keys, :data:`carry.MENTIONS_TYPE`),
    ``n_tokens``, ``late`` (the token vectors, or None when late interaction is off) and
    ``terms`` (the BM25 terms, numbered as :func:`assemble` takes them: a
    :class:`TermsOfWords`).

    Takes the batches as they come (a list is emptied as it goes): the vectors and token
    counts are written once into their place, a batch's expansions and entities become
    Arrow arrays put in order at the end, its words numbered terms, and a batch's arrays
    go as soon as they are copied, so the driver never holds every batch and the columns
    at once, nor a Python string per row. Given ``work``, the vectors, terms, expansions
    and entities go into its files and are mapped from there: at a million memories
    0.75 GB of float16 vectors and ~0.4 GB of expansions and entities the heap does not
    hold. Raises RuntimeError unless every row ``0 … n − 1`` came exactly once."""
    vector = file_array(work / "new-vectors.npy", np.float16, (n, DIM)) if work is not None \
        else np.empty((n, DIM), np.float16)
    seqs: list[np.ndarray] = []
    n_tokens = np.empty(n, np.int32)
    codes: list[Any] = []  # per row, its token vectors' blobs (with late interaction)
    scales: list[Any] = []
    seen = np.zeros(n, bool)
    with_late = None
    terms = TermsOfWords(n, work / "new-terms-arrived.i32" if work is not None else None)  # numbered as they come

    def arrived() -> Iterator[pa.Table]:
        """Each batch taken in, its expansions and entities given back as they came."""
        nonlocal with_late
        for batch in _draining(batches):
            at = np.asarray(batch.pop("seq"), np.int64)
            if len(at) and (at.min() < 0 or at.max() >= n or seen[at].any() or len(np.unique(at)) < len(at)):
                raise RuntimeError(f"the transform stages returned rows outside 0..{n - 1} or twice")
            seen[at] = True
            if with_late is None:
                with_late = "late_codes" in batch
                if with_late:
                    codes.extend([None] * n)
                    scales.extend([None] * n)
            rows = np.asarray(batch.pop("vector"))
            vector[at] = np.stack(list(rows)) if rows.ndim == 1 else rows
            n_tokens[at] = np.asarray(batch.pop("n_tokens"), np.int32)
            seqs.append(at)
            terms.add(at, batch.pop("words"))
            if with_late:
                for i, c, x in zip(at.tolist(), batch.pop("late_codes"), batch.pop("late_scales")):
                    codes[i], scales[i] = bytes(c), bytes(x)
            yield pa.table([pa.array([str(e) for e in batch.pop("expansions")], pa.string()),
                            pa.array([json.loads(str(m)) for m in batch.pop("entities")], carry.MENTIONS_TYPE)],
                           schema=NEW_OUTPUTS)

    if work is None:
        outputs = pa.concat_tables([NEW_OUTPUTS.empty_table(), *arrived()])
    else:
        outputs = mapped_parts(arrived(), NEW_OUTPUTS, work / "new-outputs-arrived.arrow")
    if not seen.all():
        raise RuntimeError(f"the transform stages returned {int(seen.sum())} rows for {n} inputs")
    if with_late is None:  # no batch came: no rows
        late = empty_tokens() if config.late_interaction.enabled else None
    else:
        late = from_blobs(codes, scales) if with_late else None
    order = np.argsort(np.concatenate(seqs), kind="stable") if seqs else np.zeros(0, np.int64)
    outputs = take_rows(outputs, order).combine_chunks() if work is None else \
        mapped_table(outputs, work / "new-outputs.arrow", order=order)  # a block at a time
    return {"vector": vector, "expansions": outputs.column("expansions"), "entities": outputs.column("entities"),
            "n_tokens": n_tokens, "late": late, "terms": terms}


#: The transform stages' outputs :func:`collect` puts in row order as tables: each new
#: row's expansions (its JSON list) and entity keys.
NEW_OUTPUTS = pa.schema([("expansions", pa.string()), ("entities", carry.MENTIONS_TYPE)])


def _draining(batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    """``batches`` one by one; a list is emptied as it goes, so each batch can be freed
    once taken."""
    if not isinstance(batches, list):
        yield from batches
        return
    batches.reverse()
    while batches:
        yield batches.pop()


def new_row_table(rows: list[dict[str, Any]]) -> pa.Table:
    """``rows`` (decoded records, :func:`helix_ray.ingest.stages.decode_row`) as a table
    in :data:`PENDING_SCHEMA`, a column at a time (an ingest takes its new rows from its
    :class:`~helix_ray.ingest.incoming.Incoming` records instead)."""
    return pa.Table.from_arrays([pa.array([r.get(f.name) for r in rows], f.type) for f in PENDING_SCHEMA],
                                schema=PENDING_SCHEMA)


def with_token_counts(table: pa.Table, n_tokens: Sequence[int] | np.ndarray) -> pa.Table:
    """``table`` (:data:`PENDING_SCHEMA`) with its rows' token counts: a table in
    :data:`GENERATION_SCHEMA`."""
    if len(n_tokens) != table.num_rows:
        raise ValueError(f"{len(n_tokens)} token counts for {table.num_rows} rows")
    field = GENERATION_SCHEMA.field("n_tokens")
    return table.append_column(field, pa.array(np.asarray(n_tokens, np.int64), field.type))


def memory_table(rows: list[dict[str, Any]] | pa.Table, cols: dict[str, Any] | None) -> pa.Table:
    """``rows`` (decoded records, or a table in :data:`PENDING_SCHEMA`) as a table in
    :data:`GENERATION_SCHEMA`, their token counts from ``cols`` (:func:`collect`), or
    counted here when there are none (rows that were not transformed)."""
    table = rows if isinstance(rows, pa.Table) else new_row_table(rows)
    if cols is None:
        count = token_counter()
        n_tokens = [count(t) for t in table.column("text").to_pylist()]
    else:
        n_tokens = cols["n_tokens"]
    return with_token_counts(table, n_tokens)


def in_generation_schema(table: pa.Table) -> pa.Table:
    """``table`` with :data:`GENERATION_SCHEMA`'s columns in its order: a generation
    written without a column gets it as nulls (as ``Table.from_pylist`` with the schema
    would)."""
    if table.schema.equals(GENERATION_SCHEMA):
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in GENERATION_SCHEMA]
    return pa.Table.from_arrays(columns, schema=GENERATION_SCHEMA)


def turns_of(metadata: pa.ChunkedArray) -> np.ndarray:
    """Each row's ``metadata["turn"]``: 0 when absent or not a whole number ≥ 0 (a stored
    row may hold any JSON value there, and must not fail the compaction that reads it).
    Only the rows whose JSON text names a "turn" are parsed."""
    turns = np.zeros(len(metadata), np.int64)
    named = np.flatnonzero(pc.fill_null(pc.match_substring(metadata, '"turn"'), False).to_numpy(zero_copy_only=False))
    for i, text in zip(named.tolist(), take_rows(metadata, named).to_pylist()):
        turn = json.loads(text).get("turn")
        if isinstance(turn, int) and not isinstance(turn, bool) and 0 <= turn <= np.iinfo(np.int64).max:
            turns[i] = turn
    return turns


def _sorted_vectors(previous: Generation | None, previous_rows: np.ndarray, new: np.ndarray,
                    take: np.ndarray, path: Path, block: int = SORT_BLOCK) -> np.ndarray:
    """Row ``take[i]`` of (the previous generation's ``previous_rows``, then ``new``) at
    row i, as the float16 values the generation stores: the kNN, graph and indexes built
    from them are the ones the next ingest carries over for these rows (scored in
    float32 a block at a time). Written to ``path`` (``.npy``) ``block`` rows at a time
    and returned memory-mapped from it: the driver never holds them (0.75 GB at a
    million memories), the HNSW units read the same file, and publish links it into the
    generation instead of writing it again."""
    n_old = len(previous_rows)

    def blocks() -> Iterator[np.ndarray]:
        for lo in range(0, len(take), block):
            rows = take[lo:lo + block]
            out = np.empty((len(rows), DIM), np.float16)
            from_old = rows < n_old
            at_old, at_new = np.flatnonzero(from_old), np.flatnonzero(~from_old)
            if len(at_old):
                assert previous is not None
                out[at_old] = np.asarray(previous.vectors[previous_rows[rows[at_old]]])  # ascending within a tenant
            if len(at_new):
                out[at_new] = np.asarray(new[rows[at_new] - n_old], np.float16)
            yield out

    save_npy_blocks(path, np.float16, (len(take), DIM), blocks())
    return np.load(path, mmap_mode="r")


def _semantic_knn(vectors: np.ndarray, parts: dict[str, tuple[int, int]], previous: Generation | None,
                  previous_row: np.ndarray, config: IngestConfig, work: Path, tasks: Tasks):
    """Each tenant's k nearest memories (the graph's semantic edges), from an HNSW index
    over its int8 vectors when it is large enough to get one (kept for the dense leg),
    else exactly. A memory carried over keeps its list unless a neighbour left; it meets
    only the new memories; an HNSW index is carried too (:func:`carry.dense_index`).
    The indexes are built and searched by ``tasks`` over files in ``work``
    (:mod:`helix_ray.ingest.dense`). Returns all rows' lists (N, k + 1) to store (None
    when ``graph.knn`` is 0), mapped from ``work``'s :data:`KNN_FILES` (which the graph's
    unit reads), the HNSW index files, and the tombstones each carried index holds."""
    width = config.graph.knn + 1 if config.graph.knn > 0 else 0  # 0: no semantic edges
    now = carry.moved_to(previous.size, previous_row) if previous is not None else None
    before = carry.previous_knn(previous, width, now) if width else None
    dense_indexes, removed = _dense_indexes(vectors, parts, previous, previous_row, now, config, work, tasks)
    # The tenants' ranges cover every row, and tenant_knn writes all of its range (−1 padded).
    all_n = file_array(work / KNN_FILES[0], np.int32, (len(vectors), width))
    all_s = file_array(work / KNN_FILES[1], np.float32, (len(vectors), width))
    for user, (start, end) in parts.items() if width else ():
        k = min(width, end - start)
        search = similarity = None
        if user in dense_indexes:
            search = functools.partial(dense.search, tasks, work / VECTORS, dense_indexes[user], k=k)
            similarity = dense.Int8Cosine(vectors)
        carry.tenant_knn(vectors, start, end, k, width, previous=before, previous_row=previous_row, search=search,
                         similarity=similarity, out=(all_n[start:end], all_s[start:end]))
    return (all_n, all_s) if width else None, dense_indexes, removed


#: The files of ``work`` the kNN lists are written into: neighbours, similarities.
KNN_FILES = ("knn-neighbours.npy", "knn-similarities.npy")


def _dense_indexes(vectors: np.ndarray, parts: dict[str, tuple[int, int]], previous: Generation | None,
                   previous_row: np.ndarray, now: np.ndarray | None, config: IngestConfig, work: Path,
                   tasks: Tasks) -> tuple[dict[str, Path], dict[str, int]]:
    """The HNSW index file of each tenant with at least ``hnsw_min_rows`` memories,
    carried from the previous generation's where it can be, else built; and the
    tombstones each carried one holds. The units read ``vectors`` from their file in
    ``work``."""
    large = [u for u, (start, end) in parts.items() if end - start >= config.hnsw_min_rows]
    if not large:
        return {}, {}
    params = HnswSettings(config.hnsw_connectivity, config.hnsw_expansion_add, config.hnsw_min_rows,
                          config.hnsw_threads)
    removed: dict[str, int] = {}
    calls: list[tuple[Any, ...]] = []
    for i, user in enumerate(large):
        start, end = parts[user]
        out = work / f"p{i}.usearch"
        carried = carry.dense_index(previous, user, start, end, previous_row, now,
                                    connectivity=config.hnsw_connectivity, expansion_add=config.hnsw_expansion_add)
        if carried is not None:
            calls.append((dense.carry_index, (work / VECTORS, carried[0], params, out)))
            removed[user] = carried[1]
        else:
            calls.append((dense.build_index, (work / VECTORS, start, end, DIM, params, out)))
    made = tasks.map(_call, calls)
    return dict(zip(large, made)), removed


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)


def _late_tokens(previous: Generation | None, old_rows: np.ndarray, old_table: pa.Table, new_cols: dict[str, Any],
                 config: IngestConfig, db: StoreDB) -> TokenRows | None:
    """Token vectors of old rows then new rows (the unsorted concatenation), or None when
    late interaction is off. Old rows keep the previous generation's tokens: as pointers
    into its segments (publish links them, :mod:`helix_ray.store.late`; the segments
    holding a forgotten user's tokens are rewritten without them), or projected now when
    it holds the backbone's 384-d ones. A previous generation built without tokens has
    its rows encoded now (once: the next run reuses them)."""
    if not config.late_interaction.enabled or new_cols.get("late") is None:
        return None
    new = new_cols.pop("late")  # from here on only the returned rows hold the new tokens
    old = None
    if len(old_rows) and previous is not None and isinstance(previous.late, SegmentedTokens):
        fresh = np.concatenate([np.full(len(old_rows), -1, np.int64), np.arange(len(new), dtype=np.int64)])
        carried = np.concatenate([np.asarray(old_rows, np.int64), np.full(len(new), -1, np.int64)])
        return TokenRows(previous.late, carried, new, fresh, purge=_erased_rows(previous, db))
    if len(old_rows) and previous is not None and previous.late is not None:
        old = previous.late.take(old_rows)
    elif len(old_rows):
        encoder = get_token_encoder(config.late_interaction.max_tokens, pool_factor=config.late_interaction.pool_factor)
        old = from_blobs(*to_blobs(encoder.encode_passages(old_table.column("text").to_pylist())))
    return TokenRows.of(PassageTokens.concat([p for p in (old, new) if p is not None]))


def _erased_rows(previous: Generation, db: StoreDB) -> np.ndarray:
    """The previous generation's rows of forgotten users (:meth:`StoreDB.erased_ids`)."""
    erased = db.erased_ids()
    if not erased:
        return np.zeros(0, np.int64)
    ids = previous.memories.column("id")
    return np.flatnonzero(pc.is_in(ids, value_set=pa.array(sorted(erased), ids.type)).to_numpy(
        zero_copy_only=False)).astype(np.int64)
