"""A store on a filesystem that fills up: ``Memory.add`` (the Writer's write path) and
ingest fail with a
:class:`~helix_ray.errors.DiskFull` that says what is full and what to free, the
current generation keeps serving, nothing half-written becomes current, and writing
resumes once space is back.

The filesystem is a 24 MiB tmpfs the test mounts (it needs root; elsewhere it skips).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from helix_ray import Memory
from helix_ray.errors import DiskFull, is_disk_full
from helix_ray.store.doctor import check_store
from helix_ray.store.generation import Generation, current_generation_number
from tests.helpers import memory, write_jsonl


@pytest.fixture()
def small_fs(tmp_path):
    """A 24 MiB tmpfs mounted for the test."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(mount, leave: int) -> None:
    """Take all the free space of ``mount`` but ``leave`` bytes."""
    with open(mount / "filler", "wb") as fh:
        fh.write(b"\0" * max(shutil.disk_usage(mount).free - leave, 0))


TEXTS = ("The gateway listens on port 8443 for tenant traffic.",
         "Redis caches the billing service keys for ten minutes.",
         "Kafka consumers lag when the shard rebalance meets the backup window.",
         "Rotate the API keys with the rotate script, then restart the gateway pods.",
         "The checksum of every shard is verified after the nightly backup.")


@pytest.mark.parametrize("leave_kib", [4, 24, 64])  # each runs out at another file of the write
def test_a_full_disk_refuses_writes_keeps_serving_and_recovers(small_fs, tmp_path, leave_kib):
    store = small_fs / "store"
    with Memory(store, warm=False, record_access=False) as mem:
        mem.add([memory(0, TEXTS[0])])
        serving = current_generation_number(store)
        _fill(small_fs, leave=leave_kib * 1024)

        with pytest.raises(DiskFull) as refused:
            for i, text in enumerate(TEXTS[1:], start=1):  # the first may still fit
                mem.add([memory(i, text)])
                serving = current_generation_number(store)
        message = str(refused.value)
        assert f"No space left on the filesystem of store {store}" in message
        assert " free, and this write needs about " in message
        assert f"generation {serving} stays current and keeps serving" in message
        assert "Free space on that filesystem" in message
        assert is_disk_full(refused.value.__cause__ or refused.value)

        source = write_jsonl(tmp_path / "more.jsonl", [memory(9, "Integration tests run against a real Postgres.")])
        with pytest.raises(DiskFull, match="No space left on the filesystem of store"):
            mem.ingest([source])  # its fold of the pending writes first, or the ingest itself

        # Nothing half-written became current; the current generation opens and answers.
        assert current_generation_number(store) == serving
        assert Generation.open_current(store).number == serving
        # (not the database check: it opens the file read-only, which the open writer's lock refuses)
        assert [c.found for c in check_store(store) if not c.ok and c.name != "database"] == []
        assert mem.recall("which port does the gateway listen on", user="dana").items[0].id == "m000"

        (small_fs / "filler").unlink()
        written = mem.add([memory(7, "Dana prefers short commit messages in the imperative mood.")])
        assert written.ids == ("m007",) and written.generation == serving  # in the delta over the same generation
        assert mem.recall("commit message style", user="dana", k=3).items[0].id == "m007"
        assert mem.ingest([source]).published  # the writes folded first, then the file
        assert current_generation_number(store) > serving
        assert mem.recall("commit message style", user="dana", k=3).items[0].id == "m007"


def test_online_writes_and_compaction_on_a_full_disk(small_fs):
    """The server's Writer (no Ray): a write and a compaction refused with DiskFull, the
    generation unchanged, and both go through once space is back."""
    from helix_ray.ingest.run import initialise
    from helix_ray.live.writer import WriterCore

    store = small_fs / "store"
    initialise(store)
    core = WriterCore(store)
    try:
        core.add([{"id": "w0", "text": TEXTS[0]}], user="dana")
        assert core.compact()["published"]
        core.add([{"id": "w1", "text": TEXTS[1]}], user="dana")  # pending: for the compaction to fold
        serving = current_generation_number(store)
        _fill(small_fs, leave=8 * 1024)
        with pytest.raises(DiskFull, match="No space left on the filesystem of store"):
            for i, text in enumerate(TEXTS[2:] * 4, start=2):  # the first may still fit
                core.add([{"id": f"w{i}", "text": text}], user="dana")
        with pytest.raises(DiskFull, match="while ingesting"):
            core.compact()
        assert current_generation_number(store) == serving == Generation.open_current(store).number
        assert {"w0", "w1"} <= set(core.entries) | set(Generation.open_current(store).columns.id_to_row)

        (small_fs / "filler").unlink()
        core.add([{"id": "w9", "text": "Dana prefers short commit messages in the imperative mood."}], user="dana")
        assert core.compact()["published"] and current_generation_number(store) > serving
        assert {"w0", "w1", "w9"} <= set(Generation.open_current(store).columns.id_to_row)
    finally:
        core.db.close()
