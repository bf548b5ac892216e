"""The delta segment that serves online writes before compaction, no Ray: its merge with
the generation's legs, its manifest over immutable segment files (what a write adds, what
a replica reads), its late-interaction tokens and its BM25 analysis."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from helix_ray.live.delta import DELTA_BASE as DELTA_BASE_ROWS  # the delta's row ids start here
from tests.helpers import local_recall


def test_merge_dense_orders_by_cosine_and_keeps_top_k():
    from helix_ray.recall.dense import DenseHits
    from helix_ray.live.delta import DELTA_BASE, merge_dense

    base = DenseHits(np.array([4, 9, 2]), np.array([0.9, 0.7, 0.5], np.float32), "binary", window=np.array([2]))
    extra = DenseHits(np.array([DELTA_BASE + 1, DELTA_BASE + 3]), np.array([0.8, 0.1], np.float32), "delta")
    merged = merge_dense(base, extra, top_k=3)
    assert merged.rows.tolist() == [4, DELTA_BASE + 1, 9] and merged.first_pass == "binary+delta"
    assert merged.window.tolist() == [2]  # the generation's search in the query's time window, kept
    assert merge_dense(base, None, top_k=3) is base


def test_rows_hidden_since_the_legs_ran_leave_every_list():
    """A delete answered between the legs and the finish: the row leaves the query's list,
    each context turn's and the time window's, whichever list found it."""
    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.recall import _visible
    from helix_ray.recall.dense import DenseHits
    from helix_ray.recall.lexical import LexicalHits

    rows = np.array([3, 7, 9], np.int64)
    dense_hits = DenseHits(rows, np.array([0.9, 0.8, 0.7], np.float32), "binary", (np.array([7, 2]),), np.array([9, 7]))
    lexical_hits = LexicalHits(rows, np.ones(3, np.float32), np.ones(3, np.float32), False, (), np.array([7, 5]))
    shown_dense = _visible(dense_hits, {7}, DeltaSegment.empty(), 1)
    shown_lexical = _visible(lexical_hits, {7}, DeltaSegment.empty(), 1)
    assert shown_dense.rows.tolist() == [3, 9] and shown_dense.similarities.tolist() == pytest.approx([0.9, 0.7])
    assert [c.tolist() for c in shown_dense.context] == [[2]] and shown_dense.window.tolist() == [9]
    assert shown_lexical.rows.tolist() == [3, 9] and shown_lexical.window.tolist() == [5]
    assert _visible(dense_hits, set(), DeltaSegment.empty(), 1).window.tolist() == [9, 7]


def test_merge_lexical_normalises_by_the_shared_ceiling():
    """Hand-computed: base raw [6, 3], delta raw [4.5]; ceiling over both 8 → normalised
    [.75, .5625, .375]; the strong signal (≥ .85) does not hold after the merge."""
    from helix_ray.recall.lexical import LexicalHits
    from helix_ray.live.delta import DELTA_BASE, DeltaLexical, merge_lexical

    base = LexicalHits(np.array([7, 1]), np.array([6.0, 3.0], np.float32), np.array([1.0, 0.5], np.float32), True,
                       window=np.array([1]))
    extra = DeltaLexical(np.array([DELTA_BASE + 5]), np.array([4.5], np.float32), ceiling=8.0)
    merged = merge_lexical(base, extra, top_k=10, strong_score=0.85, strong_gap=0.15)
    assert merged.rows.tolist() == [7, DELTA_BASE + 5, 1] and merged.window.tolist() == [1]
    np.testing.assert_allclose(merged.normalised, [0.75, 0.5625, 0.375])
    assert merged.strong_signal is False
    assert merge_lexical(base, None, top_k=10, strong_score=0.85, strong_gap=0.15) is base


def _segment_files(store) -> dict[str, tuple[int, int]]:
    return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (store / "delta").glob("seg-*.arrow")}


def test_a_write_publishes_only_its_own_entries_and_replicas_parse_only_those(shells):
    """The delta is a manifest over immutable segment files: a write adds one file of its
    own entries and leaves every earlier file as it was; a replica parses only the new
    file and joins it with what it holds, to the same snapshot a fresh read gives."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.delta_format import current_delta_version

    writer, store, views = shells["writer"], shells["store"], shells["bm25"].views
    texts = ["The canary fleet runs in eu-west-3.", "Billing exports land in the ledger bucket.",
             "Rotate the signing keys every ninety days."]
    reads = views.segments.reads
    before: dict[str, tuple[int, int]] = {}
    for n, text in enumerate(texts):
        writer.add([{"id": f"alice-seg{n}", "text": text}], "alice")
        files = _segment_files(store)
        new = sorted(set(files) - set(before))
        assert len(new) == 1, new
        assert {name: files[name] for name in before} == before  # nothing written earlier was rewritten
        with pa.memory_map(str(store / "delta" / new[0])) as source:
            assert ipc.open_file(source).read_all().column("id").to_pylist() == [f"alice-seg{n}"]
        before = files
        held = views.delta()
        assert views.segments.reads == reads + n + 1  # the new file only
        fresh = DeltaSegment.load(store, current_delta_version(store))
        assert held.version == fresh.version and list(held.ids) == list(fresh.ids) == [
            f"alice-seg{i}" for i in range(n + 1)]
        np.testing.assert_array_equal(held.vectors, fresh.vectors)
        assert held.late_codes == fresh.late_codes and held.lexical_texts == fresh.lexical_texts
    *_, out = local_recall(shells, "where does the canary fleet run?")
    assert out["items"][0]["id"] == "alice-seg0" and out["items"][0]["origin"] == "delta"
    # BM25 over the joined segments' postings scores as one table of the same entries does.
    from helix_ray.recall import lexical
    from helix_ray.recall.scope import make_scope

    tables = []
    for name in held.segments:
        with pa.memory_map(str(store / "delta" / name)) as source:
            tables.append(ipc.open_file(source).read_all())
    whole = DeltaSegment.from_table(held.version, pa.concat_tables(tables), held.tombstones.values())
    base = views.generations[views.latest].generation.bm25
    for query in ("the canary fleet and the signing keys", "ledger bucket exports", "keys keys every"):
        scope = make_scope(query=query, user="alice", budget_tokens=400, k=8)
        a = held.lexical_search(query, scope, views.latest, base, top_k=10, span=None)
        b = whole.lexical_search(query, scope, views.latest, base, top_k=10, span=None)
        assert a is not None and b is not None and len(a.rows) >= 1
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)
        assert (a.ceiling, a.coverage) == pytest.approx((b.ceiling, b.coverage))
    assert isinstance(base, lexical.BM25Index)


def test_small_segments_merge_and_dead_entries_leave_the_files(shells, monkeypatch):
    """Small segments are merged once enough pile up; an entry replaced by a PATCH or
    deleted is dead in the manifest at once and gone from the files at the next rewrite;
    a store whose files hold more dead entries than live ones is rewritten whole."""
    from helix_ray.live import writer as writer_module
    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.delta_format import current_delta_version

    monkeypatch.setattr(writer_module, "MERGE_SMALL_AT", 3)
    monkeypatch.setattr(writer_module, "SMALL_SEGMENT", 2)
    writer, store = shells["writer"], shells["store"]
    for n in range(3):
        writer.add([{"id": f"alice-m{n}", "text": f"Merge drill {n}: the on-call rota moves to team {n}."}], "alice")
    core = writer.core
    assert len(core.segments) == 1 and sorted(core.segments[0][1].tolist()) == sorted(
        core.entries[f"alice-m{n}"]["seq"] for n in range(3))
    # On disk: the files some kept snapshot lists (a lagging replica may still read one), no more.
    kept = [json.loads(f.read_text()) for f in (store / "delta").glob("*.json") if f.stem.isdigit()]
    assert len(kept) == 4 and set(_segment_files(store)) == {n for m in kept for n in m["segments"]}
    dead = {core.entries["alice-m0"]["seq"], core.entries["alice-m1"]["seq"]}
    writer.patch("alice-m0", {"text": "Merge drill 0: the on-call rota moved to the platform team."}, "alice")
    writer.delete("alice-m1", "alice")
    manifest = json.loads((store / "delta" / f"{current_delta_version(store):010d}.json").read_text())
    assert set(manifest["dead"]) == dead
    snapshot = DeltaSegment.load(store, current_delta_version(store))
    assert sorted(snapshot.ids.tolist()) == ["alice-m0", "alice-m2"] and "alice-m1" in snapshot.tombstones
    assert snapshot.texts[snapshot.ids.tolist().index("alice-m0")].endswith("the platform team.")
    # Two dead rows against two live ones: one more delete tips it, and the files are rewritten.
    writer.delete("alice-m2", "alice")
    assert len(core.segments) == 1 and core.segments[0][1].tolist() == [core.entries["alice-m0"]["seq"]]
    manifest = json.loads((store / "delta" / f"{current_delta_version(store):010d}.json").read_text())
    assert manifest["dead"] == [] and manifest["segments"] == [core.segments[0][0]]


def test_a_write_whose_publish_failed_is_in_the_next_snapshot(shells, monkeypatch):
    """A write is committed to DuckDB before its snapshot is published; when publishing
    fails (a full disk), the caller gets a DiskFull, and the next publish carries the
    write all the same: no later snapshot leaves a live entry out."""
    from helix_ray.live import writer as writer_module
    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.delta_format import current_delta_version
    from helix_ray.serve.errors import ReplicaError

    real, calls = writer_module.publish_manifest, []

    def full_disk_once(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "publish_manifest", full_disk_once)
    writer, store = shells["writer"], shells["store"]
    with pytest.raises(ReplicaError, match="while publishing the delta snapshot") as refused:
        writer.add([{"id": "alice-unpublished", "text": "The disk filled up while this note was published."}],
                   "alice")
    assert refused.value.kind == "DiskFull"  # HTTP 507, as any full disk
    writer.add([{"id": "alice-after", "text": "The next write published fine."}], "alice")
    snapshot = DeltaSegment.load(store, current_delta_version(store))
    assert sorted(snapshot.ids.tolist()) == ["alice-after", "alice-unpublished"] and len(calls) == 2
    *_, out = local_recall(shells, "what happened when the disk filled up?")
    assert "alice-unpublished" in [i["id"] for i in out["items"]]


def test_a_format_1_delta_snapshot_is_still_read(shells):
    """A delta snapshot of format 1 (one whole table per snapshot, no segment files) still serves."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.delta_format import delta_dir

    writer, store = shells["writer"], shells["store"]
    writer.add([{"id": "alice-v1", "text": "The old snapshot format held every entry in one file."}], "alice")
    name = writer.core.segments[0][0]
    with pa.memory_map(str(delta_dir(store) / name)) as source:
        table = ipc.open_file(source).read_all()
    meta = {"format": "helix-delta", "format_version": 1, "version": 99, "tombstones": [["alice-03", "alice", None]]}
    table = table.replace_schema_metadata({"helix_delta": json.dumps(meta)})
    with pa.OSFile(str(delta_dir(store) / "0000000099.arrow"), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    old = DeltaSegment.load(store, 99)
    assert old.ids.tolist() == ["alice-v1"] and set(old.tombstones) == {"alice-03"}
    assert old.late.take(np.array([0])).tokens.shape[0] > 0


def test_the_delta_analyses_text_as_its_generation_does(shells):
    """BM25 over online writes uses the analyzer the generation's manifest records: a
    question in words meets a compound identifier before compaction, as after it."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.index.bm25 import Analyzer
    from helix_ray.store.generation import Generation

    recorded = Generation.open_current(shells["store"]).manifest["bm25"]
    assert Analyzer.from_dict(recorded).split_identifiers
    shells["writer"].add([{"id": "alice-ident", "text": "Call refreshVaultTokenCache() after rotating signing keys."}],
                         "alice")
    plan = shells["embedder"].plan("refresh the vault token cache", user="alice", config=RetrievalConfig(),
                                   budget_tokens=400, k=8, explain=True)
    hits = asyncio.run(shells["bm25"].search(plan))
    out = asyncio.run(shells["ranker"].finish(plan, hits, asyncio.run(shells["dense"].search(plan))))
    assert next(r for r in out["explain"] if r["id"] == "alice-ident")["bm25_rank"] == 1
    assert next(i for i in out["items"] if i["id"] == "alice-ident")["origin"] == "delta"


def test_the_delta_strong_signal_weighs_the_query_terms_the_user_holds(shells):
    """A write only in the delta: the query naming it exactly is a strong signal; the same
    query with a word no memory holds is not (the delta merge uses the same coverage rule
    as the generation's BM25 leg)."""
    shells["writer"].add([{"id": "alice-zq", "text": "zqxv flux capacitor calibration"}], "alice")
    _, exact, _, _ = local_recall(shells, "zqxv flux capacitor calibration")
    assert exact.hits.rows[0] >= DELTA_BASE_ROWS and exact.hits.strong_signal
    _, unknown, _, _ = local_recall(shells, "zqxv flux capacitor calibration wombat")
    assert unknown.hits.rows[0] == exact.hits.rows[0] and not unknown.hits.strong_signal


def test_online_writes_carry_late_interaction_tokens_through_a_restart(shells):
    """A write is scored by MaxSim like a stored memory: its tokens are encoded by the
    Writer, logged durably, published in the delta snapshot and read by the Ranker."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.recall import late
    from helix_ray.live.delta import DeltaSegment
    from helix_ray.live.delta_format import current_delta_version
    from helix_ray.live.writer import WriterCore
    from helix_ray.config import IngestConfig
    from helix_ray.token_encoder import from_blobs, get_token_encoder, to_blobs

    text = "The staging Kafka cluster was renamed to heron-7 after the quota incident."
    query = "what is the staging Kafka cluster called now?"
    writer, store = shells["writer"], shells["store"]
    writer.add([{"id": "alice-heron", "text": text}], "alice")
    delta = DeltaSegment.load(store, current_delta_version(store))
    pos = list(delta.ids).index("alice-heron")
    encoder = get_token_encoder(pool_factor=IngestConfig().late_interaction.pool_factor)  # as the Writer's
    q = encoder.encode_query(query)
    direct = late.maxsim(q, from_blobs(*to_blobs(encoder.encode_passages([text]))), np.array([0]))
    np.testing.assert_allclose(late.maxsim(q, delta.late, np.array([pos])), direct, atol=0.02)

    writer.core.close()
    writer.core = WriterCore(store)  # a restarted Writer replica replays its log, tokens included
    assert writer.core.entries["alice-heron"]["late_codes"] == delta.late_codes[pos]
    plan = shells["embedder"].plan(query, user="alice", config=RetrievalConfig(), budget_tokens=400, k=8,
                                   explain=True)
    lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
    out = asyncio.run(shells["ranker"].finish(plan, lexical, dense))
    row = next(r for r in out["explain"] if r["id"] == "alice-heron")
    assert row["late_maxsim"] == pytest.approx(float(direct[0]), abs=0.02)
    assert out["items"][0]["id"] == "alice-heron"


def test_an_online_write_gets_the_graph_score_it_gets_after_compaction(shells):
    """A write in the delta has no edges yet, but as a seed of graph expansion it holds
    the restart mass every seed holds: its graph signal is not zeroed for being new, so
    a memory recalled right after it is written ranks as it does once compacted."""
    from helix_ray.config import RetrievalConfig

    text = "The staging NATS cluster is now called nats-blue after the October migration."
    shells["writer"].add([{"id": "alice-nats", "text": text}], "alice")

    def row() -> dict:
        plan = shells["embedder"].plan("what did we rename the staging message broker to", user="alice",
                                       config=RetrievalConfig(), budget_tokens=400, k=8, explain=True)
        lexical = asyncio.run(shells["bm25"].search(plan))
        out = asyncio.run(shells["ranker"].finish(plan, lexical, asyncio.run(shells["dense"].search(plan))))
        assert out["flags"]["graph"]["method"] == "ppr"  # expansion ran (a strong signal would skip it)
        return next(r for r in out["explain"] if r["id"] == "alice-nats")

    before = row()
    assert before["rrf_score"] > 0 and before["graph_ppr"] > 0, before
    assert shells["writer"].compact()["published"]
    asyncio.run(shells["ranker"].views.refresh())
    after = row()
    assert after["graph_ppr"] > 0
    assert abs(before["graph"] - after["graph"]) < 0.35, (before, after)
