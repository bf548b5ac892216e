"""``Memory.add``, ``patch`` and ``delete`` go through the Writer's write path: durable and
recallable at once, with no generation built per write; compaction (background or
``Memory.compact``) and ``Memory.ingest`` fold them into a generation.

Real DuckDB files and the real encoders; each test works on its own copy of one small
ingested store.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helix_ray import Memory
from helix_ray.errors import NotFound, StoreError
from helix_ray.live import compactor
from helix_ray.live.delta import DELTA_BASE
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation, current_generation_number
from tests.helpers import memory, write_jsonl

BASE = [memory(0, "The gateway listens on port 8443 for tenant traffic."),
        memory(1, "Redis caches the billing service keys for ten minutes."),
        memory(2, "Lee's gateway runs on port 9000.", user="lee")]


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    from helix_ray.ingest.run import ingest

    folder = tmp_path_factory.mktemp("writes")
    store = folder / "store"
    report = ingest([write_jsonl(folder / "base.jsonl", BASE)], store, runner="local", show_progress=False)
    assert report.published
    return store


@pytest.fixture()
def store(base_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(base_store, copy)
    return copy


def ids(mem: Memory, query: str, user: str = "dana", **kw) -> list[str]:
    return [item.id for item in mem.recall(query, user=user, **kw).items]


def test_an_add_is_recalled_at_once_without_a_new_generation(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        before = current_generation_number(store)
        counted = (mem.stats()["memories"], mem.stats()["by_user"]["dana"], mem.user_stats("dana")["user_memories"])
        written = mem.add([memory(7, "We pinned uvicorn to 0.30 after the keep-alive bug.")])
        assert written.ids == ("m007",) and written.generation == before and written.replaced == ()
        assert current_generation_number(store) == before  # the write is in the delta, not a generation
        assert ids(mem, "why did we pin uvicorn?")[0] == "m007"
        assert ids(mem, "which port does the gateway listen on?")[0] == "m000"  # the generation still answers
        assert mem.stats()["pending_writes"] == 1
        # Counted as a memory at once (recall returns it), not at the compaction.
        assert (mem.stats()["memories"], mem.stats()["by_user"]["dana"], mem.user_stats("dana")["user_memories"]) \
            == (counted[0] + 1, counted[1] + 1, {"dana": counted[1] + 1})
        mem.add([memory(0, "The gateway listens on port 7443.")])  # a new version: no new memory
        assert mem.stats()["memories"] == counted[0] + 1
    with StoreDB(store) as db:  # durable: logged in the database before add returned
        assert db.row("SELECT count(*) FROM serve_log WHERE id = 'm007'") == (1,)


def test_an_add_names_the_ids_it_replaced(store):
    """A write's ``replaced``: its ids that named a live memory already, in the delta or
    in the generation, whole or stored as chunks; a new id or a deleted one is no
    replacement."""
    long_text = " ".join(f"Step {n}: the heron runbook says to drain queue {n} before the restart." for n in range(90))
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert mem.add([memory(7, "We pinned uvicorn to 0.30.")]).replaced == ()
        again = mem.add([memory(7, "We pinned uvicorn to 0.31."), memory(0, "The gateway listens on 7443."),
                         memory(9, "A new fact.")])
        assert (again.ids, again.replaced) == (("m007", "m000", "m009"), ("m007", "m000"))
        assert mem.add([{"id": "runbook", "user": "dana", "text": long_text}]).replaced == ()
        assert mem.add([{"id": "runbook", "user": "dana", "text": "Drain the queues."}]).replaced == ("runbook",)
        mem.delete("m009")
        assert mem.add([memory(9, "A new fact.")]).replaced == ()


def test_a_second_users_memories_stay_invisible(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(8, "The zebra deploy key lives in vault path kv/zebra.", user="lee")])
        assert "m008" not in ids(mem, "where is the zebra deploy key?")
        assert ids(mem, "where is the zebra deploy key?", user="lee")[0] == "m008"
        assert "m002" not in ids(mem, "gateway port")  # nor the generation's rows of lee


def test_patch_and_delete_of_a_memory_and_of_a_chunked_one(store):
    long_text = " ".join(f"Step {n}: the heron runbook says to drain queue {n} before the restart." for n in range(90))
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        written = mem.add([{"id": "runbook", "user": "dana", "text": long_text}])
        assert written.ids == ("runbook",)
        chunks = [i for i in ids(mem, "heron runbook drain queue", k=20) if i.startswith("runbook#chunk")]
        assert chunks, "a long text is stored as chunks"
        mem.patch("runbook", pinned=True)  # every chunk changes
        pinned = ids(mem, "heron runbook drain queue", k=20, pinned=True)
        assert pinned and all(i.startswith("runbook#chunk") for i in pinned)
        assert not [i for i in ids(mem, "heron runbook drain queue", k=20, pinned=False) if i.startswith("runbook")]
        mem.patch("m000", text="The gateway listens on port 7443 since the migration.")
        top = mem.recall("which port does the gateway listen on?", user="dana").items[0]
        assert (top.id, "7443" in top.text) == ("m000", True)
        mem.delete("runbook")
        assert not [i for i in ids(mem, "heron runbook drain queue", k=20) if i.startswith("runbook")]
        mem.delete("m001")
        assert "m001" not in ids(mem, "what does Redis cache?")
        with pytest.raises(NotFound, match=r"no such memory for user 'dana'. Check the id: every write gives it "
                                           r"\(helix add, MCP remember"):
            mem.delete("m002", user="dana")  # lee's


def test_a_deleted_memory_written_again_counts_as_a_memory_not_as_deleted(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        before = mem.stats()
        mem.delete("m001")
        gone = mem.stats()
        assert (gone["memories"], gone["deleted"]) == (before["memories"] - 1, before["deleted"] + 1)
        mem.add([memory(1, "Redis caches the billing service keys for an hour.")])
        again = mem.stats()
        assert (again["memories"], again["deleted"]) == (before["memories"], before["deleted"])


def test_an_add_is_recalled_after_close_and_reopen(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(9, "The heron backup job runs nightly at two.")])
        mem.delete("m001")
    with Memory(store, warm=False, compact_interval_s=None) as mem:  # the log replayed into the delta
        assert ids(mem, "when does the heron backup job run?")[0] == "m009"
        assert "m001" not in ids(mem, "what does Redis cache?")


def test_compact_folds_the_writes_into_a_generation(store):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        before = current_generation_number(store)
        mem.add([memory(10, "Kite retries three times before it gives up.")])
        mem.delete("m001")
        report = mem.compact()
        assert report["published"] and report["folded"] == 1 and report["generation"] > before
        assert mem.stats()["pending_writes"] == 0
        held = Generation.open_current(store).columns.id_to_row
        assert "m010" in held and "m001" not in held
        assert ids(mem, "how often does kite retry?")[0] == "m010"
        assert "m001" not in ids(mem, "what does Redis cache?")


def test_a_compaction_of_a_write_deleted_before_it_leaves_nothing_pending(store):
    """A memory added and deleted between two compactions is in no generation: the
    compaction publishes nothing, and the deletion is done, not pending for good (also
    after a restart, and with no other write to come)."""
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        before = current_generation_number(store)
        mem.add([memory(11, "Kite retries three times before it gives up.")])
        mem.patch("m011", text="Kite retries five times before it gives up.")
        mem.delete("m011")
        assert mem.stats()["pending_writes"] == 1
        report = mem.compact()
        assert not report["published"] and report["deletions"] == 1 and report["generation"] == before
        assert mem.stats()["pending_writes"] == 0
        assert "m011" not in ids(mem, "how often does kite retry?")
        assert mem.compact()["reason"] == "nothing to compact"
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert mem.stats()["pending_writes"] == 0
        assert "m011" not in ids(mem, "how often does kite retry?")
        mem.delete("m001")  # a generation row: the next compaction drops it
        assert mem.compact()["published"] and mem.stats()["pending_writes"] == 0
        assert "m001" not in ids(mem, "what does Redis cache?")


def test_the_background_compaction_folds_the_writes(store):
    with Memory(store, warm=False, compact_interval_s=0.5) as mem:
        before = current_generation_number(store)
        mem.add([memory(11, "The owl dashboard refreshes every minute.")])
        for _ in range(600):
            if mem.stats()["pending_writes"] == 0:
                break
            time.sleep(0.1)
        assert current_generation_number(store) > before
        assert ids(mem, "how often does the owl dashboard refresh?")[0] == "m011"
        if sys.platform == "linux":  # the compactor yields the cores to recall; this thread keeps its priority
            [thread] = [t for t in threading.enumerate() if t.name == "helix-compactor"]
            mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(mine + compactor.COMPACT_NICE, 19)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_lower_priority_lowers_the_calling_thread_and_the_threads_it_starts():
    seen: dict[str, int | None] = {}

    def child() -> None:
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def lowered() -> None:
        seen["set"] = compactor.lower_priority(3)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        started = threading.Thread(target=child)
        started.start()
        started.join()

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    expected = min(mine + 3, 19)
    assert seen == {"set": expected, "thread": expected, "child": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert compactor.lower_priority(0) is None  # 0: nothing changes
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_open_writer_folds_what_an_earlier_session_left_without_a_new_write(store):
    """``open_writer`` (how ``helix mcp`` opens a store): the Writer and its background
    compaction start with the Memory, not at its first write; ``user_stats`` counts one
    user's memories and pending writes, never another's."""
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(13, "The heron queue drains at noon.")])
    before = current_generation_number(store)
    with Memory(store, warm=False, compact_interval_s=0.5, open_writer=True) as mem:
        for _ in range(300):  # no call of mem: only the open can have started the compaction
            if current_generation_number(store) > before:
                break
            time.sleep(0.1)
        assert current_generation_number(store) > before
        for _ in range(100):  # the compaction publishes, then drops the folded write from the delta
            if mem.user_stats("dana")["pending_writes"] == 0:
                break
            time.sleep(0.1)
        assert mem.user_stats("dana") == {"user_memories": {"dana": 3}, "pending_writes": 0}
        assert mem.user_stats("lee") == {"user_memories": {"lee": 1}, "pending_writes": 0}


def test_ingest_after_adds_keeps_both(store, tmp_path):
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(12, "The lynx token rotates weekly.")])
        mem.add([memory(0, "The gateway listens on port 6443 after the move.")])  # a newer text of m000
        report = mem.ingest(write_jsonl(tmp_path / "more.jsonl", [memory(13, "Tuatara logs are kept ninety days.")]))
        assert report.published
        assert mem.stats()["pending_writes"] == 0  # folded first
        assert ids(mem, "how often does the lynx token rotate?")[0] == "m012"
        assert ids(mem, "how long are tuatara logs kept?")[0] == "m013"
        top = mem.recall("which port does the gateway listen on?", user="dana").items[0]
        assert top.id == "m000" and "6443" in top.text


def test_a_deleted_memory_stays_deleted_when_its_source_is_read_again(store, tmp_path):
    """Protects: `helix delete` of a Markdown section, then the unchanged notes ingested
    again, brought the section back. A user's delete holds against a source that gives
    the same text (a long one's chunks too), before and after a compaction; a new text
    is a new version, which comes back whole; writing it again brings it back."""
    long_text = " ".join(f"Step {n}: the heron runbook says to drain queue {n} before the restart." for n in range(90))
    source = write_jsonl(tmp_path / "notes.jsonl", [*BASE[:2], {"id": "runbook", "user": "dana", "text": long_text}])
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert mem.ingest(source).published
        mem.delete("m001")
        mem.delete("runbook")
        again = mem.ingest(source)
        chunks = again.kept_deleted - 1
        assert chunks >= 3 and (again.new, again.updated, again.unchanged) == (0, 0, 1), again
        assert "m001" not in ids(mem, "what does Redis cache?")
        assert not [i for i in ids(mem, "heron runbook drain queue", k=20) if i.startswith("runbook")]
        mem.compact()
        assert mem.ingest(source).kept_deleted == chunks + 1
        edited = long_text.replace("Step 89:", "Finally, step 89:")
        changed = mem.ingest(write_jsonl(tmp_path / "edited.jsonl", [*BASE[:2], {"id": "runbook", "user": "dana",
                                                                                 "text": edited}]))
        assert changed.kept_deleted == 1 and changed.new == chunks, changed  # m001 still; every chunk is back
        stored = Generation.open_current(store).memories.column("id").to_pylist()
        assert len([i for i in stored if i.startswith("runbook#")]) == chunks
        mem.add([BASE[1]])  # written again by the user
        assert ids(mem, "what does Redis cache?")[0] == "m001"
        assert mem.ingest(source).kept_deleted == 0
        assert ids(mem, "what does Redis cache?")[0] == "m001"
        # Deleted as chunks, written again short: the memory is the user's again, every chunk id.
        mem.delete("runbook")
        assert mem.db.withdrawn([f"runbook#chunk{n}" for n in range(1, chunks + 1)])
        mem.add([{"id": "runbook", "user": "dana", "text": "Drain the queues, then restart."}])
        assert not mem.db.withdrawn(["runbook", *(f"runbook#chunk{n}" for n in range(1, chunks + 1))])


def test_memory_works_inside_a_running_event_loop(store):
    """A notebook's cell runs inside an event loop: add and recall must not start one."""

    async def cell() -> list[str]:
        with Memory(store, warm=False, compact_interval_s=None) as mem:
            mem.add([memory(14, "The marten cache is warmed at boot.")])
            return ids(mem, "when is the marten cache warmed?")

    assert asyncio.run(cell())[0] == "m014"


def test_two_memory_objects_of_one_store_share_its_writer(store):
    """A notebook cell ``mem = Memory(store)`` run twice: the old object lives on in its
    threads. Both must write through one Writer (one log sequence, one delta), so that
    neither undoes the other's writes nor folds a memory the other deleted."""
    first = Memory(store, warm=False, compact_interval_s=None)
    second = Memory(store, warm=False, compact_interval_s=None)
    try:
        first.add([memory(20, "The ibis queue drains at midnight.")])
        second.add([memory(21, "The okapi cluster runs on arm nodes.")])
        first.add([memory(22, "The quokka build caches its wheels.")])  # the next seq, not one the other used
        second.delete("m001")
        assert first.compact()["published"]  # folds the other's writes and its deletion too
        second.add([memory(23, "The wombat alerts page the on-call twice.")])
        first.delete("m020")
        for mem in (first, second):
            assert ids(mem, "when does the ibis queue drain?")[:1] != ["m020"]
            assert ids(mem, "which nodes does the okapi cluster run on?")[0] == "m021"
            assert ids(mem, "what does the quokka build cache?")[0] == "m022"
            assert ids(mem, "how often do wombat alerts page?")[0] == "m023"
            assert "m001" not in ids(mem, "what does Redis cache?")
            assert mem.stats()["pending_writes"] == 2  # m023 and the deletion of m020
        first.close()
        with pytest.raises(StoreError, match="closed Memory"):
            first.add([memory(24, "A closed Memory writes nothing.")])
        second.add([memory(25, "The narwhal backups go to cold storage.")])  # the other one still writes
        assert second.compact()["published"]
        assert ids(second, "where do narwhal backups go?")[0] == "m025"
    finally:
        first.close()
        second.close()
    with Memory(store, warm=False, compact_interval_s=None) as again:
        assert ids(again, "how often do wombat alerts page?")[0] == "m023"
        assert "m020" not in ids(again, "when does the ibis queue drain?")
        assert "m001" not in ids(again, "what does Redis cache?")


def _files(store) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(store)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(store.rglob("*")) if p.is_file()}


def test_recall_and_stats_change_nothing_in_the_store_but_the_access_log(store):
    """``helix recall`` and ``helix stats`` only read: no Writer opens (no delta
    published, no log replayed). A recall's hits go to the database's access log (the
    recency signal), so ``helix.duckdb`` may change on a recall, nothing else; stats
    records nothing."""
    import json
    import subprocess
    import sys

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(30, "The gannet feed refreshes every five minutes.")])  # pending, in the delta
    before = _files(store)

    def helix(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "helix_ray.cli", *args, "--store", str(store), "--json"],
                              capture_output=True, text=True, check=True, timeout=300).stdout

    assert json.loads(helix("stats"))["pending_writes"] == 1
    assert _files(store) == before
    found = json.loads(helix("recall", "how often does the gannet feed refresh?", "--user", "dana"))
    assert found["items"][0]["id"] == "m030"  # the published delta, read without a Writer
    after = _files(store)
    assert {name for name in after if after[name] != before.get(name)} <= {"helix.duckdb", "helix.duckdb.wal"}
    with StoreDB(store) as db:
        assert db.row("SELECT count(*) FROM access_log WHERE id = 'm030'") == (1,)


def test_a_new_process_reads_the_recall_hits_no_compaction_folded_yet(store):
    """Recency reads a recall's hits at once, in the process that made them and in the
    next one to open the store (each `helix recall` is one), before a compaction folds
    them into the generation."""
    import json
    import subprocess

    question = "which port does the gateway listen on?"
    with Memory(store, warm=False, compact_interval_s=None, record_access=False) as mem:
        first = mem.recall(question, user="dana").items[0]
    assert first.id == "m000" and first.signals["recency"] == 0.0  # never accessed
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        assert mem.recall(question, user="dana").items[0].signals["recency"] == 0.0  # recorded after ranking
        assert mem.recall(question, user="dana").items[0].signals["recency"] > 0.99
    found = json.loads(subprocess.run([sys.executable, "-m", "helix_ray.cli", "recall", question, "--user", "dana",
                                       "--store", str(store), "--json"],
                                      capture_output=True, text=True, check=True, timeout=300).stdout)
    assert found["items"][0]["id"] == "m000" and found["items"][0]["signals"]["recency"] > 0.99
    assert current_generation_number(store) == 1  # no compaction folded the hits


def test_a_memory_left_open_is_closed_at_exit_with_its_hits_logged(store):
    """A script or notebook that never closes its Memory loses nothing: at exit the
    recall hits are logged and the database closed (no leaked DuckDB objects reported)."""
    import subprocess

    script = (f"from helix_ray import Memory\nmem = Memory({str(store)!r}, warm=False)\n"
              "print(mem.recall('which port does the gateway listen on?', user='dana').items[0].id)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and done.stdout == "m000\n", done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
    with StoreDB(store) as db:
        assert db.row("SELECT count(*) FROM access_log WHERE id = 'm000'") == (1,)


def test_ingest_folds_and_ingests_with_no_write_in_between(store, tmp_path, monkeypatch):
    """A write that returns between the fold of the pending writes and the ingest would
    stay in the delta over the ingested record of its id (and the next compaction would
    write it over that record): it must wait for the ingest, and so be the newer one."""
    import threading

    from helix_ray.ingest import run

    events: list[str] = []
    real_ingest = run.ingest

    def ingest(*args, **kw):
        events.append("ingest")
        return real_ingest(*args, **kw)

    monkeypatch.setattr(run, "ingest", ingest)
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(31, "The pending write before the ingest.")])
        real_fold = mem._fold

        def fold():
            report = real_fold()
            events.clear()  # the fold's own pipeline run
            writer = threading.Thread(target=lambda: (mem.add([memory(0, "The gateway moved to port 5443.")]),
                                                      events.append("write")))
            writer.start()
            writer.join(timeout=3)  # returns here when a write can land between the fold and the ingest
            return report

        monkeypatch.setattr(mem, "_fold", fold)
        report = mem.ingest(write_jsonl(tmp_path / "more.jsonl",
                                        [memory(0, "The gateway listens on port 4443 per the new runbook.")]))
        assert report.published
        for _ in range(100):
            if "write" in events:
                break
            time.sleep(0.1)
        assert events == ["ingest", "write"]  # the write waited for the ingest: it is the newer one
        top = mem.recall("which port does the gateway listen on?", user="dana").items[0]
        assert top.id == "m000" and "5443" in top.text
        mem.compact()
        top = mem.recall("which port does the gateway listen on?", user="dana").items[0]
        assert top.id == "m000" and "5443" in top.text


def test_ingest_says_when_the_pending_writes_cannot_be_folded(store, tmp_path, monkeypatch):
    from helix_ray.live import compaction

    def broken(core, **kw):
        raise OSError("the inbox is read-only")

    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(32, "A write the fold cannot take.")])
        monkeypatch.setattr(compaction, "compact", broken)
        with pytest.raises(StoreError, match=r"the 1 pending writes could not be folded.*inbox is read-only.*"
                                             r"nothing was ingested"):
            mem.ingest(write_jsonl(tmp_path / "more.jsonl", [memory(33, "Never ingested.")]))
        assert ids(mem, "the fold cannot take")[0] == "m032"  # still in the delta


def test_the_first_compaction_that_encodes_every_memorys_tokens_says_so_once(tmp_path, caplog):
    """A store built without token vectors, opened with late interaction on and no
    background compaction: ``compact`` still encodes them all, so it warns, once."""
    import logging

    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest

    built = IngestConfig(late_interaction={"enabled": False})
    ingest([write_jsonl(tmp_path / "base.jsonl", BASE)], tmp_path / "store", config=built, runner="local",
           show_progress=False)
    with caplog.at_level(logging.WARNING, logger="helix_ray.live.writer"):
        with Memory(tmp_path / "store", warm=False, compact_interval_s=None) as mem:
            mem.add([memory(34, "The first write after the build.")])
            assert not [r for r in caplog.records if "token vectors" in r.getMessage()]  # no compaction yet
            mem.compact()
            mem.add([memory(35, "The second write after the build.")])
            mem.compact()
    said = [r.getMessage() for r in caplog.records if "token vectors" in r.getMessage()]
    assert len(said) == 1 and "encode the tokens of all 3 memories" in said[0], said


def test_a_store_made_again_at_the_same_path_keeps_its_delta_files(base_store, tmp_path):
    """The Writer prunes delta segments that no kept snapshot lists, reading each
    snapshot's list once per process: a store deleted and made again at the same path has
    other lists under the same names."""
    store = tmp_path / "again"
    for round_ in range(2):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(base_store, store)
        with Memory(store, warm=False, compact_interval_s=None) as mem:
            for i in range(6):  # six snapshots: the writer prunes past the newest four
                mem.add([memory(40 + i, f"Round {round_} note {i}: the quota bucket holds {i} tokens.")])
            assert ids(mem, f"Round {round_} note 5 quota bucket")[0] == "m045"
            assert sum(i.startswith("m04") for i in ids(mem, "quota bucket tokens", k=10)) == 6


def test_recall_over_pending_writes_keeps_blas_on_the_calling_thread(store, monkeypatch):
    """The delta's own search (a product over every pending write) runs under the
    recall's one-thread BLAS limit, as the generation's legs do: an idle BLAS worker
    would otherwise spin on the core the query's token encoder runs on."""
    from threadpoolctl import threadpool_info

    from helix_ray.live.delta import DeltaSegment

    def blas_threads() -> int:
        return max((lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"), default=1)

    if blas_threads() < 2:
        pytest.skip("BLAS runs one thread here whatever the limit")
    seen: list[int] = []
    search = DeltaSegment.dense_search

    def watched(self, *args, **kwargs):
        seen.append(blas_threads())
        return search(self, *args, **kwargs)

    monkeypatch.setattr(DeltaSegment, "dense_search", watched)
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        mem.add([memory(7, "We pinned uvicorn to 0.30 after the keep-alive bug.")])
        mem.recall("what did we lock down after the connection problem?", user="dana")
    assert seen and set(seen) == {1}
    assert blas_threads() >= 2  # and restored after it


CHAT = ["Caroline: I went to the pottery class on Sunday.",
        "Melanie: Oh nice, how did it go?",
        "Caroline: Yes! I made a bowl for my mum.",
        "Melanie: Will you go again next week?",
        "Caroline: Maybe, if the kiln is free.",
        "Melanie: Tell me how the bowl turns out!"]


def _turn(i: int, session: str = "s1", at: str | None = None) -> dict:
    return memory(i, CHAT[i % len(CHAT)] if session == "s1" else f"Jon: note {i} about the lake.", type="episodic",
                  session_id=session, created_at=f"2025-03-02T{at or f'10:{i:02d}:00'}Z")


def _unit(v):
    import numpy as np

    return v / np.linalg.norm(v)


def test_a_written_turn_takes_in_its_sessions_previous_turn(tmp_path):
    """A conversation turn written through Memory.add takes in the stored vector of its
    session's latest turn at or before its time, as ingest mixes one
    (``session_context``): a turn of the generation, of the delta, or one written before
    it in the same call; a turn written late mixes the one before it in time; a deleted
    turn is not one; a turn earlier than all of its session's, another session's first
    turn and a memory without a session keep their own vector. A compaction stores the
    mixed vectors as they are, not mixed again. The same previous turn's text is the
    last line of the written turn's BM25 text (``session_context_words``), and of its
    expansions once compacted.

    Own vectors come from a second store written with session_context 0 in the same
    calls: the int8 model quantizes activations per batch, so only the same batches
    give the same vectors."""
    import numpy as np

    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest

    calls = [[_turn(1)], [_turn(2), _turn(3)], [_turn(7, "s2")], [memory(8, "Billing moved to Postgres.")],
             [_turn(4, at="09:59:00")],  # before every turn of its session: left as it is
             [_turn(6, at="10:02:30")]]  # written after m003, said between m002 and m003
    stores = {}
    for name, weight in (("on", 1.0), ("off", 0.0)):
        config = IngestConfig(session_context=weight)
        store = tmp_path / name
        ingest([write_jsonl(tmp_path / "first.jsonl", [_turn(0)])], store, runner="local", config=config,
               show_progress=False)
        mem = Memory(store, ingest=config, compact_interval_s=None, record_access=False)
        for batch in calls:
            mem.add(batch)
        stores[name] = mem
    try:
        on, off = stores["on"], stores["off"]
        got = {i: np.asarray(e["vector"], np.float32) for i, e in on._core().entries.items()}
        own = {i: np.asarray(e["vector"], np.float32) for i, e in off._core().entries.items()}
        base = Generation.open_current(on.store)
        first = np.asarray(base.vectors[base.columns.id_to_row["m000"]], np.float32)
        np.testing.assert_allclose(got["m001"], _unit(own["m001"] + first), atol=1e-6)  # the generation's turn
        np.testing.assert_allclose(got["m002"], _unit(own["m002"] + got["m001"]), atol=1e-6)  # the delta's
        np.testing.assert_allclose(got["m003"], _unit(own["m003"] + got["m002"]), atol=1e-6)  # same call
        for alone in ("m007", "m008", "m004"):
            np.testing.assert_allclose(got[alone], own[alone], atol=1e-6)
        np.testing.assert_allclose(got["m006"], _unit(own["m006"] + got["m002"]), atol=1e-6)
        assert float(got["m002"] @ own["m002"]) < 0.97  # the context moved it
        lexical = {i: e["lexical"] for i, e in on._core().entries.items()}
        for i, before in (("m001", 0), ("m002", 1), ("m003", 2), ("m006", 2)):
            assert lexical[i].endswith("\n" + CHAT[before]), (i, lexical[i])
        for alone in ("m007", "m008", "m004"):
            assert not any(lexical[alone].endswith(line) for line in CHAT if line != CHAT[int(alone[-1]) % 6])

        for mem in (on, off):  # the session's latest turn deleted: the next one mixes the one before it
            mem.delete("m003", user="dana")
            mem.add([_turn(5)])
        got5 = np.asarray(on._core().entries["m005"]["vector"], np.float32)
        own5 = np.asarray(off._core().entries["m005"]["vector"], np.float32)
        np.testing.assert_allclose(got5, _unit(own5 + got["m006"]), atol=1e-6)  # m003 (10:03) gone
        assert on._core().entries["m005"]["lexical"].endswith("\n" + CHAT[0])  # m006's text

        assert on.compact()["published"]
        folded = Generation.open_current(on.store)
        for i, vector in [*got.items(), ("m005", got5)]:
            if i != "m003":  # deleted
                stored = np.asarray(folded.vectors[folded.columns.id_to_row[i]], np.float32)
                np.testing.assert_allclose(stored, vector, atol=5e-4)  # float16, not mixed again
        expansions = on._core().db.expansions_for(["m001", "m002", "m005", "m007"])
        # The rebuild's dedup dropped m000 for m006, the same text: m001 follows m004 (09:59) now.
        assert [expansions[i][-1] for i in ("m001", "m002", "m005")] == [CHAT[4], CHAT[1], CHAT[0]]
        assert expansions["m007"][-1] not in CHAT
    finally:
        for mem in stores.values():
            mem.close()


def test_a_written_turn_finds_its_previous_turn_in_a_segment(tmp_path):
    """Past two folds the session's previous turn is a segment row of the generation
    (the delta no longer holds it): the next turn mixes its stored vector in."""
    import numpy as np

    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest

    config = IngestConfig(fold={"min_base_rows": 0, "max_share": 1.0})
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "base.jsonl", BASE)], store, runner="local", config=config, show_progress=False)
    with Memory(store, ingest=config, compact_interval_s=None, record_access=False) as mem:
        mem.add([_turn(11)])
        assert mem.compact()["mode"] == "segment"
        mem.add([_turn(17, "s2")])
        assert mem.compact()["mode"] == "segment"
        core = mem._core()
        assert "m011" not in core.entries
        segment = Generation.open_current(store).segment_rows()
        held = dict(zip(segment.column("id").to_pylist(), segment.column("vector").to_pylist()))
        mem.add([_turn(12)])
        mixed = np.asarray(core.entries["m012"]["vector"], np.float32)
        assert core.entries["m012"]["lexical"].endswith("\n" + CHAT[11 % len(CHAT)])  # the segment row's text
    with Memory(tmp_path / "plain", ingest=IngestConfig(session_context=0), compact_interval_s=None,
                record_access=False) as plain:
        plain.add([_turn(12)])
        own = np.asarray(plain._core().entries["m012"]["vector"], np.float32)
    np.testing.assert_allclose(mixed, _unit(own + np.asarray(held["m011"], np.float32)), atol=1e-6)


def test_a_large_tenants_sessions_are_indexed_as_a_scan_finds_them(tmp_path, monkeypatch):
    """SessionRows: the index a large tenant gets gives each session the rows a scan of
    the tenant's sessions gives (none for a session it does not hold); it is made again
    for a rebuilt generation and kept for a folded one (the same memories file)."""
    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest
    from helix_ray.live import session_context

    rows = [_turn(1), _turn(2, "s2"), _turn(3), memory(4, "Billing moved to Postgres."), _turn(5, "s2"),
            memory(6, "Lee's note.", user="lee", session_id="s1")]
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "rows.jsonl", rows)], store, runner="local", show_progress=False)
    generation = Generation.open_current(store)
    scanned = session_context.SessionRows()
    found = {s: scanned.offsets(generation, "dana", s).tolist() for s in ("s1", "s2", "s9")}
    ids = generation.memories.column("id").to_pylist()
    start = generation.partitions["dana"][0]
    assert {s: sorted(ids[start + o] for o in found[s]) for s in found} == {
        "s1": ["m001", "m003"], "s2": ["m002", "m005"], "s9": []}
    monkeypatch.setattr(session_context, "INDEX_FROM", 0)
    indexed = session_context.SessionRows()
    indexed.index_large_tenants(generation)  # what a replica warming the generation does
    assert sorted(list(indexed._indexes.values())[-1]) == ["dana", "lee"]
    for s, offsets in found.items():
        assert indexed.offsets(generation, "dana", s).tolist() == offsets
    assert indexed.offsets(generation, "lee", "s1").tolist() == [0]
    with Memory(store, compact_interval_s=None, record_access=False) as warmed:  # warms in the background
        warmed.ready(60)
        for thread in [t for t in threading.enumerate() if t.name == "helix-warm"]:
            thread.join(60)  # after the question, it indexes the sessions and reads the files
        assert sorted(list(warmed._views.sessions._indexes.values())[-1]) == ["dana", "lee"]
    with Memory(store, compact_interval_s=None, record_access=False) as mem:
        mem.delete("m001", user="dana")
        assert mem.compact()["published"]
    newer = Generation.open_current(store)
    start = newer.partitions["dana"][0]
    assert [newer.memories.column("id")[start + o].as_py() for o in indexed.offsets(newer, "dana", "s1")] == ["m003"]
    kept, before = indexed._index(newer, "dana"), indexed.offsets(newer, "dana", "s1").tolist()
    fold = IngestConfig(fold={"min_base_rows": 0, "max_share": 1.0})
    with Memory(store, ingest=fold, compact_interval_s=None, record_access=False) as mem:
        mem.add([_turn(12)])
        assert mem.compact()["mode"] == "segment"
    folded = Generation.open_current(store)  # the same memories file, linked: the index stays
    assert folded.number > newer.number and indexed.offsets(folded, "dana", "s1").tolist() == before
    assert indexed._index(folded, "dana") is kept


def _graph_origin(result) -> dict:
    frame = result.explain
    return dict(zip(frame["id"].to_list(), frame["origin"].to_list()))


def test_graph_expansion_reaches_a_written_turn_through_its_session(tmp_path):
    """A written conversation turn is linked to its session's node: a query whose seeds
    are the session's stored turns reaches it by graph expansion, though it shares no
    word with the query; so does a turn of a session only the delta holds, through a
    node made for that session once two of its turns are written. A turn outside the
    recall's scope is not added. Turns take no words of the turn before them here
    (``session_context_words``), so that the query's words stay in the seeds alone."""
    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest

    config = IngestConfig(session_context_words=False)

    stored = [_turn(1), _turn(2), _turn(3),
              memory(10, "Jon: the lake was cold this morning.", type="episodic", session_id="s2",
                     created_at="2025-03-01T09:00:00Z"),
              memory(11, "Jon: we rowed across the lake.", type="episodic", session_id="s2",
                     created_at="2025-03-01T09:01:00Z")]
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "rows.jsonl", stored)], store, runner="local", config=config, show_progress=False)
    quiet = memory(20, "Melanie: Sounds lovely, send me a photo later!", type="episodic", session_id="s1",
                   created_at="2025-03-02T10:30:00Z")
    fresh = [memory(21, "Ana: the glaze recipe for the pottery bowls is in my notebook.", type="episodic",
                    session_id="s3", created_at="2025-03-03T09:00:00Z"),
             memory(22, "Ana: remind me on Friday.", type="episodic", session_id="s3",
                    created_at="2025-03-03T09:01:00Z")]
    with Memory(store, ingest=config, compact_interval_s=None, record_access=False) as mem:
        mem.add([quiet, *fresh])
        # BM25 alone finds the seeds: on so small a store the dense leg would list every turn.
        ask = dict(user="dana", k=20, budget_tokens=100_000, explain=True, disabled=frozenset({"router", "dense"}))
        found = _graph_origin(mem.recall("pottery class bowl", **ask))
        assert found.get("m020") == "graph"  # reached through s1's node in the generation
        assert found.get("m022") == "graph"  # through the node made for s3
        assert "m010" not in found and "m011" not in found  # the lake session is not linked to pottery
        # The stored turns are in this scope and m020 is not: the node links it, and it stays out.
        early = _graph_origin(mem.recall("pottery class bowl", until="2025-03-02T10:10:00Z", **ask))
        assert {"m001", "m002"} & set(early) and "m020" not in early and "m022" not in early


def test_a_written_turn_of_the_same_time_follows_the_latest_arrival(tmp_path):
    """Turns of one time (LoCoMo dates a session, not its turns): the previous turn is
    the one that arrived last, a written one after the generation's, and the
    generation's in row order, as ingest orders them; another user's session of the
    same id is never one. A memory rewritten long, as chunks, is not mixed with its own
    earlier version: its first chunk takes the turn before it, each next chunk the one
    before that."""
    import numpy as np

    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest

    at = "10:00:00"
    first = [_turn(1, at=at), _turn(2, at=at), memory(3, "Lee: my lake trip.", user="lee", type="episodic",
                                                       session_id="s1", created_at=f"2025-03-02T{at}Z")]
    long_text = " ".join(f"Caroline: sentence {n} about the pottery kiln and its glaze." for n in range(120))
    stores = {}
    for name, weight in (("on", 1.0), ("off", 0.0)):
        config = IngestConfig(session_context=weight)
        ingest([write_jsonl(tmp_path / "first.jsonl", first)], tmp_path / name, runner="local", config=config,
               show_progress=False)
        mem = stores[name] = Memory(tmp_path / name, ingest=config, compact_interval_s=None, record_access=False)
        mem.add([_turn(4, at=at)])
        mem.add([_turn(5, at=at)])
        mem.add([_turn(9, at="10:09:00")])
        mem.patch("m009", user="dana", text=long_text)
    try:
        got = {i: np.asarray(e["vector"], np.float32) for i, e in stores["on"]._core().entries.items()}
        own = {i: np.asarray(e["vector"], np.float32) for i, e in stores["off"]._core().entries.items()}
        base = Generation.open_current(stores["on"].store)
        second = np.asarray(base.vectors[base.columns.id_to_row["m002"]], np.float32)
        np.testing.assert_allclose(got["m004"], _unit(own["m004"] + second), atol=1e-6)
        np.testing.assert_allclose(got["m005"], _unit(own["m005"] + got["m004"]), atol=1e-6)
        chunks = sorted(i for i in got if i.startswith("m009#chunk"))
        assert len(chunks) >= 2 and "m009" not in got
        np.testing.assert_allclose(got[chunks[0]], _unit(own[chunks[0]] + got["m005"]), atol=1e-6)
        np.testing.assert_allclose(got[chunks[1]], _unit(own[chunks[1]] + got[chunks[0]]), atol=1e-6)
    finally:
        for mem in stores.values():
            mem.close()


def test_a_forgotten_users_turns_are_never_a_written_turns_previous_turn(tmp_path):
    """After a user is forgotten without a rebuild, their rows are still in the
    generation's files; a turn written again under that user and session does not mix
    them in (compaction would keep that vector for good)."""
    import numpy as np

    from helix_ray.ingest.run import ingest

    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "rows.jsonl", [_turn(1), _turn(2)])], store, runner="local", show_progress=False)
    with Memory(store, compact_interval_s=None, record_access=False) as mem:
        mem._core().forget_user("dana", compact=False)
        mem.add([_turn(3)])
        mixed = np.asarray(mem._core().entries["m003"]["vector"], np.float32)
    with Memory(tmp_path / "plain", compact_interval_s=None, record_access=False) as plain:
        plain.add([_turn(3)])
        own = np.asarray(plain._core().entries["m003"]["vector"], np.float32)
    np.testing.assert_allclose(mixed, own, atol=1e-6)


def test_a_written_turn_links_the_one_turn_the_generation_holds_of_its_session(tmp_path):
    """Ingest gives a session a node from its second memory on: a generation holding one
    turn of a session has none. A turn written to that session then links the two through
    a node of the snapshot's own, as a compaction would; another user's session of the
    same name, and a turn the delta deleted, stay out."""
    from helix_ray.ingest.run import ingest
    from helix_ray.live.views import _session_edges

    base = [memory(0, "Jon: we moved the lake trip to June.", type="episodic", session_id="s9"),
            memory(1, "Lee: the lake trip moved too.", user="lee", type="episodic", session_id="s9"),
            memory(2, "Jon: the cabin needs a new roof.", type="episodic", session_id="s7"),
            memory(3, "The gateway listens on port 8443.")]
    store = tmp_path / "store"
    assert ingest([write_jsonl(tmp_path / "base.jsonl", base)], store, runner="local", show_progress=False).published

    def linked(mem: Memory) -> dict[str, set[str]]:
        """Each memory id → the ids of the memories its session edges reach through a hub."""
        views = mem._views
        view = views.generations[views.latest]
        delta = views.delta_for(view)
        edges = _session_edges(delta, view, view.generation.graph.num_nodes)
        ids = view.generation.memories.column("id").to_pylist()

        def name(node: int) -> str:
            return ids[node] if node < len(ids) else str(delta.ids[delta.positions(np.array([node]))[0]])

        hubs: dict[int, set[str]] = {}
        for src, dst in zip(edges.src.tolist(), edges.dst.tolist()):
            if dst >= view.generation.graph.num_nodes and (src < len(ids) or src >= DELTA_BASE):
                hubs.setdefault(dst, set()).add(name(src))
        return {i: members - {i} for members in hubs.values() for i in members}

    with Memory(store, warm=False, record_access=False, compact_interval_s=None) as mem:
        mem.add([memory(4, "Jon: and we booked the cabin for the trip.", type="episodic", session_id="s9")])
        mem.recall("when is the lake trip?", user="dana")  # opens the views
        assert linked(mem) == {"m000": {"m004"}, "m004": {"m000"}}
        mem.add([memory(5, "Jon: the roof is fixed.", type="episodic", session_id="s7")])
        mem.delete("m002", user="dana")
        mem.recall("is the roof fixed?", user="dana")
        assert linked(mem) == {"m000": {"m004"}, "m004": {"m000"}}  # m005's session: its one row is deleted
