"""Markdown section ids name their user (``md:<user>/<path>#<slug>``): two users ingest
one folder into one store, and a store made before ids named their user is renamed
by the next read, not kept twice."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from helix_ray.config import IngestConfig, ValidationConfig
from helix_ray.ingest.ids import legacy_markdown_id, markdown_id, user_part
from helix_ray.ingest.normalize import normalise
from helix_ray.ingest.run import ingest
from helix_ray.ingest.sources import read_source
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation

OPS = "# Ops\n\n## Deploy\nRun make deploy from the release branch, then watch the canary for ten minutes.\n"
QUEUE = "# Queue\n\n## Broker\nThe event bus runs on NATS JetStream with three replicas per stream.\n"


def _config(user: str | None) -> IngestConfig:
    base = IngestConfig()
    return base.model_copy(update={"validation": base.validation.model_copy(update={"default_user": user})})


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    (folder / "team").mkdir(parents=True)
    (folder / "ops.md").write_text(OPS, encoding="utf-8")
    (folder / "team" / "queue.md").write_text(QUEUE, encoding="utf-8")
    return folder


def _ids(store: Path) -> set[str]:
    return set(Generation.open_current(store).columns.id_to_row)


def test_a_section_id_names_its_user_escaped_and_the_front_matter_user_wins(tmp_path):
    note = tmp_path / "n.md"
    note.write_text("---\nuser: lee\n---\n# N\n## A\nalpha\n", encoding="utf-8")
    plain = tmp_path / "p.md"
    plain.write_text("# P\n## B\nbeta\n", encoding="utf-8")
    raws = list(read_source(note, "markdown")) + list(read_source(plain, "markdown"))
    rows, quarantined = normalise(raws, ValidationConfig(default_user="ops/team:1"),
                                  default_time=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc))
    assert not quarantined
    assert [r["id"] for r in rows] == ["md:lee/n.md#a", "md:ops%2Fteam%3A1/p.md#b"]
    assert all("_md_section" not in json.loads(r["metadata"]) for r in rows), "the key is not kept as metadata"
    assert user_part("a%b") == "a%25b" and markdown_id("a%b", "x.md#s") == "md:a%25b/x.md#s"
    assert legacy_markdown_id("md:ops%2Fteam%3A1/p.md#b", "ops/team:1") == "md:p.md#b"
    assert legacy_markdown_id("md:lee/n.md#a", "dana") is None


def test_two_users_ingest_one_markdown_folder_into_one_store(tmp_path, docs):
    """Protects: the second user's ingest of a folder the first ingested was quarantined
    whole as id_conflict (the ids did not name their user)."""
    store = tmp_path / "store"
    for user in ("alice", "bob"):
        report = ingest([docs], store, runner="local", show_progress=False, config=_config(user))
        assert (report.accepted, report.new, report.quarantined, report.renamed) == (2, 2, 0, 0), report
    assert _ids(store) == {f"md:{u}/{p}" for u in ("alice", "bob") for p in ("ops.md#deploy", "team/queue.md#broker")}
    from helix_ray.memory import Memory

    with Memory(store, record_access=False, warm=False) as mem:
        for user in ("alice", "bob"):
            items = mem.recall("which broker runs the event bus?", user=user, k=2).items
            assert items and {i.id for i in items} <= {f"md:{user}/ops.md#deploy", f"md:{user}/team/queue.md#broker"}
            assert items[0].id == f"md:{user}/team/queue.md#broker"
    with StoreDB(store) as db:
        assert db.counts()["quarantined"] == 0


def _old_store(tmp_path: Path, docs: Path, owners: dict[str, str]) -> Path:
    """A store made before Markdown ids named their user: the folder's sections under
    ``md:<path>#<slug>``, each of the user ``owners`` gives its path (``ops.md#deploy``)."""
    raws = [r for r in read_source(docs, "markdown") if "_reject" not in r]
    old = [{**{k: v for k, v in r.items() if not k.startswith("_")}, "id": "md:" + r["_md_section"],
            "user": owners[r["_md_section"]]} for r in raws]
    source = tmp_path / "old.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in old), encoding="utf-8")
    store = tmp_path / "store"
    report = ingest([source], store, runner="local", show_progress=False)
    assert report.published and report.quarantined == 0, report
    return store


def test_an_old_markdown_store_read_again_keeps_each_section_once(tmp_path, docs):
    """Re-ingesting a folder whose sections a store made before ids named their user holds
    replaces that user's old ids (marked deleted, counted renamed) instead of keeping both;
    another user's old id stays theirs until they read the folder again. A section stored
    as chunks is renamed chunks and all."""
    (docs / "shards.md").write_text("# Shards\n\n## Backups\n" + " ".join(
        f"Shard {m} is copied to object storage at {m % 24}:00 and its checksum checked." for m in range(60)))
    store = _old_store(tmp_path, docs, {"ops.md#deploy": "dev", "team/queue.md#broker": "ops",
                                        "shards.md#backups": "dev"})
    old_chunks = {i for i in _ids(store) if i.startswith("md:shards.md#backups#chunk")}
    assert len(old_chunks) > 1
    report = ingest([docs], store, runner="local", show_progress=False, config=_config("dev"))
    assert (report.renamed, report.quarantined) == (1 + len(old_chunks), 0), report
    mine = {"md:dev/ops.md#deploy", "md:dev/team/queue.md#broker"}
    assert {i for i in _ids(store) if "shards" not in i} == mine | {"md:team/queue.md#broker"}
    assert {i.replace("md:", "md:dev/", 1) for i in old_chunks} == {i for i in _ids(store) if "shards" in i}
    again = ingest([docs], store, runner="local", show_progress=False, config=_config("ops"))
    assert (again.renamed, again.quarantined) == (1, 0), again
    assert {i for i in _ids(store) if "shards" not in i} == {f"md:{u}/{p}" for u in ("dev", "ops")
                                                             for p in ("ops.md#deploy", "team/queue.md#broker")}
    with StoreDB(store) as db:
        known = db.known_hashes()
        assert all(known[i][1] for i in {"md:ops.md#deploy", "md:team/queue.md#broker", *old_chunks}), "deleted"


def test_an_id_of_today_that_reads_like_an_old_one_is_not_renamed(tmp_path):
    """``md:dev/ops.md#deploy`` is dev's ops.md today, and would be a store made before's
    id of dev/ops.md: reading a folder with a dev/ops.md must not delete dev's ops.md."""
    top, nested = tmp_path / "top", tmp_path / "nested"
    top.mkdir()
    (nested / "dev").mkdir(parents=True)
    (top / "ops.md").write_text(OPS, encoding="utf-8")
    (nested / "dev" / "ops.md").write_text("# Dev\n\n## Deploy\nOn a laptop, tilt up deploys every service into a "
                                          "kind cluster.\n", encoding="utf-8")
    store = tmp_path / "store"
    assert ingest([top], store, runner="local", show_progress=False, config=_config("dev")).new == 1
    report = ingest([nested], store, runner="local", show_progress=False, config=_config("dev"))
    assert (report.new, report.renamed) == (1, 0), report
    assert _ids(store) == {"md:dev/ops.md#deploy", "md:dev/dev/ops.md#deploy"}
