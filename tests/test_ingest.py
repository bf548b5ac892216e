"""The ingest pipeline end to end (runner="local": same stage functions, one process;
tests/test_ingest_ray.py runs them on a real local Ray)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from helix_ray.config import IngestConfig
from helix_ray.embedder import get_embedder
from helix_ray.errors import InvalidArgument, ManifestMismatch
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation, current_generation_number, generations_dir
from helix_ray.ingest.graph import edges_tables
from helix_ray.ingest.run import ingest
from tests.helpers import SAMPLE, memory, write_jsonl

FACTS = [
    "We decided to use NATS JetStream over Kafka because it is a single binary.",
    "The ingest worker lives in services/ingest/worker.py and batches 500 readings.",
    "psycopg2.OperationalError: FATAL: remaining connection slots are reserved for superusers.",
    "To rotate the API keys: 1. run make rotate-keys 2. restart the gateway pods.",
    "Dana prefers tabs over spaces in the Go services.",
    "The gateway listens on port 8443 in production and 8080 in development.",
]


def test_quarantine_keeps_every_bad_row_with_reason_and_position(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [memory(i, t) for i, t in enumerate(FACTS)])
    report = ingest([good, SAMPLE / "bad_records.jsonl"], tmp_path / "store", runner="local")
    bad_lines = (SAMPLE / "bad_records.jsonl").read_text().splitlines()
    assert report.read == len(FACTS) + len(bad_lines)
    assert report.accepted == len(FACTS) and report.quarantined == len(bad_lines)
    assert report.quarantine_reasons == {
        "missing_text": 1, "empty_text": 2, "wrong_type": 1, "unknown_type": 1,
        "out_of_range": 1, "bad_time": 1, "too_deep": 1,
    }
    with StoreDB(tmp_path / "store") as db:
        rows = db.quarantine()
    assert len(rows) == len(bad_lines)
    assert {r["position"] for r in rows} == {f"line {i}" for i in range(1, len(bad_lines) + 1)}
    # Nothing lost: each quarantined raw record is the whole input record.
    deepest = max(rows, key=lambda r: r["raw"].count('"level"'))
    assert json.loads(deepest["raw"]) == {k: v for k, v in json.loads(bad_lines[7]).items() if k != "_why"}
    assert {json.loads(r["raw"])["id"] for r in rows} == {json.loads(line)["id"] for line in bad_lines}


def test_an_id_given_twice_keeps_the_later_and_quarantines_the_earlier(tmp_path):
    earlier = memory(0, FACTS[0], salience=0.7, project="atlas", metadata={"k": [1, "two"]})
    source = write_jsonl(tmp_path / "a.jsonl", [earlier, memory(1, FACTS[1]), memory(0, FACTS[2])])
    report = ingest([source], tmp_path / "store", runner="local")
    assert (report.read, report.accepted, report.quarantined) == (3, 2, 1)
    assert report.quarantine_reasons == {"duplicate_id": 1}
    with StoreDB(tmp_path / "store") as db:
        (held,) = db.quarantine()
    raw = json.loads(held["raw"])  # the earlier record, whole, with its values as given
    assert (raw["text"], raw["salience"], raw["project"]) == (FACTS[0], 0.7, "atlas")
    assert json.loads(raw["metadata"]) == {"k": [1, "two"]}
    assert raw["created_at"].startswith("2025-03-01 10:00:00")
    gen = Generation.open_current(tmp_path / "store")
    assert gen.memories.column("text")[gen.columns.id_to_row["m000"]].as_py() == FACTS[2]


def test_ingest_never_moves_a_memory_to_another_user(tmp_path):
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0], user="alice")])], store, runner="local")
    report = ingest([write_jsonl(tmp_path / "b.jsonl", [memory(0, FACTS[1], user="bob")])], store, runner="local")
    assert report.quarantine_reasons == {"id_conflict": 1} and report.accepted == 0
    with StoreDB(store) as db:
        assert "user 'alice'" in db.quarantine()[0]["reason"]
    gen = Generation.open_current(store)
    row = gen.columns.id_to_row["m000"]
    assert (gen.memories.column("user")[row].as_py(), gen.memories.column("text")[row].as_py()) == ("alice", FACTS[0])


def test_an_edited_memory_keeps_the_accesses_its_previous_version_had(tmp_path):
    """A new text for m001 (an edit, or a PATCH, whose record the server reads from the
    database) brings access_count 0: the hits folded into the previous generation were
    lost with the old row."""
    store = tmp_path / "store"
    first = memory(1, FACTS[0], access_count=7, last_accessed_at="2025-04-01T12:00:00Z")
    ingest([write_jsonl(tmp_path / "a.jsonl", [first, memory(2, FACTS[1])])], store, runner="local")
    report = ingest([write_jsonl(tmp_path / "b.jsonl", [memory(1, FACTS[2])])], store, runner="local")
    assert report.updated == 1
    gen = Generation.open_current(store)
    row = gen.memories.take([gen.columns.id_to_row["m001"]]).to_pylist()[0]
    assert row["text"] == FACTS[2] and row["access_count"] == 7
    assert row["last_accessed_at"].isoformat().startswith("2025-04-01T12:00:00")


def test_a_turn_that_is_not_a_whole_number_is_quarantined_not_fatal(tmp_path):
    """``metadata.turn`` orders a session. "first", [1], 3e30, -1 or true passed
    validation would fail the whole ingest after its embedding (and, written through the
    server, every later compaction): each is quarantined with what is allowed."""
    bad = ["first", [1], 3e30, -1, True]
    rows = [memory(0, FACTS[0], metadata={"turn": 2})] + [
        memory(i + 1, FACTS[i + 1], metadata={"turn": turn}) for i, turn in enumerate(bad)]
    report = ingest([write_jsonl(tmp_path / "t.jsonl", rows)], tmp_path / "store", runner="local")
    assert report.accepted == 1 and report.quarantine_reasons == {"wrong_type": len(bad)}
    with StoreDB(tmp_path / "store") as db:
        assert all("metadata.turn must be a whole number" in r["reason"] for r in db.quarantine())


def test_turns_already_stored_that_are_not_whole_numbers_read_as_zero():
    """Rows written before that check (in a generation, in the server's log) must not
    fail the compaction that reads them again."""
    import pyarrow as pa

    from helix_ray.ingest.assemble import turns_of

    texts = ['{"turn": "x"}', '{"turn": 3}', None, '{"a": 1}', '{"turn": -2}', '{"turn": 1e40}', '{"turn": true}',
             '{"turn": 12345}']
    assert turns_of(pa.chunked_array([pa.array(texts, pa.string())])).tolist() == [0, 3, 0, 0, 0, 0, 0, 12345]


def test_a_memory_once_dropped_as_a_duplicate_stays_deleted_when_deleted(tmp_path):
    """m001 is dropped as a near-duplicate of m002, written again with another text (live
    again), then deleted: the database said deleted, but compaction counted an id ever
    dropped as a duplicate as "not deleted" and carried m001 into every later generation."""
    store = tmp_path / "store"
    near = [memory(1, "We decided to use NATS over Kafka because it is simpler to operate.",
                   created_at="2025-03-01T00:00:00Z"),
            memory(2, "We decided to use NATS over Kafka because it is simpler to run.", created_at="2025-03-02T00:00:00Z")]
    assert ingest([write_jsonl(tmp_path / "a.jsonl", near)], store, runner="local").duplicates == 1
    ingest([write_jsonl(tmp_path / "b.jsonl", [memory(1, FACTS[4])])], store, runner="local")
    assert "m001" in Generation.open_current(store).memories.column("id").to_pylist()
    with StoreDB(store) as db:
        db.delete(["m001"])  # what DELETE /v1/memories/m001 writes
    ingest([write_jsonl(tmp_path / "c.jsonl", [memory(3, FACTS[5])])], store, runner="local")
    ids = Generation.open_current(store).memories.column("id").to_pylist()
    assert "m003" in ids and "m002" in ids and "m001" not in ids


def test_delete_marks_the_ids_given_and_drops_only_their_feedback(tmp_path):
    """One statement for any number of ids: repeats and unknown ids are harmless, other
    memories and their feedback stay."""
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(i, FACTS[i]) for i in range(1, 4)])], store, runner="local")
    with StoreDB(store) as db:
        db.add_feedback("alice", "which queue", ["m001", "m002", "m003"])
        db.delete(["m001", "m003", "m001", "no-such-id"])
        db.delete([])
        assert dict(db.con.execute("SELECT id, deleted FROM memories").fetchall()) == \
            {"m001": True, "m002": False, "m003": True}
        assert db.con.execute("SELECT memory_id FROM feedback").fetchall() == [("m002",)]


def test_a_store_takes_a_new_dedup_num_perm(tmp_path):
    """Changing ``dedup.num_perm`` must not fail every later ingest into the store (the
    old rows' signatures and the new ones cannot be stacked): the old rows are signed
    again, and a near-duplicate of an old memory is still found."""
    from helix_ray.config import load_config

    store = tmp_path / "store"
    first = memory(1, "We decided to use NATS over Kafka because it is simpler to operate.",
                   created_at="2025-03-01T00:00:00Z")
    ingest([write_jsonl(tmp_path / "a.jsonl", [first, memory(2, FACTS[1])])], store, runner="local")
    wider = load_config(IngestConfig, overrides={"dedup": {"num_perm": 128}})
    near = memory(3, "We decided to use NATS over Kafka because it is simpler to run.", created_at="2025-03-02T00:00:00Z")
    report = ingest([write_jsonl(tmp_path / "b.jsonl", [near])], store, config=wider, runner="local")
    assert report.published and report.duplicates == 1
    gen = Generation.open_current(store)
    assert gen.minhash.shape == (2, 128) and sorted(gen.memories.column("id").to_pylist()) == ["m002", "m003"]


def test_one_id_for_two_users_in_one_ingest_stays_with_the_first(tmp_path):
    """As across ingests (above): the first user's memory keeps the id, the other
    user's record is quarantined as a conflict, not as a duplicate_id that would let the
    later user's record replace the first user's."""
    rows = [memory(0, FACTS[0], user="alice"), memory(0, FACTS[1], user="bob"), memory(1, FACTS[2], user="bob")]
    report = ingest([write_jsonl(tmp_path / "a.jsonl", rows)], tmp_path / "store", runner="local")
    assert report.quarantine_reasons == {"id_conflict": 1} and report.accepted == 2
    with StoreDB(tmp_path / "store") as db:
        (held,) = db.quarantine()
    assert "user 'alice', not 'bob'" in held["reason"] and json.loads(held["raw"])["text"] == FACTS[1]
    gen = Generation.open_current(tmp_path / "store")
    row = gen.columns.id_to_row["m000"]
    assert (gen.memories.column("user")[row].as_py(), gen.memories.column("text")[row].as_py()) == ("alice", FACTS[0])


def test_reingesting_bad_rows_does_not_duplicate_quarantine(tmp_path):
    bad = SAMPLE / "bad_records.jsonl"
    good = write_jsonl(tmp_path / "good.jsonl", [memory(0, FACTS[0])])
    ingest([good, bad], tmp_path / "store", runner="local")
    ingest([good, bad], tmp_path / "store", runner="local")
    with StoreDB(tmp_path / "store") as db:
        assert db.counts()["quarantined"] == 8


def test_near_duplicates_keep_the_newer_and_record_the_link(tmp_path):
    rows = [
        memory(1, "We decided to use NATS over Kafka because it is simpler to operate.", created_at="2025-03-01T00:00:00Z"),
        memory(2, "We decided to use NATS over Kafka because it is simpler to run.", created_at="2025-03-02T00:00:00Z"),
        # Shares vocabulary but is a different fact: stays.
        memory(3, "We decided to use Kafka over NATS for the audit log because it keeps data for years.",
               created_at="2025-03-03T00:00:00Z"),
        # Same text, another tenant: never deduplicated across tenants.
        memory(4, "We decided to use NATS over Kafka because it is simpler to operate.", user="lee"),
        # Exact duplicate of m005 (older): dropped.
        memory(5, "The gateway listens on port 8443.", created_at="2025-03-05T00:00:00Z"),
        memory(6, "The gateway listens on port 8443.", created_at="2025-03-04T00:00:00Z"),
    ]
    report = ingest([write_jsonl(tmp_path / "d.jsonl", rows)], tmp_path / "store", runner="local")
    assert report.duplicates == 2
    gen = Generation.open_current(tmp_path / "store")
    ids = set(gen.memories.column("id").to_pylist())
    assert ids == {"m002", "m003", "m004", "m005"}
    with StoreDB(tmp_path / "store") as db:
        links = set(db.con.execute("SELECT dropped_id, kept_id FROM duplicates").fetchall())
        dropped = db.con.execute("SELECT id, deleted FROM memories WHERE id IN ('m001', 'm006')").fetchall()
    assert links == {("m001", "m002"), ("m006", "m005")}
    assert sorted(dropped) == [("m001", True), ("m006", True)]  # kept in the database, not served


def test_pinned_wins_a_duplicate_pair(tmp_path):
    rows = [memory(1, "Never force-push to main, even on a hotfix branch.", pinned=True, created_at="2025-01-01T00:00:00Z"),
            memory(2, "Never force-push to main, even on a hotfix branch!", created_at="2025-02-01T00:00:00Z")]
    ingest([write_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "store", runner="local")
    assert Generation.open_current(tmp_path / "store").memories.column("id").to_pylist() == ["m001"]


def test_incremental_ingest_embeds_only_new_memories(tmp_path):
    embedder = get_embedder()
    first = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:4])])
    second = write_jsonl(tmp_path / "b.jsonl", [memory(10 + i, t) for i, t in enumerate(FACTS[4:])])
    store = tmp_path / "store"
    before = embedder.calls
    r1 = ingest([first], store, runner="local")
    assert embedder.calls - before == 4 and r1.embedded == 4 and r1.generation == 1
    g1 = Generation.open_current(store)
    old_vectors = {mid: np.array(g1.vectors[i]) for i, mid in enumerate(g1.memories.column("id").to_pylist())}

    before = embedder.calls
    r2 = ingest([first, second], store, runner="local")
    assert embedder.calls - before == 2, "old memories must not be embedded again"
    assert (r2.new, r2.unchanged, r2.generation, r2.total_memories) == (2, 4, 2, 6)
    g2 = Generation.open_current(store)
    for i, mid in enumerate(g2.memories.column("id").to_pylist()):
        if mid in old_vectors:
            np.testing.assert_array_equal(g2.vectors[i], old_vectors[mid])

    before = embedder.calls
    r3 = ingest([first, second], store, runner="local")
    assert embedder.calls == before and not r3.published and r3.unchanged == 6
    assert current_generation_number(store) == 2


def test_changed_text_under_the_same_id_is_re_embedded(tmp_path):
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(1, FACTS[0]), memory(2, FACTS[1])])], store, runner="local")
    report = ingest([write_jsonl(tmp_path / "b.jsonl", [memory(1, FACTS[4])])], store, runner="local")
    assert (report.updated, report.embedded, report.total_memories) == (1, 1, 2)
    gen = Generation.open_current(store)
    assert gen.text(gen.columns.id_to_row["m001"]) == FACTS[4]


def test_changed_fields_with_the_same_text_update_without_re_embedding(tmp_path):
    """A PATCH of type/salience (folded by compaction) or a re-tagged record: the new
    generation and the database hold the new fields, the vector is the old one."""
    embedder = get_embedder()
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(1, FACTS[0]), memory(2, FACTS[1])])], store, runner="local")
    g1 = Generation.open_current(store)
    row1 = g1.columns.id_to_row["m001"]
    vector = np.array(g1.vectors[row1])
    assert g1.memories.column("type")[row1].as_py() == "decision"
    before = embedder.calls
    patched = memory(1, FACTS[0], type="semantic", salience=0.25, pinned=True, metadata={"ticket": "OPS-7"})
    report = ingest([write_jsonl(tmp_path / "a.jsonl", [patched, memory(2, FACTS[1])])], store, runner="local")
    assert embedder.calls == before
    assert (report.published, report.updated, report.retagged, report.unchanged, report.embedded) == (True, 1, 1, 1, 0)
    g2 = Generation.open_current(store)
    row = g2.columns.id_to_row["m001"]
    got = {k: g2.memories.column(k)[row].as_py() for k in ("type", "pinned", "metadata")}
    assert got == {"type": "semantic", "pinned": True, "metadata": '{"ticket": "OPS-7"}'}
    assert g2.memories.column("salience")[row].as_py() == pytest.approx(0.25)
    np.testing.assert_array_equal(g2.vectors[row], vector)
    with StoreDB(store, read_only=True) as db:
        assert db.con.execute("SELECT type, pinned FROM memories WHERE id = 'm001'").fetchone() == ("semantic", True)
    again = ingest([write_jsonl(tmp_path / "a.jsonl", [patched, memory(2, FACTS[1])])], store, runner="local")
    assert not again.published and again.unchanged == 2 and again.retagged == 0


def test_a_re_ingest_takes_a_sections_stated_day_again_never_its_files_modification_time(tmp_path):
    """A journal whose front matter is re-dated, its text unchanged, moves to the new day
    (re-tagged, not re-embedded), as does a journal read before its days were; a section
    dated by its file's modification time keeps its day when the file is saved again."""
    import datetime as dt
    import os

    notes = tmp_path / "notes"
    notes.mkdir()
    journal, ops = notes / "journal.md", notes / "ops.md"
    journal.write_text("---\nuser: dana\ndate: 2024-05-03\n---\n# Journal\n\n## Retry limit\n\nSet it to 5.\n")
    ops.write_text("---\nuser: dana\n---\n# Ops\n\n## Deploy\n\nRun make deploy.\n")
    os.utime(ops, (1_700_000_000, 1_700_000_000))  # 2023-11-14
    store = tmp_path / "store"

    def days() -> dict[str, str]:
        g = Generation.open_current(store)
        return {i.rsplit("#", 1)[1]: t.isoformat() for i, t in zip(g.memories.column("id").to_pylist(),
                                                                   g.memories.column("created_at").to_pylist())}

    ingest([notes], store, runner="local")
    assert days() == {"retry-limit": "2024-05-03T12:00:00+00:00", "deploy": "2023-11-14T22:13:20+00:00"}
    journal.write_text(journal.read_text().replace("2024-05-03", "2024-04-26"))
    os.utime(ops, (1_800_000_000, 1_800_000_000))  # saved again, unchanged
    report = ingest([notes], store, runner="local")
    assert (report.retagged, report.embedded, report.unchanged) == (1, 0, 1)
    assert days() == {"retry-limit": "2024-04-26T12:00:00+00:00", "deploy": "2023-11-14T22:13:20+00:00"}
    with StoreDB(store, read_only=True) as db:
        seconds = db.con.execute("SELECT epoch(created_at) FROM memories WHERE id LIKE '%#retry-limit'").fetchone()[0]
    assert seconds == dt.datetime(2024, 4, 26, 12, tzinfo=dt.timezone.utc).timestamp()
    again = ingest([notes], store, runner="local")
    assert not again.published and again.retagged == 0


def test_the_database_keeps_the_expansions_the_bm25_index_was_built_with(tmp_path):
    """A later ingest with another analyzer re-analyses old memories from their text and
    the expansions the database holds: those must be what the index was built with,
    term for term, for every memory (quotes, a backslash and non-ASCII text included)."""
    from helix_ray.index.bm25 import Terms, lexical_text, load_bm25, load_terms
    from helix_ray.ingest.doc2query import OfflineExpander

    texts = FACTS + ['A "quoted" path C:\\ops\\deploy and café naïve 😀 notes on the gateway.']
    rows = [memory(i, t, type="episodic" if i % 2 else "semantic") for i, t in enumerate(texts)]
    ingest([write_jsonl(tmp_path / "a.jsonl", rows)], tmp_path / "store", runner="local")
    gen = Generation.open_current(tmp_path / "store")
    index = load_bm25(gen.path / "bm25")
    terms = load_terms(gen.path / "bm25", index.retriever.vocab_dict)
    ids = gen.memories.column("id").to_pylist()
    with StoreDB(tmp_path / "store") as db:
        stored = db.expansions_for(ids)
    made = OfflineExpander(IngestConfig().doc2query.max_queries).expand(texts, [r["type"] for r in rows])
    assert stored == {r["id"]: queries for r, queries in zip(rows, made)}
    texts_now = gen.memories.column("text").to_pylist()
    again = Terms.analyse(index.analyzer, [lexical_text(t, stored[i]) for i, t in zip(ids, texts_now)])
    for row in range(len(ids)):
        ours = [terms.vocab[j] for j in terms.ids[terms.offsets[row]:terms.offsets[row + 1]]]
        theirs = [again.vocab[j] for j in again.ids[again.offsets[row]:again.offsets[row + 1]]]
        assert ours == theirs, ids[row]


def test_same_input_gives_the_same_generation(tmp_path):
    rows = [memory(i, t, session_id="s1") for i, t in enumerate(FACTS)]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    gens = []
    for name in ("one", "two"):
        ingest([source], tmp_path / name, runner="local")
        gens.append(Generation.open_current(tmp_path / name))
    a, b = gens
    assert a.memories.equals(b.memories)
    np.testing.assert_array_equal(a.vectors, b.vectors)
    np.testing.assert_array_equal(a.binary, b.binary)
    np.testing.assert_array_equal(a.minhash, b.minhash)
    for name in ("indptr", "indices", "weights", "types"):
        np.testing.assert_array_equal(getattr(a.graph, name), getattr(b.graph, name))
    assert a.entities.equals(b.entities)
    assert a.manifest["partitions"] == b.manifest["partitions"]
    bm25_files = sorted(p.name for p in (a.path / "bm25").iterdir())
    for name in bm25_files:
        assert (a.path / "bm25" / name).read_bytes() == (b.path / "bm25" / name).read_bytes(), name


def test_crash_mid_publish_leaves_previous_generation_serving(tmp_path):
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:3])])], store, runner="local")
    more = write_jsonl(tmp_path / "b.jsonl", [memory(10 + i, t) for i, t in enumerate(FACTS[3:])])
    with pytest.raises(RuntimeError, match="injected crash after writing binary.npy"):
        ingest([more], store, runner="local", crash_after="binary.npy")
    assert current_generation_number(store) == 1
    assert sorted(p.name for p in generations_dir(store).iterdir() if not p.name.startswith(".")) == ["000001"]
    assert not list(generations_dir(store).glob(".work-*"))  # the run's index work files went with it
    (generations_dir(store) / ".work-killed").mkdir()  # as a run killed outright leaves it
    gen = Generation.open_current(store)
    assert gen.size == 3 and gen.memories.num_rows == 3  # still whole and readable
    with StoreDB(store) as db:
        assert db.con.execute("SELECT status FROM ingest_runs ORDER BY started_at DESC LIMIT 1").fetchone() == ("failed",)
        assert db.counts()["memories"] == 3  # the failed run recorded nothing as ingested
    retry = ingest([more], store, runner="local")
    assert retry.generation == 2 and retry.total_memories == 6 and retry.embedded == 3
    assert not any(p.name.startswith((".tmp-", ".work-")) for p in generations_dir(store).iterdir())


def _ingest_failing_at(owner, attribute: str, sources, store, monkeypatch) -> None:
    """An ingest of ``sources`` during which ``owner.attribute`` raises, as a crash there
    would; the error must reach the caller."""
    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure in {attribute}")

    with monkeypatch.context() as patch:
        patch.setattr(owner, attribute, fail)
        with pytest.raises(RuntimeError, match=f"injected failure in {attribute}"):
            ingest(sources, store, runner="local")


def test_a_failure_recording_the_run_leaves_the_previous_generation_current(tmp_path, monkeypatch):
    """The database records a generation before readers switch to it: a failure there
    (here the graph's entities) leaves CURRENT, and the database, as they were."""
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:3])])], store, runner="local")
    more = write_jsonl(tmp_path / "b.jsonl", [memory(10 + i, t) for i, t in enumerate(FACTS[3:])])

    _ingest_failing_at(StoreDB, "replace_entities", [more], store, monkeypatch)
    assert current_generation_number(store) == 1 and Generation.open_current(store).size == 3
    with StoreDB(store) as db:
        assert db.counts()["memories"] == 3
    retry = ingest([more], store, runner="local")
    assert (retry.generation, retry.total_memories, retry.embedded) == (3, 6, 3)  # 2: the unused folder
    with StoreDB(store) as db:
        assert db.counts()["memories"] == 6 and db.counts()["deleted"] == 0


def test_a_generation_recorded_but_never_made_current_is_rolled_forward(tmp_path, monkeypatch):
    """A crash after the database commit and before CURRENT moves: the next run makes
    the recorded generation current first, so a new memory and a changed text both
    arrive, and nothing is embedded twice."""
    import helix_ray.ingest.run as pipeline

    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0])])], store, runner="local")
    more = write_jsonl(tmp_path / "b.jsonl", [memory(0, FACTS[2]), memory(1, FACTS[1])])  # m000's text changes

    _ingest_failing_at(pipeline, "set_current", [more], store, monkeypatch)  # the crash before CURRENT moves
    assert current_generation_number(store) == 1
    again = ingest([more], store, runner="local")
    assert current_generation_number(store) == 2 and again.embedded == 0 and again.unchanged == 2
    gen = Generation.open_current(store)
    assert gen.memories.column("text")[gen.columns.id_to_row["m000"]].as_py() == FACTS[2]
    assert "m001" in gen.columns.id_to_row


def test_a_local_ingest_imports_neither_pipelines_nor_ray(tmp_path):
    """The library reaches the Ray Data job (the top-level ``pipelines`` package) only
    when a run asks for Ray: a local ingest, as a Memory or the server's writer runs
    one, imports neither ``pipelines`` nor Ray."""
    import subprocess
    import sys

    from tests.helpers import REPO

    source = write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0])])
    code = ("import sys\n"
            "from helix_ray.ingest.run import ingest\n"
            f"assert ingest([{str(source)!r}], {str(tmp_path / 'store')!r}, runner='local').published\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('pipelines', 'ray'))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_old_generations_are_pruned(tmp_path):
    store = tmp_path / "store"
    for i, fact in enumerate(FACTS[:4]):
        report = ingest([write_jsonl(tmp_path / f"{i}.jsonl", [memory(i, fact)])], store, runner="local")
    assert report.generation == 4 and report.pruned == [1]
    assert sorted(p.name for p in generations_dir(store).iterdir()) == ["000002", "000003", "000004"]
    assert Generation.open_current(store).size == 4


def test_pruning_keeps_the_generations_that_were_current_not_abandoned_folders(tmp_path):
    """Two runs that failed after writing their folders (5, 6) must not push generation
    3, current before 4, out of the kept ones."""
    store = tmp_path / "store"
    for i, fact in enumerate(FACTS[:4]):
        ingest([write_jsonl(tmp_path / f"{i}.jsonl", [memory(i, fact)])], store, runner="local")
    for abandoned in (5, 6):
        (generations_dir(store) / f"{abandoned:06d}").mkdir()
    report = ingest([write_jsonl(tmp_path / "5.jsonl", [memory(5, FACTS[4])])], store, runner="local")
    assert report.generation == 7 and sorted(report.pruned) == [2, 5, 6]
    assert sorted(p.name for p in generations_dir(store).iterdir()) == ["000003", "000004", "000007"]


def test_reader_refuses_a_mismatched_manifest(tmp_path):
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0])])], store, runner="local")
    with pytest.raises(ManifestMismatch, match=r"embedder 'bge-small-en-int8'.*'other-model'"):
        Generation.open_current(store, expect_embedder="other-model")
    manifest = generations_dir(store) / "000001" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(ManifestMismatch, match="format_version 99"):
        Generation.open_current(store)


def _edges(generation: Generation) -> list[dict]:
    """The generation's graph as rows, its nodes named: memory ids, then ``user|key``."""
    entities = generation.entities
    names = pa.concat_arrays([generation.memories.column("id").combine_chunks(), pc.binary_join_element_wise(
        entities.column("user").combine_chunks(), entities.column("key").combine_chunks(), "|")])
    return [e for block in edges_tables(generation.graph, names) for e in block.to_pylist()]


def test_graph_links_sessions_entities_and_neighbours(tmp_path):
    rows = [memory(i, t, session_id="s1", created_at=f"2025-03-01T10:0{i}:00Z") for i, t in enumerate([
        "The ingest worker in services/ingest/worker.py crashed with OperationalError.",
        "We restarted services/ingest/worker.py and it recovered.",
        "Lunch was pizza.",
    ])]
    ingest([write_jsonl(tmp_path / "g.jsonl", rows)], tmp_path / "store", runner="local")
    generation = Generation.open_current(tmp_path / "store")
    edges = [(e["src"], e["dst"], e["type"]) for e in _edges(generation)]
    with StoreDB(tmp_path / "store") as db:  # the database keeps the entity nodes, not the edges
        assert db.counts()["entities"] == generation.entities.num_rows
        tables = {t for (t,) in db.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    assert "entities" in tables and "edges" not in tables
    types = {t for _, _, t in edges}
    assert {"mention", "same_session", "temporal"} <= types
    assert ("m000", "m001", "temporal") in edges and ("m001", "m002", "temporal") in edges
    mentions = {(s, d) for s, d, t in edges if t == "mention"}
    assert ("m000", "dana|path:services/ingest/worker.py") in mentions


def test_forgetting_a_user_counts_the_served_graph_edges_of_their_nodes(tmp_path):
    """The graph's edges live only in the generation's files: a forget counts those that
    touch the user's memories and entities there, and no edge of the other tenant."""
    from helix_ray.memory import Memory

    rows = [memory(i, t, user=user, session_id="s1", created_at=f"2025-03-01T10:0{i}:00Z")
            for user in ("dana", "lee") for i, t in enumerate([
                "The ingest worker in services/ingest/worker.py crashed with OperationalError.",
                "We restarted services/ingest/worker.py and it recovered.",
                "Lunch was pizza."][: 3 if user == "dana" else 2])]
    for i, row in enumerate(rows):
        row["id"] = f"{row['user']}-{i}"
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "g.jsonl", rows)], store, runner="local")
    ends = [(e["src"], e["dst"]) for e in _edges(Generation.open_current(store))]
    dana = sum(s.startswith("dana") and d.startswith("dana") for s, d in ends)
    assert 0 < dana < len(ends) and all(s[:3] == d[:3] for s, d in ends)  # each edge within one tenant
    with Memory(store, compact_interval_s=None, record_access=False) as mem:
        assert mem.stats()["edges"] == len(ends)
        gone = mem._core().forget_user("dana", compact=False)
    assert (gone["memories"], gone["edges"]) == (3, dana), gone


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgument, match="existing file"):
        ingest([tmp_path / "missing.jsonl"], tmp_path / "store", runner="local")
    with pytest.raises(InvalidArgument, match="runner"):
        ingest([SAMPLE / "memories.jsonl"], tmp_path / "store", runner="spark")
    with pytest.raises(InvalidArgument, match="format"):
        ingest([SAMPLE / "memories.jsonl"], tmp_path / "store", fmt="csv")


def test_large_tenants_get_a_deterministic_hnsw_index(tmp_path):
    from helix_ray.config import IngestConfig

    config = IngestConfig(hnsw_min_rows=4)  # dana has 6 memories, lee 1
    rows = [memory(i, t) for i, t in enumerate(FACTS)] + [memory(50, "Lee ships the beacon CLI.", user="lee")]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    gens = []
    for name in ("one", "two"):
        ingest([source], tmp_path / name, runner="local", config=config)
        gens.append(Generation.open_current(tmp_path / name))
    a, b = gens
    assert a.has_dense_index("dana") and not a.has_dense_index("lee")
    dense_file = a.manifest["partitions"][0]["dense"]
    assert (a.path / dense_file).read_bytes() == (b.path / dense_file).read_bytes()
    assert len(a.dense_index("dana")) == 6


def test_deleted_memory_leaves_and_comes_back_when_given_again(tmp_path):
    store = tmp_path / "store"
    source = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:3])])
    ingest([source], store, runner="local")
    with StoreDB(store) as db:
        db.delete(["m001"])
    other = write_jsonl(tmp_path / "b.jsonl", [memory(9, FACTS[5])])
    after_delete = ingest([other], store, runner="local")
    ids = set(Generation.open_current(store).memories.column("id").to_pylist())
    assert "m001" not in ids and after_delete.total_memories == 3
    again = ingest([source], store, runner="local")
    assert again.new == 1 and again.unchanged == 2
    assert "m001" in set(Generation.open_current(store).memories.column("id").to_pylist())
    # A record dropped as a duplicate is not "deleted": re-ingesting it is no news.
    dup = write_jsonl(tmp_path / "c.jsonl", [memory(20, FACTS[0] + " ")])
    assert ingest([dup], store, runner="local").new == 1
    assert not ingest([dup], store, runner="local").published


TURNS = ["Caroline: I went to the pottery class on Sunday.",
         "Melanie: Oh nice, how did it go?",
         "Caroline: Yes! I made a bowl for my mum.",
         "Melanie: Will you go again next week?"]


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


#: What a stored vector's float16 rounding (and mixing before it) can move a component by.
F16 = 5e-4


def _vectors(store, ids) -> dict[str, np.ndarray]:
    gen = Generation.open_current(store)
    return {i: np.asarray(gen.vectors[gen.columns.id_to_row[i]]) for i in ids}


def test_a_conversation_turn_takes_in_its_sessions_previous_turn(tmp_path):
    """session_context: a turn's vector is unit(v_turn + w · stored v_previous) within its
    session, in time then arrival order; the first turn, another session's turn and a
    memory without a session keep their own vector. Ingested turn by turn, each new turn
    mixes in the stored vector of the one before and old rows are never touched.

    Own vectors come from the same ingest with session_context 0: the int8 model
    quantizes activations per batch, so only the same batches give the same vectors."""
    turns = [memory(i, t, type="episodic", session_id="s1", created_at="2025-03-02T10:00:00Z")
             for i, t in enumerate(TURNS)]
    other = memory(9, "Caroline: I am off to the lake.", type="episodic", session_id="s2")
    plain = memory(20, "Billing moved to Postgres in March.", type="semantic", session_id="s1")
    source = write_jsonl(tmp_path / "all.jsonl", turns + [other, plain])
    ids_ = [f"m{i:03d}" for i in range(4)] + ["m009", "m020"]
    ingest([source], tmp_path / "off", runner="local", config=IngestConfig(session_context=0))
    ingest([source], tmp_path / "on", runner="local")  # the default weight, 1.0
    own, got = _vectors(tmp_path / "off", ids_), _vectors(tmp_path / "on", ids_)
    for i in ("m000", "m009", "m020"):  # first of s1, first of s2, not a conversation turn
        np.testing.assert_allclose(got[i], own[i], atol=1e-6)
    for i in (1, 2, 3):
        mixed = own[f"m{i:03d}"] + 1.0 * got[f"m{i - 1:03d}"]
        # stored as float16 (11 significant bits), mixed from unrounded vectors at ingest
        np.testing.assert_allclose(got[f"m{i:03d}"], _unit(mixed), atol=F16)
        assert float(got[f"m{i:03d}"] @ own[f"m{i:03d}"]) < 0.97  # the context moved it

    steps = {"on": {}, "off": {}}
    for i, turn in enumerate(turns):
        one = write_jsonl(tmp_path / f"t{i}.jsonl", [turn])
        for name, weight in (("on", 1.0), ("off", 0.0)):
            ingest([one], tmp_path / f"step-{name}", runner="local", config=IngestConfig(session_context=weight))
            now = _vectors(tmp_path / f"step-{name}", [f"m{j:03d}" for j in range(i + 1)])
            for j in range(i):  # old rows keep their vectors
                np.testing.assert_array_equal(now[f"m{j:03d}"], steps[name][f"m{j:03d}"])
            steps[name] = now
        new, pure = steps["on"][f"m{i:03d}"], steps["off"][f"m{i:03d}"]
        expected = pure if i == 0 else _unit(pure + steps["on"][f"m{i - 1:03d}"])
        np.testing.assert_allclose(new, expected, atol=F16)


def test_a_conversation_turn_is_also_found_by_its_previous_turns_words(tmp_path):
    """session_context_words: a turn's expansions end with its session's previous turn's
    text, as one line; an old row's when the turns come one ingest at a time. The first
    turn, another session's first, a memory without a session, a chunk of a long turn
    and the turn after it take none; off, no turn does. BM25 alone then finds the reply
    "Oh nice, how did it go?" by the words of the turn it answers."""
    from helix_ray.memory import Memory

    at = "2025-03-02T10:0{}:00Z"
    turns = [memory(i, t, type="episodic", session_id="s1", created_at=at.format(i)) for i, t in enumerate(TURNS)]
    other = memory(9, "Caroline: I am off to the lake.", type="episodic", session_id="s2")
    plain = memory(20, "Billing moved to Postgres in March.", type="semantic", session_id="s1")
    pasted = memory(30, _long_doc("kiln", 4), type="episodic", session_id="s1", created_at=at.format(5))
    after = memory(31, "Melanie: That is a lot of notes!", type="episodic", session_id="s1", created_at=at.format(6))
    source = write_jsonl(tmp_path / "all.jsonl", [*reversed(turns), other, plain, pasted, after])  # time orders them
    ingest([source], tmp_path / "on", runner="local", show_progress=False)
    ingest([source], tmp_path / "off", runner="local", config=IngestConfig(session_context_words=False),
           show_progress=False)
    with StoreDB(tmp_path / "on") as db:
        ids_ = list(db.expansions_for([f"m{i:03d}" for i in (0, 1, 2, 3, 9, 20, 31)]))
        chunks = [i for i in db.known_hashes() if i.startswith("m030#")]
        expanded = db.expansions_for([*ids_, *chunks])
    assert len(chunks) >= 2
    for i in (1, 2, 3):
        assert expanded[f"m{i:03d}"][-1] == TURNS[i - 1]
    for i in ("m000", "m009", "m020", "m031", *chunks):
        assert not any(line.startswith(("Caroline:", "Melanie:")) for line in expanded[i]), i
    with StoreDB(tmp_path / "off") as db:
        assert not any(line in TURNS for lines in db.expansions_for(ids_).values() for line in lines)

    ask = dict(user="dana", k=10, budget_tokens=10_000, disabled=frozenset({"router", "dense", "late"}))
    for name, reply_found in (("on", True), ("off", False)):
        with Memory(tmp_path / name, compact_interval_s=None, record_access=False) as mem:
            found = [m.id for m in mem.recall("pottery class", **ask).items]
        assert "m000" in found and ("m001" in found) == reply_found, (name, found)

    for i, turn in enumerate(turns[:2]):  # one ingest a turn: the second takes the stored first's words
        ingest([write_jsonl(tmp_path / f"t{i}.jsonl", [turn])], tmp_path / "steps", runner="local",
               show_progress=False)
    with StoreDB(tmp_path / "steps") as db:
        assert db.expansions_for(["m001"])["m001"][-1] == TURNS[0]


def test_the_fingerprint_of_stages_4_and_5_follows_the_config_and_the_shipped_models(tmp_path, monkeypatch):
    """A served write's vectors stand in for compaction's own only under the same
    fingerprint: another config, or a model replaced under the same name, is another."""
    from helix_ray import embedder, token_encoder
    from helix_ray.ingest import stages

    base = stages.fingerprint(IngestConfig())
    assert stages.fingerprint(IngestConfig()) == base
    assert stages.fingerprint(IngestConfig(embedder={"batch_size": 8})) == base  # the same vectors
    assert stages.fingerprint(IngestConfig(embedder={"batch_chars": 4_000})) == base
    assert stages.fingerprint(IngestConfig(doc2query={"max_queries": 2})) != base
    assert stages.fingerprint(IngestConfig(late_interaction={"max_tokens": 64})) != base
    assert stages.fingerprint(IngestConfig(session_context=0.5)) != base  # a written turn's vector mixes with it
    assert stages.fingerprint(IngestConfig(session_context_words=False)) != base  # and its expansions
    for name in ("bge_small_en", "colbert"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"x" * 10)
    monkeypatch.setattr(embedder, "embedded_model_dir", lambda: tmp_path / "bge_small_en")
    monkeypatch.setattr(token_encoder, "model_dir", lambda: tmp_path / "colbert")
    ours = stages.fingerprint(IngestConfig())
    assert ours != base
    (tmp_path / "bge_small_en" / "model.onnx").write_bytes(b"x" * 11)  # another model, same name
    assert stages.fingerprint(IngestConfig()) != ours


def _long_doc(topic: str, sections: int) -> str:
    return "\n\n".join([f"# {topic}"] + [
        f"## Part {n}\n" + " ".join(f"Part {n} of the {topic} notes covers shard {m} and its backup." for m in range(30))
        for n in range(1, sections + 1)])


def test_a_long_record_is_stored_as_chunks_and_a_new_version_leaves_none_behind(tmp_path):
    """Ingest stores a long text as chunks <id>#chunk<n> (nothing cut, nothing
    quarantined, and the report says so); ingesting the id again with a shorter text,
    or a long one again, replaces every earlier chunk or the earlier whole memory."""
    from helix_ray.cli_common import format_report
    from helix_ray.schema import parent_of
    from helix_ray.store.generation import Generation

    store = tmp_path / "store"
    reports = []

    def ids_after(text: str) -> list[str]:
        source = write_jsonl(tmp_path / f"doc-{len(text)}.jsonl", [{"id": "doc", "text": text, "user": "dana"}])
        reports.append(ingest([source], store, runner="local", show_progress=False))
        assert reports[-1].quarantined == 0, reports[-1]
        return sorted(Generation.open_current(store).memories.column("id").to_pylist())

    long_text = _long_doc("heron", 8)
    chunks = ids_after(long_text)
    assert len(chunks) >= 4 and all(parent_of(i) == "doc" for i in chunks)
    assert (reports[-1].read, reports[-1].chunks, reports[-1].chunked) == (len(chunks), len(chunks), 1)
    assert format_report(reports[-1]).splitlines()[0] == (
        f"read {len(chunks)} records ({len(chunks)} of them chunks of 1 long text): {len(chunks)} accepted, "
        "0 quarantined")
    texts = Generation.open_current(store).memories.column("text").to_pylist()
    assert any("Part 8 of the heron notes covers shard 29 and its backup." in t for t in texts)  # the end
    assert ids_after("The heron notes moved to the wiki.") == ["doc"]
    assert (reports[-1].chunks, reports[-1].chunked) == (0, 0)
    assert format_report(reports[-1]).startswith("read 1 record: 1 accepted")
    again = ids_after(_long_doc("okapi", 3))
    assert "doc" not in again and all(parent_of(i) == "doc" for i in again) and len(again) < len(chunks)
    with StoreDB(store) as db:
        live = {i for i, (_, deleted) in db.known_hashes().items() if not deleted}
    assert live == set(again)


def test_sorted_rows_and_arrays_are_written_to_files_and_mapped(tmp_path):
    """What ingest keeps out of its heap from the sort on: a table's rows in a given
    order, written a block at a time and read back from a memory map of the file; an
    array filled in place in a file whose blocks were taken when it was made."""
    import pyarrow.ipc as ipc

    from helix_ray.store.publish import file_array, mapped_table

    table = pa.table({"id": [f"m{i}" for i in range(10)], "n": list(range(10))})
    order = np.array([3, 1, 4, 0, 9, 2, 6, 5, 8, 7])
    mapped = mapped_table(table, tmp_path / "rows.arrow", order=order, block=3)
    assert mapped.column("n").to_pylist() == order.tolist() and mapped.column("id")[0].as_py() == "m3"
    assert ipc.open_file(str(tmp_path / "rows.arrow")).read_all().equals(mapped)
    assert mapped_table(table, tmp_path / "none.arrow", order=np.zeros(0, np.int64)).num_rows == 0
    filled = file_array(tmp_path / "ids.npy", np.int32, (5,))
    filled[:] = [5, 4, 3, 2, 1]
    filled.flush()
    assert isinstance(filled, np.memmap) and np.load(tmp_path / "ids.npy").tolist() == [5, 4, 3, 2, 1]
    assert file_array(tmp_path / "empty.npy", np.uint32, (0, 4)).shape == (0, 4)


def _batch(seq: list[int]) -> dict[str, np.ndarray]:
    from helix_ray.embedder import DIM

    return {"seq": np.array(seq), "vector": np.array([np.full(DIM, s, np.float32) for s in seq]),
             "n_tokens": np.array([s + 1 for s in seq]), "expansions": np.array([f'["q{s}"]' for s in seq], object),
             "entities": np.array([f'["name:e{s}"]' for s in seq], object),
             "words": np.array([f"w{s} common" for s in seq], object)}


def test_collect_takes_batches_as_they_come_and_each_row_once(tmp_path):
    """The transform stages' batches, in any order, from a generator: each row lands in
    its place, and a batch is let go once copied (the generator is never held whole).
    A row missing, or one sent twice, is an error rather than a zero vector. Given a
    file, the vectors are written into it as they come, not held."""
    from helix_ray.ingest.assemble import collect

    config = IngestConfig(late_interaction={"enabled": False})
    given: list[dict[str, np.ndarray]] = []

    def batches():
        for seq in ([3, 1], [0], [4, 2]):
            assert all("vector" not in b for b in given)  # the batches before were copied and let go
            given.append(_batch(seq))
            yield given[-1]

    cols = collect(batches(), 5, config)
    assert cols["vector"][:, 0].tolist() == [0, 1, 2, 3, 4] and cols["n_tokens"].tolist() == [1, 2, 3, 4, 5]
    assert cols["expansions"].to_pylist() == [f'["q{s}"]' for s in range(5)] and cols["late"] is None
    terms = cols["terms"].terms()  # numbered as the rows give them, not as the batches came
    assert terms.vocab == ["w0", "common", "w1", "w2", "w3", "w4"] and terms.ids.tolist() == [0, 1, 2, 1, 3, 1, 4, 1, 5, 1]
    given.clear()  # given a work folder: the columns are written into its files and mapped from them
    mapped = collect(batches(), 5, config, work=tmp_path)
    assert isinstance(mapped["vector"], np.memmap) and mapped["vector"][:, 0].tolist() == [0, 1, 2, 3, 4]
    in_file = pa.ipc.open_file(tmp_path / "new-outputs.arrow").read_all()
    for name in ("expansions", "entities"):
        assert mapped[name].to_pylist() == in_file.column(name).to_pylist() == cols[name].to_pylist()
    assert mapped["terms"].terms().ids.tolist() == terms.ids.tolist()
    listed = [_batch([1]), _batch([0])]
    assert collect(listed, 2, config)["entities"].to_pylist() == [["name:e0"], ["name:e1"]] and listed == []
    with pytest.raises(RuntimeError, match="1 rows for 2 inputs"):
        collect(iter([_batch([1])]), 2, config)
    with pytest.raises(RuntimeError, match="twice"):
        collect(iter([_batch([0, 1]), _batch([1])]), 2, config)
    with pytest.raises(RuntimeError, match="outside"):
        collect(iter([_batch([0, 2])]), 2, config)
    empty = collect(iter([]), 0, config)
    assert empty["vector"].shape[0] == 0 and empty["late"] is None and len(empty["entities"]) == 0
    mapped = collect(iter([_batch([2, 0]), _batch([1])]), 3, config, work=tmp_path)
    assert isinstance(mapped["vector"], np.memmap) and mapped["vector"][:, 0].tolist() == [0, 1, 2]
    assert np.load(tmp_path / "new-vectors.npy")[:, 0].tolist() == [0, 1, 2]
    assert mapped["terms"].ids == [] and (tmp_path / "new-terms-arrived.i32").stat().st_size == 6 * 4  # in the file
    assert mapped["terms"].terms().vocab == ["w0", "common", "w1", "w2"]
