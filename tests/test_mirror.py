"""A store's mirror (helix_ray/store/mirror.py): push makes a pyarrow.fs location hold the
store's current generation, delta and small files; pull makes a local cache a copy that
recall reads as it reads the store. A local folder stands in for object storage.

One real store is built with the real ingest (``runner="local"``): generation 1 (the
shipped sample's memories), then generation 2 (two more) and 3 (one more), each pushed
in turn; each test uses its own mirror and cache."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from helix_ray.errors import GenerationDamaged, InvalidArgument, StoreError
from helix_ray.store import mirror as mirror_mod
from helix_ray.store.generation import Generation, current_generation_number
from helix_ray.store.mirror import open_mirror, pull, push
from tests.helpers import SAMPLE, memory, write_jsonl

QUERY = "When does the staging cluster restart?"


def _ingest(store: Path, records: list[dict], folder: Path, name: str) -> int:
    from helix_ray.config import IngestConfig, load_config
    from helix_ray.ingest.run import ingest

    source = write_jsonl(folder / f"{name}.jsonl", records)
    config = load_config(IngestConfig, overrides={"hnsw_min_rows": 0})
    return ingest([source], store, config=config, runner="local", show_progress=False).generation


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[int, Path]:
    """Copies of one store at generations 1, 2 and 3 (each a folder of its own)."""
    from helix_ray.config import IngestConfig, load_config
    from helix_ray.ingest.run import ingest

    folder = tmp_path_factory.mktemp("mirror")
    store = folder / "store"
    config = load_config(IngestConfig, overrides={"hnsw_min_rows": 0})
    assert ingest([SAMPLE / "memories.jsonl"], store, config=config, runner="local", show_progress=False).generation == 1
    out = {1: Path(shutil.copytree(store, folder / "at1"))}
    assert _ingest(store, [memory(900, "The staging cluster restarts every Sunday at noon."),
                           memory(901, "Release notes are drafted on Thursdays.")], folder, "two") == 2
    out[2] = Path(shutil.copytree(store, folder / "at2"))
    assert _ingest(store, [memory(902, "The on-call rotation changes on Mondays.")], folder, "three") == 3
    out[3] = store
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _with_delta(source: Path, tmp_path: Path, record: dict) -> Path:
    """A copy of ``source`` with ``record`` (user dana) written to its delta."""
    from helix_ray.memory import Memory

    store = Path(shutil.copytree(source, tmp_path / "store"))
    mem = Memory(store, warm=False)
    try:
        mem.add([{**record, "user": "dana"}])
    finally:
        mem.close()
    return store


def _recall_ids(store: Path, query: str = QUERY, user: str = "dana") -> list[str]:
    """What a serving replica of the compact graph answers over ``store``."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve.shells import PipelineShell

    async def run() -> list[str]:
        shell = PipelineShell(store)
        out = await shell.recall(query, user=user, config=RetrievalConfig(), budget_tokens=400, k=8)
        return [item["id"] for item in out["items"]]

    return asyncio.run(run())


# --------------------------------------------------------------------------- URIs


@pytest.mark.parametrize(("uri", "says"), [
    ("relative/folder", "absolute path"),
    ("nosuch://bucket/x", "nosuch://bucket/x"),
    ("", "absolute folder path, a file:// URI, or an s3://"),
])
def test_a_bad_uri_is_refused_saying_what_is_allowed(uri, says):
    with pytest.raises(InvalidArgument) as err:
        open_mirror(uri)
    message = str(err.value)
    assert message.startswith(f"Got mirror={uri!r}") and says in message and "--mirror" in message


def test_a_path_and_a_file_uri_open_the_same_folder(tmp_path):
    assert open_mirror(str(tmp_path)).root == open_mirror(f"file://{tmp_path}").root == str(tmp_path)


def test_the_store_itself_is_no_mirror(stores):
    with pytest.raises(InvalidArgument, match="another folder than the store"):
        push(stores[1], open_mirror(str(stores[1])))


# --------------------------------------------------------------------------- push and pull


def test_a_pulled_cache_holds_the_generation_byte_for_byte_and_recalls_alike(stores, tmp_path):
    mirror = open_mirror(f"file://{tmp_path / 'mirror'}")
    report = push(stores[2], mirror)
    assert (report.generation, report.copied) == (2, 0) and report.uploaded > 5
    cache = tmp_path / "cache"
    got = pull(open_mirror(str(tmp_path / "mirror")), cache)
    assert got.generation == 2 and got.changed and got.linked == 0
    assert _files(cache / "generations/000002") == _files(stores[2] / "generations/000002")
    assert current_generation_number(cache) == 2
    Generation(cache / "generations/000002", verify="full")
    assert not (cache / "helix.duckdb").exists() and not (cache / "inbox").exists()
    ids = _recall_ids(cache)
    assert ids and ids == _recall_ids(stores[2]) and "m900" in ids


def test_unchanged_files_are_copied_at_the_mirror_and_linked_in_the_cache(stores, tmp_path):
    """Token segments a store hard-links between generations are copied at the mirror,
    not uploaded, and hard-linked in the cache, not downloaded; two generations stay."""
    mirror, reader, cache = open_mirror(str(tmp_path / "m")), open_mirror(str(tmp_path / "m")), tmp_path / "c"
    push(stores[1], mirror)
    pull(reader, cache)
    second = push(stores[2], mirror)
    gen2 = json.loads((stores[2] / "generations/000002/manifest.json").read_text())
    gen1 = json.loads((stores[1] / "generations/000001/manifest.json").read_text())
    same = {n for n, r in gen2["files"].items() if gen1["files"].get(n) == r}
    assert same and second.copied == len(same) and second.uploaded == len(gen2["files"]) - len(same)
    assert sorted(p.name for p in (tmp_path / "m/generations").iterdir()) == ["000001", "000002"]
    for name in same:  # a folder mirror links them
        assert (tmp_path / "m/generations/000002" / name).stat().st_ino == \
            (tmp_path / "m/generations/000001" / name).stat().st_ino
    got = pull(reader, cache)
    assert got.linked == len(same) and got.downloaded == len(gen2["files"]) - len(same)
    name = sorted(same)[0]
    assert (cache / "generations/000002" / name).stat().st_ino == (cache / "generations/000001" / name).stat().st_ino
    push(stores[3], mirror)
    assert sorted(p.name for p in (tmp_path / "m/generations").iterdir()) == ["000002", "000003"]
    assert pull(reader, cache).generation == 3
    assert sorted(p.name for p in (cache / "generations").iterdir()) == ["000002", "000003"]


def test_an_upload_never_writes_into_a_file_linked_to_another_generation(tmp_path):
    """A push that stopped half-way can leave a link to the previous generation's file
    where the retry uploads a new one: the previous generation keeps its bytes."""
    mirror = open_mirror(str(tmp_path / "m"))
    old = tmp_path / "m/generations/000001/vectors.f16.npy"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"old")
    (tmp_path / "m/generations/000002").mkdir()
    os.link(old, tmp_path / "m/generations/000002/vectors.f16.npy")
    (tmp_path / "new.npy").write_bytes(b"new bytes")
    mirror.upload(tmp_path / "new.npy", "generations/000002/vectors.f16.npy")
    assert old.read_bytes() == b"old"
    assert (tmp_path / "m/generations/000002/vectors.f16.npy").read_bytes() == b"new bytes"


def test_a_generation_already_in_the_cache_is_not_downloaded_again(stores, tmp_path):
    mirror = open_mirror(str(tmp_path / "m"))
    push(stores[2], mirror)
    reader = open_mirror(str(tmp_path / "m"))
    assert pull(reader, tmp_path / "c").downloaded > 0
    again = pull(reader, tmp_path / "c")
    assert (again.downloaded, again.linked, again.changed) == (0, 0, False)
    assert push(stores[2], mirror).uploaded == 0


def test_a_push_cut_short_never_moves_the_mirrors_current(stores, tmp_path, monkeypatch):
    mirror = open_mirror(str(tmp_path / "m"))
    push(stores[1], mirror)
    upload = mirror_mod.Mirror.upload

    def failing(self, local, rel):
        if rel.endswith("manifest.json"):
            raise OSError("connection reset")
        return upload(self, local, rel)

    monkeypatch.setattr(mirror_mod.Mirror, "upload", failing)
    with pytest.raises(OSError, match="connection reset"):
        push(stores[2], mirror)
    assert (tmp_path / "m/CURRENT").read_text().strip() == "1"
    assert pull(open_mirror(str(tmp_path / "m")), tmp_path / "c").generation == 1
    monkeypatch.undo()
    assert push(stores[2], mirror).generation == 2
    assert pull(open_mirror(str(tmp_path / "m")), tmp_path / "c").generation == 2


def test_a_pull_cut_short_or_damaged_leaves_the_cache_on_its_generation(stores, tmp_path, monkeypatch):
    mirror, reader, cache = open_mirror(str(tmp_path / "m")), open_mirror(str(tmp_path / "m")), tmp_path / "c"
    push(stores[1], mirror)
    pull(reader, cache)
    push(stores[2], mirror)
    download = mirror_mod.Mirror.download
    calls = []

    def failing(self, rel, local):
        calls.append(rel)
        if len(calls) == 2:
            raise OSError("connection reset")
        return download(self, rel, local)

    monkeypatch.setattr(mirror_mod.Mirror, "download", failing)
    with pytest.raises(OSError):
        pull(reader, cache)
    monkeypatch.undo()
    assert current_generation_number(cache) == 1
    assert sorted(p.name for p in (cache / "generations").iterdir()) == ["000001"]  # no .partial left

    victim = tmp_path / "m/generations/000002/memories.arrow"  # same size, one byte flipped
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(GenerationDamaged, match="memories.arrow has CRC-32") as err:
        pull(reader, cache)
    assert "push the store to it again" in str(err.value) and "keeps generation 1" in str(err.value)
    assert current_generation_number(cache) == 1
    assert sorted(p.name for p in (cache / "generations").iterdir()) == ["000001"]


def test_an_empty_mirror_or_a_mirror_of_another_store_is_refused(stores, tmp_path):
    with pytest.raises(StoreError, match="holds no generation yet"):
        pull(open_mirror(str(tmp_path / "m")), tmp_path / "c")
    push(stores[3], open_mirror(str(tmp_path / "m")))
    with pytest.raises(StoreError, match="newer than store"):
        push(stores[1], open_mirror(str(tmp_path / "m")))


def test_the_delta_and_small_files_follow_the_store(stores, tmp_path):
    """A write in the store's delta is found by recall over the cache after a push and a
    pull; the live settings come along and leave with the store's."""
    record = memory(950, "The staging cluster restarts on Wednesdays at dawn from now on.")
    store = _with_delta(stores[2], tmp_path, record)
    (store / "serve-settings.json").write_text('{"k": 7}')
    mirror, reader, cache = open_mirror(str(tmp_path / "m")), open_mirror(str(tmp_path / "m")), tmp_path / "c"
    sent = push(store, mirror)
    assert sent.delta_version > 0 and sent.segments >= 1 and "serve-settings.json" in sent.small_files
    got = pull(reader, cache)
    assert got.delta_version == sent.delta_version
    assert (cache / "delta/CURRENT").read_text() == (store / "delta/CURRENT").read_text()
    assert json.loads((cache / "serve-settings.json").read_text()) == {"k": 7}
    assert "m950" in _recall_ids(cache, "Which day does the staging cluster restart from now on?")
    (store / "serve-settings.json").unlink()
    assert push(store, mirror).small_files == ["serve-settings.json"]
    assert pull(reader, cache).changed and not (cache / "serve-settings.json").exists()


# --------------------------------------------------------------------------- helix ingest --mirror


def test_helix_ingest_pushes_each_publish_to_its_mirror(tmp_path, capsys):
    from helix_ray.cli import main

    store, uri = tmp_path / "store", f"file://{tmp_path / 'm'}"
    first = write_jsonl(tmp_path / "a.jsonl", [memory(1, "The gateway runs four uvicorn workers per pod.")])
    args = ["--store", str(store), "--runner", "local", "--no-progress", "--mirror", uri]
    assert main(["ingest", str(first), *args]) == 0
    assert f"mirror {uri}: generation 1" in capsys.readouterr().out
    assert (tmp_path / "m/CURRENT").read_text().strip() == "1"
    second = write_jsonl(tmp_path / "b.jsonl", [memory(2, "Backups run nightly at two.")])
    assert main(["ingest", str(second), *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mirrored"]["generation"] == 2 and report["mirrored"]["copied"] > 0
    assert pull(open_mirror(uri), tmp_path / "c").generation == 2


def test_a_bad_mirror_is_refused_before_the_store_is_touched(tmp_path, capsys):
    from helix_ray.cli import main

    source = write_jsonl(tmp_path / "a.jsonl", [memory(1, "The gateway runs four uvicorn workers per pod.")])
    code = main(["ingest", str(source), "--store", str(tmp_path / "store"), "--runner", "local", "--no-progress",
                 "--mirror", "mirror-here"])
    assert code == 2 and "absolute path" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_an_ingest_run_again_after_a_failed_push_completes_it(tmp_path, monkeypatch):
    from helix_ray.ingest.run import ingest

    source = write_jsonl(tmp_path / "a.jsonl", [memory(1, "The gateway runs four uvicorn workers per pod.")])
    run = dict(runner="local", show_progress=False, mirror=str(tmp_path / "m"))
    monkeypatch.setattr(mirror_mod.Mirror, "replace", lambda *a: (_ for _ in ()).throw(OSError("no route")))
    with pytest.raises(StoreError, match="Generation 1 is current in .*Run the same `helix ingest"):
        ingest([source], tmp_path / "store", **run)
    monkeypatch.undo()
    assert current_generation_number(tmp_path / "store") == 1 and not (tmp_path / "m/CURRENT").exists()
    again = ingest([source], tmp_path / "store", **run)
    assert not again.published and again.mirrored["generation"] == 1
    assert (tmp_path / "m/CURRENT").read_text().strip() == "1"


# --------------------------------------------------------------------------- serving from a mirror


def test_replicas_serve_a_cache_of_the_mirror_that_follows_the_writer(stores, tmp_path):
    """The Writer pushes each write and each compaction; a replica reading the store
    through a synced cache answers as one reading the store, then finds the write (from
    the delta), then serves the compaction's generation. No Ray: the shells in process."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve.shells import PipelineShell, WriterShell

    store, uri, cache = Path(shutil.copytree(stores[2], tmp_path / "store")), f"file://{tmp_path / 'm'}", tmp_path / "c"
    writer = WriterShell(store, mirror=uri)
    try:
        assert (tmp_path / "m/CURRENT").read_text().strip() == "2"
        replica = PipelineShell("/no/such/store", mirror=uri, mirror_cache=str(cache), watch_interval_s=0.1)
        sync = mirror_mod.CacheSync.start(uri, cache)
        assert replica.ranker.views.store == cache and sync.last is not None and sync.last.generation == 2

        async def answer(query: str) -> list[tuple[str, str]]:
            out = await replica.recall(query, user="dana", config=RetrievalConfig(), budget_tokens=400, k=8)
            return [(item["id"], item["origin"]) for item in out["items"]]

        async def until(query: str, wanted: tuple[str, str]) -> list[tuple[str, str]]:
            for _ in range(200):
                got = await answer(query)
                if wanted in got:
                    return got
                await asyncio.sleep(0.1)
            raise AssertionError(f"{wanted} not answered from the cache: {got}")

        assert [i for i, _ in asyncio.run(answer(QUERY))] == _recall_ids(store)
        written = memory(960, "The staging cluster restarts on Fridays at dusk from now on.")
        writer.add([written], user=None)
        query = "Which day does the staging cluster restart from now on?"
        asyncio.run(until(query, ("m960", "delta")))
        assert writer.compact()["generation"] == 3
        asyncio.run(until(query, ("m960", "generation")))
        assert current_generation_number(cache) == 3 and not (cache / "helix.duckdb").exists()
    finally:
        mirror_mod.CacheSync.start(uri, cache).stop()
        writer.core.close()


def test_serve_args_refuse_a_bad_mirror_and_the_inline_graph_with_one(tmp_path):
    from pydantic import ValidationError

    from helix_ray.serve.app import ServeArgs

    with pytest.raises(ValidationError, match="absolute path"):
        ServeArgs(store=str(tmp_path), mirror="relative/m")
    with pytest.raises(ValidationError, match="graph 'split' or 'compact'"):
        ServeArgs(store=str(tmp_path), mirror=str(tmp_path / "m"), graph="inline")
    assert ServeArgs(store=str(tmp_path), mirror=str(tmp_path / "m"), graph="compact").mirror_cache is None


def _deployments(app) -> dict[str, tuple[dict, dict]]:
    """Each deployment of a built application: (its replicas' actor options, its keyword arguments)."""
    from ray.serve.deployment import Application

    bound = app._bound_deployment
    out = {bound.name: (bound.ray_actor_options or {}, dict(bound.init_kwargs))}
    for arg in [*bound.init_args, *bound.init_kwargs.values()]:
        if isinstance(arg, Application):
            out.update(_deployments(arg))
    return out


@pytest.mark.parametrize("graph", ["compact", "split"])
def test_build_app_pushes_first_and_keeps_the_writer_and_ingress_on_the_stores_node(stores, tmp_path, graph):
    """The store is at the mirror before any replica starts; the Writer and the ingress
    are pinned to the store's node, the recall replicas are not and read the mirror."""
    from helix_ray.serve.app import NODE_ID_LABEL, ServeArgs, build_app

    mirror, node = tmp_path / "m", "ab" * 28
    app = build_app(ServeArgs(store=str(stores[1]), mirror=str(mirror), store_node=node, graph=graph))
    assert (mirror / "CURRENT").read_text().strip() == "1"
    placed = _deployments(app)
    recall = {"compact": ["Pipeline"], "split": ["Embedder", "DenseANN", "BM25", "Ranker"]}[graph]
    assert sorted(placed) == sorted(["HelixAPI", "Writer", *recall])
    for name, (options, kwargs) in placed.items():
        pinned = options.get("label_selector") == {NODE_ID_LABEL: node}
        assert pinned == (name in ("HelixAPI", "Writer")), name
        if name in recall:
            assert kwargs.get("mirror") == str(mirror), name
    assert placed["Writer"][1]["mirror"] == str(mirror)
    alone = _deployments(build_app(ServeArgs(store=str(stores[1]), graph=graph)))
    assert not any("label_selector" in options or kwargs.get("mirror") for options, kwargs in alone.values())


def test_forgetting_a_user_leaves_nothing_of_theirs_at_the_mirror_or_in_a_cache(stores, tmp_path):
    """The mirror keeps the generation and delta snapshot before the current ones, and a
    cache keeps what the mirror keeps: after a user is forgotten, neither holds theirs."""
    from helix_ray.serve.shells import WriterShell
    from tests.helpers import files_holding

    store, mirror, cache = Path(shutil.copytree(stores[2], tmp_path / "store")), tmp_path / "m", tmp_path / "c"
    reader = open_mirror(str(mirror))
    writer = WriterShell(store, mirror=str(mirror))
    try:
        writer.add([memory(970, "Erin keeps the spare badge in the blue drawer.", user="erin")], user=None)
        assert writer.compact()["generation"] == 3
        pull(reader, cache)
        assert files_holding(mirror, "blue drawer") and files_holding(cache, "blue drawer")
        writer.forget_user("erin", compact=True)
    finally:
        writer.core.close()
    assert pull(reader, cache).generation == 4
    assert files_holding(mirror, "blue drawer") == [] and files_holding(cache, "blue drawer") == []
    assert sorted(p.name for p in (cache / "generations").iterdir()) == ["000004"]


def test_a_cache_synced_between_a_forgets_pushes_still_drops_the_users_copies(stores, tmp_path, monkeypatch):
    """Regression: a sync between a forget's pushes took the new generation or delta
    snapshot while the mirror still listed the old one; later syncs saw nothing new and
    never pruned, so the cache kept the forgotten text. Every sync prunes what the
    mirror no longer lists."""
    from helix_ray.live.writer import WriterCore
    from helix_ray.serve.shells import WriterShell
    from tests.helpers import files_holding

    store, mirror, cache = Path(shutil.copytree(stores[2], tmp_path / "store")), tmp_path / "m", tmp_path / "c"
    reader = open_mirror(str(mirror))
    original = WriterCore.push_mirror

    def push_then_pull(self, **kwargs):
        outcome = original(self, **kwargs)
        pull(reader, cache)
        return outcome

    writer = WriterShell(store, mirror=str(mirror))
    try:
        writer.add([memory(971, "Erin waters the fern on the third floor.", user="erin")], user=None)
        assert writer.compact()["generation"] == 3
        monkeypatch.setattr(WriterCore, "push_mirror", push_then_pull)
        writer.forget_user("erin", compact=True)
    finally:
        writer.core.close()
    assert files_holding(mirror, "third floor") == []
    pull(reader, cache)
    assert files_holding(cache, "third floor") == []


def test_a_push_after_a_forget_without_the_mirror_keeps_no_older_generation(stores, tmp_path, capsys):
    """Regression: ``helix forget-user`` runs without the mirror, so the next push kept
    the generation before the forget (holding the user's rows) as the mirror's previous
    one. The forget leaves a marker in the store; pushes keep no history until one
    completes."""
    from helix_ray.cli import main
    from helix_ray.serve.shells import WriterShell
    from tests.helpers import files_holding

    store, mirror = Path(shutil.copytree(stores[2], tmp_path / "store")), tmp_path / "m"
    writer = WriterShell(store, mirror=str(mirror))
    try:
        writer.add([memory(972, "Erin parks in bay seventeen.", user="erin")], user=None)
        assert writer.compact()["generation"] == 3
    finally:
        writer.core.close()
    assert files_holding(mirror, "bay seventeen")
    assert main(["forget-user", "--store", str(store), "erin", "--compact"]) == 0
    assert "this store's mirror holds the user's data until the next push" in capsys.readouterr().out
    assert mirror_mod.forget_pending(store)
    push(store, open_mirror(str(mirror)))
    assert files_holding(mirror, "bay seventeen") == []
    assert not mirror_mod.forget_pending(store)
    assert sorted(p.name for p in (mirror / "generations").iterdir()) == ["000004"]


def test_a_store_never_mirrored_says_nothing_of_a_mirror_when_a_user_is_forgotten(stores, tmp_path, capsys):
    from helix_ray.cli import main
    from helix_ray.serve.shells import WriterShell

    store = Path(shutil.copytree(stores[2], tmp_path / "store"))
    (store / mirror_mod.MIRRORED).unlink(missing_ok=True)
    writer = WriterShell(store)
    try:
        writer.add([memory(973, "Fay keeps the spare key in the red tin.", user="fay"),
                    memory(974, "Gus waters the ferns on Fridays.", user="gus")], user=None)
        assert writer.forget_user("fay", compact=False)["mirror_stale"] is False
    finally:
        writer.core.close()
    assert not mirror_mod.forget_pending(store)
    capsys.readouterr()
    assert main(["forget-user", "--store", str(store), "gus"]) == 0
    assert "forgot user 'gus'" in (out := capsys.readouterr().out) and "this store's mirror" not in out


class _ObjectStorageAway:
    """While ``away``, every object the mirror replaces whole (a ``CURRENT``, a delta
    manifest) fails as a network error would, after the segments went up."""

    def __init__(self, monkeypatch):
        self.away = False
        real = mirror_mod.Mirror.replace

        def replace(mirror, rel, data):
            if self.away:
                raise OSError(113, "No route to host")
            return real(mirror, rel, data)

        monkeypatch.setattr(mirror_mod.Mirror, "replace", replace)


def _until(done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def quick_retries(monkeypatch):
    """The Compactor's thread ticks every 20 ms and retries a failed push after 0.1 s, doubling."""
    from helix_ray.live import compactor

    monkeypatch.setattr(compactor, "COMPACT_TICK_S", 0.02)
    monkeypatch.setattr(compactor, "MIRROR_RETRY_S", 0.1)


def test_a_failed_push_is_retried_in_the_background_without_another_write(stores, tmp_path, monkeypatch,
                                                                           quick_retries):
    """Regression: a push that failed waited for the next change, so a mirror that was
    away for a moment stayed behind while no write came. The Compactor's thread pushes
    again, backing off, and the Writer's stats say the mirror lags and since when."""
    from helix_ray.serve.shells import WriterShell
    from helix_ray.store.pointer import read_int

    store, mirror = Path(shutil.copytree(stores[2], tmp_path / "store")), tmp_path / "m"
    storage = _ObjectStorageAway(monkeypatch)
    writer = WriterShell(store, mirror=str(mirror))
    try:
        assert writer.stats()["mirror"] == {"uri": str(mirror), "behind": False, "forget_pending": False}
        storage.away = True
        writer.add([memory(980, "The kiln room opens at seven.")], user=None)
        state = writer.stats()["mirror"]
        assert state["behind"] and state["behind_since"] and "No route to host" in state["last_error"]
        assert read_int(mirror / "delta/CURRENT") < read_int(store / "delta/CURRENT")
        time.sleep(1.0)
        # Tries 0.1, 0.2, 0.4 s after the one before: a few in a second, not one every tick.
        assert 3 <= writer.core.mirror_behind.failures <= 5, writer.core.mirror_behind
        storage.away = False
        _until(lambda: writer.core.mirror_behind is None)
        assert writer.stats()["mirror"] == {"uri": str(mirror), "behind": False, "forget_pending": False}
    finally:
        writer.core.close()
    version = read_int(store / "delta/CURRENT")
    assert read_int(mirror / "delta/CURRENT") == version
    assert (mirror / f"delta/{version:010d}.json").read_bytes() == (store / f"delta/{version:010d}.json").read_bytes()
    assert read_int(mirror / "CURRENT") == current_generation_number(store) == 2


def test_a_forget_whose_push_failed_is_completed_at_the_mirror_by_the_retry(stores, tmp_path, monkeypatch,
                                                                            quick_retries):
    """The forget's push fails: the answer says the mirror is stale, the stats say a
    forget is pending there. The background retry keeps no older generation or snapshot,
    as the forget's own push would have, and clears the pending mark."""
    from helix_ray.serve.shells import WriterShell
    from tests.helpers import files_holding

    store, mirror = Path(shutil.copytree(stores[2], tmp_path / "store")), tmp_path / "m"
    storage = _ObjectStorageAway(monkeypatch)
    writer = WriterShell(store, mirror=str(mirror))
    try:
        writer.add([memory(981, "Erin keeps the kiln key under the mat.", user="erin")], user=None)
        assert writer.compact()["generation"] == 3
        assert files_holding(mirror, "under the mat")
        storage.away = True
        assert writer.forget_user("erin", compact=True)["mirror_stale"] is True
        assert mirror_mod.forget_pending(store) and writer.stats()["mirror"]["forget_pending"]
        assert files_holding(mirror, "under the mat")
        storage.away = False
        _until(lambda: writer.core.mirror_behind is None)
        assert writer.stats()["mirror"] == {"uri": str(mirror), "behind": False, "forget_pending": False}
    finally:
        writer.core.close()
    assert not mirror_mod.forget_pending(store)
    assert files_holding(mirror, "under the mat") == []
    assert sorted(p.name for p in (mirror / "generations").iterdir()) == ["000004"]
    assert len(list((mirror / "delta").glob("*.json"))) == 1


def test_a_file_the_previous_cached_generation_lost_is_downloaded(stores, tmp_path):
    """A file the cache would hard-link from its previous generation, but which is gone
    from there, is downloaded instead of failing the pull."""
    mirror, reader, cache = open_mirror(str(tmp_path / "m")), open_mirror(str(tmp_path / "m")), tmp_path / "c"
    push(stores[1], mirror)
    pull(reader, cache)
    push(stores[2], mirror)
    for path in (cache / "generations/000001").rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            path.unlink()
    got = pull(reader, cache)
    assert got.generation == 2 and got.linked == 0
    assert _files(cache / "generations/000002") == _files(stores[2] / "generations/000002")


def test_a_delta_pull_that_fails_leaves_no_temporary_file(stores, tmp_path, monkeypatch):
    """The cached delta snapshot and its segments are written aside and renamed in; a
    failure removes what was written aside."""
    store = _with_delta(stores[2], tmp_path, memory(951, "The lab printer jams on glossy paper."))
    reader, cache = open_mirror(str(tmp_path / "m")), tmp_path / "c"
    push(store, open_mirror(str(tmp_path / "m")))
    pull(reader, cache)  # generation and delta in
    (cache / "delta/CURRENT").write_text("0\n")  # the next pull takes the snapshot again

    def broken(fd):
        raise OSError("disk full")

    monkeypatch.setattr(mirror_mod.os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        pull(reader, cache)
    monkeypatch.undo()
    assert not [p.name for p in (cache / "delta").iterdir() if p.name.startswith(".")]


def test_a_mirror_pointer_holding_garbage_is_a_store_error_naming_it(stores, tmp_path):
    mirror = open_mirror(str(tmp_path / "m"))
    push(stores[1], mirror)
    (tmp_path / "m/CURRENT").write_text("not-a-number\n")
    with pytest.raises(StoreError, match="not-a-number.*Delete that file and push"):
        pull(open_mirror(str(tmp_path / "m")), tmp_path / "c")
