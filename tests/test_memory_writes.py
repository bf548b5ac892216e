"""``Memory.add``, ``patch`` and ``delete`` go through the Writer's write path: durable and
recallable at once, with no generation built per write; compaction (background or
``Memory.compact``) and ``Memory.ingest`` fold them into a generation.

Real DuckDB files and the real encoders; each test works on its own copy of one small
ingested store.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from helix_ray import Memory
from helix_ray.serve.errors import NotFound
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
        written = mem.add([memory(7, "We pinned uvicorn to 0.30 after the keep-alive bug.")])
        assert written.ids == ("m007",) and written.generation == before
        assert current_generation_number(store) == before  # the write is in the delta, not a generation
        assert ids(mem, "why did we pin uvicorn?")[0] == "m007"
        assert ids(mem, "which port does the gateway listen on?")[0] == "m000"  # the generation still answers
        assert mem.stats()["pending_writes"] == 1
    with StoreDB(store) as db:  # durable: logged in the database before add returned
        assert db.row("SELECT count(*) FROM serve_log WHERE id = 'm007'") == (1,)


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
        with pytest.raises(NotFound, match="no such memory for user 'dana'"):
            mem.delete("m002", user="dana")  # lee's


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


def test_memory_works_inside_a_running_event_loop(store):
    """A notebook's cell runs inside an event loop: add and recall must not start one."""

    async def cell() -> list[str]:
        with Memory(store, warm=False, compact_interval_s=None) as mem:
            mem.add([memory(14, "The marten cache is warmed at boot.")])
            return ids(mem, "when is the marten cache warmed?")

    assert asyncio.run(cell())[0] == "m014"
