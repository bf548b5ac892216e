"""A store over its life: backed up and restored (the same recall from both, a damaged
or mismatched backup refused, a store another process writes refused), a user
forgotten (no byte of theirs left in any file once compacted, the other user's
memories still recalled; the next generation leaves them out even without
``--compact``), and a generation of another format version refused with the command
that opens it.

One real store (two users, a few memories each, online writes through the Writer's
core, recall hits, feedback, API keys) is built once with the real ingest
(``runner="local"``); each test works on a copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from helix_ray.cli import main
from tests.helpers import REPO, TENANT_TOPICS, audit_without, files_holding, write_jsonl

#: The user forgotten, a tag in each of their texts, and the user kept. Neither string
#: occurs anywhere else, so finding one in a file means it holds that user's data.
GONE, GONE_TAG, KEPT = "zq9-user", "QUOKKA-7731", "bex"
QUERY = "database migrations and backups"


def _records(user: str, tag: str) -> list[dict]:
    return [{"id": f"{user}-{i}", "user": user, "text": f"{TENANT_TOPICS[i]} ({tag} note {i})",
             "created_at": f"2025-03-{1 + i:02d}T10:00:00Z", "session_id": f"{user}-s{i // 3}"}
            for i in range(6)]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    from helix_ray.ingest.run import ingest
    from helix_ray.memory import Memory
    from helix_ray.store.keys import KeyStore
    from helix_ray.live.writer import WriterCore

    folder = tmp_path_factory.mktemp("lifecycle")
    source = write_jsonl(folder / "records.jsonl", _records(GONE, GONE_TAG) + _records(KEPT, "kept"))
    store = folder / "store"
    report = ingest([source], store, runner="local", show_progress=False)
    assert report.published and report.accepted == 12, report
    core = WriterCore(store)  # online writes, pending in the log, the delta and the inbox
    core.add([{"id": f"{GONE}-online", "text": f"The gateway rejects large uploads ({GONE_TAG} online)."}], user=GONE)
    core.add([{"id": f"{KEPT}-online", "text": "The gateway rejects large uploads (kept online)."}], user=KEPT)
    core.close()
    with Memory(store) as mem:  # recall hits reach the access log
        for user in (GONE, KEPT):
            mem.recall(QUERY, user=user)
            mem.feedback(QUERY, user=user, memory_ids=[f"{user}-1"])
    for user in (GONE, KEPT):
        KeyStore(store).create(user)
    return store


@pytest.fixture()
def store(built, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(built, copy)
    return copy


def _recalled(store: Path, user: str) -> list[str]:
    from helix_ray.memory import Memory

    with Memory(store, record_access=False) as mem:
        return [item.id for item in mem.recall(QUERY, user=user, k=8).items]


@contextmanager
def _held(store: Path) -> Iterator[None]:
    """Another process holding the store's database read-write, as `helix serve` does."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from helix_ray.store.db import StoreDB; db = StoreDB(sys.argv[1]); "
                               "print('open', flush=True); sys.stdin.read()", str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        yield
    finally:
        holder.communicate("", timeout=60)


def _pending(store: Path) -> list[str]:
    from helix_ray.live.writer import WriterCore

    core = WriterCore(store)
    try:
        return sorted(core.entries)
    finally:
        core.close()


# --------------------------------------------------------------------------- backup and restore


def test_a_restored_backup_recalls_what_the_store_recalled(store, tmp_path, capsys):
    """Same ids in the same order from the store and from its restored copy, for both
    users; the online writes pending in the log come back too, and the manifest lists
    every file with size and checksum."""
    before = {user: _recalled(store, user) for user in (GONE, KEPT)}
    assert all(before.values())
    assert main(["backup", "--store", str(store), str(tmp_path / "backup")]) == 0
    manifest = json.loads((tmp_path / "backup" / "backup-manifest.json").read_text())
    paths = {f["path"] for f in manifest["files"]}
    assert {"CURRENT", "helix.duckdb", "keys.json", "delta/CURRENT", "generations/000001/manifest.json"} <= paths
    assert any(p.startswith("inbox/serve-") for p in paths)
    assert manifest["generation"] == 1 and manifest["helix_version"] and manifest["created_at"]
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"] if f["path"] != "CURRENT")
    assert main(["restore", str(tmp_path / "backup")]) == 2
    assert "Got DIR=''; name the new store's folder (new, or empty) to restore into" in capsys.readouterr().err
    assert main(["restore", str(tmp_path / "backup"), str(tmp_path / "a"), "--store", str(tmp_path / "b")]) == 2
    assert "name one folder to restore into" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert main(["restore", str(tmp_path / "backup"), "--store", str(tmp_path / "restored")]) == 0
    capsys.readouterr()
    assert {user: _recalled(tmp_path / "restored", user) for user in (GONE, KEPT)} == before
    assert _pending(tmp_path / "restored") == _pending(store) == [f"{KEPT}-online", f"{GONE}-online"]


def test_restore_refuses_a_damaged_backup_and_a_folder_in_use(store, tmp_path, capsys):
    from helix_ray.store.backup import backup

    backup(store, tmp_path / "backup")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["restore", str(tmp_path / "backup"), str(occupied)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert main(["backup", "--store", str(store), str(occupied)]) == 2
    capsys.readouterr()
    vectors = tmp_path / "backup" / "generations" / "000001" / "vectors.f16.npy"
    data = bytearray(vectors.read_bytes())
    data[-1] ^= 0xFF
    vectors.unlink()  # a hard link to the store's file: replace it, do not write through it
    vectors.write_bytes(bytes(data))
    assert main(["restore", str(tmp_path / "backup"), str(tmp_path / "restored")]) == 2
    err = capsys.readouterr().err
    assert "vectors.f16.npy does not match its SHA-256" in err and "Nothing was restored" in err
    assert not (tmp_path / "restored").exists()


def test_restore_refuses_a_backup_of_another_format(store, tmp_path, capsys):
    from helix_ray.store.backup import backup

    backup(store, tmp_path / "backup")
    path = tmp_path / "backup" / "backup-manifest.json"
    path.write_text(path.read_text().replace('"format_version": 1', '"format_version": 2'))
    assert main(["restore", str(tmp_path / "backup"), str(tmp_path / "restored")]) == 2
    assert "Restore it with the Helix version that wrote it" in capsys.readouterr().err


def test_backup_refuses_a_store_another_process_writes(store, tmp_path):
    """A served store's database is held read-write by the server: the backup says so
    and how to go on, and leaves nothing behind."""
    from helix_ray.errors import StoreError
    from helix_ray.store.backup import backup

    with _held(store), pytest.raises(StoreError, match="another process holds its database.*Stop the server"):
        backup(store, tmp_path / "backup")
    assert not (tmp_path / "backup").exists() and not list(tmp_path.glob(".backup.tmp-*"))


# --------------------------------------------------------------------------- forgetting a user


def test_forget_user_with_compact_leaves_no_byte_of_theirs(store, capsys):
    """Every file of the store, the DuckDB database included, holds neither the user's
    texts nor their name afterwards, and the other user's memories, online write and
    key are all there."""
    import duckdb

    from helix_ray.store.keys import KeyStore
    from helix_ray.store.generation import Generation

    assert files_holding(store, GONE_TAG) and files_holding(store, GONE)
    with duckdb.connect(str(store / "helix.duckdb"), read_only=True) as con:
        accesses = con.execute("SELECT count(*), max(rowid) FROM access_log").fetchone()
    kept_before = set(_recalled(store, KEPT))
    # Compacts by default, as DELETE /v1/users does.
    assert main(["forget-user", "--store", str(store), GONE, "--json"]) == 0
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["memories"] == 6 and outcome["online_writes"] == 1 and outcome["chunks"] == 0
    assert outcome["feedback"] == 1 and outcome["keys"] == 1 and outcome["compacted"]
    assert files_holding(store, GONE_TAG) == [] and files_holding(store, GONE) == []
    last = audit_without(store, GONE_TAG)[-1]
    assert (last["action"], last["target"], last["params"], last["outcome"]) == ("forget-user", GONE,
                                                                                 {"compact": True}, "ok")
    assert _recalled(store, GONE) == []
    assert kept_before <= set(_recalled(store, KEPT))
    generation = Generation.open_current(store)
    assert sorted(generation.memories.column("id").to_pylist()) == sorted(
        [f"{KEPT}-{i}" for i in range(6)] + [f"{KEPT}-online"])
    assert [r.user for r in KeyStore(store).records()] == [KEPT]
    with duckdb.connect(str(store / "helix.duckdb"), read_only=True) as con:
        # The access log keeps its positions (a generation's watermark counts them).
        assert con.execute("SELECT count(*), max(rowid) FROM access_log").fetchone() == accesses
        assert con.execute("SELECT count(*) FROM erased").fetchone() == (0,)
        assert con.execute('SELECT DISTINCT "user" FROM feedback').fetchall() == [(KEPT,)]


def test_without_compact_the_next_generation_leaves_the_user_out(store, tmp_path, capsys):
    """The database forgets at once; the generation still serves the rows until the
    next one is published, and that one (here an ingest of another user's record) does
    not carry them over."""
    from helix_ray.ingest.run import ingest
    from helix_ray.store.generation import Generation

    assert main(["forget-user", "--store", str(store), GONE, "--no-compact"]) == 0
    assert "the current generation still holds them, and recall still finds them" in capsys.readouterr().out
    assert GONE_TAG.encode() not in (store / "helix.duckdb").read_bytes()
    assert _recalled(store, GONE)  # served from the generation until the next one
    more = write_jsonl(tmp_path / "more.jsonl", [{"id": f"{KEPT}-later", "user": KEPT, "text": TENANT_TOPICS[9]}])
    assert ingest([more], store, runner="local", show_progress=False).published
    ids = Generation.open_current(store).memories.column("id").to_pylist()
    assert not [i for i in ids if i.startswith(GONE)] and f"{KEPT}-later" in ids
    assert _recalled(store, GONE) == []


def test_forget_user_of_an_unknown_user_says_so(store, capsys):
    assert main(["forget-user", "--store", str(store), "zq9-usr"]) == 1
    assert "holds nothing of user 'zq9-usr'; check the id" in capsys.readouterr().err
    assert _recalled(store, GONE)


def test_forget_user_refuses_a_store_another_process_writes(store, capsys):
    with _held(store):
        assert main(["forget-user", "--store", str(store), GONE]) == 2
    err = capsys.readouterr().err
    assert f"With `helix serve` running, ask it: `DELETE /v1/users/{GONE}` with an admin key" in err, err
    assert GONE_TAG.encode() in (store / "helix.duckdb").read_bytes()


@pytest.mark.parametrize("fitted_on, removed", [((GONE, KEPT), True), ((KEPT,), False), (None, True)])
def test_the_query_adapter_goes_when_it_learnt_from_the_user(tmp_path, fitted_on, removed):
    """A fitted map cannot unlearn one user's queries: it is removed when they were among
    those it was fitted on, or when it does not record whose they were."""
    import numpy as np

    from helix_ray.recall.adapter import ADAPTER_FILE, QueryAdapter, forget_user, load

    QueryAdapter(np.eye(4, dtype=np.float32), "test-encoder", 1.0, 3, users=fitted_on).save(tmp_path)
    assert load(tmp_path, expect_embedder="test-encoder", expect_dim=4).users == fitted_on
    assert forget_user(tmp_path, GONE) is removed
    assert (tmp_path / ADAPTER_FILE).exists() is not removed


# --------------------------------------------------------------------------- format versions


@pytest.mark.parametrize("version, says", [
    (0, "written by an older Helix, and no command converts a generation in place: ingest the sources again "
        "into a new store (`helix ingest SOURCE --store NEWDIR`)"),
    (3, "written by a newer Helix: upgrade this one (`pip install -U helix-ray`"),
])
def test_a_generation_of_another_format_version_says_what_opens_it(store, capsys, version, says):
    manifest = store / "generations" / "000001" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = version
    manifest.write_text(json.dumps(data))
    assert main(["recall", QUERY, "--store", str(store), "--user", KEPT]) == 2
    err = capsys.readouterr().err
    assert f"format_version {version} (this Helix reads 1 and 2)" in err and says in err, err
