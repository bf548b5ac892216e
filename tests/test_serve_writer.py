"""The Writer, no Ray: its durable log and what a restart rebuilds from it, compaction
(what it reuses, what holds while it runs, how it fails and backs off), feedback, and the
access log that recall hits reach and the next generation folds."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from tests.helpers import STRONG_ERROR, STRONG_ID, local_recall, tenant_records


def test_writer_rebuilds_the_delta_from_its_log_after_a_restart(shells):
    from helix_ray.live.writer import WriterCore

    writer = shells["writer"]
    writer.add([{"id": "alice-durable", "text": "The restart drill runs every second Thursday."}], "alice")
    writer.delete("alice-03", "alice")
    version = writer.core.version
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # what a restarted Writer replica does
    assert "alice-durable" in writer.core.entries and "alice-03" in writer.core.tombstones
    assert writer.core.version == version + 1
    *_, out = local_recall(shells, "when does the restart drill run?")
    ids_ = [i["id"] for i in out["items"]]
    assert "alice-durable" in ids_ and "alice-03" not in ids_
    assert list((shells["store"] / "inbox").glob("*.jsonl"))  # the ingest-ready copy, fsynced


def test_a_delete_and_a_patch_survive_two_compactions_and_a_restart(shells):
    """A memory written and deleted between two compactions, and the text a PATCH
    replaced, stay gone after a restart: the log's older put of each must not outlive the
    row that replaced it (pruned once a generation holds it), or the replay would make it
    live again and the next compaction publish it."""
    from helix_ray.live.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-okapi", "text": "The okapi vault password rotates on Fridays."}], "alice")
    writer.delete("alice-okapi", "alice")
    writer.add([{"id": "alice-heron", "text": "The heron queue drains at midnight."}], "alice")
    writer.patch("alice-heron", {"text": "The heron queue drains at noon."}, "alice")
    inbox = shells["store"] / "inbox"
    (inbox / "20260101T000000-deadbeef.jsonl").write_text("{}\n")  # as an ingest that failed leaves Memory.add's
    assert writer.compact()["published"]
    # A served write's copy (a file per write) is deleted once a generation holds it;
    # the compaction's input, and any other file, go to folded/.
    assert not list(inbox.glob("*.jsonl"))
    assert sorted(p.name[:8] for p in (inbox / "folded").glob("*.jsonl")) == ["20260101", "compact-"]
    writer.add([{"id": "alice-later", "text": "A later note, so that a second compaction has work."}], "alice")
    assert writer.compact()["published"]  # prunes the rows the first one folded
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # a restarted Writer replica
    assert "alice-okapi" not in writer.core.entries and "alice-heron" not in writer.core.entries
    for shell in ("bm25", "dense", "ranker"):
        asyncio.run(shells[shell].views.refresh())
    *_, out = local_recall(shells, "okapi vault password")
    assert "alice-okapi" not in [i["id"] for i in out["items"]]
    *_, out = local_recall(shells, "when does the heron queue drain?")
    heron = [i for i in out["items"] if i["id"] == "alice-heron"]
    assert heron and "noon" in heron[0]["text"], out["items"]
    writer.add([{"id": "alice-third", "text": "A third note, for a third generation."}], "alice")
    assert writer.compact()["published"]
    ids = set(Generation.open_current(shells["store"]).memories.column("id").to_pylist())
    assert "alice-okapi" not in ids and {"alice-heron", "alice-later", "alice-third"} <= ids


def test_compaction_takes_what_the_writes_computed_instead_of_embedding_again(shells):
    """A write is expanded, embedded and token-encoded when it is made (it is served from
    the delta at once); compaction takes the writes' own outputs instead of computing
    them again, also after a restart, and computes again only what another ingest config
    made."""
    from helix_ray.config import IngestConfig
    from helix_ray.live.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    notes = {"alice-gecko": "The gecko cache warms up before the nightly batch.",
             "alice-newt": "Newt builds are pinned to the LTS toolchain."}
    writer.add([{"id": i, "text": t} for i, t in notes.items()], "alice")
    made = {i: writer.core.entries[i] for i in notes}
    out = writer.compact()
    assert out["published"] and out["folded"] == 2, out
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (2, 0), out["ingest"]
    gen = Generation.open_current(shells["store"])
    rows = {i: r for r, i in enumerate(gen.memories.column("id").to_pylist())}
    for memory_id, entry in made.items():
        row = rows[memory_id]
        np.testing.assert_array_equal(gen.vectors[row], np.asarray(entry["vector"]).astype(np.float16))  # as stored
        tokens = gen.late.take(np.array([row])).tokens
        assert tokens.tobytes() == entry["late_codes"]
        assert gen.memories.column("n_tokens")[row].as_py() == entry["n_tokens"]
    *_, found = local_recall(shells, "when does the gecko cache warm up?")
    assert found["items"][0]["id"] == "alice-gecko", found["items"]

    # After a restart the log row says which config computed it.
    writer.add([{"id": "alice-skink", "text": "Skink dashboards refresh every five minutes."}], "alice")
    writer.core.close()
    writer.core = WriterCore(shells["store"])
    out = writer.compact()
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (1, 0), out["ingest"]
    # Another config (fewer doc2query expansions) computes its own.
    writer.add([{"id": "alice-tuatara", "text": "Tuatara logs are kept for ninety days."}], "alice")
    writer.core.close()
    writer.core = WriterCore(shells["store"], ingest=IngestConfig(doc2query={"max_queries": 2}))
    out = writer.compact()
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (0, 1), out["ingest"]


def test_a_failed_compaction_leaves_no_input_behind_and_backs_off(shells, monkeypatch):
    """A compaction whose ingest fails (a full disk here) leaves no input file behind (it
    is a copy of serve_log's pending rows, which go on serving), and the background
    compactor waits longer after each failure — also with the pending writes past
    ``compact_max_pending``, where a try at every tick would write one more copy of
    every pending write each time. Once the fault is gone, the next try folds them."""
    import helix_ray.ingest.run as ingest_module
    from helix_ray.live import compactor

    writer = shells["writer"]
    writer.add([{"id": "alice-wren", "text": "The wren backup job runs nightly at two."}], "alice")
    inbox = shells["store"] / "inbox"
    real = ingest_module.ingest
    tries: list[float] = []

    def full_disk(*args, **kwargs):
        tries.append(time.monotonic())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ingest_module, "ingest", full_disk)
    with pytest.raises(Exception, match="No space left"):
        writer.compact()
    assert not list(inbox.glob("compact-*.jsonl")) and writer.core.compactable() == 1
    *_, out = local_recall(shells, "when does the wren backup job run?")
    assert "alice-wren" in [i["id"] for i in out["items"]]

    monkeypatch.setattr(compactor, "COMPACT_TICK_S", 0.02)
    monkeypatch.setattr(compactor, "COMPACT_RETRY_S", 0.1)
    tries.clear()
    writer.compactor.max_pending = 1  # past it: the compactor's thread tries at its next tick
    deadline = time.monotonic() + 10
    while not tries and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2.0)
    gaps = np.diff(tries)
    # Waits of 0.2, 0.4, 0.8, 1.6 s: four or five tries in 2 s, not one at every 20 ms tick.
    assert 2 <= len(tries) <= 6 and (gaps >= 0.18).all() and gaps[-1] > gaps[0], tries
    assert not list(inbox.glob("compact-*.jsonl"))
    monkeypatch.setattr(ingest_module, "ingest", real)
    while writer.core.compactable() and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    writer.compactor.max_pending = 2000
    assert writer.core.compactable() == 0 and writer.core.last_compaction["published"]


def test_every_compaction_gives_the_heap_back_when_it_ends(shells, monkeypatch):
    """The Writer trims the C heap once after each compaction, after the new generation
    is published, and also after one that failed (its arrays are as free)."""
    import helix_ray.ingest.run as ingest_module
    from helix_ray.live import writer as writer_module

    writer = shells["writer"]
    trims: list[int | None] = []
    monkeypatch.setattr(writer_module, "trim_heap", lambda: trims.append(writer.core.generation))
    before = writer.core.generation
    writer.add([{"id": "alice-heron", "text": "The heron sync runs hourly."}], "alice")
    assert writer.compact()["published"]
    assert trims == [writer.core.generation] and writer.core.generation != before

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    writer.add([{"id": "alice-ibis", "text": "The ibis export runs weekly."}], "alice")
    monkeypatch.setattr(ingest_module, "ingest", full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.compact()
    assert len(trims) == 2


def test_served_files_of_compactions_that_publish_nothing_are_pruned(shells, monkeypatch):
    """A compaction that publishes nothing (every pending write is already in the
    generation as it is) moves the writes' inbox files to ``folded/``, each with the text
    of its memory: only the newest KEEP_FOLDED stay, as for the compactions' inputs. And
    the count of writes compaction could not fold is of those still in the delta, not of
    every one ever tried."""
    from helix_ray.live import compaction

    monkeypatch.setattr(compaction, "KEEP_FOLDED", 1)
    writer = shells["writer"]
    record = {"id": "alice-lark", "text": "The lark report goes out on Mondays."}
    writer.add([record], "alice")
    assert writer.compact()["published"]
    folded = shells["store"] / "inbox" / "folded"
    for _ in range(3):
        writer.add([record], "alice")  # the same memory again: nothing new to publish
        assert not writer.compact()["published"]
    assert len(list(folded.glob("serve-*.jsonl"))) == 1 and len(list(folded.glob("compact-*.jsonl"))) == 1
    # Each write replaced the one before: one entry is left that compaction could not fold.
    assert writer.stats()["delta"]["unfoldable"] == 1


def test_writes_go_on_while_a_compaction_runs_and_what_they_changed_stays(shells, monkeypatch):
    """The compaction's pipeline runs outside the writer's lock (it rebuilds every index:
    long on a large store, and no write may wait for it). Paused mid-way here, the
    writer takes a write, a PATCH and a DELETE of memories it is folding, a DELETE of a
    generation memory and its stats; after it publishes, each of those still holds —
    through a second compaction and a restart."""
    import threading

    import helix_ray.ingest.run as ingest_module
    from helix_ray.live.delta_format import NOT_FOLDED
    from helix_ray.live.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-kite", "text": "The kite service retries three times."},
                {"id": "alice-moth", "text": "The moth cache expires hourly."}], "alice")
    running, resume = threading.Event(), threading.Event()
    real = ingest_module.ingest

    def paused(*args, **kwargs):
        running.set()
        assert resume.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(ingest_module, "ingest", paused)
    outcome: dict = {}
    compaction = threading.Thread(target=lambda: outcome.update(writer.compact()))
    compaction.start()
    try:
        assert running.wait(60)
        clock = time.perf_counter()
        writer.add([{"id": "alice-wren", "text": "The wren queue was added during the compaction."}], "alice")
        writer.patch("alice-kite", {"text": "The kite service retries five times."}, "alice")
        writer.delete("alice-moth", "alice")
        writer.delete(STRONG_ID, "alice")  # a generation memory
        assert writer.core.stats()["delta"]["tombstones"] >= 2
        assert time.perf_counter() - clock < 30  # answered while the pipeline waits, not after it
        assert compaction.is_alive()
    finally:
        resume.set()
        compaction.join(120)
    monkeypatch.setattr(ingest_module, "ingest", real)
    assert outcome["published"], outcome
    core = writer.core
    assert core.entries["alice-wren"]["folded_into"] == NOT_FOLDED  # came after the snapshot: next time
    assert core.entries["alice-kite"]["folded_into"] == NOT_FOLDED and "five" in core.entries["alice-kite"]["text"]
    assert "alice-moth" in core.tombstones and "alice-moth" not in core.entries

    def check() -> None:
        for shell in ("bm25", "dense", "ranker"):
            asyncio.run(shells[shell].views.refresh())
        *_, out = local_recall(shells, "how often does the kite service retry?")
        kite = [i for i in out["items"] if i["id"] == "alice-kite"]
        assert kite and "five" in kite[0]["text"], out["items"]
        *_, out = local_recall(shells, "when does the moth cache expire?")
        assert "alice-moth" not in [i["id"] for i in out["items"]]
        *_, out = local_recall(shells, STRONG_ERROR)
        assert STRONG_ID not in [i["id"] for i in out["items"]]
        *_, out = local_recall(shells, "the wren queue")
        assert "alice-wren" in [i["id"] for i in out["items"]]

    check()
    assert writer.compact()["published"]
    writer.core.close()
    writer.core = WriterCore(shells["store"])
    check()
    ids = Generation.open_current(shells["store"]).memories.column("id").to_pylist()
    assert "alice-moth" not in ids and STRONG_ID not in ids and {"alice-wren", "alice-kite"} <= set(ids)


def test_a_delete_made_while_a_compaction_ran_holds_if_the_writer_stops_before_it_ends(shells, monkeypatch):
    """A DELETE answered while the pipeline ran, of a memory it was folding: the pipeline
    writes the row as live, and the writer marks it deleted again once the pipeline is
    done. If the Writer stops in between (here: the pipeline raises after its commit), the
    restart must mark it: the next compaction would carry the row over, past its
    tombstone, and serve the memory again."""
    import threading

    import helix_ray.ingest.run as ingest_module
    from helix_ray.live.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-lynx", "text": "The lynx token leaked; rotate it."}], "alice")
    running, resume = threading.Event(), threading.Event()
    real = ingest_module.ingest

    def stops_after_its_commit(*args, **kwargs):
        running.set()
        assert resume.wait(60)
        real(*args, **kwargs)
        raise RuntimeError("the Writer stopped here")

    monkeypatch.setattr(ingest_module, "ingest", stops_after_its_commit)
    failed: list[BaseException] = []

    def compact() -> None:
        try:
            writer.core.compact()
        except RuntimeError as exc:
            failed.append(exc)

    compaction = threading.Thread(target=compact)
    compaction.start()
    assert running.wait(60)
    writer.delete("alice-lynx", "alice")
    resume.set()
    compaction.join(120)
    assert failed and "stopped here" in str(failed[0])
    monkeypatch.setattr(ingest_module, "ingest", real)
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # the restart
    writer.add([{"id": "alice-next", "text": "Another note, so the next compaction has work."}], "alice")
    assert writer.compact()["published"]
    assert "alice-lynx" not in Generation.open_current(shells["store"]).memories.column("id").to_pylist()
    for shell in ("bm25", "dense", "ranker"):
        asyncio.run(shells[shell].views.refresh())
    *_, out = local_recall(shells, "the lynx token leaked")
    assert "alice-lynx" not in [i["id"] for i in out["items"]]


def test_a_new_store_is_served_empty_filled_online_and_compacted(tmp_path):
    """A store nothing was ingested into starts with an empty generation (what
    ``build_app`` publishes): recall answers nothing, a write is recalled from the delta,
    compaction folds it into generation 2, and deleting the only memory compacts into an
    empty generation 3 (bm25s cannot index zero documents; the store writes an empty index)."""
    from helix_ray.serve import shells as sh
    from helix_ray.store.generation import Generation
    from helix_ray.ingest.run import initialise

    store = tmp_path / "new-store"
    assert initialise(store) == 1 and initialise(store) == 1  # the second call finds it
    assert Generation.open_current(store).size == 0
    writer = sh.WriterShell(store, compact_interval_s=3600)
    try:
        parts = {"embedder": sh.EmbedderShell(), "bm25": sh.BM25Shell(store), "dense": sh.DenseShell(store),
                 "ranker": sh.RankerShell(store), "writer": writer}
        query = "why did we pin uvicorn?"
        *_, out = local_recall(parts, query)
        assert out["items"] == [] and out["generation"] == 1
        writer.add([{"id": "alice-uvicorn", "text": "We pinned uvicorn to 0.30 after the keep-alive bug."}], "alice")
        *_, out = local_recall(parts, query)
        assert [(i["id"], i["origin"]) for i in out["items"]] == [("alice-uvicorn", "delta")]
        assert not out["flags"]["degraded"]
        report = writer.compact()
        assert report["published"] and report["generation"] == 2 and report["folded"] == 1, report
        for shell in ("bm25", "dense", "ranker"):  # what each replica's CURRENT watcher does
            assert asyncio.run(parts[shell].views.refresh())
        *_, out = local_recall(parts, query)
        assert [(i["id"], i["origin"]) for i in out["items"]] == [("alice-uvicorn", "generation")]
        assert out["generation"] == 2
        writer.delete("alice-uvicorn", "alice")
        report = writer.compact()
        assert report["published"] and report["generation"] == 3, report
        assert Generation.open_current(store).size == 0
        for shell in ("bm25", "dense", "ranker"):
            assert asyncio.run(parts[shell].views.refresh())
        *_, out = local_recall(parts, query)
        assert out["items"] == [] and out["generation"] == 3
    finally:
        writer._stop.set()
        writer.core.close()


def test_a_writer_says_at_start_when_its_first_compaction_would_encode_every_memorys_tokens(tmp_path, caplog):
    """A store built without token vectors, served with late interaction on (the
    default): the first compaction encodes every memory's tokens, minutes on a large
    store. The Writer says so at start, with the fix; served as built, it says nothing."""
    import logging

    from helix_ray.config import IngestConfig
    from helix_ray.live.writer import WriterCore
    from helix_ray.ingest.run import ingest

    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()[:12]))
    built = IngestConfig(late_interaction={"enabled": False})
    ingest([source], tmp_path / "store", config=built, runner="local", show_progress=False)
    for config, warned in ((built, False), (IngestConfig(), True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="helix_ray.live.writer"):
            core = WriterCore(tmp_path / "store", ingest=config)
            core.close()
        said = [r.getMessage() for r in caplog.records if "token vectors" in r.getMessage()]
        assert bool(said) == warned, said
    assert "encode the tokens of all 12 memories" in said[0] and "late_interaction: {enabled: false}" in said[0]


def test_writer_records_feedback_and_a_delete_takes_it_away(shells):
    from helix_ray.errors import InvalidArgument, NotFound

    writer = shells["writer"]
    assert writer.core.feedback("how do we rotate keys", ["alice-01", "alice-02"], user="alice") == {"recorded": 2}
    assert writer.core.db.feedback_pairs() == [
        {"user": "alice", "query": "how do we rotate keys", "memory_ids": ["alice-01", "alice-02"]}]
    assert writer.core.db.feedback_pairs(["bob"]) == []
    with pytest.raises(NotFound, match="no memories with those ids"):
        writer.core.feedback("q", ["alice-01"], user="bob")  # not bob's
    with pytest.raises(InvalidArgument, match="at most 100"):
        writer.core.feedback("q", [f"alice-{i}" for i in range(101)], user="alice")
    writer.core.delete("alice-01", user="alice")
    assert writer.core.db.feedback_pairs() == [
        {"user": "alice", "query": "how do we rotate keys", "memory_ids": ["alice-02"]}]


def test_a_patch_of_fields_only_is_folded_by_compaction(shells):
    """PATCH pinned/salience (text unchanged): compaction folds it into the generation
    without re-embedding, and the delta is left empty."""
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.patch("alice-00", {"pinned": True, "salience": 0.9}, "alice")
    report = writer.compact()
    assert report["published"] and (report["folded"], report["kept_in_delta"]) == (1, 0)
    assert (report["ingest"]["retagged"], report["ingest"]["embedded"]) == (1, 0)
    assert writer.core.compactable() == 0
    gen = Generation.open_current(shells["store"])
    row = gen.columns.id_to_row["alice-00"]
    assert gen.memories.column("pinned")[row].as_py() is True
    assert gen.memories.column("salience")[row].as_py() == pytest.approx(0.9)


def test_replicas_read_only_the_hits_appended_since_they_last_looked(tmp_path, monkeypatch):
    """Recall hits are appended a batch per line; a replica's AccessTail parses only the
    new complete lines (a line still being written waits), starts over when the Writer
    rewrote the file (a new file by rename), and agrees with a whole read throughout."""
    from helix_ray.live import writer as writer_module
    from helix_ray.live.access_log import AccessTail, accesses_path, read_accesses
    from helix_ray.ingest.run import initialise

    store = tmp_path / "store"
    initialise(store)
    core = writer_module.WriterCore(store)
    try:
        tail = AccessTail(accesses_path(store))
        assert tail.read() == {}
        core.accessed([("a", "alice", 10), ("b", "alice", 20)])
        assert tail.read() == {"a": 10, "b": 20}
        offset = tail._offset
        core.accessed([("a", "alice", 30), ("b", "alice", 5)])  # b's older hit changes nothing
        assert accesses_path(store).stat().st_size > offset  # appended, not rewritten
        assert tail.read() == {"a": 30, "b": 20} == read_accesses(store)
        with open(accesses_path(store), "a") as fh:  # a line the Writer is still writing
            fh.write('{"c": 4')
        assert "c" not in tail.read()
        with open(accesses_path(store), "a") as fh:
            fh.write('0}\n')
        assert tail.read()["c"] == 40
        held = tail.read()
        monkeypatch.setattr(writer_module, "ACCESSES_REWRITE_BYTES", 1)  # the next batch rewrites the file
        core.accessed([("d", "alice", 50)])
        assert accesses_path(store).read_text().count("\n") == 1
        # The rewrite is the Writer's own record (c came from the hand-written lines above).
        assert tail.read() == {"a": 30, "b": 20, "d": 50} == read_accesses(store)
        assert held == {"a": 30, "b": 20, "c": 40}  # a request holding the dict of before still sees it whole
    finally:
        core.close()


def test_served_recency_moves_with_the_writers_recent_hits(shells):
    """The Writer publishes the hits not yet folded (delta/ACCESSES.jsonl); the Ranker
    reads them, so a memory just recalled ranks with fresh recency before compaction, and
    a Writer restarted on the same store publishes them again."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve import shells as sh

    def recency_of(memory_id: str) -> float:
        plan = shells["embedder"].plan("deploy the gateway", user="alice", config=RetrievalConfig(),
                                       budget_tokens=2000, k=20, explain=True)
        lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
        explain = asyncio.run(shells["ranker"].finish(plan, lexical, dense))["explain"]
        return {row["id"]: row["recency"] for row in explain}[memory_id]

    plan = shells["embedder"].plan("deploy the gateway", user="alice", config=RetrievalConfig(), budget_tokens=2000,
                                   k=20, explain=True)
    lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
    candidate = asyncio.run(shells["ranker"].finish(plan, lexical, dense))["explain"][-1]["id"]
    before = recency_of(candidate)
    shells["writer"].accessed([(candidate, "alice", int(time.time() * 1_000_000))])
    assert recency_of(candidate) > max(before, 0.99)
    # Bounded: past MAX_RECENT_ACCESSES ids, the newest stay (the log keeps every hit).
    from helix_ray.live import writer as writer_module
    from helix_ray.live.access_log import accesses_path, read_accesses

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer_module, "MAX_RECENT_ACCESSES", 2)
        shells["writer"].accessed([("old-hit", "alice", 1), ("newer-hit", "alice", 2)])
    assert set(read_accesses(shells["store"])) == {candidate, "newer-hit"}
    shells["writer"]._stop.set()
    shells["writer"].core.close()
    accesses_path(shells["store"]).unlink()
    restarted = sh.WriterShell(shells["store"], compact_interval_s=3600)
    try:
        assert read_accesses(shells["store"])[candidate] > 0
    finally:
        restarted._stop.set()
        restarted.core.close()


def test_a_write_compaction_drops_as_a_near_duplicate_leaves_the_delta(shells):
    """Two online writes, the later a near-copy of the earlier: compaction keeps the newer
    in the generation, and the older must not stay live in the delta beside it."""
    writer = shells["writer"]
    text = ("The nightly export job writes parquet files to the analytics bucket under exports slash "
            "year month day and keeps thirty days of history before deleting the oldest folder")
    writer.add([{"id": "w-old", "text": text}], "alice")
    writer.add([{"id": "w-new", "text": text + " automatically"}], "alice")
    report = writer.compact()
    assert report["published"] and report["ingest"]["duplicates"] == 1
    assert (report["folded"], report["kept_in_delta"]) == (2, 0) and writer.core.compactable() == 0
    for leg in ("bm25", "dense", "ranker"):  # what each replica's watcher does within a second
        assert asyncio.run(shells[leg].views.refresh())
    *_, out = local_recall(shells, "nightly export job parquet analytics bucket")
    assert "w-new" in [i["id"] for i in out["items"]] and "w-old" not in [i["id"] for i in out["items"]]


def test_the_writer_records_accesses_after_any_read_of_its_database(shells):
    """DuckDB 2.0 refuses to register a table on a connection whose last result was left
    unfinished (``fetchone()`` leaves one): a user's GET /v1/stats, or a PATCH, then made
    every access-log flush fail until the next write."""
    writer = shells["writer"]
    assert writer.user_stats("alice")["user_memories"]["alice"] > 0
    assert writer.accessed([("alice-00", "alice", 1_750_000_000_000_000)]) == {"recorded": 1}
    writer.patch("alice-01", {"salience": 0.9}, "alice")  # reads the record from the database first
    assert writer.accessed([("alice-01", "alice", 1_750_000_000_000_001)]) == {"recorded": 1}
    assert writer.core.db.row("SELECT count(*) FROM access_log WHERE id IN ('alice-00', 'alice-01')") == (2,)


def test_server_recall_hits_reach_the_access_log_and_the_next_generation(shells):
    """What the ingress sends after each answer: the Writer logs it, and compaction
    folds it into last_accessed_at / access_count (recency's input), once."""
    import datetime as dt

    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    first = Generation.open_current(shells["store"])
    base = first.memories.to_pylist()[first.columns.id_to_row["alice-00"]]["access_count"]
    when = dt.datetime(2025, 6, 1, 12, tzinfo=dt.timezone.utc)
    micros = int(when.timestamp() * 1_000_000)
    assert writer.accessed([("alice-00", "alice", micros), ("alice-00", "alice", micros - 10)]) == {"recorded": 2}
    assert writer.stats()["db"]["accesses"] == 2
    writer.patch("alice-01", {"salience": 0.8}, "alice")  # something to compact
    assert writer.compact()["published"]
    gen = Generation.open_current(shells["store"])
    row = gen.memories.to_pylist()[gen.columns.id_to_row["alice-00"]]
    assert row["access_count"] == base + 2 and row["last_accessed_at"] == when
    writer.patch("alice-01", {"salience": 0.7}, "alice")
    assert writer.compact()["published"]
    gen = Generation.open_current(shells["store"])
    assert gen.memories.to_pylist()[gen.columns.id_to_row["alice-00"]]["access_count"] == base + 2  # not twice


def _runbook(topic: str, sections: int = 8) -> str:
    """A Markdown runbook long enough to be stored as several chunks."""
    parts = [f"# {topic} runbook"]
    for n in range(1, sections + 1):
        parts.append(f"## Step {n}\n" + " ".join(
            f"Step {n} of the {topic} procedure checks replica {m} and writes its state to the audit log."
            for m in range(12)))
    parts.append("## Rollback\nTo roll back the heron migration, restore snapshot 4417 and replay the okapi WAL.")
    return "\n\n".join(parts)


def test_a_long_write_is_stored_as_chunks_that_recall_patch_and_delete_treat_as_one(shells):
    """A text over chunk.max_tokens is written as chunks <id>#chunk<n>: none is cut, a
    recall finds the chunk that answers, names its parent, and PATCH and DELETE of the
    id act on every chunk; a shorter new text leaves no stale chunk behind."""
    from helix_ray.schema import parent_of
    from helix_ray.live.writes import family
    from helix_ray.tokens import token_counter

    writer = shells["writer"]
    text = _runbook("heron")
    out = writer.add([{"id": "alice-runbook", "text": text, "project": "atlas"}], "alice")
    assert out["ids"] == ["alice-runbook"]  # the caller's id, not its chunks'
    chunks = family(writer.core, "alice-runbook", "alice")
    count = token_counter()
    assert len(chunks) >= 3 and all(parent_of(c) == "alice-runbook" for c in chunks)
    texts = [writer.core.entries[c]["record"]["text"] for c in chunks]
    assert all(count(t) <= writer.core.config.chunk.max_tokens + 16 for t in texts)  # + the heading line
    assert "restore snapshot 4417 and replay the okapi WAL" in texts[-1]  # the end is there, not cut off

    *_, found = local_recall(shells, "how do I roll back the heron migration?")
    top = found["items"][0] if found["items"] else {}
    assert top.get("parent") == "alice-runbook" and "snapshot 4417" in top["text"], found["items"]

    writer.patch("alice-runbook", {"pinned": True}, "alice")  # a field: every chunk
    assert family(writer.core, "alice-runbook", "alice") == chunks
    assert all(writer.core.entries[c]["record"]["pinned"] for c in chunks)
    meta = json.loads(writer.core.entries[chunks[0]]["record"]["metadata"]) \
        if isinstance(writer.core.entries[chunks[0]]["record"]["metadata"], str) \
        else writer.core.entries[chunks[0]]["record"]["metadata"]
    assert meta["chunk"]["parent"] == "alice-runbook" and meta["chunk"]["of"] == len(chunks)

    writer.patch("alice-runbook", {"text": "The heron runbook moved to the wiki."}, "alice")  # short now
    assert family(writer.core, "alice-runbook", "alice") == ["alice-runbook"]
    assert all(c in writer.core.tombstones for c in chunks)

    writer.patch("alice-runbook", {"text": _runbook("okapi", 4)}, "alice")  # long again: chunks replace it
    again = family(writer.core, "alice-runbook", "alice")
    assert "alice-runbook" not in again and len(again) >= 2

    writer.delete("alice-runbook", "alice")
    assert family(writer.core, "alice-runbook", "alice") == []
    writer.add([{"id": "alice-note", "text": "A short note, so that compaction has something to publish."}], "alice")
    assert writer.compact()["published"]
    from helix_ray.store.generation import Generation

    ids = Generation.open_current(shells["store"]).memories.column("id").to_pylist()
    assert not [i for i in ids if i.startswith("alice-runbook")]


def test_another_users_chunked_memory_cannot_be_deleted_or_patched(shells):
    from helix_ray.serve.errors import ReplicaError, message_of
    from helix_ray.live.writes import family

    writer = shells["writer"]
    writer.add([{"id": "bob-runbook", "text": _runbook("kestrel")}], "bob")
    chunks = family(writer.core, "bob-runbook", "bob")
    for call in (lambda: writer.delete("bob-runbook", "alice"),
                 lambda: writer.patch("bob-runbook", {"pinned": True}, "alice")):
        with pytest.raises(ReplicaError) as refused:
            call()
        assert "no such memory for user 'alice'" in message_of(refused.value)
    assert family(writer.core, "bob-runbook", "bob") == chunks
    assert not any(writer.core.entries[c]["record"]["pinned"] for c in chunks)


def test_chunks_survive_compaction_as_they_are_and_one_patched_chunk_keeps_its_siblings(shells):
    """A compaction reads chunks back without chunking them again; a PATCH of one chunk
    (an id recall returned) changes that chunk alone, and its siblings outlive the next
    compaction; DELETE of the parent after compaction removes every chunk."""
    from helix_ray.schema import parent_of
    from helix_ray.live.writes import family
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-guide", "text": _runbook("plover")}], "alice")
    chunks = family(writer.core, "alice-guide", "alice")
    assert writer.compact()["published"]

    def stored() -> list[str]:
        ids = Generation.open_current(shells["store"]).memories.column("id").to_pylist()
        return sorted(i for i in ids if i.startswith("alice-guide"))

    assert stored() == sorted(chunks) and all(parent_of(i) == "alice-guide" for i in stored())
    delta, writer.core.entries = writer.core.entries, {}  # what the database alone holds
    try:
        assert family(writer.core, "alice-guide", "alice") == chunks
    finally:
        writer.core.entries = delta
    writer.patch(chunks[1], {"pinned": True}, "alice")
    writer.add([{"id": "alice-other", "text": "Another note, for the compaction."}], "alice")
    assert writer.compact()["published"]
    assert stored() == sorted(chunks)
    writer.delete("alice-guide", "alice")
    writer.add([{"id": "alice-third", "text": "A third note, for the compaction."}], "alice")
    assert writer.compact()["published"]
    assert stored() == []


def test_a_write_cannot_take_or_shadow_another_users_chunks(shells):
    from helix_ray.errors import InvalidArgument
    from helix_ray.serve.errors import ReplicaError, message_of
    from helix_ray.live.writes import family

    writer = shells["writer"]
    writer.add([{"id": "shared", "text": _runbook("dunlin")}], "bob")
    bobs = family(writer.core, "shared", "bob")
    for text in ("short", _runbook("alice's own")):
        with pytest.raises(ReplicaError) as refused:
            writer.add([{"id": "shared", "text": text}], "alice")
        assert "belongs to another user" in message_of(refused.value)
    assert family(writer.core, "shared", "bob") == bobs and not any(c in writer.core.tombstones for c in bobs)
    with pytest.raises((ReplicaError, InvalidArgument)) as refused:
        writer.add([{"id": "shared#chunk9", "text": "a chunk of my own"}], "alice")
    assert "#chunk" in message_of(refused.value)


def test_served_recall_widens_a_compacted_chunk_with_its_neighbours(shells):
    """Once compaction has folded a long memory into the generation, a Serve recall with
    budget to spare returns the answering chunk with the chunk before it."""
    from helix_ray.config import RetrievalConfig

    writer = shells["writer"]
    writer.add([{"id": "alice-widen", "text": _runbook("sandpiper")}], "alice")
    assert writer.compact()["published"]
    for shell in ("bm25", "dense", "ranker"):
        asyncio.run(shells[shell].views.refresh())
    question = "how do I roll back the sandpiper heron migration?"

    def best(budget: int, **config) -> dict:
        plan = shells["embedder"].plan(question, user="alice", config=RetrievalConfig(**config), budget_tokens=budget,
                                       k=1)
        lexical = asyncio.run(shells["bm25"].search(plan))
        dense = asyncio.run(shells["dense"].search(plan))
        return asyncio.run(shells["ranker"].finish(plan, lexical, dense))["items"][0]

    narrow, wide = best(4000, pack={"widen_chunks": False}), best(4000)
    assert narrow["id"] == wide["id"] and narrow["parent"] == "alice-widen"
    assert wide["n_tokens"] > narrow["n_tokens"] and wide["text"].endswith(narrow["text"].split("\n", 1)[1])
