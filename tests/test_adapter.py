"""The query adapter (stage 1b): the fit itself on synthetic vectors, then `helix adapt`
on the shipped sample store with the real model, recall through it, and a Serve
EmbedderShell picking it up and dropping it without a restart."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helix_ray.cli import main as helix
from helix_ray.errors import InvalidArgument, StoreError
from helix_ray.recall import adapter
from tests.helpers import REPO


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _rotated_pairs(n: int = 300, dim: int = 32, seed: int = 0):
    """Memories D, and queries written 'differently': D rotated by a fixed random
    orthogonal map, plus noise. Raw query vectors miss their memory; an adapter can
    learn the rotation back."""
    rng = np.random.default_rng(seed)
    docs = _unit(rng.normal(size=(n, dim)))
    rotation, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    queries = _unit(docs @ rotation + 0.3 * rng.normal(size=(n, dim)) / np.sqrt(dim))
    return queries, docs


def _mrr(queries: np.ndarray, docs: np.ndarray) -> float:
    gold = [[i] for i in range(len(docs))]
    return float(adapter.reciprocal_ranks(queries, gold, [docs] * len(docs)).mean())


def test_fit_learns_a_map_back_to_the_memories():
    queries, docs = _rotated_pairs()
    train, held = slice(0, 200), slice(200, 300)
    w = adapter.fit(queries[train], docs[train], ridge=1.0)
    mapped = _unit(queries[held] @ w)
    assert _mrr(queries[held], docs[held]) < 0.2  # the raw vectors mostly miss
    assert _mrr(mapped, docs[held]) > 0.9  # held-out queries find their memory through W


def test_a_large_ridge_keeps_the_identity_and_zero_is_refused():
    queries, docs = _rotated_pairs()
    np.testing.assert_allclose(adapter.fit(queries, docs, ridge=1e7), np.eye(queries.shape[1]), atol=1e-4)
    with pytest.raises(InvalidArgument, match="ridge"):
        adapter.fit(queries, docs, ridge=0.0)


def test_choose_ridge_scores_each_candidate_by_cross_validation():
    queries, docs = _rotated_pairs()
    gold = [[i] for i in range(len(docs))]
    best, ranks = adapter.choose_ridge(queries, docs, gold, [docs] * len(docs), folds=3,
                                       grid=(0.1, 1000.0))
    scores = {k: v.mean() for k, v in ranks.items()}
    assert set(scores) == {"identity", "ridge=0.1", "ridge=1000"}
    assert best == max((0.1, 1000.0), key=lambda r: scores[f"ridge={r:g}"])
    assert scores[f"ridge={best:g}"] > scores["identity"] + 0.3


def test_choose_ridge_can_leave_one_group_out():
    queries, docs = _rotated_pairs(n=90)
    gold = [[i] for i in range(len(docs))]
    groups = [i // 30 for i in range(90)]  # three "stores"
    _, by_group = adapter.choose_ridge(queries, docs, gold, [docs] * 90, grid=(1.0,), groups=groups)
    _, by_fold = adapter.choose_ridge(queries, docs, gold, [docs] * 90, grid=(1.0,), folds=3)
    # same number of folds, other partitions: fitted on 60 queries either way, but not the same 60
    assert not np.array_equal(by_group["ridge=1"], by_fold["ridge=1"])
    assert by_group["ridge=1"].mean() > by_group["identity"].mean()


def test_reciprocal_rank_counts_ties_against_the_gold_row():
    pool = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)
    query = np.array([[1.0, 0.0]], np.float32)
    assert adapter.reciprocal_ranks(query, [[1]], [pool])[0] == 0.5  # row 0 ties row 1
    assert adapter.reciprocal_ranks(query, [[0, 1]], [pool])[0] == 1.0  # both gold
    assert adapter.reciprocal_ranks(query, [[2]], [pool])[0] == 1 / 3  # below both ties


def test_saved_adapter_loads_back_and_refuses_another_encoder(tmp_path):
    matrix = np.eye(4, dtype=np.float32) * 2
    adapter.QueryAdapter(matrix, "bge-test", 3.0, 25).save(tmp_path)
    loaded = adapter.load(tmp_path, expect_embedder="bge-test", expect_dim=4)
    assert loaded is not None and loaded.ridge == 3.0 and loaded.pairs == 25
    np.testing.assert_array_equal(loaded.matrix, matrix)
    np.testing.assert_allclose(loaded.apply(np.array([3.0, 4.0, 0.0, 0.0])), [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
    assert adapter.load(tmp_path / "elsewhere", expect_embedder="bge-test", expect_dim=4) is None
    with pytest.raises(StoreError, match="fitted for embedder 'bge-test'.*this store's embedder is 'other'"):
        adapter.load(tmp_path, expect_embedder="other", expect_dim=4)
    with pytest.raises(StoreError, match="4-d vectors"):
        adapter.load(tmp_path, expect_embedder="bge-test", expect_dim=384)


# ----------------------------------------------------------------------------- on a real store


@pytest.fixture
def atlas_copy(atlas_memory, tmp_path):
    """A copy of the sample store (the session's stays without an adapter), and labelled
    queries for it: the golden queries and the memories each should find."""
    store = shutil.copytree(atlas_memory.store, tmp_path / "store")
    pairs = tmp_path / "pairs.jsonl"
    with open(pairs, "w") as fh:
        for line in (REPO / "tests" / "golden_queries.jsonl").read_text().splitlines():
            case = json.loads(line)
            fh.write(json.dumps({"query": case["query"], "user": case["user"],
                                 "memory_ids": case["expected_in_top_k"]}) + "\n")
    return store, pairs


def test_helix_adapt_fits_saves_and_recall_goes_through_it(atlas_copy, capsys):
    from helix_ray.embedder import get_embedder
    from helix_ray.memory import Memory
    from helix_ray.recall.embed import embed_query

    store, pairs = atlas_copy
    # Every line twice, and one id the store does not hold: the same query counts once
    # (it must not sit on both sides of a cross-validation fold), the unknown id is skipped.
    lines = pairs.read_text().splitlines()
    extra = json.loads(lines[0]) | {"memory_ids": ["no-such-memory"]}
    pairs.write_text("\n".join(lines + lines + [json.dumps(extra)]) + "\n")
    assert helix(["adapt", "--store", str(store), "--pairs", str(pairs), "--force", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["queries"], report["pairs"], report["skipped_queries"], report["skipped_ids"]) == (25, 51, 0, 1)
    assert report["saved"] and isinstance(report["improves"], bool)
    assert set(report["cv_mrr@10"]) == {"identity", *(f"ridge={r:g}" for r in adapter.RIDGE_GRID)}
    saved = adapter.load(store, expect_embedder=get_embedder().name, expect_dim=384)
    assert saved is not None and saved.pairs == 25 and saved.ridge == report["ridge"]

    query = "why did we pick NATS over Kafka?"
    with Memory(store, record_access=False) as mem:
        plan = mem.recaller.plan(query, user="dana")
        result = mem.recall(query, user="dana")
    assert plan.flags.get("query_adapter") and result.flags.get("query_adapter")
    raw = embed_query(get_embedder(), query)
    np.testing.assert_allclose(plan.query_vector, saved.apply(raw), atol=1e-5)
    assert float(plan.query_vector @ raw) < 0.9999  # the map moved it

    with Memory(store, record_access=False) as mem:  # open while the adapter goes and comes back
        assert mem.recall(query, user="dana").flags.get("query_adapter")
        assert helix(["adapt", "--store", str(store), "--remove"]) == 0
        assert not (store / adapter.ADAPTER_FILE).exists()
        assert "query_adapter" not in mem.recall(query, user="dana").flags
        plain = mem.recaller.plan(query, user="dana")
        saved.save(store)
        assert mem.recall(query, user="dana").flags.get("query_adapter")
    assert "query_adapter" not in plain.flags
    np.testing.assert_allclose(plain.query_vector, raw, atol=1e-6)


def test_feedback_recorded_through_memory_fits_the_adapter(atlas_copy, capsys):
    from helix_ray.memory import Memory

    store, pairs = atlas_copy
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    with Memory(store, record_access=False) as mem:
        for row in rows:
            assert mem.feedback(row["query"], user=row["user"], memory_ids=row["memory_ids"]) == len(row["memory_ids"])
        mem.feedback(rows[0]["query"], user=rows[0]["user"], memory_ids=rows[0]["memory_ids"])  # given twice
        with pytest.raises(InvalidArgument, match="no memories with these ids"):
            mem.feedback("q", user="dana", memory_ids=["no-such-memory"])
        with pytest.raises(InvalidArgument, match="non-empty list"):
            mem.feedback("q", user="dana", memory_ids=[])
        with pytest.raises(InvalidArgument, match="at most 100"):
            mem.feedback("q", user="dana", memory_ids=[f"atlas-{i}" for i in range(101)])
        with pytest.raises(InvalidArgument, match="non-empty string"):
            mem.feedback(" ", user="dana", memory_ids=rows[0]["memory_ids"])
        # Through the Memory's lock: its access-log thread shares the DuckDB connection.
        assert len(mem.feedback_pairs()) == 25 and mem.feedback_pairs(["nobody"]) == []
    assert helix(["adapt", "--store", str(store), "--from-feedback", "--force", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["queries"], report["pairs"], report["skipped_ids"]) == (25, 25, 0) and report["saved"]
    assert helix(["stats", "--store", str(store), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["feedback"] == 25 and stats["query_adapter"]["queries"] == 25
    assert helix(["adapt", "--store", str(store), "--from-feedback", "--pairs", str(pairs)]) == 2
    assert "either" in capsys.readouterr().err
    assert helix(["adapt", "--store", str(store), "--from-feedback", "--user", "nobody"]) == 2
    assert "records no feedback of user 'nobody'" in (err := capsys.readouterr().err) and "Memory.feedback" in err
    assert helix(["adapt", "--store", str(store), "--pairs", str(pairs), "--user", "dana"]) == 2
    assert "filters --from-feedback" in capsys.readouterr().err
    assert helix(["adapt", "--store", str(store.parent / "no-store"), "--from-feedback"]) == 2
    assert "must be a Helix store" in capsys.readouterr().err
    assert not (store.parent / "no-store").exists()


def test_helix_adapt_does_not_save_an_adapter_that_does_not_help(atlas_copy, tmp_path, capsys):
    store, pairs = atlas_copy
    # Labels that have nothing to do with the queries: each query "should find" the
    # memory of another query, rotated by one. No map learns that from the others.
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps(r | {"memory_ids": rows[(i + 1) % len(rows)]["memory_ids"]}) + "\n"
                                for i, r in enumerate(rows)))
    assert helix(["adapt", "--store", str(store), "--pairs", str(shuffled)]) == 0
    out = capsys.readouterr().out
    assert "not saved" in out and not (store / adapter.ADAPTER_FILE).exists()


def test_eval_adapt_on_a_split_too_small_names_the_corpus(tmp_path):
    from helix_ray.eval.beir import load_beir
    from helix_ray.eval.runner import evaluate

    mini = REPO / "tests" / "fixtures" / "eval" / "mini_beir"
    with pytest.raises(ValueError, match=r"corpus 'mini_beir' from mini_beir \(1 labelled queries there\).*at least 20"):
        evaluate(load_beir(mini), systems=["dense"], workdir=tmp_path, adapt_on=load_beir(mini, split="train"),
                 show_progress=False)


def test_helix_adapt_explains_bad_pairs(atlas_copy, tmp_path, capsys):
    store, pairs = atlas_copy
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"query": "q", "user": "dana"}\n')
    assert helix(["adapt", "--store", str(store), "--pairs", str(broken)]) == 2
    assert "broken.jsonl line 1" in capsys.readouterr().err
    few = tmp_path / "few.jsonl"
    few.write_text("".join(pairs.read_text().splitlines(keepends=True)[:5]))
    assert helix(["adapt", "--store", str(store), "--pairs", str(few)]) == 2
    assert "5 usable queries of 5 pairs" in (err := capsys.readouterr().err) and "at least 20 distinct" in err
    assert helix(["adapt", "--store", str(store)]) == 2
    assert "--pairs" in capsys.readouterr().err
    assert not (store / adapter.ADAPTER_FILE).exists()


def test_serve_embedder_picks_the_adapter_up_and_drops_it_without_a_restart(atlas_copy):
    from helix_ray.config import RetrievalConfig
    from helix_ray.embedder import get_embedder
    from helix_ray.serve.shells import EmbedderShell

    from helix_ray.recall.embed import embed_query

    store, _ = atlas_copy
    shell = EmbedderShell(store=store)
    query = "how do I rotate the API keys"
    raw = embed_query(get_embedder(), query)

    def plan():
        return shell.plan(query, user="dana", config=RetrievalConfig())

    assert "query_adapter" not in plan().flags
    dim = get_embedder().dim
    matrix = np.eye(dim, dtype=np.float32) + 0.05 * np.random.default_rng(0).normal(size=(dim, dim)).astype(np.float32)
    saved = adapter.QueryAdapter(matrix, get_embedder().name, 1.0, 20)
    saved.save(store)
    adapted = plan()
    assert adapted.flags.get("query_adapter")
    np.testing.assert_allclose(adapted.query_vector, saved.apply(raw), atol=1e-5)
    (store / adapter.ADAPTER_FILE).unlink()
    plain = plan()
    assert "query_adapter" not in plain.flags
    np.testing.assert_allclose(plain.query_vector, raw, atol=1e-6)
