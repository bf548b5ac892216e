"""Generations of format 2: a full generation's files plus segments of folded writes.

A segment holds delta entries as the delta's files do; recall searches its rows as it
searches the live delta's, so a write answers the same whether it is pending in the
delta or frozen in a segment. These tests freeze the live delta of a real store into a
segment with :func:`helix_ray.store.publish.publish_segment` (what a fold writes) and
compare recall before and after, through ``Memory`` (real DuckDB file, real encoders).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from helix_ray import Memory
from helix_ray.errors import ManifestMismatch
from helix_ray.live.delta_format import current_delta_version, delta_dir, publish_manifest
from helix_ray.store.doctor import check_store
from helix_ray.store.generation import DEAD_SCHEMA, Generation, current_generation_number
from helix_ray.store.publish import prune, publish_segment
from tests.helpers import memory, write_jsonl

BASE = [memory(0, "The gateway listens on port 8443 for tenant traffic."),
        memory(1, "Redis caches the billing service keys for ten minutes."),
        memory(2, "The deploy pipeline runs migrations before rolling the gateway pods."),
        memory(3, "Lee's gateway runs on port 9000.", user="lee")]
WRITES = [memory(10, "We pinned uvicorn to 0.30 after the keep-alive bug."),
          memory(11, "The ledger service retries a failed payout three times with backoff."),
          memory(12, "Lee rotates the vault tokens every Monday.", user="lee")]
QUERIES = [("why did we pin uvicorn?", "dana"), ("which port does the gateway listen on?", "dana"),
           ("how are payouts retried?", "dana"), ("how long are billing keys cached?", "dana"),
           ("when are vault tokens rotated?", "lee")]


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    from helix_ray.ingest.run import ingest

    folder = tmp_path_factory.mktemp("segments")
    store = folder / "store"
    report = ingest([write_jsonl(folder / "base.jsonl", BASE)], store, runner="local", show_progress=False)
    assert report.published
    return store


@pytest.fixture()
def store(base_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(base_store, copy)
    return copy


def answers(store) -> dict[tuple[str, str], list[tuple[str, float]]]:
    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        return {(q, u): [(item.id, round(item.score, 5)) for item in mem.recall(q, user=u).items]
                for q, u in QUERIES}


def live_rows(store) -> pa.Table:
    """The live delta snapshot's entries, as the delta's files hold them."""
    folder = delta_dir(store)
    meta = json.loads((folder / f"{current_delta_version(store):010d}.json").read_text())
    tables = [ipc.open_file(pa.memory_map(str(folder / name), "r")).read_all() for name in meta["segments"]]
    table = pa.concat_tables(tables)
    return table.filter(pa.compute.invert(pa.compute.is_in(table.column("seq"), pa.array(meta["dead"], pa.int64()))))


def freeze(store, dead: dict[str, int] | None = None, *, empty_delta: bool = True) -> int:
    """Publish the live delta's entries as a segment of the next generation; with
    ``empty_delta``, then an empty delta snapshot (what a fold's writer does after)."""
    dead = dead or {}
    rows = live_rows(store)
    frozen = Generation.open_current(store).segments  # the writer's log still lists them as pending
    if frozen is not None:
        rows = rows.filter(pa.compute.invert(pa.compute.is_in(rows.column("seq"), frozen.column("seq"))))
    number = publish_segment(store, rows,
                             pa.table({"id": list(dead), "seq": list(dead.values())}, schema=DEAD_SCHEMA))
    if empty_delta:
        publish_manifest(store, current_delta_version(store) + 1, [])
    return number


def test_writes_answer_alike_from_the_delta_and_from_a_segment(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    pending = answers(store)
    assert pending[QUERIES[0]][0][0] == "m010" and pending[QUERIES[4]][0][0] == "m012"

    number = freeze(store)
    gen = Generation.open_current(store, verify="full")
    assert number == current_generation_number(store) == 2 and gen.manifest["format_version"] == 2
    assert gen.size == len(BASE) and gen.segments.num_rows == len(WRITES) and gen.dead == {}
    assert gen.manifest["counts"]["segment_rows"] == len(WRITES)
    assert answers(store) == pending


def test_a_fold_that_ended_before_the_delta_said_so_answers_once(store):
    """The entries are in the segment and still pending in the live snapshot: each
    answers once, from the segment."""
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    pending = answers(store)
    freeze(store, empty_delta=False)
    assert answers(store) == pending


def test_dead_ids_hide_the_base_row_and_older_segment_rows(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    first = Generation.open_current(store)
    seq = {i: s for i, s in zip(live_rows(store).column("id").to_pylist(), live_rows(store).column("seq").to_pylist())}
    # m000 (a base row) deleted, m010 (a segment row) deleted after it was written
    freeze(store, {"m000": seq["m010"] + 1, "m010": seq["m010"] + 1})
    found = answers(store)
    everything = {i for items in found.values() for i, _ in items}
    assert "m000" not in everything and "m010" not in everything
    assert found[QUERIES[2]][0][0] == "m011"
    assert first.number == 1


def test_the_live_delta_replaces_and_deletes_segment_rows(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    freeze(store, empty_delta=False)  # the writer's log still lists them as pending
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.patch("m011", user="dana", text="Payouts are never retried; a failed one pages the on-call.")
        mem.delete("m010", user="dana")
        found = {(q, u): [i.id for i in mem.recall(q, user=u).items] for q, u in QUERIES}
        texts = {i.id: i.text for i in mem.recall("how are payouts retried?", user="dana").items}
    assert "m010" not in {i for ids in found.values() for i in ids}
    assert texts["m011"].startswith("Payouts are never retried")
    assert sum(ids.count("m011") for ids in found.values()) <= len(QUERIES)  # one copy per answer at most
    assert all(len(ids) == len(set(ids)) for ids in found.values())


def test_a_segment_links_the_generation_it_extends(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES[:1])
    freeze(store)
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES[1:])
    freeze(store, {"m002": 1})
    third = Generation.open_current(store, verify="full")
    base = store / "generations" / "000001"
    assert third.number == 3 and third.manifest["base"] == 1 and third.manifest["parent"] == 2
    for name in ("memories.arrow", "vectors.f16.npy", "graph/indices.npy", "segments/s000002.arrow"):
        source = (base if not name.startswith("segments") else store / "generations" / "000002") / name
        assert os.stat(third.path / name).st_ino == os.stat(source).st_ino, name
    assert third.segments.num_rows == len(WRITES) and third.manifest["counts"]["segment_rows"] == len(WRITES)
    assert third.dead == {"m002": 1}
    checks = {c.name: c for c in check_store(store)}
    assert checks["manifest"].ok and "3 more in 2 segments" in checks["manifest"].found, checks["manifest"]
    assert checks["files"].ok and "segments" not in checks["files"].found, checks["files"]
    prune(store, keep=1)  # the base folder goes; its files stay reachable through the links
    assert not base.exists()
    assert answers(store)[QUERIES[2]][0][0] == "m011"


def test_a_replica_warming_a_folded_generation_reads_only_its_new_files(store):
    """A replica warms each generation it swaps to by reading its files through the page
    cache; a folded one is its parent's files linked, read already."""
    from helix_ray.recall.warm import ROLE_FILES, read_through

    parent = Generation.open_current(store).path
    read_through(parent, ROLE_FILES["all"], once=True)
    assert read_through(parent, ROLE_FILES["all"], once=True) == 0
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    folded = store / "generations" / f"{freeze(store):06d}"
    seen = {os.stat(p).st_ino for p in parent.rglob("*") if p.is_file()}
    roots = [folded / name for name in ROLE_FILES["all"]]
    files = [p for root in roots for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()]
    assert files and all(p.stat().st_ino in seen for p in files)  # a fold links every file warming reads
    assert read_through(folded, ROLE_FILES["all"], once=True) == 0
    whole = read_through(parent, ROLE_FILES["all"])
    assert whole == sum(p.stat().st_size for p in files) > 0
    copy = shutil.copytree(parent, store / "copy")  # the same bytes in other files: read
    assert read_through(copy, ROLE_FILES["all"], once=True) == whole


def test_a_folded_generation_shares_its_parents_per_row_columns(store):
    """What a reader builds per row, and the BM25 index, is built once for a base and the
    folds on it."""
    import gc

    parent = Generation.open_current(store)
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    folded = Generation(store / "generations" / f"{freeze(store):06d}")
    assert folded.columns is parent.columns and folded.scope_columns is parent.scope_columns
    assert folded.bm25 is parent.bm25  # the linked index files: their vocabulary parsed once
    copy = Generation(shutil.copytree(parent.path, store / "copy"))  # the same rows in another file
    assert copy.columns is not parent.columns and copy.bm25 is not parent.bm25
    assert list(copy.columns.ids) == list(parent.columns.ids)
    from helix_ray.store import generation

    inode = os.stat(parent.path / "memories.arrow").st_ino
    assert sorted(key[0] for key in list(generation._BUILT.keys()) if key[2] == inode) == ["columns", "rows", "scope"]
    del parent, folded
    gc.collect()
    assert not any(key[2] == inode for key in list(generation._BUILT.keys()))  # gone with the generations


def test_generations_linking_one_hnsw_file_share_its_view(tenant_store, tmp_path):
    """A fold links its parent's HNSW files: every open generation that links one file
    searches one view of it; a copy of the bytes in another file gets its own."""
    parent = Generation.open_current(tenant_store[0])
    linked = Generation(shutil.copytree(parent.path, tmp_path / "linked", copy_function=os.link))
    copied = Generation(shutil.copytree(parent.path, tmp_path / "copied"))
    users = [u for u in parent.partitions if parent.has_dense_index(u)]
    assert users
    for user in users:
        assert linked.dense_index(user) is parent.dense_index(user)
        assert copied.dense_index(user) is not parent.dense_index(user)


def test_a_crash_while_writing_a_segment_leaves_the_current_generation(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    with pytest.raises(RuntimeError, match="injected crash"):
        publish_segment(store, live_rows(store), DEAD_SCHEMA.empty_table(), crash_after="s000002.arrow")
    assert current_generation_number(store) == 1
    assert freeze(store) == 2  # the next publish clears what the crash left
    assert not list((store / "generations").glob(".tmp-*"))


def test_a_damaged_segment_is_refused_by_name(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    freeze(store)
    segment = store / "generations" / "000002" / "segments" / "s000002.arrow"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.unlink()  # a linked file: write a new one, not through the link
    segment.write_bytes(bytes(data))
    with pytest.raises(Exception, match="s000002.arrow"):
        Generation.open_current(store, verify="full")
    files = {c.name: c for c in check_store(store)}["files"]
    assert not files.ok and "segments/s000002.arrow" in files.found, files


def test_a_format_this_helix_does_not_read_is_refused(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    freeze(store)
    path = store / "generations" / "000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 3
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestMismatch, match="format_version 3 .this Helix reads 1 and 2."):
        Generation.open_current(store)
    assert np.asarray(Generation(store / "generations" / "000001").vectors).shape[0] == len(BASE)


def test_the_serve_shells_answer_from_a_segment(shells):
    """The BM25, dense and ranker replicas search a generation's segments as they search
    the delta, and tag what they return from it as the generation's."""
    from helix_ray.serve import shells as sh
    from tests.helpers import local_recall

    store = shells["store"]
    shells["writer"].add([{"id": "alice-seg0", "text": "The canary fleet runs in eu-west-3."}], "alice")
    query = "where does the canary fleet run?"
    *_, pending = local_recall(shells, query)
    assert pending["items"][0]["id"] == "alice-seg0" and pending["items"][0]["origin"] == "delta"
    freeze(store, empty_delta=False)
    fresh = {"embedder": shells["embedder"], "bm25": sh.BM25Shell(store), "dense": sh.DenseShell(store),
             "ranker": sh.RankerShell(store)}
    _, lexical, dense, frozen = local_recall(fresh, query)
    assert lexical.generation == dense.generation == frozen["generation"] == 2
    # The same order and scores; a score may differ in its last digit (float32 sums in another order).
    assert [i["id"] for i in frozen["items"]] == [i["id"] for i in pending["items"]]
    assert [i["score"] for i in frozen["items"]] == pytest.approx([i["score"] for i in pending["items"]], abs=1e-5)
    assert frozen["items"][0]["origin"] == "generation"


# --------------------------------------------------------------------------- the Writer's fold


def fold(mem: Memory) -> dict:
    report = mem._core().fold()
    if report.get("published"):
        mem._compacted(report)
    return report


def test_a_fold_writes_a_segment_and_recall_answers_as_before(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
    pending = answers(store)
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        report = fold(mem)
        assert report["published"] and report["mode"] == "segment" and report["folded"] == len(WRITES)
        assert report["generation"] == current_generation_number(store) == 2
        assert mem.stats()["pending_writes"] == 0 and mem.stats()["memories"] == len(BASE) + len(WRITES)
        assert fold(mem)["reason"] == "nothing to compact"
    gen = Generation.open_current(store, verify="full")
    assert gen.manifest["format_version"] == 2 and gen.segments.num_rows == len(WRITES)
    assert answers(store) == pending  # and after the writer replays its log
    assert not list((store / "inbox").glob("serve-*.jsonl"))  # the generation holds those writes now


def test_recall_during_a_fold_reads_the_older_generation_until_the_new_one_is_warm(store, monkeypatch):
    """A compaction of this process publishes; until the Memory has opened and warmed
    what it published, recall reads the generation it had, with the writes from the
    delta, and answers alike before, during and after."""
    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        mem.add(WRITES)

        def asked() -> dict:
            return {(q, u): [(item.id, round(item.score, 5)) for item in mem.recall(q, user=u).items]
                    for q, u in QUERIES}

        before, during, served = asked(), [], []
        core = mem._core()

        def fold_then_ask():
            report = core.fold()
            assert report["published"] and current_generation_number(store) == 2
            during.append(asked())
            served.append(mem.recaller.generation.number)
            return report

        monkeypatch.setattr(core, "compact", fold_then_ask)
        assert mem.compact()["mode"] == "segment"
        assert served == [1] and mem.recaller.generation.number == 2
        frozen = mem._views.generations[2].frozen
        assert frozen is not None  # its rows' postings made before a recall asked:
        assert all(part._terms_by for part in frozen.parts_kept(np.ones(len(frozen), bool))[0])
        assert before == during[0] == asked()


def test_a_fold_parses_and_analyses_only_the_segment_it_adds(store):
    """The next generation of a fold links its parent's segment files: their rows are
    parsed and analysed for BM25 once per process, and the new generation adds one
    segment's worth of work, however many segments came before; what is built from
    its other linked files (the session nodes) is shared."""
    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        mem.add(WRITES[:2])
        mem.recall(QUERIES[0][0], user="dana")  # opens the store's views, which open what each fold publishes
        assert fold(mem)["published"]
        cache = mem._views.frozen
        first = mem._views.generations[2].frozen
        reads = cache.reads
        mem.add(WRITES[2:])
        mem.delete(WRITES[0]["id"], user="dana")  # the second fold's dead list hides a first segment row
        assert fold(mem)["published"]
        second = mem._views.generations[3].frozen
        assert cache.reads == reads + 1  # the new segment file alone
        (old_part,), _ = first.parts_kept(np.ones(len(first), bool))
        parts, kept = second.parts_kept(np.ones(len(second), bool))
        assert parts[0] is old_part and old_part._terms_by  # the same object, analysed once
        views = mem._views.generations
        assert views[3].session_nodes is views[2].session_nodes  # built once from the linked entities.arrow
        assert sorted(second.ids.tolist()) == sorted(Generation.open_current(store).segment_rows()
                                                     .column("id").to_pylist())
        assert WRITES[0]["id"] not in second.ids.tolist() and kept.sum() == len(WRITES) - 1
        got = {(q, u): [(item.id, round(item.score, 5)) for item in mem.recall(q, user=u).items]
               for q, u in QUERIES}
    assert answers(store) == got  # a process that parsed every segment anew answers alike
    assert WRITES[0]["id"] not in [i for items in got.values() for i, _ in items]


def test_warming_a_fold_looks_up_the_terms_of_the_writes_it_folded(store, monkeypatch):
    """The live delta's texts were analysed for BM25 when recall first searched them; the
    fold's segment holds the same writes, so warming its generation analyses none again."""
    from helix_ray.index.bm25 import Analyzer

    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        before = mem.recall("why did we pin uvicorn?", user="dana")  # the delta's texts analysed
        analysed: list[str] = []
        inner = Analyzer.tokenize

        def tokenize(self, texts, **kwargs):
            analysed.extend(texts)
            return inner(self, texts, **kwargs)

        monkeypatch.setattr(Analyzer, "tokenize", tokenize)
        assert fold(mem)["published"] and mem._views.generations[2].frozen is not None
        frozen = mem._views.generations[2].frozen
        assert all(part._terms_by for part in frozen.parts_kept(np.ones(len(frozen), bool))[0])  # warmed
        assert not [t for t in analysed for w in WRITES if w["text"] in t]  # by looking the terms up
        after = mem.recall("why did we pin uvicorn?", user="dana")
    assert [(i.id, round(i.score, 5)) for i in after.items] == [(i.id, round(i.score, 5)) for i in before.items]


def test_a_recall_inside_a_compaction_sees_what_an_ingest_published_before_it(store, tmp_path, monkeypatch):
    """A Memory still on the generation before an ingest does not go on reading it while
    the next compaction runs: that compaction started from the ingest's generation, and
    only a Memory that serves it may wait for the swap."""
    more = write_jsonl(tmp_path / "more.jsonl", [memory(20, "The kiln scheduler drains its jobs at midnight UTC.")])
    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        assert mem.recall("which port does the gateway listen on?", user="dana").items  # serves generation 1
        assert mem.ingest([more]).published  # generation 2; this Memory has not read it yet
        mem.add(WRITES[:1])
        core, seen = mem._core(), []
        inner = core.compact

        def compact_then_ask(*args, **kwargs):
            report = inner(*args, **kwargs)  # published, not yet swapped to
            for query in ("when does the kiln scheduler drain its jobs?", "why did we pin uvicorn?"):
                seen.append([item.id for item in mem.recall(query, user="dana").items])
            return report

        monkeypatch.setattr(core, "compact", compact_then_ask)
        assert mem.compact()["published"]
    assert memory(20, "")["id"] in seen[0] and WRITES[0]["id"] in seen[1]


def test_writes_after_a_fold_change_and_delete_folded_memories(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        fold(mem)
        mem.patch("m011", user="dana", text="Payouts are never retried; a failed one pages the on-call.")
        mem.delete("m010", user="dana")
        mem.delete("m001", user="dana")  # a base row
        before = {(q, u): [(i.id, i.text) for i in mem.recall(q, user=u).items] for q, u in QUERIES}
        fold(mem)
        after = {(q, u): [(i.id, i.text) for i in mem.recall(q, user=u).items] for q, u in QUERIES}
    assert after == before
    shown = {i for items in after.values() for i, _ in items}
    assert "m010" not in shown and "m001" not in shown
    assert dict(after[QUERIES[2]])["m011"].startswith("Payouts are never retried")
    gen = Generation.open_current(store)
    assert gen.number == 3 and gen.dead.keys() >= {"m010", "m001", "m011"}
    assert {k: [i for i, _ in v] for k, v in answers(store).items()} == {k: [i for i, _ in v] for k, v in after.items()}


def test_a_full_compaction_takes_the_segments_into_its_own_files(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        fold(mem)
        mem.patch("m000", user="dana", text="The gateway listens on port 9443 since the TLS change.")
        mem.delete("m012", user="lee")
        fold(mem)
        mem.add([memory(13, "The search cluster keeps 30 days of logs.")])
        mem.patch("m000", user="dana", salience=0.9)  # the same text as the segment's: still not the base's
        report = mem.compact()
        assert report["published"] and report.get("mode") != "segment"
        items = {i.id: i.text for i in mem.recall("which port does the gateway listen on?", user="dana").items}
        assert mem.stats()["memories"] == len(BASE) + len(WRITES) + 1 - 1
    gen = Generation.open_current(store, verify="full")
    assert gen.manifest["format_version"] == 1 and gen.segments is None
    held = dict(zip(gen.memories.column("id").to_pylist(), gen.memories.column("text").to_pylist()))
    assert set(held) == {"m000", "m001", "m002", "m003", "m010", "m011", "m013"}
    assert held["m000"].startswith("The gateway listens on port 9443") and items["m000"] == held["m000"]
    assert gen.memories.column("salience")[gen.memories.column("id").to_pylist().index("m000")].as_py() == \
        pytest.approx(0.9)


def test_an_ingest_over_a_generation_with_segments_keeps_their_rows(store, tmp_path):
    from helix_ray.ingest.run import ingest

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        fold(mem)
    report = ingest([write_jsonl(tmp_path / "more.jsonl", [memory(20, "Backups run at 02:00 UTC.")])], store,
                    runner="local", show_progress=False)
    assert report.published and report.new == len(WRITES) + 1
    gen = Generation.open_current(store)
    assert gen.manifest["format_version"] == 1
    assert set(gen.memories.column("id").to_pylist()) == {r["id"] for r in BASE + WRITES} | {"m020"}
    assert answers(store)[QUERIES[0]][0][0] == "m010"


def test_a_fold_that_fails_before_the_database_records_it_changes_nothing(store, monkeypatch):
    from helix_ray.store.db import StoreDB

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        pending = {(q, u): [i.id for i in mem.recall(q, user=u).items] for q, u in QUERIES}

        def fail(self, number, run_id):
            raise RuntimeError("injected failure while recording")

        monkeypatch.setattr(StoreDB, "record_generation", fail)
        with pytest.raises(RuntimeError, match="injected failure"):
            fold(mem)
        monkeypatch.undo()
        assert current_generation_number(store) == 1 and mem.stats()["pending_writes"] == len(WRITES)
        assert {(q, u): [i.id for i in mem.recall(q, user=u).items] for q, u in QUERIES} == pending
        assert fold(mem)["published"] and current_generation_number(store) == 3  # 2 was left unused
    assert {k: [i for i, _ in v] for k, v in answers(store).items()} == pending


def test_forgetting_a_user_leaves_no_byte_of_their_folded_writes(store):
    from tests.helpers import files_holding

    from helix_ray.live.writer import WriterCore

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        fold(mem)
    assert files_holding(store, "vault tokens every Monday")
    core = WriterCore(store, warn_tokens=False)
    try:
        gone = core.forget_user("lee")
    finally:
        core.close()
    assert gone["compacted"] and gone["memories"] == 2, gone
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert [i.id for i in mem.recall("when are vault tokens rotated?", user="lee").items] == []
        assert mem.recall("why did we pin uvicorn?", user="dana").items[0].id == "m010"
    assert files_holding(store, "vault tokens every Monday") == [] and files_holding(store, "Lee's gateway") == []
    assert Generation.open_current(store).manifest["format_version"] == 1


def test_compaction_folds_while_the_segments_stay_small_then_rebuilds(store):
    from helix_ray.config import IngestConfig

    small = IngestConfig(fold={"min_base_rows": 0, "max_rows": 4, "max_share": 1.0})
    with Memory(store, ingest=small, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        first = mem.compact()
        assert first["mode"] == "segment" and first["segment_rows"] == 3
        mem.add([memory(30, "The CDN caches images for a day."), memory(31, "Payroll runs on the 25th.")])
        second = mem.compact()  # 5 rows would pass max_rows
        assert second["published"] and "mode" not in second
        assert Generation.open_current(store).manifest["format_version"] == 1
        assert mem.recall("why did we pin uvicorn?", user="dana").items[0].id == "m010"
    with Memory(store, ingest=IngestConfig(fold={"min_base_rows": len(BASE) + 6}), warm=False,
                compact_interval_s=None) as mem:  # a base below min_base_rows: always a rebuild
        mem.add([memory(32, "Alerts page the on-call after five minutes.")])
        assert "mode" not in mem.compact()


def test_a_dead_list_of_the_same_size_gets_its_own_checksum(store):
    """Folding a change to an id already dead keeps the list's size: its checksum is
    taken again, not carried from the generation before."""
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)
        fold(mem)
        mem.patch("m011", user="dana", salience=0.9)
        fold(mem)
    gen = Generation.open_current(store, verify="full")
    assert gen.number == 3 and set(gen.dead) == {"m010", "m011", "m012"}
    assert {c.name: c for c in check_store(store)}["files"].ok


def test_a_fold_of_deletes_alone_hides_the_deleted_rows(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.delete("m000", user="dana")
        report = fold(mem)
        assert report["published"] and report["segment_rows"] == 0
        assert "m000" not in ids_of(mem, "which port does the gateway listen on?")
    with Memory(store, warm=False, compact_interval_s=None) as mem:  # and after the log is replayed
        assert "m000" not in ids_of(mem, "which port does the gateway listen on?")


def test_forgetting_a_user_whose_rows_are_only_in_segments(store):
    from helix_ray.live.writer import WriterCore
    from tests.helpers import files_holding

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(50, "Zoe keeps the kiln schedule in the blue binder.", user="zoe")])
        fold(mem)
    core = WriterCore(store, warn_tokens=False)
    try:
        gone = core.forget_user("zoe")
    finally:
        core.close()
    assert gone["compacted"], gone
    assert files_holding(store, "kiln schedule in the blue binder") == []
    assert Generation.open_current(store).manifest["format_version"] == 1
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert mem.recall("where is the kiln schedule?", user="zoe").items == []


def test_a_fold_recorded_but_not_current_is_made_current_by_the_next_writer(store, monkeypatch):
    from helix_ray.live import fold as fold_module

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES)

        def crash(store_, number):
            raise RuntimeError("injected crash before CURRENT moves")

        monkeypatch.setattr(fold_module, "set_current", crash)
        with pytest.raises(RuntimeError, match="injected crash"):
            fold(mem)
    monkeypatch.undo()
    assert current_generation_number(store) == 1
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(13, "The search cluster keeps 30 days of logs.")])  # the Writer starts: rolls forward
        assert current_generation_number(store) == 2
        assert fold(mem)["generation"] == 3
        assert ids_of(mem, "why did we pin uvicorn?")[0] == "m010"
        assert mem._core().compact(rebuild=True)["published"]  # and a rebuild keeps every write
    held = set(Generation.open_current(store).memories.column("id").to_pylist())
    assert held >= {"m010", "m011", "m012", "m013"}


def ids_of(mem: Memory, query: str, user: str = "dana") -> list[str]:
    return [item.id for item in mem.recall(query, user=user).items]


ADAPT_QUERIES = {"m000": ["which port does the gateway listen on?", "gateway port for tenants", "tenant traffic port",
                          "where does tenant traffic arrive?", "what port is 8443?"],
                 "m001": ["how long are billing keys cached?", "billing key cache lifetime", "redis billing cache",
                          "when do cached billing keys expire?", "what does redis cache?"],
                 "m010": ["why did we pin uvicorn?", "uvicorn version pin", "keep-alive bug workaround",
                          "which uvicorn release do we use?", "what broke keep-alive?"],
                 "m011": ["how are payouts retried?", "ledger payout retries", "failed payout backoff",
                          "how many times is a payout retried?", "what does the ledger do on failure?"]}


def test_an_adapter_fits_on_the_memories_a_segment_holds(store):
    """Labelled queries may name memories written online and folded into a segment: their
    vectors are the segment's, a replaced memory's its new version's, and a memory the
    segment deletes is not found."""
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.adapter import _Memories, fit_pairs

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add(WRITES + [memory(1, "Redis now caches the billing keys for an hour.")])  # m001 again
    rows = live_rows(store)
    seqs = dict(zip(rows.column("id").to_pylist(), rows.column("seq").to_pylist()))
    freeze(store, {"m001": seqs["m001"], "m002": max(seqs.values()) + 1})  # m001 replaced, m002 deleted
    gen = Generation.open_current(store)
    start, end = gen.partitions["dana"]
    segment = gen.segment_rows()
    vector_of = dict(zip(segment.column("id").to_pylist(), segment.column("vector").to_numpy(zero_copy_only=False)))

    pool, at = _Memories(gen).of("dana", ["m000", "m001", "m002", "m010", "m012", "nope"])
    assert len(pool) == end - start + 3  # the base rows, then dana's three segment rows
    assert at[0] == gen.columns.id_to_row["m000"] - start and at[1:] and all(p >= end - start for p in at[1:])
    assert len(at) == 3  # m002 is deleted, m012 is lee's, "nope" is nobody's
    assert sorted(map(tuple, pool[at[1:]].round(6))) == sorted(
        tuple(np.asarray(vector_of[i], np.float32).round(6)) for i in ("m001", "m010"))

    pairs = [{"query": q, "user": "dana", "memory_ids": [i]} for i, qs in ADAPT_QUERIES.items() for q in qs]
    pairs.append({"query": "what does the deploy pipeline run first?", "user": "dana", "memory_ids": ["m002"]})
    _, report = fit_pairs(gen, get_embedder(), pairs, ridge=1.0)
    assert (report["queries"], report["skipped_queries"], report["skipped_ids"]) == (20, 1, 1)
