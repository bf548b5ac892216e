"""Run systems side by side on the same stores and score them.

Each corpus of an :class:`EvalSet` becomes its own store (built once by the real ingest
pipeline, runner "local", and reused while its documents are unchanged). A *system*
maps (recaller, query) to a ranked list of document ids. Baselines call the retrieval
legs directly (BM25 only, dense only, plain RRF of both); Helix systems call the whole
recall pipeline, with stages switched off for the ablations, at the question's date
(``now``) when the benchmark gives one.

A query with turns before its question (``EvalQuery.context``) reaches every system as
one string, the turns then the question, except a system named ``<helix system>+ctx``,
whose recall gets the question and the turns apart (``context=``). Scores are per
document: on a store whose long documents were cut into chunks, a chunk counts as its
parent document, at its best rank, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import helix_ray.ingest.run as ingest_run
from helix_ray.config import IngestConfig, RetrievalConfig, deep_merge, load_config
from helix_ray.embedder import get_embedder
from helix_ray.errors import InvalidArgument
from helix_ray.eval.datasets import EvalQuery, EvalSet
from helix_ray.eval.locomo import LOCOMO_CATEGORY_NAMES
from helix_ray.eval.metrics import evaluate_ranking, paired_difference, summarise
from helix_ray.ingest.normalize import asks_only
from helix_ray.recall import adapter as adapter_mod
from helix_ray.recall import dense, fuse, lexical
from helix_ray.recall.embed import embed_query
from helix_ray.recall.threads import encoder_threads
from helix_ray.store.generation import Generation
from helix_ray.schema import parent_of
from helix_ray.tokens import token_counter

log = logging.getLogger(__name__)

Ranker = Callable[[Any, EvalQuery, int], list[str]]
EVAL_BUDGET = 1_000_000  # tokens: retrieval metrics judge the ranking, not the packing
RUNNER_ONLY = {"embed_actors", "embed_actor_threads", "embed_actor_cpus", "embed_actor_restarts"}
"""IngestConfig fields that change how the Ray Data runner schedules work, not what a
store holds (eval builds stores in-process): left out of a store's cache key."""


def store_for(corpus_id: str, docs: Sequence[Any], workdir: Path, ingest_config: IngestConfig,
              show_progress: bool = False, derive_types: bool = False) -> Path:
    """Build (or reuse) the store of one corpus.

    Memory types are given, not derived: a document's own ``type`` when it has one (a
    loader that reads memories, such as a repository's code and commits), else a
    conversation turn (it has a session) is ``episodic`` and a document of a BEIR-style
    corpus ``semantic``. Ingest's type rules are written for an agent's memories; on a
    homogeneous corpus they would scatter its documents over the per-type weight rows (an
    abstract saying "we chose" becomes a decision) and rank them by that accident
    (docs/quality.md). ``derive_types``: documents without their own type get the one
    ingest's rules derive, as memories written without a type do (a mixed pool of types).
    A document's ``metadata`` is stored with it.
    """
    ingest_config, rows = _records(corpus_id, docs, ingest_config, derive_types)
    store = workdir / f"{corpus_id.replace('/', '_')}-{store_key(docs, ingest_config, [r['type'] for r in rows])}"
    if (store / "CURRENT").exists():
        return store
    source = workdir / f"{store.name}.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    report = ingest_run.ingest([source], store, fmt="jsonl", config=ingest_config, runner="local",
                               show_progress=show_progress)
    if report.quarantined:
        log.warning("%s: %d documents quarantined (%s)", corpus_id, report.quarantined, report.quarantine_reasons)
    return store


def _records(corpus_id: str, docs: Sequence[Any], ingest_config: IngestConfig,
             derive_types: bool) -> tuple[IngestConfig, list[dict[str, Any]]]:
    """The memory records of ``docs`` (see :func:`store_for`), and the ingest config to
    store them with (session context off where no document has a session)."""
    if not any(d.session_id for d in docs):  # no conversation turns: session_context cannot matter
        ingest_config = ingest_config.model_copy(update={"session_context": 0.0})
    rows = [{
        "id": d.id, "text": d.text, "user": corpus_id, "session_id": d.session_id,
        "created_at": d.created_at or "2020-01-01T00:00:00Z",
        "type": _given(d, "type") or (None if derive_types else "episodic" if d.session_id else "semantic"),
        "source": "eval",
        "metadata": {**({"speaker": d.speaker} if d.speaker else {}), **(_given(d, "metadata") or {})},
    } for d in docs]
    return ingest_config, rows


def written_store(corpus_id: str, docs: Sequence[Any], workdir: Path, ingest_config: IngestConfig,
                  derive_types: bool = False) -> Path:
    """Build (or reuse) a store of one corpus whose documents were written through
    :meth:`helix_ray.Memory.add`, as an agent's memories arrive (the Writer embeds them
    at write time), in time order, :data:`WRITE_BATCH` at a time, and left in the
    delta: what recall reads before a compaction folds them into a generation. The
    records are :func:`store_for`'s; ``WRITTEN`` in the folder marks a finished store."""
    from helix_ray.memory import Memory  # the Writer and the recall stages: only for this system

    ingest_config, rows = _records(corpus_id, docs, ingest_config, derive_types)
    key = store_key(docs, ingest_config, [r["type"] for r in rows])
    store = workdir / f"{corpus_id.replace('/', '_')}-written-{key}"
    if (store / WRITTEN_MARK).exists():
        return store
    if store.exists():  # a build that stopped half-way
        shutil.rmtree(store)
    ordered = [r for _, r in sorted(enumerate(rows), key=lambda p: (p[1]["created_at"], p[0]))]
    with Memory(store, ingest=ingest_config, warm=False, record_access=False, compact_interval_s=None) as mem:
        for start in range(0, len(ordered), WRITE_BATCH):
            mem.add([{k: v for k, v in r.items() if v is not None} for r in ordered[start:start + WRITE_BATCH]])
    (store / WRITTEN_MARK).write_text(f"{len(rows)} records written\n", encoding="utf-8")
    return store


#: The file that marks a store :func:`written_store` finished.
WRITTEN_MARK = "WRITTEN"
#: Records per ``Memory.add`` call when a store is written: one, as an agent remembers a
#: turn at a time (doc2query's offline keyphrases weigh words by their rarity within a
#: call's texts, so the batching changes the expansions).
WRITE_BATCH = 1


class WrittenRecaller:
    """What a Helix system calls on a written store: :meth:`Memory.recall`, over the
    (empty) generation and the delta that holds every memory."""

    def __init__(self, memory: Any, chunked: bool):
        self.memory, self.chunked = memory, chunked
        self.generation = memory.recaller.generation

    def recall(self, query: str, *, k: int, **options: Any) -> Any:
        # A chunked corpus: enough items to fill k documents (the generation, which
        # helix() reads that from, holds no rows here).
        return self.memory.recall(query, k=min(CHUNK_OVERFETCH * k, 200) if self.chunked else k, **options)


def _any_longer(docs: Sequence[Any], max_tokens: int) -> bool:
    """Whether any document is longer than ``max_tokens`` tokens (a token is at least one
    byte, so texts of at most that many bytes are not counted)."""
    count = token_counter()
    return any(len(d.text.encode("utf-8")) > max_tokens and count(d.text) > max_tokens for d in docs)


def store_key(docs: Sequence[Any], ingest_config: IngestConfig, types: Sequence[str]) -> str:
    """What a store is built from, hashed: the ingest settings that change its content and
    every document (id, text, date, session), so a store is reused only for the same
    documents (a turn corpus and a session corpus of one conversation never share one).
    Documents' own types and metadata count only when some document has them, so the
    key of a corpus without them is what it always was."""
    content = ingest_config.model_dump(mode="json", exclude=RUNNER_ONLY)
    # How many texts share a model call moves a vector by the int8 model's activation noise
    # only: batch_chars is not part of the key (batch_size is, as it always was).
    content["embedder"].pop("batch_chars")
    if not _any_longer(docs, ingest_config.chunk.max_tokens):  # nothing to chunk: the same store either way
        content.pop("chunk")
    elif not content["chunk"]["lead_title"]:  # off, chunks are what they were before the option: same key
        content["chunk"].pop("lead_title")
    if not content["ask_discount"] or not any(_asks_only(d) for d in docs):
        content.pop("ask_discount")  # off, or no turn that only asks: the store it was before the option
    given = [(_given(d, "type"), json.dumps(_given(d, "metadata"), sort_keys=True)) for d in docs]
    return hashlib.sha1(json.dumps(
        [content, [(d.id, d.text, d.created_at, d.session_id) for d in docs]]
        + ([list(types)] if any(t != "episodic" for t in types) else [])
        + ([given] if any(t is not None or m != "null" for t, m in given) else [])
    ).encode()).hexdigest()[:12]


def _asks_only(doc: Any) -> bool:
    """Whether ``doc`` is stored as a turn that only asks: its speaker as its record
    gives it (:func:`_records`: its own metadata's, else ``speaker``)."""
    return asks_only(doc.text, (_given(doc, "metadata") or {}).get("speaker", doc.speaker))


def _given(doc: Any, field: str) -> Any:
    """``doc``'s own ``type`` or ``metadata`` (None when it gives none, or is a record
    without the field)."""
    return getattr(doc, field, None)


# ----------------------------------------------------------------------------- documents, not chunks


def _documents(ids: Iterable[str]) -> list[str]:
    """``ids`` in order, each kept at its first occurrence."""
    return list(dict.fromkeys(ids))


def _parents(gen) -> Any:
    """The generation's per-row parent ids (a chunk's document, ``<parent>#chunk<n>``;
    None for a memory that is not a chunk), or None when the store has no chunks."""
    columns = gen.columns
    if _LAST_COLUMNS[0] is not columns:  # a system's queries read one generation in a row
        parents = [parent_of(str(i)) for i in columns.ids]
        _LAST_COLUMNS[:] = [columns, parents if any(p is not None for p in parents) else None]
    return _LAST_COLUMNS[1]


_LAST_COLUMNS: list[Any] = [None, None]  # (columns, their parents or None): the last generation asked about


def _row_documents(gen, rows: Iterable[int]) -> list[str]:
    """The documents of ``rows``, best first: a chunk counts as its parent, once."""
    ids, parents = gen.columns.ids, _parents(gen)
    if parents is None:
        return _documents(str(ids[r]) for r in rows)
    return _documents(str(parents[r] or ids[r]) for r in rows)


def _item_documents(items) -> list[str]:
    """The documents of recall items in rank order: a chunk counts as its parent, once."""
    return _documents(getattr(item, "parent", None) or item.id for item in sorted(items, key=lambda i: i.rank))


def _wide(gen, k: int) -> int:
    """How many rows a baseline reads to fill ``k`` documents: more when chunks of one
    document may fill several of its first rows."""
    return k if _parents(gen) is None else CHUNK_OVERFETCH * k


#: Rows read per document slot on a chunked store.
CHUNK_OVERFETCH = 4


def question_time(q: EvalQuery) -> dt.datetime | None:
    """When ``q`` is asked (its ``question_date`` as a UTC datetime), for recall's ``now``."""
    if not q.question_date:
        return None
    when = dt.datetime.fromisoformat(q.question_date.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def query_string(q: EvalQuery) -> str:
    """The query as an agent sends it today: the turns before the question, then the question."""
    return "\n".join((*q.context, q.text))


# ----------------------------------------------------------------------------- systems


def _bm25(recaller, q: EvalQuery, k: int) -> list[str]:
    gen = recaller.generation
    start, end = gen.partitions[q.corpus_id]
    cfg = recaller.config.lexical
    hits = lexical.search(gen.bm25, q.text, start=start, end=end, mask=None, top_k=max(_wide(gen, k), cfg.top_k),
                          strong_score=cfg.strong_signal_score, strong_gap=cfg.strong_signal_gap)
    return _row_documents(gen, hits.rows)[:k]


def _dense_rows(recaller, q: EvalQuery, k: int):
    vector = embed_query(recaller.embedder, q.text)
    if recaller.adapter is not None:  # the baseline sees the same query vector as Helix
        vector = recaller.adapter.apply(vector)
    cfg, wide = recaller.config.dense, _wide(recaller.generation, k)
    if wide > max(k, cfg.top_k):  # a chunked store: enough rows to fill k documents
        cfg = cfg.model_copy(update={"top_k": wide})
    return dense.search(recaller.generation, q.corpus_id, vector, mask=None, config=cfg).rows


def _dense(recaller, q: EvalQuery, k: int) -> list[str]:
    return _row_documents(recaller.generation, _dense_rows(recaller, q, k))[:k]


def _rrf(recaller, q: EvalQuery, k: int) -> list[str]:
    gen = recaller.generation
    start, end = gen.partitions[q.corpus_id]
    cfg = recaller.config
    lex = lexical.search(gen.bm25, q.text, start=start, end=end, mask=None,
                         top_k=max(cfg.lexical.top_k, _wide(gen, k)), strong_score=1.0, strong_gap=1.0)
    fused = fuse.rrf({"dense": _dense_rows(recaller, q, k), "bm25": lex.rows}, k=60)
    return _row_documents(gen, fused.rows)[:k]


def _context(q: EvalQuery) -> dict[str, Any]:
    """The turns before the question, as recall's ``context`` (only when there are some:
    a system given the joined query string has none left)."""
    return {"context": list(q.context)} if q.context else {}


def helix(disabled: Iterable[str] = (), overrides: dict[str, Any] | None = None) -> Ranker:
    off = frozenset(disabled)
    config = load_config(RetrievalConfig, overrides=overrides) if overrides else None

    def run(recaller, q: EvalQuery, k: int) -> list[str]:
        result = recaller.recall(q.text, user=q.corpus_id, budget_tokens=EVAL_BUDGET, k=min(_wide(recaller.generation, k), 200),
                                 disabled=off | {"router"},
                                 config=config, now=question_time(q), **_context(q))
        return _item_documents(result.items)[:k]

    return run


def _no_vector(recaller, q: EvalQuery, k: int) -> list[str]:
    """What a Serve recall answers while the Embedder is down: BM25 alone through
    fusion, expansion, ranking and packing (:meth:`Recaller.plan_without_vector`)."""
    plan = recaller.plan_without_vector(q.text, user=q.corpus_id, budget_tokens=EVAL_BUDGET, k=k,
                                        now=question_time(q), **_context(q))
    result = recaller.finish(plan, recaller.lexical_leg(plan), None)
    return _item_documents(result.items)[:k]


SYSTEMS: dict[str, Ranker] = {
    "bm25": _bm25,
    "dense": _dense,
    "rrf": _rrf,
    "helix": helix(),
    "helix-no-graph": helix(["graph"]),
    "helix-no-late": helix(["late"]),
    "helix-mmr": helix(overrides={"diversity": {"mode": "mmr"}}),
    "helix-session": helix(overrides={"diversity": {"mode": "auto"}}),
    "helix-no-recency": helix(["recency"]),
    "helix-no-strong-signal": helix(["strong_signal"]),
    "helix-no-dedup": helix(["dedup"]),
    "helix-rerank": helix(overrides={"rerank": {"enabled": True}}),
    "helix-no-vector": _no_vector,
}
SYSTEMS["helix-no-doc2query"] = helix()
SYSTEMS["helix-no-context"] = helix()
SYSTEMS["helix-no-lead-title"] = helix()
#: The whole pipeline over a store whose documents were written through ``Memory.add``
#: and are still in the delta (:func:`written_store`): an agent's memories before a
#: compaction, beside ``helix`` on the ingested store.
WRITTEN = "helix-written"
SYSTEMS[WRITTEN] = helix()
#: Systems that need stores built differently: their ingest overrides. The baselines read
#: plain vectors and plain BM25 text: a conversation turn's session context is Helix's
#: ingest, not theirs.
_PLAIN = {"session_context": 0.0, "session_context_words": False}
INGEST_VARIANTS: dict[str, dict[str, Any]] = {"helix-no-doc2query": {"doc2query": {"backend": "none"}},
                                              "helix-no-context": _PLAIN, "bm25": _PLAIN, "dense": _PLAIN,
                                              "helix-no-lead-title": {"chunk": {"lead_title": False}},
                                              "rrf": _PLAIN, WRITTEN: {}}
#: The suffix of a system given the turns before the question as recall's ``context``.
WITH_CONTEXT = "+ctx"
#: What joins retrieval settings to ``helix``'s name: ``helix@rank.reweigh_silent=true``
#: runs the whole pipeline with that setting changed, on the same store as ``helix``, so
#: its paired comparison with ``helix`` tests a default change.
WITH_SETTINGS = "@"
#: Systems that never embed the query: their store variant needs no adapter.
LEXICAL_ONLY = frozenset({"bm25"})
DEFAULT_SYSTEMS = ("bm25", "dense", "rrf", "helix", "helix-no-late", "helix-rerank", "helix-no-graph", "helix-mmr",
                   "helix-session", "helix-no-recency", "helix-no-strong-signal", "helix-no-doc2query",
                   "helix-no-context")


@dataclasses.dataclass
class EvalReport:
    dataset: str
    systems: dict[str, dict[str, Any]]
    queries: int
    seconds: float
    adapters: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # corpus → fit report
    #: system → baseline → metric → :func:`~helix_ray.eval.metrics.paired_difference`
    comparisons: dict[str, dict[str, dict[str, dict[str, Any]]]] = dataclasses.field(default_factory=dict)
    #: system → one row per query (corpus by corpus, the same order for every system): its
    #: ``query_id``, category, metrics and the document ids it ranked (``ranked``, as many
    #: as the largest k), to read what changed where
    per_query: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def evaluate(
    evalset: EvalSet,
    *,
    systems: Sequence[str] | dict[str, Ranker] = DEFAULT_SYSTEMS,
    workdir: Path,
    ingest_config: IngestConfig | None = None,
    retrieval_config: RetrievalConfig | None = None,
    ks: tuple[int, ...] = (5, 10),
    depth: int = 10,
    show_progress: bool = True,
    adapt_on: EvalSet | None = None,
    derive_types: bool = False,
) -> EvalReport:
    """Score each system on each query of ``evalset``; ``depth`` items are retrieved.

    ``adapt_on``: labelled queries of a tuning split. Over the same corpora (BEIR's
    dev or train qrels), a query adapter is fitted per corpus; over other corpora
    (LoCoMo's tuning conversations), one adapter is fitted across them and used for
    every scored corpus (:mod:`helix_ray.recall.adapter`, λ by cross-validation on the
    tuning queries alone). Every system's query vector goes through it, unless
    cross-validation shows no gain (then none, as ``helix adapt`` would not save it).
    The fits are reported in ``EvalReport.adapters``, per store variant. ``derive_types``:
    see :func:`store_for`."""
    from helix_ray.recall.pipeline import Recaller  # loads scipy: only when systems are scored

    started = time.perf_counter()
    chosen = systems if isinstance(systems, dict) else {name: _system(name) for name in systems}
    if adapt_on is not None and any(store_variant(name) == WRITTEN for name in chosen):
        raise ValueError(f"{WRITTEN} takes no query adapter (--adapt-on): a Memory recalls with the adapter "
                         "`helix adapt` saved in its store, and a written store has none. Run it without --adapt-on.")
    ingest_config = ingest_config or IngestConfig()
    embedder = get_embedder(ingest_config.embedder)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    metrics: list[str] = []  # the metric keys of a row, which summarise averages
    by_corpus: dict[str, list[EvalQuery]] = {}
    for q in evalset.queries:
        by_corpus.setdefault(q.corpus_id, []).append(q)
    base = ingest_config.model_dump(mode="json")  # a variant changes the given settings, not the defaults
    variants = {store_variant(name): load_config(IngestConfig, overrides=deep_merge(base, ingest_overrides(name)))
                for name in chosen if store_variant(name) is not None}
    tuning: dict[str, list[EvalQuery]] = {}
    for q in (adapt_on.queries if adapt_on is not None else ()):
        tuning.setdefault(q.corpus_id, []).append(q)
    # Tuning queries over the scored corpora: one adapter per corpus. Over other corpora
    # (LoCoMo's tuning conversations): one adapter fitted across them, used everywhere.
    pooled = adapt_on is not None and not set(tuning) & set(by_corpus)
    adapters: dict[str, dict[str, Any]] = {}
    shared: dict[str | None, Any] = {}

    def fit(key: str | None, cfg: IngestConfig, corpus_id: str | None, generation=None):
        """The adapter a store variant uses (None: none, or no gain in cross-validation,
        as `helix adapt` would not save it), fitted on ``corpus_id``'s tuning queries or,
        pooled, on every tuning corpus's."""
        assert adapt_on is not None
        if pooled:
            corpora = sorted(tuning)
            parts = [(Generation.open_current(store_for(c, adapt_on.corpora[c], Path(workdir), cfg,
                                                                derive_types=derive_types)),
                      [{"query": t.text, "user": c, "memory_ids": sorted(t.gold)} for t in tuning[c]])
                     for c in corpora]
            where = f"{len(corpora)} corpora of {adapt_on.name}"
        else:
            assert corpus_id is not None
            parts = [(generation, [{"query": t.text, "user": corpus_id, "memory_ids": sorted(t.gold)}
                                   for t in tuning.get(corpus_id, [])])]
            where = f"corpus {corpus_id!r} from {adapt_on.name}"
        try:
            adapter, fitted = adapter_mod.fit_pairs_across(parts, embedder)
        except InvalidArgument as exc:
            raise ValueError(f"Cannot fit a query adapter for {where} "
                             f"({sum(len(p) for _, p in parts)} labelled queries there): {exc}") from None
        fitted["used"] = bool(fitted["improves"])
        label = ("all" if pooled else str(corpus_id)) + ("" if key is None else f" (store of {key})")
        adapters[label] = fitted
        return adapter if fitted["used"] else None

    for n, (corpus_id, queries) in enumerate(sorted(by_corpus.items()), start=1):
        recallers: dict[str | None, Any] = {}
        with contextlib.ExitStack() as opened:  # a written store's Memory, closed however the corpus ends
            for key, cfg in [(None, ingest_config), *variants.items()]:
                if key == WRITTEN:
                    recallers[key] = _written_recaller(opened, corpus_id, evalset.corpora[corpus_id], Path(workdir),
                                                       cfg, retrieval_config, derive_types)
                    continue
                store = store_for(corpus_id, evalset.corpora[corpus_id], Path(workdir), cfg,
                                  derive_types=derive_types)
                generation = Generation.open_current(store)
                adapter = None
                if adapt_on is not None and key not in LEXICAL_ONLY:  # a lexical system has no query vector
                    if pooled:
                        if key not in shared:
                            shared[key] = fit(key, cfg, None)
                        adapter = shared[key]
                    else:
                        adapter = fit(key, cfg, corpus_id, generation)
                # Queries encoded as helix_ray.Memory encodes them (the token encoding beside the
                # sentence vector, half the cores each, on a store with token vectors); the
                # adapter fits above batch-encode with every core.
                threads = encoder_threads(generation, retrieval_config)
                recallers[key] = Recaller(generation, get_embedder(ingest_config.embedder, threads),
                                          retrieval_config or RetrievalConfig(), adapter=adapter, threads=threads)
            for name, system in chosen.items():
                recaller = recallers[store_variant(name)]
                for q in queries:
                    ranked = _documents(system(recaller, asked(name, q), depth))[:depth]
                    scores = evaluate_ranking(ranked, q.gold, ks=ks)
                    metrics = metrics or list(scores)
                    rows[name].append({"query_id": q.id, "category": q.category or "all", **scores, "ranked": ranked})
        if show_progress:
            log.info("[%d/%d] %s: %d queries", n, len(by_corpus), corpus_id, len(queries))
    summary = {name: _flatten(summarise(r, metrics=metrics)) for name, r in rows.items()}
    return EvalReport(evalset.name, summary, len(evalset.queries), round(time.perf_counter() - started, 1),
                      adapters, compare(rows, ks), rows)


def _written_recaller(opened: contextlib.ExitStack, corpus_id: str, docs: Sequence[Any], workdir: Path,
                      cfg: IngestConfig, retrieval_config: RetrievalConfig | None,
                      derive_types: bool) -> WrittenRecaller:
    """The :data:`WRITTEN` system's recaller over ``corpus_id``: its written store open
    in a ``Memory`` until ``opened`` closes."""
    from helix_ray.memory import Memory

    store = written_store(corpus_id, docs, workdir, cfg, derive_types=derive_types)
    cfg = _records(corpus_id, docs, cfg, derive_types)[0]  # the config it was written with
    memory = opened.enter_context(Memory(store, retrieval=retrieval_config, ingest=cfg, record_access=False,
                                         compact_interval_s=None))
    return WrittenRecaller(memory, chunked=_any_longer(docs, cfg.chunk.max_tokens))


#: The systems every other one is compared with, query by query.
BASELINES = ("bm25", "dense", "rrf")


def compare(rows: dict[str, list[dict[str, Any]]], ks: Sequence[int] = (10,)) -> dict[str, Any]:
    """Each non-baseline system against each baseline in ``rows`` (per-query rows in the
    same query order for every system); a system with settings changed (``helix@…``) also
    against the same system without them (``helix``, or ``helix+ctx`` for
    ``helix@…+ctx``), and any other Helix system against ``helix``. On nDCG and Recall at
    the largest k ≤ 10: the mean difference, its bootstrap 95 % interval and the
    sign-flip p-value."""
    k = max([k for k in ks if k <= 10] or [min(ks)])
    out: dict[str, Any] = {}
    for name, mine in rows.items():
        if name in BASELINES:
            continue
        # helix@…+ctx against helix+ctx; a stage off, a store built otherwise, +ctx: against helix
        unchanged = base_system(name) + name[len(_without_context(name)):] if WITH_SETTINGS in name else "helix"
        against = [b for b in BASELINES if b in rows] + ([unchanged] if unchanged != name and unchanged in rows else [])
        for base in against:
            out.setdefault(name, {})[base] = {
                metric: _rounded(paired_difference([r[metric] for r in mine], [r[metric] for r in rows[base]]))
                for metric in (f"ndcg@{k}", f"recall@{k}")}
    return out


def _rounded(diff: dict[str, Any]) -> dict[str, Any]:
    return {"n": diff["n"], "delta": round(diff["delta"], 4), "ci95": [round(v, 4) for v in diff["ci95"]],
            "p": round(diff["p"], 4)}


def _without_context(name: str) -> str:
    """``name`` without its ``+ctx`` suffix."""
    return name[: -len(WITH_CONTEXT)] if name.endswith(WITH_CONTEXT) else name


def base_system(name: str) -> str:
    """``name`` without its settings and its ``+ctx`` suffix (the system it runs, and whose
    store it uses)."""
    return _without_context(name).split(WITH_SETTINGS, 1)[0]


#: The section of a system's settings that changes ingest, not recall:
#: ``helix@ingest.chunk.max_tokens=300`` runs ``helix`` on a store built with that setting.
INGEST_SECTION = "ingest"


def ingest_overrides(name: str) -> dict[str, Any]:
    """The ingest settings system ``name`` is built with, over the run's: a named
    variant's (``helix-no-doc2query``), or its ``@ingest.<section>.<key>=<value>`` ones."""
    return INGEST_VARIANTS.get(base_system(name)) or _all_settings(name).get(INGEST_SECTION, {})


def store_variant(name: str) -> str | None:
    """Which store system ``name`` reads: None for the run's, else a key naming its
    ingest settings (the variant's name, or the ``@ingest.…`` settings written out)."""
    if base_system(name) in INGEST_VARIANTS:
        return base_system(name)
    changed = ingest_overrides(name)
    return f"{INGEST_SECTION}:{json.dumps(changed, sort_keys=True)}" if changed else None


def settings_of(name: str) -> dict[str, Any]:
    """The retrieval settings a system name changes, as nested overrides:
    ``helix@rank.reweigh_silent=true@late.weight=0.5`` gives
    ``{"rank": {"reweigh_silent": True}, "late": {"weight": 0.5}}``. Values are read as
    YAML scalars (true, 0.5, none, a word). Settings under ``ingest.`` change the store
    instead (:func:`ingest_overrides`)."""
    return {k: v for k, v in _all_settings(name).items() if k != INGEST_SECTION}


def _all_settings(name: str) -> dict[str, Any]:
    import yaml

    overrides: dict[str, Any] = {}
    for assignment in _without_context(name).split(WITH_SETTINGS)[1:]:
        key, sep, value = assignment.partition("=")
        parts = key.split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ValueError(f"Got setting {assignment!r} in system {name!r}; a setting is "
                             "<section>.<key>=<value>, e.g. helix@rank.reweigh_silent=true.")
        node = overrides
        for part in parts[:-1]:
            node = node.setdefault(part.strip(), {})
        node[parts[-1].strip()] = yaml.safe_load(value)
    return overrides


def asked(name: str, q: EvalQuery) -> EvalQuery:
    """The query system ``name`` is given: a ``+ctx`` system gets the question and the
    turns before it apart (recall's ``context``); every other system one string, the
    turns then the question, as an agent that searches its window sends it."""
    if name.endswith(WITH_CONTEXT) or not q.context:
        return q
    return dataclasses.replace(q, text=query_string(q), context=())


def _system(name: str) -> Ranker:
    base = base_system(name)
    if base not in SYSTEMS or (base != name and base in BASELINES):
        allowed = ", ".join(SYSTEMS)
        raise ValueError(f"Got system {name!r}; allowed: {allowed}, and any of them but {', '.join(BASELINES)} "
                         f"with {WITH_CONTEXT!r} appended (e.g. helix{WITH_CONTEXT}: the turns before the question "
                         "given to recall as context, not joined to the query).")
    if WITH_SETTINGS not in name:
        return SYSTEMS[base]
    if base != "helix":
        raise ValueError(f"Got system {name!r}; settings ({WITH_SETTINGS}<section>.<key>=<value>) change "
                         "the system 'helix' only, e.g. helix@rank.reweigh_silent=true.")
    overrides = settings_of(name)
    try:
        load_config(RetrievalConfig, overrides=overrides)
        load_config(IngestConfig, overrides=ingest_overrides(name))
    except InvalidArgument as exc:
        raise ValueError(f"Got system {name!r}; its settings are not valid: {exc}") from None
    return helix(overrides=overrides or None)


def _flatten(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: round(v, 4) for k, v in summary["means"].items()}
    out["n"] = summary["n"]
    groups = summary.get("groups") or {}
    if len(groups) > 1:
        out["per_category"] = {g: {**{k: round(v, 4) for k, v in s["means"].items()}, "n": s["n"]}
                               for g, s in sorted(groups.items())}
    return out


def format_table(report: EvalReport, metrics: Sequence[str] = ("recall@5", "recall@10", "recall_any@5",
                                                                  "ndcg@10", "mrr@10")) -> str:
    present = [m for m in metrics if any(m in s for s in report.systems.values())]
    width = max(len(n) for n in report.systems) + 2
    lines = [f"{report.dataset}: {report.queries} queries, {report.seconds}s",
             "system".ljust(width) + "".join(m.rjust(14) for m in present)]
    for name, s in report.systems.items():
        lines.append(name.ljust(width) + "".join(f"{s.get(m, float('nan')):14.4f}" for m in present))
    lines += _category_lines(report, [m for m in CATEGORY_METRICS if m in present] or present[:1], width)
    if report.comparisons:
        lines.append("paired differences, query by query (mean, bootstrap 95% interval, sign-flip p):")
        for name, against in report.comparisons.items():
            for base, diffs in against.items():
                cells = [f"{m} {d['delta']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] "
                         + ("p<0.001" if d["p"] < 0.001 else f"p={d['p']:.3f}") for m, d in diffs.items()]
                lines.append(f"  {name} − {base}: " + "; ".join(cells))
    return "\n".join(lines)


#: The metrics shown per category under the overall table.
CATEGORY_METRICS = ("recall@10", "ndcg@10")


def _category_label(dataset: str, category: str) -> str:
    name = LOCOMO_CATEGORY_NAMES.get(category) if dataset == "locomo" else None
    return f"{category} {name}" if name else category


def _category_lines(report: EvalReport, metrics: Sequence[str], width: int) -> list[str]:
    """One table per metric: a row per system, a column per category (with its query count)."""
    cats = sorted({c for s in report.systems.values() for c in (s.get("per_category") or {})})
    if not cats:
        return []
    counts = {c: next(s["per_category"][c]["n"] for s in report.systems.values() if c in s.get("per_category", {}))
              for c in cats}
    heads = [f"{_category_label(report.dataset, c)} ({counts[c]})" for c in cats]
    cell = max(14, *(len(h) + 2 for h in heads))
    label = max(width, *(len(f"{m} by category") + 2 for m in metrics))
    lines: list[str] = []
    for metric in metrics:
        lines.append(f"{metric} by category".ljust(label) + "".join(h.rjust(cell) for h in heads))
        for name, s in report.systems.items():
            per = s.get("per_category") or {}
            lines.append(name.ljust(label)
                         + "".join(f"{per.get(c, {}).get(metric, float('nan')):{cell}.4f}" for c in cats))
    return lines


def format_markdown(report: EvalReport, metrics: Sequence[str] = ("recall@5", "recall@10", "recall_any@5", "ndcg@10",
                                                                   "mrr@10")) -> str:
    """The report as a Markdown table (overall metrics, then Recall@10 per category)."""
    present = [m for m in metrics if any(m in s for s in report.systems.values())]
    cats = sorted({c for s in report.systems.values() for c in (s.get("per_category") or {})})
    head = ["system", *present, *[f"R@10 cat {c}" for c in cats]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in report.systems.items():
        per = s.get("per_category") or {}
        cells = [f"{s.get(m, float('nan')):.4f}" for m in present]
        cells += [f"{per.get(c, {}).get('recall@10', float('nan')):.4f}" for c in cats]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)
