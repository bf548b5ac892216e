"""Damaged stores: a truncated or bit-flipped generation file, a garbled manifest, a
garbled DuckDB file. Each is detected when the generation opens or by `helix doctor`,
refused with a message naming the file, and recall falls back to the previous
generation when one is whole.

One real store of two generations (the shipped sample's memories, then one more memory)
is built once with the real ingest (``runner="local"``); each test damages a copy."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import zlib
from pathlib import Path

import pytest

from helix_ray.cli import main
from helix_ray.errors import GenerationDamaged, StoreError
from helix_ray.store import integrity
from helix_ray.store.generation import Generation, open_good_generation
from tests.helpers import SAMPLE, memory, write_jsonl

GEN1, GEN2 = Path("generations/000001"), Path("generations/000002")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from helix_ray.ingest.run import ingest

    from helix_ray.config import IngestConfig, load_config

    folder = tmp_path_factory.mktemp("integrity")
    config = load_config(IngestConfig, overrides={"hnsw_min_rows": 0})  # HNSW files too
    run = dict(config=config, runner="local", show_progress=False)
    assert ingest([SAMPLE / "memories.jsonl"], folder / "store", **run).generation == 1
    more = write_jsonl(folder / "more.jsonl", [memory(900, "The staging cluster restarts every Sunday at noon."),
                                               memory(901, "Release notes are drafted on Thursdays.")])
    assert ingest([more], folder / "store", **run).generation == 2
    return folder / "store"


@pytest.fixture()
def copy(store, tmp_path) -> Path:
    """A private copy of :func:`store`, to damage."""
    return Path(shutil.copytree(store, tmp_path / "store"))


def doctor(capsys, store: Path) -> tuple[int, list[str]]:
    """``helix doctor --store STORE`` in this process: (exit code, its PROBLEM lines)."""
    code = main(["doctor", "--store", str(store)])
    out, _ = capsys.readouterr()
    return code, [line for line in out.splitlines() if line.startswith("PROBLEM")]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def recalled_generation(store: Path) -> int:
    from helix_ray.memory import Memory

    with Memory(store, record_access=False) as mem:
        mem.recall("deploy", user="dana")
        return mem.recaller.generation.number


# --------------------------------------------------------------------------- what publish records


def test_the_manifest_records_every_file_with_its_size_and_crc(store):
    """Protects: a file written by publish but left out of the manifest's checksums."""
    folder = store / GEN2
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == set(on_disk) - {"manifest.json"}
    assert {"vectors.f16.npy", "memories.arrow", "bm25/vocab.index.json", "graph/indptr.npy"} <= set(manifest["files"])
    for name, record in manifest["files"].items():
        data = on_disk[name].read_bytes()
        assert record == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["manifest_crc32"] == f"{zlib.crc32(canonical):08x}"


def test_open_hashes_the_smallest_files_within_its_budget():
    files = {"big": {"bytes": 60}, "a": {"bytes": 10}, "b": {"bytes": 30}, "c": {"bytes": 30}}
    assert integrity.to_hash_at_open(files, budget=70) == {"a", "b", "c"}
    assert integrity.to_hash_at_open(files, budget=69) == {"a", "b"}
    assert integrity.to_hash_at_open(files, budget=0) == set()


def test_a_file_is_hashed_once_per_process_until_it_changes(copy, monkeypatch):
    """An open hashes each small file once: opened again (a folded generation links its
    parent's files), a file that matched is not read again; changed in place since (a
    new mtime), it is hashed again and refused."""
    hashed = []
    real = integrity.file_crc32
    monkeypatch.setattr(integrity, "file_crc32", lambda path: hashed.append(path.name) or real(path))
    Generation(copy / GEN2)
    assert "minhash.npy" in hashed
    hashed.clear()
    Generation(copy / GEN2)
    assert hashed == []
    flip_middle_byte(copy / GEN2 / "minhash.npy")
    with pytest.raises(GenerationDamaged, match="minhash.npy has CRC-32"):
        Generation(copy / GEN2)
    assert hashed == ["minhash.npy"]


def test_a_whole_store_opens_and_doctor_passes(store, capsys):
    assert Generation(store / GEN2, verify="full").number == 2
    assert doctor(capsys, store) == (0, [])


# --------------------------------------------------------------------------- (a) a truncated file


@pytest.mark.parametrize("name", ["vectors.f16.npy", "dense/p0.usearch", "bm25/vocab.index.json"])
def test_a_truncated_file_is_refused_by_name_and_recall_falls_back(copy, capsys, caplog, name):
    size = (copy / GEN2 / name).stat().st_size
    truncate(copy / GEN2 / name)
    with pytest.raises(GenerationDamaged) as refused:
        Generation(copy / GEN2)
    message = str(refused.value)
    assert f"Generation 2 of {copy} is damaged: generations/000002/{name} has {size - 100} bytes; the manifest " \
           f"records {size}." in message
    assert f"`helix doctor --store {copy}`" in message and "Restore the store folder from a backup" in message

    code, problems = doctor(capsys, copy)
    assert code == 1 and len(problems) == 1 and problems[0].split()[1] == "files" and name in problems[0]

    with caplog.at_level(logging.WARNING, logger="helix_ray.store.generation"):
        assert recalled_generation(copy) == 1
    assert any(f"Generation 2 of {copy} is damaged" in r.message and "goes on from generation 1" in r.message
               for r in caplog.records)


# --------------------------------------------------------------------------- (b) a flipped byte


@pytest.mark.parametrize("name", ["vectors.f16.npy", "memories.arrow"])
def test_a_flipped_byte_is_refused_by_name_and_recall_falls_back(copy, capsys, name):
    before = json.loads((copy / GEN2 / "manifest.json").read_text())["files"][name]["crc32"]
    flip_middle_byte(copy / GEN2 / name)
    with pytest.raises(GenerationDamaged, match=rf"generations/000002/{name} has CRC-32 [0-9a-f]{{8}}; the manifest "
                                                rf"records {before}"):
        Generation(copy / GEN2)
    code, problems = doctor(capsys, copy)
    assert code == 1 and len(problems) == 1 and f"{name} has CRC-32" in problems[0]
    assert recalled_generation(copy) == 1


def test_a_file_past_the_open_budget_is_hashed_by_doctor_and_full_verify(copy, capsys, monkeypatch):
    """Protects the rule: opening hashes files only within OPEN_HASH_BYTES (sizes always),
    while ``verify="full"`` and doctor hash every file."""
    flip_middle_byte(copy / GEN2 / "vectors.f16.npy")
    monkeypatch.setattr(integrity, "OPEN_HASH_BYTES", 0)
    assert Generation(copy / GEN2).number == 2
    with pytest.raises(GenerationDamaged, match="vectors.f16.npy has CRC-32"):
        Generation(copy / GEN2, verify="full")
    assert doctor(capsys, copy)[0] == 1


# --------------------------------------------------------------------------- (c) a garbled manifest


def _edit_manifest(store: Path) -> None:
    """Valid JSON, one count changed: only the manifest's own checksum tells."""
    path = store / GEN2 / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["counts"]["memories"] += 1
    path.write_text(json.dumps(manifest, indent=1))


@pytest.mark.parametrize("damage, says", [
    (lambda s: (s / GEN2 / "manifest.json").write_bytes(b'{"format": "helix-gen\x00\xff'), "is not UTF-8 text"),
    (lambda s: truncate(s / GEN2 / "manifest.json"), "is not valid JSON"),
    (lambda s: (s / GEN2 / "manifest.json").write_text("[1, 2]"), "holds a JSON list, not an object"),
    (_edit_manifest, "has CRC-32"),
    (lambda s: (s / GEN2 / "manifest.json").unlink(), "is missing"),
])
def test_a_garbled_manifest_is_refused_by_name_and_recall_falls_back(copy, capsys, damage, says):
    damage(copy)
    with pytest.raises(GenerationDamaged, match=f"generations/000002/manifest.json {says}"):
        Generation(copy / GEN2)
    code, problems = doctor(capsys, copy)
    assert code == 1 and len(problems) == 1 and problems[0].split()[1] == "manifest" and says in problems[0]
    assert recalled_generation(copy) == 1


# --------------------------------------------------------------------------- (d) a garbled database


def _garble_second_half(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data), 4096):  # a byte in every 4 KiB: every block DuckDB uses there
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_a_text_byte(path: Path) -> None:
    """Flip a byte of the memories' text, in a block DuckDB reads only to return texts."""
    import duckdb

    with duckdb.connect(str(path), read_only=True) as con:
        block, offset = con.execute("SELECT block_id, block_offset FROM pragma_storage_info('memories') "
                                    "WHERE column_name = 'text' AND block_id >= 0 LIMIT 1").fetchone()  # type: ignore
    data = bytearray(path.read_bytes())
    data[3 * 4096 + block * 262144 + 8 + offset + 10] ^= 0x01  # 3 header blocks; a block: checksum, then data
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, _garble_second_half, _flip_a_text_byte],
                         ids=["truncated", "garbled", "flipped"])
def test_doctor_reports_a_damaged_database_with_its_fix_not_a_traceback(copy, capsys, damage):
    """Protects: doctor reading every table whole (a count alone reads a few blocks and
    misses damage elsewhere)."""
    damage(copy / "helix.duckdb")
    code, problems = doctor(capsys, copy)
    assert code == 1 and len(problems) == 1, problems
    assert problems[0].startswith("PROBLEM  database  helix.duckdb does not open as a Helix database (")


def _flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # in DuckDB's first block, which every open reads
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_header_byte, lambda p: p.write_bytes(b"not a database" * 100)],
                         ids=["flipped", "overwritten"])
def test_memory_refuses_a_database_damaged_where_it_opens_it(copy, damage):
    from helix_ray.memory import Memory

    damage(copy / "helix.duckdb")
    with pytest.raises(StoreError, match=rf"Cannot open {copy}/helix.duckdb \(read-write\): it is damaged \(.*\)\. "
                                         rf"`helix doctor --store {copy}` checks the whole store\. Restore"):
        Memory(copy, record_access=False)


# --------------------------------------------------------------------------- no good generation; old ones


def test_with_no_whole_generation_left_recall_refuses_naming_each(copy):
    truncate(copy / GEN2 / "vectors.f16.npy")
    flip_middle_byte(copy / GEN1 / "memories.arrow")
    with pytest.raises(GenerationDamaged) as refused:
        recalled_generation(copy)
    message = str(refused.value)
    assert "generations/000002/vectors.f16.npy has" in message and "generations/000001/memories.arrow has CRC-32" \
        in message and message.endswith("No earlier generation opens whole either.")


def test_a_generation_without_checksums_opens_as_before(copy, capsys):
    """Generations written before checksums were recorded open, and doctor says so."""
    for folder in (copy / GEN1, copy / GEN2):
        manifest = json.loads((folder / "manifest.json").read_text())
        del manifest["files"], manifest["manifest_crc32"]
        (folder / "manifest.json").write_text(json.dumps(manifest))
    flip_middle_byte(copy / GEN2 / "vectors.f16.npy")  # undetectable without checksums
    assert Generation(copy / GEN2, verify="full").number == 2
    main(["doctor", "--store", str(copy)])
    out = capsys.readouterr().out
    assert "ok       files     generations/000002:" in out
    assert "no checksums recorded; the next ingest or compaction records them" in out


# --------------------------------------------------------------------------- serving replicas


def test_a_replica_starts_on_the_previous_generation_when_current_is_damaged(copy, caplog):
    from helix_ray.live.views import StoreViews

    truncate(copy / GEN2 / "binary.npy")
    with caplog.at_level(logging.WARNING, logger="helix_ray.store.generation"):
        views = StoreViews(copy, role="dense")
    assert views.latest == 1 and list(views.generations) == [1]
    assert any("generations/000002/binary.npy has" in r.message for r in caplog.records)


def test_a_replica_keeps_serving_when_the_new_current_is_damaged(store, copy, caplog):
    """A running replica passes over a damaged new CURRENT, warns once, keeps its
    generation, and swaps when a whole one is published."""
    from helix_ray.live.views import StoreViews
    from helix_ray.store.publish import set_current

    set_current(copy, 1)
    views = StoreViews(copy, role="dense")
    assert views.latest == 1
    flip_middle_byte(copy / GEN2 / "minhash.npy")
    set_current(copy, 2)
    with caplog.at_level(logging.WARNING, logger="helix_ray.store.generation"):
        assert asyncio.run(views.refresh()) is False
        assert asyncio.run(views.refresh()) is False
    assert views.latest == 1
    assert len([r for r in caplog.records if "generations/000002/minhash.npy has CRC-32" in r.message]) == 1

    whole = Path(shutil.copytree(store / GEN2, copy / "generations" / "000003"))  # as if published again
    manifest = json.loads((whole / "manifest.json").read_text())
    (whole / "manifest.json").write_text(json.dumps(integrity.seal({**manifest, "generation": 3})))
    set_current(copy, 3)
    assert asyncio.run(views.refresh()) is True and views.latest == 3


def test_open_good_generation_is_none_for_a_store_without_one(tmp_path):
    assert open_good_generation(tmp_path) is None
