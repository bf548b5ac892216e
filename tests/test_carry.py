"""What one generation hands the next (helix_ray/ingest/carry.py): an ingest into a
store takes the carried-over rows' entities, BM25 terms, nearest neighbours and HNSW
index from the previous generation, and the result is the one a full rebuild gives."""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from helix_ray.config import IngestConfig
from helix_ray.index.bm25 import Analyzer, Terms, build_bm25, load_bm25
from helix_ray.index.quantize import quantize_int8
from helix_ray.ingest import entities as entity_mod
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation
from helix_ray.ingest.run import ingest
from tests.helpers import write_jsonl

NAMES = ["Dana", "Lee", "Priya", "Tomas", "Grafana Cloud", "Kafka", "NATS JetStream", "Postgres"]
IDENTS = ["parse_config", "retryBudget", "GatewayServer", "HELIX_STORE", "rotate_keys", "shardIndex"]
PATHS = ["services/ingest/worker.py", "deploy/gateway.yaml", "cmd/beacon/main.go", "docs/runbook.md"]
WORDS = ("latency retry deploy canary rollout schema migration alert pager quota bucket ledger vault cache "
         "token index shard replica budget timeout cluster node backup restore upgrade patch release").split()


def _rows(start: int, count: int, seed: int, *, users=("dana", "lee", "kim"), day: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(start, start + count):
        user = users[i % len(users)] if i % 7 else users[0]
        text = (f"{rng.choice(NAMES)} changed {rng.choice(IDENTS)} in {rng.choice(PATHS)}: "
                + " ".join(rng.choice(WORDS, 12)) + f" (note {i})")
        rows.append({"id": f"m{i:04d}", "text": text, "user": user, "session_id": f"s{i // 6}",
                     "created_at": f"2025-03-{day + i % 20:02d}T10:{i % 60:02d}:00Z"})
    return rows


CONFIG = IngestConfig(late_interaction={"enabled": False})


def _strip_carry(store) -> None:
    """Make the current generation look like one written before it carried anything
    (nor recorded checksums)."""
    gen = Generation.open_current(store)
    manifest = {k: v for k, v in gen.manifest.items() if k not in ("files", "manifest_crc32")}
    manifest["carry"] = {}
    (gen.path / "manifest.json").write_text(json.dumps(manifest))


def _terms_as_text(gen: Generation) -> list[list[str]]:
    terms = gen.terms
    return [[terms.vocab[i] for i in terms.ids[a:b]] for a, b in zip(terms.offsets[:-1], terms.offsets[1:])]


def _same_knn(a: Generation, b: Generation) -> int:
    """Asserts both generations hold the same nearest neighbours per row (rows with a
    near-tie in similarity may order it either way); returns how many rows were compared."""
    (na, sa), (nb, sb) = a.knn, b.knn
    np.testing.assert_allclose(sa, sb, atol=1e-5)
    gaps = np.abs(np.diff(np.asarray(sa), axis=1))
    clear = (gaps > 1e-5).all(axis=1)
    np.testing.assert_array_equal(np.asarray(na)[clear], np.asarray(nb)[clear])
    return int(clear.sum())


def test_an_ingest_carries_what_it_can_and_gives_what_a_full_rebuild_gives(tmp_path, monkeypatch):
    store, control = tmp_path / "store", tmp_path / "control"
    ingest([write_jsonl(tmp_path / "a.jsonl", _rows(0, 150, seed=1))], store, runner="local", config=CONFIG)
    first = Generation.open_current(store)
    assert set(first.manifest["carry"]) >= {"mentions", "terms", "knn"}
    # Deleted memories that other rows list among their nearest: those rows are searched again.
    listed = np.asarray(first.knn[0])[:, 1:]
    victims = [first.memories.column("id")[int(r)].as_py() for r in (listed[0, 0], listed[40, 0])]
    with StoreDB(store) as db:
        db.delete(victims)
    shutil.copytree(store, control)
    _strip_carry(control)

    changed = _rows(0, 1, seed=99)[0] | {"text": "Lee moved parse_config into deploy/gateway.yaml for the canary"}
    later = _rows(150, 40, seed=2, users=("dana", "lee", "kim", "ola"), day=5) + [changed]
    source = write_jsonl(tmp_path / "b.jsonl", later)
    extracted = []
    real_extract = entity_mod.extract
    monkeypatch.setattr(entity_mod, "extract", lambda text: extracted.append(text) or real_extract(text))
    carried = ingest([source], store, runner="local", config=CONFIG)
    carried_extracts, extracted[:] = set(extracted), []
    full = ingest([source], control, runner="local", config=CONFIG)
    assert carried.published and full.published and carried.total_memories == full.total_memories
    # Old rows' entities are taken, not extracted again (the rebuild extracts them all).
    assert carried_extracts == {r["text"] for r in later}
    assert len(set(extracted)) > len(later) + 140

    a, b = Generation.open_current(store), Generation.open_current(control)
    assert a.memories.column("id").to_pylist() == b.memories.column("id").to_pylist()
    assert not set(victims) & set(a.memories.column("id").to_pylist())
    assert a.mentions.to_pylist() == b.mentions.to_pylist()
    assert a.entities.equals(b.entities)
    assert _terms_as_text(a) == _terms_as_text(b)
    assert sorted(a.bm25.retriever.vocab_dict) == sorted(b.bm25.retriever.vocab_dict)
    for query in ("parse config canary", "rollout of the gateway", "Grafana Cloud alert pager", "note 170"):
        tokens = a.bm25.query_tokens(query)
        assert tokens == b.bm25.query_tokens(query)
        np.testing.assert_allclose(a.bm25.scores(tokens), b.bm25.scores(tokens), rtol=1e-6)
    assert _same_knn(a, b) > 0.9 * a.size
    ga, gb = a.graph, b.graph
    np.testing.assert_array_equal(ga.indptr, gb.indptr)
    np.testing.assert_array_equal(ga.indices, gb.indices)
    np.testing.assert_array_equal(ga.types, gb.types)
    np.testing.assert_allclose(ga.weights, gb.weights, atol=1e-5)


def test_a_carried_hnsw_index_holds_every_row_under_its_new_number(tmp_path):
    config = IngestConfig(late_interaction={"enabled": False}, hnsw_min_rows=30)  # dana has 38 memories
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", _rows(0, 90, seed=3, day=5))], store, runner="local", config=config)
    gone = "m0007"  # dana's
    with StoreDB(store) as db:
        db.delete([gone])
    # Older memories sort before dana's existing ones: every one of those is renumbered.
    earlier = _rows(200, 12, seed=4, users=("dana",), day=1)
    ingest([write_jsonl(tmp_path / "b.jsonl", earlier)], store, runner="local", config=config)
    gen = Generation.open_current(store)
    start, end = gen.partitions["dana"]
    assert gen.manifest["carry"]["dense_removed"] == {"dana": 1}
    index = gen.dense_index("dana")
    assert len(index) == end - start
    int8 = quantize_int8(np.asarray(gen.vectors, dtype=np.float32))
    rows = np.arange(start, end)
    np.testing.assert_array_equal(index.get(rows.astype(np.uint64)), int8[start:end])
    found = index.search(int8[start:end], 1)
    assert (found.keys[:, 0] == rows).mean() > 0.95  # each row finds itself
    assert gone not in gen.memories.column("id").to_pylist()

    # Past MAX_REMOVED_SHARE of tombstones the index is built anew.
    with StoreDB(store) as db:
        db.delete(gen.memories.column("id").to_pylist()[start:start + 10])
    ingest([write_jsonl(tmp_path / "c.jsonl", _rows(300, 3, seed=5, users=("dana",), day=20))], store,
           runner="local", config=config)
    rebuilt = Generation.open_current(store)
    assert rebuilt.manifest["carry"]["dense_removed"] == {}
    assert len(rebuilt.dense_index("dana")) == rebuilt.partitions["dana"][1] - rebuilt.partitions["dana"][0]


DOCS = ["The parse_config helper reads the gateway config.", "Retry budgets keep writeBoolean calls cheap.",
        "the the the", "", "HTTPServerError at deploy: retry the canary rollout."]


@pytest.mark.parametrize("analyzer", [Analyzer(), Analyzer(stemmer=None, split_identifiers=False)])
def test_terms_taken_and_joined_index_as_the_texts_do(tmp_path, analyzer):
    whole = Terms.analyse(analyzer, DOCS)
    head = Terms.analyse(analyzer, DOCS[:2])
    pieced = head.then(Terms.analyse(analyzer, DOCS[2:], head.vocab)).take(np.array([4, 0, 1, 2, 3]))
    as_text = lambda t: [[t.vocab[i] for i in t.ids[a:b]] for a, b in zip(t.offsets[:-1], t.offsets[1:])]
    assert as_text(pieced) == [as_text(whole)[i] for i in (4, 0, 1, 2, 3)]
    assert as_text(pieced)[3] == [] and as_text(pieced)[4] == []  # stop-words only, and empty
    build_bm25([DOCS[i] for i in (4, 0, 1, 2, 3)], tmp_path / "texts", analyzer=analyzer)
    saved = build_bm25(None, tmp_path / "terms", analyzer=analyzer, terms=pieced)
    assert len(saved.vocab) == len(set(saved.vocab)) == len({t for doc in as_text(whole) for t in doc})
    x, y = load_bm25(tmp_path / "texts"), load_bm25(tmp_path / "terms")
    for query in ("parse_config", "retry canary", "budgets cheap", "gateway"):
        tokens = x.query_tokens(query)
        assert tokens and tokens == y.query_tokens(query)
        np.testing.assert_array_equal(x.scores(tokens), y.scores(tokens))


def test_terms_joined_with_no_documents_are_the_other_sides():
    analyzer = Analyzer()
    none = Terms.analyse(analyzer, [])
    head = Terms.analyse(analyzer, DOCS[:2])
    for joined, expected in ((none.then(head), head), (head.then(Terms.analyse(analyzer, [], head.vocab)), head)):
        assert len(joined) == 2 and joined.vocab == expected.vocab
        np.testing.assert_array_equal(joined.offsets, expected.offsets)
        np.testing.assert_array_equal(joined.ids, expected.ids)
    tail = Terms.analyse(analyzer, DOCS[2:], head.vocab)  # whose vocabulary extends head's
    assert head.then(Terms.analyse(analyzer, [], tail.vocab)).vocab == tail.vocab


def test_one_new_memory_in_a_tenant_with_an_hnsw_index_carries_its_neighbours(tmp_path):
    """A single new row is searched in the carried index alone: usearch answers one
    query with 1-D arrays, which the nearest-neighbour lists still take."""
    config = IngestConfig(late_interaction={"enabled": False}, hnsw_min_rows=0)
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", _rows(0, 40, seed=6, users=("dana",)))], store, runner="local",
           config=config)
    report = ingest([write_jsonl(tmp_path / "b.jsonl", _rows(100, 1, seed=7, users=("dana",)))], store,
                    runner="local", config=config)
    assert report.published
    gen = Generation.open_current(store)
    row = gen.columns.id_to_row[_rows(100, 1, seed=7, users=("dana",))[0]["id"]]
    neighbours, _ = gen.knn
    assert neighbours[row][0] == row and (neighbours[row][1:] >= 0).any()  # itself first, then others


def test_the_generation_links_the_sorted_minhash_file(tmp_path, monkeypatch):
    """Ingest sorts the MinHash signatures into a work-folder file; publish links that
    file into the generation (as the vectors') instead of writing it again, and the
    generation's signatures are the rows' own, in its row order."""
    from helix_ray.ingest.dedup import signatures
    from helix_ray.store import publish

    linked: list[tuple[str, str, int]] = []
    link = publish.link_or_copy

    def recording(source, target):
        linked.append((Path(source).name, Path(target).name, os.stat(source).st_ino))
        link(source, target)

    monkeypatch.setattr(publish, "link_or_copy", recording)
    config = IngestConfig(late_interaction={"enabled": False})
    store = tmp_path / "store"
    rows = _rows(0, 30, seed=5, users=("dana", "lee"))
    ingest([write_jsonl(tmp_path / "a.jsonl", rows)], store, runner="local", config=config)
    gen = Generation.open_current(store)
    inode = os.stat(gen.path / "minhash.npy").st_ino
    assert [(s, t) for s, t, i in linked if i == inode] == [("minhash.npy", "minhash.npy")]
    text = {r["id"]: r["text"] for r in rows}
    ids = [gen.columns.ids[row] for row in range(gen.size)]
    expected = signatures([text[i] for i in ids], num_perm=config.dedup.num_perm, shingle=config.dedup.shingle)
    np.testing.assert_array_equal(np.asarray(gen.minhash[np.arange(gen.size)]), np.asarray(expected, np.uint32))


def test_the_generation_links_the_knn_files_the_graph_read(tmp_path, monkeypatch):
    """The kNN lists are written once, as int32 and float32, into the work folder's
    files the graph's unit reads; publish links those into the generation, and a row's
    list holds itself first."""
    from helix_ray.store import publish

    linked: list[tuple[str, str]] = []
    link = publish.link_or_copy

    def recording(source, target):
        linked.append((Path(source).name, Path(target).name))
        link(source, target)

    monkeypatch.setattr(publish, "link_or_copy", recording)
    config = IngestConfig(late_interaction={"enabled": False}, hnsw_min_rows=0)
    ingest([write_jsonl(tmp_path / "a.jsonl", _rows(0, 40, seed=4, users=("dana", "lee")))], tmp_path / "store",
           runner="local", config=config)
    assert ("knn-neighbours.npy", "neighbours.npy") in linked and ("knn-similarities.npy", "similarities.npy") in linked
    gen = Generation.open_current(tmp_path / "store")
    neighbours, similarities = gen.knn
    assert neighbours.dtype == np.int32 and similarities.dtype == np.float32
    assert (np.asarray(neighbours[:, 0]) == np.arange(gen.size)).all()


def test_the_generation_links_the_vectors_file_the_work_units_read(tmp_path, monkeypatch):
    """Ingest writes the sorted vectors once, to the work folder's file the HNSW units
    read; publish links that file into the generation instead of writing it again. The
    rows of the previous generation keep their vectors when new rows sort among them."""
    from helix_ray.ingest import dense
    from helix_ray.store.generation import VECTORS_FILE

    read: list[int] = []
    build, carry_ = dense.build_index, dense.carry_index

    def recording(unit):
        def run(vectors_path, *args):
            read.append(os.stat(vectors_path).st_ino)
            return unit(vectors_path, *args)
        return run

    monkeypatch.setattr(dense, "build_index", recording(build))
    monkeypatch.setattr(dense, "carry_index", recording(carry_))
    config = IngestConfig(late_interaction={"enabled": False}, hnsw_min_rows=0)
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", _rows(0, 40, seed=8, users=("dana", "lee")))], store,
           runner="local", config=config)
    first = Generation.open_current(store)
    assert read and set(read) == {os.stat(first.path / VECTORS_FILE).st_ino}
    kept = {i: np.array(first.vectors[row]) for i, row in first.columns.id_to_row.items()}
    read.clear()
    ingest([write_jsonl(tmp_path / "b.jsonl", _rows(100, 30, seed=9, users=("bo", "kim", "dana")))], store,
           runner="local", config=config)
    second = Generation.open_current(store)
    assert len(read) == 4 and set(read) == {os.stat(second.path / VECTORS_FILE).st_ino}  # two built, two carried
    assert second.size == 70 and all(second.columns.id_to_row[i] != row for i, row in first.columns.id_to_row.items()
                                     if i.startswith("m00"))
    for i, vector in kept.items():
        np.testing.assert_array_equal(second.vectors[second.columns.id_to_row[i]], vector)


def test_quantize_int8_scales_each_vector_to_127_at_its_peak():
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((50, 16)).astype(np.float32)
    vectors[3] = 0.0
    vectors[4] = -vectors[4]
    expected = np.round(vectors / np.maximum(np.abs(vectors).max(axis=1, keepdims=True), 1e-30) * 127.0)
    expected[3] = 0
    np.testing.assert_array_equal(quantize_int8(vectors), expected.astype(np.int8))
    assert (np.abs(quantize_int8(vectors)).max(axis=1)[np.arange(50) != 3] == 127).all()
    assert quantize_int8(np.zeros((0, 16), np.float32)).shape == (0, 16)
    np.testing.assert_array_equal(quantize_int8(vectors, block=7), expected.astype(np.int8))  # a block at a time
    np.testing.assert_array_equal(quantize_int8(vectors[5]), expected[5].astype(np.int8))  # one vector


class _TwoNodes:
    """Units run as on a cluster of two nodes: searches given their inputs, never a path."""

    threads, slots, spread_slots, nodes = 1, 2, 4, 2

    def __init__(self) -> None:
        self.units: collections.Counter[str] = collections.Counter()
        self.shared = 0

    def share(self, value):
        self.shared += 1
        return np.array(value)  # a copy, as the object store's: nothing of the driver's files

    def map(self, fn, calls, *, anywhere=False):
        assert anywhere and not any(isinstance(a, Path) for call in calls for a in call)
        for call in calls:
            self.units[f"node-{self.units.total() % 2}"] += 1
            yield fn(*call)


@pytest.mark.parametrize("spread", [False, True], ids=["paths", "two-nodes"])
def test_units_search_in_blocks_as_one_search_does_and_score_as_usearch(tmp_path, monkeypatch, spread):
    """The kNN searches run a block of rows per unit (a Ray task on the ray runner):
    pieced together they are the one search over every row, and the similarity used to
    meet new rows is usearch's int8 cosine. On two nodes each unit is given its rows'
    vectors and the index's bytes, shared once, and the result is the same."""
    from helix_ray.index.hnsw import open_view
    from helix_ray.ingest import dense
    from helix_ray.store.publish import HnswSettings

    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((300, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors_path = tmp_path / dense.VECTORS
    np.save(vectors_path, vectors.astype(np.float16))
    params = HnswSettings(connectivity=8, expansion_add=64, min_rows=0, threads=1)
    index_path = dense.build_index(vectors_path, 100, 300, 32, params, tmp_path / "p0.usearch")
    rows = np.arange(100, 300)
    monkeypatch.setattr(dense, "SEARCH_BLOCK", 7)  # 29 units, the last one of 4 rows
    tasks = _TwoNodes() if spread else dense.LocalTasks()
    keys, sims = dense.search(tasks, vectors_path, index_path, rows, k=5)
    assert tasks.units.total() == 29  # 200 rows, 7 to a unit
    if spread:
        assert tasks.shared == 1 + 29 and len(tasks.units) == 2  # the index once, and each unit's rows
    whole = open_view(index_path).search(quantize_int8(vectors[rows].astype(np.float16)), 5)
    np.testing.assert_array_equal(keys, whole.keys.astype(np.int64))
    np.testing.assert_allclose(sims, 1.0 - whole.distances, atol=1e-6)
    assert (keys[:, 0] == rows).mean() > 0.95 and keys.min() >= 100  # each row finds itself; keys are rows
    cosine = dense.Int8Cosine(np.load(vectors_path))
    np.testing.assert_allclose(np.take_along_axis(cosine(rows, rows), keys - 100, axis=1), sims, atol=1e-5)
    # into the caller's arrays (ingest gives views of a file's int32 map), the columns past k untouched
    given = np.full((len(rows), 8), 7, np.int32), np.full((len(rows), 8), 7, np.float32)
    dense.search(tasks, vectors_path, index_path, rows, k=5, out=(given[0][:, :5], given[1][:, :5]))
    np.testing.assert_array_equal(given[0][:, :5], keys)
    np.testing.assert_array_equal(given[1][:, :5], sims)
    assert (given[0][:, 5:] == 7).all() and (given[1][:, 5:] == 7).all()


def test_a_tenants_exact_lists_go_into_the_callers_arrays_padded():
    """tenant_knn without an index searches exactly, straight into the arrays it is
    given (views of the kNN file in an ingest): every row of its range written, the
    columns past k padded −1 / 0 whatever the arrays held."""
    from helix_ray.ingest import carry

    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((40, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    start, end, k, width = 10, 16, 6, 9  # a tenant of 6 rows: k is its size, the lists are wider
    held = np.full((40, width), 7, np.int32), np.full((40, width), 7.0, np.float32)
    out = held[0][start:end], held[1][start:end]
    got_n, got_s = carry.tenant_knn(vectors, start, end, k, width, previous=None,
                                    previous_row=np.full(40, -1, np.int64), out=out)
    assert got_n is out[0] and got_s is out[1]
    scores = vectors[start:end] @ vectors[start:end].T
    want = np.argsort(-scores, axis=1, kind="stable") + start
    np.testing.assert_array_equal(held[0][start:end, :k], want)
    np.testing.assert_allclose(held[1][start:end, :k], np.take_along_axis(scores, want - start, axis=1), atol=1e-6)
    assert (held[0][start:end, k:] == -1).all() and (held[1][start:end, k:] == 0).all()
    assert (held[0][:start] == 7).all() and (held[0][end:] == 7).all()  # nothing outside the range
    # exact_knn into given arrays is what it returns without them
    given = np.empty((end - start, k), np.int64), np.empty((end - start, k), np.float32)
    alone = carry.exact_knn(vectors[start:end], k, offset=start)
    carry.exact_knn(vectors[start:end], k, offset=start, out=given)
    np.testing.assert_array_equal(given[0], alone[0])
    np.testing.assert_array_equal(given[1], alone[1])
