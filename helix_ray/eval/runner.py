"""Run systems side by side on the same stores and score them.

Each corpus of an :class:`EvalSet` becomes its own store (built once by the real ingest
pipeline, runner "local", and reused while its documents are unchanged). A *system*
maps (recaller, query) to a ranked list of document ids. Baselines call the retrieval
legs directly (BM25 only, dense only, plain RRF of both); Helix systems call the whole
recall pipeline, with stages switched off for the ablations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import helix_ray.ingest.run as ingest_run
from helix_ray.config import IngestConfig, RetrievalConfig, load_config
from helix_ray.embedder import get_embedder
from helix_ray.errors import InvalidArgument
from helix_ray.eval.datasets import EvalQuery, EvalSet
from helix_ray.eval.metrics import evaluate_ranking, paired_difference, summarise
from helix_ray.recall import adapter as adapter_mod
from helix_ray.recall import dense, fuse, lexical
from helix_ray.recall.embed import embed_query
from helix_ray.recall.threads import encoder_threads
from helix_ray.store.generation import Generation

log = logging.getLogger(__name__)

Ranker = Callable[[Any, EvalQuery, int], list[str]]
EVAL_BUDGET = 1_000_000  # tokens: retrieval metrics judge the ranking, not the packing
RUNNER_ONLY = {"embed_actors", "embed_actor_threads", "embed_actor_cpus"}
"""IngestConfig fields that change how the Ray Data runner schedules work, not what a
store holds (eval builds stores in-process): left out of a store's cache key."""


def store_for(corpus_id: str, docs: Sequence[Any], workdir: Path, ingest_config: IngestConfig,
              show_progress: bool = False) -> Path:
    """Build (or reuse) the store of one corpus.

    Memory types are given, not derived: a conversation turn (it has a session) is
    ``episodic``, a document of a BEIR-style corpus ``semantic``. Ingest's type rules are
    written for an agent's memories; on a homogeneous corpus they would scatter its
    documents over the per-type weight rows (an abstract saying "we chose" becomes a
    decision) and rank them by that accident (docs/quality.md).
    """
    if not any(d.session_id for d in docs):  # no conversation turns: session_context cannot matter
        ingest_config = ingest_config.model_copy(update={"session_context": 0.0})
    rows = [{
        "id": d.id, "text": d.text, "user": corpus_id, "session_id": d.session_id,
        "created_at": d.created_at or "2020-01-01T00:00:00Z", "type": "episodic" if d.session_id else "semantic",
        "source": "eval", "metadata": {"speaker": d.speaker} if d.speaker else {},
    } for d in docs]
    content = ingest_config.model_dump(mode="json", exclude=RUNNER_ONLY)
    key = hashlib.sha1(json.dumps(
        [content, [(d.id, d.text, d.created_at, d.session_id) for d in docs]]
        + ([[r["type"] for r in rows]] if any(r["type"] != "episodic" for r in rows) else [])
    ).encode()).hexdigest()[:12]
    store = workdir / f"{corpus_id.replace('/', '_')}-{key}"
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


# ----------------------------------------------------------------------------- systems


def _bm25(recaller, q: EvalQuery, k: int) -> list[str]:
    gen = recaller.generation
    start, end = gen.partitions[q.corpus_id]
    cfg = recaller.config.lexical
    hits = lexical.search(gen.bm25, q.text, start=start, end=end, mask=None, top_k=max(k, cfg.top_k),
                          strong_score=cfg.strong_signal_score, strong_gap=cfg.strong_signal_gap)
    return [str(gen.columns.ids[r]) for r in hits.rows[:k]]


def _dense_rows(recaller, q: EvalQuery):
    vector = embed_query(recaller.embedder, q.text)
    if recaller.adapter is not None:  # the baseline sees the same query vector as Helix
        vector = recaller.adapter.apply(vector)
    return dense.search(recaller.generation, q.corpus_id, vector, mask=None, config=recaller.config.dense).rows


def _dense(recaller, q: EvalQuery, k: int) -> list[str]:
    return [str(recaller.generation.columns.ids[r]) for r in _dense_rows(recaller, q)[:k]]


def _rrf(recaller, q: EvalQuery, k: int) -> list[str]:
    gen = recaller.generation
    start, end = gen.partitions[q.corpus_id]
    cfg = recaller.config
    lex = lexical.search(gen.bm25, q.text, start=start, end=end, mask=None, top_k=cfg.lexical.top_k,
                         strong_score=1.0, strong_gap=1.0)
    fused = fuse.rrf({"dense": _dense_rows(recaller, q), "bm25": lex.rows}, k=60)
    return [str(gen.columns.ids[r]) for r in fused.rows[:k]]


def helix(disabled: Iterable[str] = (), overrides: dict[str, Any] | None = None) -> Ranker:
    off = frozenset(disabled)
    config = load_config(RetrievalConfig, overrides=overrides) if overrides else None

    def run(recaller, q: EvalQuery, k: int) -> list[str]:
        result = recaller.recall(q.text, user=q.corpus_id, budget_tokens=EVAL_BUDGET, k=k, disabled=off | {"router"},
                                 config=config)
        return [item.id for item in sorted(result.items, key=lambda item: item.rank)]

    return run


def _no_vector(recaller, q: EvalQuery, k: int) -> list[str]:
    """What a Serve recall answers while the Embedder is down: BM25 alone through
    fusion, expansion, ranking and packing (:meth:`Recaller.plan_without_vector`)."""
    plan = recaller.plan_without_vector(q.text, user=q.corpus_id, budget_tokens=EVAL_BUDGET, k=k)
    result = recaller.finish(plan, recaller.lexical_leg(plan), None)
    return [item.id for item in sorted(result.items, key=lambda item: item.rank)]


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
#: Systems that need stores built differently: their ingest overrides. The baselines read
#: plain vectors: a conversation turn's session context is Helix's ingest, not theirs.
_PLAIN = {"session_context": 0.0}
INGEST_VARIANTS: dict[str, dict[str, Any]] = {"helix-no-doc2query": {"doc2query": {"backend": "none"}},
                                              "helix-no-context": _PLAIN, "bm25": _PLAIN, "dense": _PLAIN,
                                              "rrf": _PLAIN}
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
) -> EvalReport:
    """Score each system on each query of ``evalset``; ``depth`` items are retrieved.

    ``adapt_on``: labelled queries of a tuning split. Over the same corpora (BEIR's
    dev or train qrels), a query adapter is fitted per corpus; over other corpora
    (LoCoMo's tuning conversations), one adapter is fitted across them and used for
    every scored corpus (:mod:`helix_ray.recall.adapter`, λ by cross-validation on the
    tuning queries alone). Every system's query vector goes through it, unless
    cross-validation shows no gain (then none, as ``helix adapt`` would not save it).
    The fits are reported in ``EvalReport.adapters``, per store variant."""
    from helix_ray.recall.pipeline import Recaller  # loads scipy: only when systems are scored

    started = time.perf_counter()
    chosen = systems if isinstance(systems, dict) else {name: _system(name) for name in systems}
    ingest_config = ingest_config or IngestConfig()
    embedder = get_embedder(ingest_config.embedder)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    by_corpus: dict[str, list[EvalQuery]] = {}
    for q in evalset.queries:
        by_corpus.setdefault(q.corpus_id, []).append(q)
    variants = {name: load_config(IngestConfig, overrides=INGEST_VARIANTS[name])
                for name in chosen if name in INGEST_VARIANTS}
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
            parts = [(Generation.open_current(store_for(c, adapt_on.corpora[c], Path(workdir), cfg)),
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
        recallers = {}
        for key, cfg in [(None, ingest_config), *variants.items()]:
            store = store_for(corpus_id, evalset.corpora[corpus_id], Path(workdir), cfg)
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
            recaller = recallers.get(name, recallers[None])
            for q in queries:
                ranked = system(recaller, q, depth)
                rows[name].append({"category": q.category or "all", **evaluate_ranking(ranked, q.gold, ks=ks)})
        if show_progress:
            log.info("[%d/%d] %s: %d queries", n, len(by_corpus), corpus_id, len(queries))
    summary = {name: _flatten(summarise(r)) for name, r in rows.items()}
    return EvalReport(evalset.name, summary, len(evalset.queries), round(time.perf_counter() - started, 1),
                      adapters, compare(rows, ks))


#: The systems every other one is compared with, query by query.
BASELINES = ("bm25", "dense", "rrf")


def compare(rows: dict[str, list[dict[str, Any]]], ks: Sequence[int] = (10,)) -> dict[str, Any]:
    """Each non-baseline system against each baseline in ``rows`` (per-query rows in the
    same query order for every system), on nDCG and Recall at the largest k ≤ 10: the
    mean difference, its bootstrap 95 % interval and the sign-flip p-value."""
    k = max([k for k in ks if k <= 10] or [min(ks)])
    out: dict[str, Any] = {}
    for name, mine in rows.items():
        if name in BASELINES:
            continue
        for base in (b for b in BASELINES if b in rows):
            out.setdefault(name, {})[base] = {
                metric: _rounded(paired_difference([r[metric] for r in mine], [r[metric] for r in rows[base]]))
                for metric in (f"ndcg@{k}", f"recall@{k}")}
    return out


def _rounded(diff: dict[str, Any]) -> dict[str, Any]:
    return {"n": diff["n"], "delta": round(diff["delta"], 4), "ci95": [round(v, 4) for v in diff["ci95"]],
            "p": round(diff["p"], 4)}


def _system(name: str) -> Ranker:
    if name not in SYSTEMS:
        raise ValueError(f"Got system {name!r}; allowed: {', '.join(SYSTEMS)}.")
    return SYSTEMS[name]


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
    if report.comparisons:
        lines.append("paired differences, query by query (mean, bootstrap 95% interval, sign-flip p):")
        for name, against in report.comparisons.items():
            for base, diffs in against.items():
                cells = [f"{m} {d['delta']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] "
                         + ("p<0.001" if d["p"] < 0.001 else f"p={d['p']:.3f}") for m, d in diffs.items()]
                lines.append(f"  {name} − {base}: " + "; ".join(cells))
    return "\n".join(lines)


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
