"""The evaluation runner end to end on a tiny BEIR fixture: real ingest (local runner),
the real embedding model, every system on the same store, and the paired comparisons."""

from __future__ import annotations

import pytest

from helix_ray.eval.beir import load_beir
from helix_ray.eval.runner import evaluate, format_table
from tests.helpers import REPO

MINI = REPO / "tests" / "fixtures" / "eval" / "mini_beir"


def test_evaluate_compares_each_system_with_each_baseline(tmp_path):
    evalset = load_beir(MINI)
    report = evaluate(evalset, systems=["bm25", "dense", "helix", "helix-no-vector"], workdir=tmp_path,
                      show_progress=False)
    assert set(report.comparisons) == {"helix", "helix-no-vector"}  # baselines are not compared with each other
    # Serve's answer while its Embedder is down: BM25 through the later stages, scored.
    assert report.systems["helix-no-vector"]["recall@10"] >= 0.5 * report.systems["bm25"]["recall@10"] > 0
    against = report.comparisons["helix"]
    assert set(against) == {"bm25", "dense"}
    for base, metrics in against.items():
        for metric, diff in metrics.items():
            assert diff["n"] == report.queries == len(evalset.queries)
            # The paired mean difference is the difference of the two systems' means.
            expected = report.systems["helix"][metric] - report.systems[base][metric]
            assert diff["delta"] == pytest.approx(expected, abs=2e-4)
            assert diff["ci95"][0] <= diff["delta"] <= diff["ci95"][1]
            assert 0 < diff["p"] <= 1
    # Query by query: the same queries in the same order for every system, each row's
    # metrics scored from the documents it lists, and averaging to the summary.
    ids = [row["query_id"] for row in report.per_query["helix"]]
    assert sorted(ids) == sorted(q.id for q in evalset.queries)
    gold = {q.id: q.gold for q in evalset.queries}
    for name, rows in report.per_query.items():
        assert [row["query_id"] for row in rows] == ids
        for row in rows:
            assert 0 < len(row["ranked"]) <= 10
            found = len(gold[row["query_id"]] & set(row["ranked"])) / len(gold[row["query_id"]])
            assert row["recall@10"] == pytest.approx(found)
        mean = sum(row["ndcg@10"] for row in rows) / len(rows)
        assert report.systems[name]["ndcg@10"] == pytest.approx(mean, abs=1e-4)
    lines = format_table(report).splitlines()
    for base in ("bm25", "dense"):
        line = next(line for line in lines if line.strip().startswith(f"helix − {base}: "))
        assert "ndcg@10" in line and "recall@10" in line and "p=" in line


def test_settings_of_the_ray_runner_alone_keep_a_store_reused():
    """Eval builds its stores in one process: a setting that only schedules Ray Data's work
    must not change a store's key, or every cached store is built again."""
    from helix_ray.config import IngestConfig
    from helix_ray.eval.runner import RUNNER_ONLY, store_key

    evalset = load_beir(MINI)
    docs = next(iter(evalset.corpora.values()))
    base = store_key(docs, IngestConfig(), ["semantic"] * len(docs))
    assert RUNNER_ONLY <= set(IngestConfig.model_fields)
    assert {f for f in IngestConfig.model_fields if f.startswith("embed_actor")} <= RUNNER_ONLY
    for field, value in {"embed_actors": 1, "embed_actor_threads": 3, "embed_actor_cpus": 0.5,
                         "embed_actor_restarts": 5}.items():
        assert store_key(docs, IngestConfig(**{field: value}), ["semantic"] * len(docs)) == base, field
    assert store_key(docs, IngestConfig(session_context=0.5), ["semantic"] * len(docs)) != base


def test_derived_types_are_what_ingest_gives_memories_written_without_one(tmp_path):
    """``derive_types``: a document with no type of its own gets ingest's rule-derived type
    (a stated choice becomes a ``decision``), in a store of its own; by default every such
    document of a corpus without conversations is ``semantic``, and a given type stays."""
    from helix_ray.config import IngestConfig
    from helix_ray.eval.datasets import EvalDoc
    from helix_ray.eval.runner import store_for
    from helix_ray.store.generation import Generation

    docs = [EvalDoc("d1", "Tide pools hold small crabs and anemones at low tide."),
            EvalDoc("d2", "We decided to use Postgres because its JSONB columns index well."),
            EvalDoc("d3", "Glass is made by melting sand with soda ash.", type="procedural")]
    kinds, stores = {}, set()
    for derive in (False, True):
        stores.add(store := store_for("c", docs, tmp_path, IngestConfig(), derive_types=derive))
        memories = Generation.open_current(store).memories
        kinds[derive] = dict(zip(memories.column("id").to_pylist(), memories.column("type").to_pylist()))
    assert kinds[False] == {"d1": "semantic", "d2": "semantic", "d3": "procedural"}
    assert kinds[True] == {"d1": "semantic", "d2": "decision", "d3": "procedural"}
    assert len(stores) == 2


def test_a_system_with_ingest_settings_runs_on_a_store_built_with_them(tmp_path):
    """``helix@ingest.<section>.<key>=<value>``: the same recall on a store of its own,
    built with that ingest setting, paired with helix; retrieval settings beside it still
    change recall."""
    from helix_ray.config import IngestConfig
    from helix_ray.eval import runner

    name = "helix@ingest.doc2query.backend=none@late.weight=0.5"
    assert runner.ingest_overrides(name) == {"doc2query": {"backend": "none"}}
    assert runner.settings_of(name) == {"late": {"weight": 0.5}}
    assert runner.store_variant("helix@late.weight=0.5") is None
    assert runner.store_variant("helix-no-doc2query") == "helix-no-doc2query"
    with pytest.raises(ValueError, match="not valid"):
        runner._system("helix@ingest.doc2query.backend=sometimes")
    evalset = load_beir(MINI)
    report = evaluate(evalset, systems=["helix", name], workdir=tmp_path, show_progress=False)
    assert set(report.comparisons[name]) == {"helix"}
    built = {d for d in tmp_path.iterdir() if d.is_dir()}
    assert len(built) == 2 * len(evalset.corpora)  # each corpus: helix's store and the variant's
    variant = IngestConfig.model_validate({"doc2query": {"backend": "none"}})
    for corpus_id, docs in evalset.corpora.items():  # built once, and found again, for the variant
        store = runner.store_for(corpus_id, docs, tmp_path, variant)
        assert store in built and store != runner.store_for(corpus_id, docs, tmp_path, IngestConfig())


def test_helix_written_recalls_documents_written_through_memory_add(tmp_path, monkeypatch):
    """``helix-written``: the corpus written through ``Memory.add`` and left in the delta
    (the generation holds none of it), recalled through ``Memory.recall``, paired with
    helix on the ingested store; the written store is reused once finished, and built
    again when a build stopped half-way."""
    from helix_ray.config import IngestConfig
    from helix_ray.eval import runner
    from helix_ray.memory import Memory
    from helix_ray.store.generation import Generation

    evalset = load_beir(MINI)
    asked = []
    recall = runner.WrittenRecaller.recall
    monkeypatch.setattr(runner.WrittenRecaller, "recall",
                        lambda self, query, **kw: asked.append(query) or recall(self, query, **kw))
    report = evaluate(evalset, systems=["helix", runner.WRITTEN], workdir=tmp_path, show_progress=False)
    assert sorted(asked) == sorted(q.text for q in evalset.queries)  # helix-written asked the written store
    assert set(report.comparisons[runner.WRITTEN]) == {"helix"}
    assert report.systems[runner.WRITTEN]["recall@10"] > 0.5
    (corpus_id, docs), = evalset.corpora.items()
    store = runner.written_store(corpus_id, docs, tmp_path, IngestConfig())
    mark = (store / runner.WRITTEN_MARK).stat().st_mtime_ns
    assert Generation.open_current(store).size == 0
    with Memory(store, compact_interval_s=None, record_access=False) as mem:
        assert mem.stats()["pending_writes"] == len(docs)
    assert runner.written_store(corpus_id, docs, tmp_path, IngestConfig()) == store
    assert (store / runner.WRITTEN_MARK).stat().st_mtime_ns == mark  # reused, not written again
    (store / runner.WRITTEN_MARK).unlink()  # as a build that stopped half-way leaves it
    assert runner.written_store(corpus_id, docs, tmp_path, IngestConfig()) == store
    with Memory(store, compact_interval_s=None, record_access=False) as mem:
        assert mem.stats()["pending_writes"] == len(docs)  # written once, not twice
    with pytest.raises(ValueError, match="no query adapter"):
        evaluate(evalset, systems=[runner.WRITTEN], workdir=tmp_path, show_progress=False, adapt_on=evalset)
