"""Markdown section ids name their user and their document set
(``md:<user>/<docs>/<path>#<slug>``): two users ingest one folder into one store, one
user's two folders that hold files of one path are two sets of memories, and a store
made before ids named their user or their document set is renamed by the next read,
not kept twice."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Callable

import pytest

from helix_ray.config import IngestConfig, ValidationConfig
from helix_ray.errors import InvalidArgument
from helix_ray.ingest.ids import legacy_markdown_ids, markdown_id, user_part
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


def _cli_ingest(source: Path, store: Path, *extra: str) -> int:
    from helix_ray.cli import main

    return main(["ingest", str(source), "--store", str(store), "--runner", "local", "--no-progress", "--json",
                 *extra])


def test_a_section_id_names_its_user_and_folder_escaped_and_the_front_matter_user_wins(tmp_path):
    folder = tmp_path / "ops:notes"
    folder.mkdir()
    note = folder / "n.md"
    note.write_text("---\nuser: lee\nid: one-for-all\n---\n# N\n## A\nalpha\n", encoding="utf-8")
    plain = folder / "p.md"
    plain.write_text("# P\n## B\nbeta\n", encoding="utf-8")
    raws = list(read_source(note, "markdown")) + list(read_source(folder, "markdown", name="wiki"))
    rows, quarantined = normalise(raws, ValidationConfig(default_user="ops/team:1"),
                                  default_time=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc))
    assert not quarantined
    assert [r["id"] for r in rows] == ["md:lee/ops%3Anotes/n.md#a", "md:lee/wiki/n.md#a",
                                       "md:ops%2Fteam%3A1/wiki/p.md#b"], "a front matter id names no section"
    assert all("_md_section" not in json.loads(r["metadata"]) for r in rows), "the key is not kept as metadata"
    assert user_part("a%b") == "a%25b" and markdown_id("a%b", "d/x.md#s") == "md:a%25b/d/x.md#s"
    assert legacy_markdown_ids("md:ops%2Fteam%3A1/wiki/p.md#b", "ops/team:1", "p.md") == (
        "md:ops%2Fteam%3A1/p.md#b", "md:p.md#b")
    assert legacy_markdown_ids("md:lee/wiki/n.md#a", "dana", "n.md") == ()
    assert legacy_markdown_ids("md:lee/wiki/n.md#a", "lee", "wiki/n.md") == (), "not a section of that file"
    assert legacy_markdown_ids("md:lee/n.md#a", "lee", "n.md") == (), "an id given, not derived"


def test_two_users_ingest_one_markdown_folder_into_one_store(tmp_path, docs):
    """Protects: the second user's ingest of a folder the first ingested was quarantined
    whole as id_conflict (the ids did not name their user)."""
    store = tmp_path / "store"
    for user in ("alice", "bob"):
        report = ingest([docs], store, runner="local", show_progress=False, config=_config(user))
        assert (report.accepted, report.new, report.quarantined, report.renamed) == (2, 2, 0, 0), report
    assert _ids(store) == {f"md:{u}/docs/{p}" for u in ("alice", "bob")
                           for p in ("ops.md#deploy", "team/queue.md#broker")}
    from helix_ray.memory import Memory

    with Memory(store, record_access=False, warm=False) as mem:
        for user in ("alice", "bob"):
            items = mem.recall("which broker runs the event bus?", user=user, k=2).items
            assert items and {i.id for i in items} <= {f"md:{user}/docs/ops.md#deploy",
                                                       f"md:{user}/docs/team/queue.md#broker"}
            assert items[0].id == f"md:{user}/docs/team/queue.md#broker"
    with StoreDB(store) as db:
        assert db.counts()["quarantined"] == 0


def _readme_folders(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders, each with a README.md and a guide/setup.md of its own."""
    made = []
    for parent, name, broker, setup in (("work", "shop", "RabbitMQ", "run poetry install"),
                                        ("home", "billing", "Kafka", "run npm ci")):
        folder = tmp_path / parent / name
        (folder / "guide").mkdir(parents=True)
        (folder / "README.md").write_text(f"# {name}\n\n## Queue\nThe {name} service publishes its events to "
                                          f"{broker}.\n", encoding="utf-8")
        (folder / "guide" / "setup.md").write_text(f"# Setup\n\n## Install\nTo set up {name}, {setup}.\n",
                                                   encoding="utf-8")
        made.append(folder)
    return made[0], made[1]


def test_two_folders_with_files_of_one_path_are_two_sets_of_memories(tmp_path):
    """Protects: the second folder's README.md replaced the first's (one id for both)."""
    shop, billing = _readme_folders(tmp_path)
    store = tmp_path / "store"
    for folder in (shop, billing):
        report = ingest([folder], store, fmt="markdown", runner="local", show_progress=False, config=_config("dev"))
        assert (report.new, report.updated, report.renamed) == (2, 0, 0), report
    assert _ids(store) == {f"md:dev/{d}/{p}" for d in ("shop", "billing")
                           for p in ("README.md#queue", "guide/setup.md#install")}
    from helix_ray.memory import Memory

    with Memory(store, record_access=False, warm=False) as mem:
        for name, broker in (("shop", "RabbitMQ"), ("billing", "Kafka")):
            (top, *_) = mem.recall(f"which broker does the {name} service publish events to?", user="dev", k=2).items
            assert top.id == f"md:dev/{name}/README.md#queue" and broker in top.text


def test_two_folders_of_one_name_need_two_doc_names(tmp_path, capsys):
    """Two folders of one name read in one run are refused; ``--doc-name`` (and
    ``doc_name=`` of :meth:`Memory.ingest`) names each in its ids."""
    shop, billing = _readme_folders(tmp_path)
    other = billing.rename(tmp_path / "home" / "shop")
    store = tmp_path / "store"
    with pytest.raises(InvalidArgument, match="one name names one folder of documents") as raised:
        ingest([shop, other], store, runner="local", show_progress=False, config=_config("dev"))
    assert raised.value.name == "doc_name" and not store.exists()
    assert _cli_ingest(shop, store, "--user", "dev", "--doc-name", "shop-docs") == 0
    from helix_ray.memory import Memory

    with Memory(store, ingest=_config("dev"), warm=False) as mem:
        assert mem.ingest(other, doc_name="billing.v2").new == 2
    assert _ids(store) == {f"md:dev/{d}/{p}" for d in ("shop-docs", "billing.v2")
                           for p in ("README.md#queue", "guide/setup.md#install")}
    capsys.readouterr()


@pytest.mark.parametrize("name", ["my docs", "team/docs", "docs:v2", "", "a" * 101])
def test_a_bad_doc_name_is_refused_saying_what_a_name_may_hold(tmp_path, docs, capsys, name):
    assert _cli_ingest(docs, tmp_path / "store", "--user", "dev", "--doc-name", name) == 2
    err = capsys.readouterr().err
    assert f"Got --doc-name={name!r}" in err and "each a letter, digit, '.', '_' or '-'" in err
    assert not (tmp_path / "store").exists(), "refused before the store is touched"


def test_doc_name_applies_to_markdown_only(tmp_path, capsys):
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "a note", "user": "dev"}\n')
    assert _cli_ingest(notes, tmp_path / "store", "--doc-name", "notes") == 2
    assert "--doc-name applies to --format markdown only" in capsys.readouterr().err


#: The id a store made before holds for a section (``ops.md#deploy``) of a user: before
#: ids named their document set, and before they named their user.
OLD_FORMS: dict[str, Callable[[str, str], str]] = {
    "md:<user>/<path>#<slug>": lambda user, section: f"md:{user}/{section}",
    "md:<path>#<slug>": lambda user, section: f"md:{section}",
}


def _old_store(tmp_path: Path, docs: Path, owners: dict[str, str], old_id: Callable[[str, str], str]) -> Path:
    """A store made before: the folder's sections under ``old_id(user, "<path>#<slug>")``,
    each of the user ``owners`` gives its path (``ops.md#deploy``)."""
    raws = [r for r in read_source(docs, "markdown") if "_reject" not in r]
    sections = [r["_md_section"].removeprefix("docs/") for r in raws]
    old = [{**{k: v for k, v in r.items() if not k.startswith("_")}, "id": old_id(owners[s], s), "user": owners[s]}
           for r, s in zip(raws, sections)]
    source = tmp_path / "old.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in old), encoding="utf-8")
    store = tmp_path / "store"
    report = ingest([source], store, runner="local", show_progress=False)
    assert report.published and report.quarantined == 0, report
    return store


@pytest.mark.parametrize("form", OLD_FORMS)
def test_an_old_markdown_store_read_again_keeps_each_section_once(tmp_path, docs, form):
    """Re-ingesting a folder whose sections a store made before holds under an older id
    replaces that user's old ids (marked deleted, counted renamed) instead of keeping both;
    another user's old id stays theirs until they read the folder again. A section stored
    as chunks is renamed chunks and all."""
    old_id = OLD_FORMS[form]
    (docs / "shards.md").write_text("# Shards\n\n## Backups\n" + " ".join(
        f"Shard {m} is copied to object storage at {m % 24}:00 and its checksum checked." for m in range(60)))
    store = _old_store(tmp_path, docs, {"ops.md#deploy": "dev", "team/queue.md#broker": "ops",
                                        "shards.md#backups": "dev"}, old_id)
    old_chunks = {i for i in _ids(store) if i.startswith(old_id("dev", "shards.md#backups#chunk"))}
    assert len(old_chunks) > 1
    report = ingest([docs], store, runner="local", show_progress=False, config=_config("dev"))
    assert (report.renamed, report.quarantined) == (1 + len(old_chunks), 0), report
    mine = {"md:dev/docs/ops.md#deploy", "md:dev/docs/team/queue.md#broker"}
    assert {i for i in _ids(store) if "shards" not in i} == mine | {old_id("ops", "team/queue.md#broker")}
    assert {"md:dev/docs/" + i.partition("shards.md")[1] + i.partition("shards.md")[2] for i in old_chunks} == {
        i for i in _ids(store) if "shards" in i}
    again = ingest([docs], store, runner="local", show_progress=False, config=_config("ops"))
    assert (again.renamed, again.quarantined) == (1, 0), again
    assert {i for i in _ids(store) if "shards" not in i} == {f"md:{u}/docs/{p}" for u in ("dev", "ops")
                                                             for p in ("ops.md#deploy", "team/queue.md#broker")}
    with StoreDB(store) as db:
        known = db.known_hashes()
        old = {old_id("dev", "ops.md#deploy"), old_id("ops", "team/queue.md#broker"), *old_chunks}
        assert all(known[i][1] for i in old), "deleted"
    from helix_ray.memory import Memory

    with Memory(store, record_access=False, warm=False) as mem:
        items = mem.recall("how do we deploy from the release branch?", user="dev", k=5).items
        assert sum("Run make deploy" in i.text for i in items) == 1, [i.id for i in items]


def test_an_id_of_today_that_reads_like_an_old_one_is_not_renamed(tmp_path):
    """``md:dev/top/ops.md#deploy`` is dev's ops.md of the folder top today, and would be,
    in stores made before, dev's top/ops.md or anyone's dev/top/ops.md: reading a folder
    that holds those must not delete dev's ops.md of top."""
    top, outer = tmp_path / "top", tmp_path / "outer"
    top.mkdir()
    (outer / "dev" / "top").mkdir(parents=True)
    (outer / "top").mkdir()
    (top / "ops.md").write_text(OPS, encoding="utf-8")
    (outer / "top" / "ops.md").write_text("# Stage\n\n## Deploy\nStaging deploys go out from main every hour by "
                                          "the scheduler.\n", encoding="utf-8")
    (outer / "dev" / "top" / "ops.md").write_text("# Dev\n\n## Deploy\nOn a laptop, tilt up deploys every service "
                                                  "into a kind cluster.\n", encoding="utf-8")
    store = tmp_path / "store"
    assert ingest([top], store, runner="local", show_progress=False, config=_config("dev")).new == 1
    report = ingest([outer], store, runner="local", show_progress=False, config=_config("dev"))
    assert (report.new, report.renamed) == (2, 0), report
    assert _ids(store) == {"md:dev/top/ops.md#deploy", "md:dev/outer/top/ops.md#deploy",
                           "md:dev/outer/dev/top/ops.md#deploy"}


def _section_texts(store: Path) -> dict[str, str]:
    gen = Generation.open_current(store)
    return dict(zip(gen.memories.column("id").to_pylist(), gen.memories.column("text").to_pylist()))


def test_a_folder_named_by_default_like_another_of_the_store_is_refused(tmp_path, capsys):
    """Protects: a second run's folder of the same name (``work/shop``, then ``home/shop``)
    replaced the first's README.md in the store without a word. Refused before anything
    is written; named otherwise (``--doc-name``), both folders' sections are kept."""
    shop, billing = _readme_folders(tmp_path)
    other = billing.rename(tmp_path / "home" / "shop")
    store = tmp_path / "store"
    assert ingest([shop], store, runner="local", show_progress=False, config=_config("dev")).new == 2
    before = _section_texts(store)
    assert _cli_ingest(other, store, "--format", "markdown", "--user", "dev") == 2
    err = capsys.readouterr().err
    assert (f"Got --doc-name='shop'; that name, taken by default from the folder's, already names {shop} in this "
            "store for user dev") in err
    assert f"To keep {other} apart, give it its own --doc-name; if {shop} moved to {other}, pass --doc-name " \
           "shop to read it under the old name." in err
    with pytest.raises(InvalidArgument, match="already names") as raised:
        ingest([other / "README.md"], store, runner="local", show_progress=False, config=_config("dev"))
    assert raised.value.name == "doc_name"
    assert _section_texts(store) == before and "RabbitMQ" in before["md:dev/shop/README.md#queue"]
    with StoreDB(store) as db:
        assert db.counts()["ingest_runs"] == 1, "refused before the run was recorded"
    assert ingest([other], store, runner="local", show_progress=False, config=_config("ops")).new == 2, \
        "another user's name of its own"
    assert ingest([other], store, runner="local", show_progress=False, config=_config("dev"),
                  doc_name="billing").new == 2
    assert {i for i in _ids(store) if i.startswith("md:dev/")} == {
        f"md:dev/{d}/{p}" for d in ("shop", "billing") for p in ("README.md#queue", "guide/setup.md#install")}


def test_a_moved_folder_read_under_its_old_name_keeps_its_sections_once(tmp_path):
    """A name given is taken at its word: the folder moved, its sections are the same
    memories (no new id), and the name names the new folder from then on."""
    shop, _ = _readme_folders(tmp_path)
    store = tmp_path / "store"
    assert ingest([shop], store, runner="local", show_progress=False, config=_config("dev")).new == 2
    ids = _ids(store)
    moved = shop.rename(tmp_path / "home" / "shop")
    with pytest.raises(InvalidArgument, match=f"if {shop} moved to {moved}, pass --doc-name shop"):
        ingest([moved], store, runner="local", show_progress=False, config=_config("dev"))
    report = ingest([moved], store, runner="local", show_progress=False, config=_config("dev"), doc_name="shop")
    assert (report.new, report.unchanged, report.removed, report.renamed) == (0, 2, 0, 0), report
    assert _ids(store) == ids
    assert ingest([moved], store, runner="local", show_progress=False, config=_config("dev")).unchanged == 2
    shop.mkdir(parents=True)
    (shop / "README.md").write_text("# shop\n\n## Queue\nA new shop publishes to Redis.\n", encoding="utf-8")
    with pytest.raises(InvalidArgument, match=f"'shop'; that name, taken by default from the folder's, already names {moved} in this store"):
        ingest([shop], store, runner="local", show_progress=False, config=_config("dev"))


def test_a_store_made_before_folders_were_recorded_opens_and_records_them(tmp_path):
    shop, billing = _readme_folders(tmp_path)
    other = billing.rename(tmp_path / "home" / "shop")
    store = tmp_path / "store"
    assert ingest([shop], store, runner="local", show_progress=False, config=_config("dev")).new == 2
    with StoreDB(store) as db:
        db.con.execute("DROP TABLE source_names")
    with StoreDB(store) as db:
        assert db.source_folders([("dev", "markdown", "shop")]) == {}
    assert ingest([shop], store, runner="local", show_progress=False, config=_config("dev")).unchanged == 2
    with StoreDB(store) as db:
        assert db.source_folders([("dev", "markdown", "shop")]) == {("dev", "markdown", "shop"): str(shop)}
    with pytest.raises(InvalidArgument, match="already names"):
        ingest([other], store, runner="local", show_progress=False, config=_config("dev"))


def test_a_section_or_file_gone_from_a_folder_read_again_is_removed(tmp_path):
    """Protects: a `## Deployment` section deleted from its file, ingested again, was
    still recalled first. Reading a folder (or a file) again removes the sections it no
    longer holds, of the users it reads them for; a file quarantined this time keeps
    its sections, and another user's and another folder's stay."""
    notes, other = tmp_path / "notes", tmp_path / "other"
    notes.mkdir()
    other.mkdir()
    (notes / "a.md").write_text("# A\n## Deploy\nWe deploy with Argo.\n## Queue\nWe use NATS.\n", encoding="utf-8")
    (notes / "b.md").write_text("# B\n## Owners\nDana owns billing.\n", encoding="utf-8")
    (notes / "c.md").write_text("# C\n## Keys\nKeys rotate monthly.\n", encoding="utf-8")
    (other / "d.md").write_text("# D\n## Oncall\nOncall rotates weekly.\n", encoding="utf-8")
    store = tmp_path / "store"
    for folder, user in ((notes, "me"), (notes, "lee"), (other, "me")):
        assert ingest([folder], store, runner="local", show_progress=False, config=_config(user)).published
    (notes / "a.md").write_text("# A\n## Queue\nWe use NATS.\n", encoding="utf-8")
    (notes / "b.md").unlink()
    (notes / "c.md").write_bytes(b"# C\n## Keys\nKeys rotate \xff monthly.\n")  # unreadable this time
    report = ingest([notes], store, runner="local", show_progress=False, config=_config("me"))
    assert (report.removed, report.quarantined) == (2, 1), report
    mine = {i for i in _ids(store) if i.startswith("md:me/")}
    assert mine == {"md:me/notes/a.md#queue", "md:me/notes/c.md#keys", "md:me/other/d.md#oncall"}
    assert {i for i in _ids(store) if i.startswith("md:lee/")} == {
        "md:lee/notes/a.md#deploy", "md:lee/notes/a.md#queue", "md:lee/notes/b.md#owners", "md:lee/notes/c.md#keys"}
    # me's run, one file naming lee: lee's other files of the folder are not this run's.
    (notes / "e.md").write_text("---\nuser: lee\n---\n# E\n## Pager\nPage the oncall.\n", encoding="utf-8")
    assert ingest([notes], store, runner="local", show_progress=False, config=_config("me")).removed == 0
    assert "md:lee/notes/b.md#owners" in _ids(store) and "md:lee/notes/e.md#pager" in _ids(store)
    (notes / "e.md").unlink()
    # lee's notes read in the same run as another folder of theirs: only that folder is lee's here.
    (other / "d.md").write_text("---\nuser: lee\n---\n# D\n## Oncall\nOncall rotates weekly.\n", encoding="utf-8")
    both = ingest([notes, other], store, runner="local", show_progress=False, config=_config(None))
    assert both.removed == 0 and "md:lee/notes/b.md#owners" in _ids(store), both
    (notes / "c.md").write_text("# C\n## Rotation\nKeys rotate monthly.\n", encoding="utf-8")
    single = ingest([notes / "c.md"], store, runner="local", show_progress=False, config=_config("me"))
    assert single.removed == 1 and "md:me/notes/c.md#keys" not in _ids(store) and "md:me/notes/a.md#queue" in _ids(store)
