"""The git source: a small repository built here (a rename, a binary file, a merge, a
commit that explains a choice), read back commit by commit; and this repository itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.git import is_decision, read_git
from tests.helpers import REPO

AUTHOR = ("-c", "user.name=Ann Example", "-c", "user.email=ann@example.org")


def git(repo: Path, *args: str, date: str | None = None) -> str:
    """Run git in ``repo`` without the machine's git config; ``date`` fixes both commit dates."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    if date:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = date
    done = subprocess.run(["git", "-C", str(repo), *AUTHOR, *args], env=env, check=True, capture_output=True,
                          text=True)
    return done.stdout.strip()


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(repository folder, commit name → full sha), newest commit last:

    add     2024-01-10 +01:00  app.py (3 lines), logo.png (binary), notes.txt; a trailer with an address
    move    2024-02-01 Z       notes.txt → docs/notes.txt, app.py +1 -1; no body
    sqlite  2024-02-10 (side)  db.py; the body explains the choice
    merge   2024-02-15         the side branch, --no-ff
    fixtures 2024-03-01        35 new files
    """
    repo = tmp_path_factory.mktemp("repos") / "shop"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    shas: dict[str, str] = {}

    (repo / "app.py").write_text("import json\n\nprint('shop')\n")
    (repo / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (repo / "notes.txt").write_text("".join(f"note {i}: keep the receipts\n" for i in range(10)))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "Add the app", "-m", "First version of the shop.\n\n"
        "Signed-off-by: Ann Example <ann@example.org>", date="2024-01-10T09:00:00+01:00")
    shas["add"] = git(repo, "rev-parse", "HEAD")

    (repo / "docs").mkdir()
    git(repo, "mv", "notes.txt", "docs/notes.txt")
    (repo / "app.py").write_text("import json\n\nprint('the shop')\n")
    git(repo, "commit", "-q", "-a", "-m", "Move notes under docs", date="2024-02-01T12:00:00Z")
    shas["move"] = git(repo, "rev-parse", "HEAD")

    git(repo, "checkout", "-q", "-b", "storage")
    (repo / "db.py").write_text("import sqlite3\n\nDB = sqlite3.connect('shop.db')\n")
    git(repo, "add", "db.py")
    git(repo, "commit", "-q", "-m", "Store orders in SQLite instead of JSON files", "-m",
        "Two writers at once corrupted orders.json; SQLite locks the file for us.",
        date="2024-02-10T08:30:00-05:00")
    shas["sqlite"] = git(repo, "rev-parse", "HEAD")

    git(repo, "checkout", "-q", "main")
    git(repo, "merge", "-q", "--no-ff", "-m", "Merge branch 'storage'", "storage", date="2024-02-15T10:00:00Z")
    shas["merge"] = git(repo, "rev-parse", "HEAD")

    (repo / "fixtures").mkdir()
    for i in range(35):
        (repo / "fixtures" / f"order_{i:02d}.json").write_text('{"id": %d}\n' % i)
    git(repo, "add", "fixtures")
    git(repo, "commit", "-q", "-m", "Add order fixtures", date="2024-03-01T00:00:00Z")
    shas["fixtures"] = git(repo, "rev-parse", "HEAD")
    return repo, shas


def by_name(records: list[dict], shas: dict[str, str]) -> dict[str, dict]:
    names = {sha: name for name, sha in shas.items()}
    return {names[r["metadata"]["git"]["commit"]]: r for r in records}


def test_every_commit_newest_first_with_ids_source_and_position(shop):
    repo, shas = shop
    records = list(read_git(repo, user="ann"))
    assert [r["metadata"]["git"]["commit"] for r in records] == [
        shas["fixtures"], shas["merge"], shas["sqlite"], shas["move"], shas["add"]]
    for r in records:
        sha = r["metadata"]["git"]["commit"]
        assert r["id"] == f"git:ann/shop:{sha[:12]}"
        assert r["source"] == "git:shop" and r["session_id"] is None
        assert r["_source"] == str(repo) and r["_position"] == f"commit {sha[:12]}"
        assert r["metadata"]["git"]["repo"] == "shop" and r["metadata"]["git"]["author"] == "Ann Example"
        assert r["user"] == "ann"  # whom the id names


def test_the_id_names_the_user_and_the_repository_name_given(shop):
    """A user's '/', ':' and '%' are written %XX: ``<user>/<repo>:`` reads back one way."""
    repo, shas = shop
    first = next(read_git(repo, user="eng/ann:100%", name="shop-v2"))
    assert first["id"] == f"git:eng%2Fann%3A100%25/shop-v2:{shas['fixtures'][:12]}"
    assert first["source"] == "git:shop-v2" and first["metadata"]["git"]["repo"] == "shop-v2"


def test_record_of_a_rename_without_body(shop):
    """A rename counts under its new path only; a message without a body is its subject
    and the Files line."""
    repo, shas = shop
    move = by_name(list(read_git(repo, user="ann")), shas)["move"]
    assert move["text"] == "Move notes under docs\n\nFiles: app.py (+1 -1), docs/notes.txt (+0 -0)"
    assert move["type"] == "episodic"
    assert move["created_at"] == "2024-02-01T12:00:00+00:00"
    assert move["metadata"]["git"] | {"commit": None} == {
        "repo": "shop", "commit": None, "author": "Ann Example", "files": ["app.py", "docs/notes.txt"],
        "insertions": 1, "deletions": 1}


def test_binary_file_counts_nothing_and_no_address_is_kept(shop):
    repo, shas = shop
    add = by_name(list(read_git(repo, user="ann")), shas)["add"]
    assert add["text"] == ("Add the app\n\nFirst version of the shop.\n\nSigned-off-by: Ann Example\n\n"
                           "Files: app.py (+3 -0), logo.png (binary), notes.txt (+10 -0)")
    assert add["metadata"]["git"]["files"] == ["app.py", "logo.png", "notes.txt"]
    assert (add["metadata"]["git"]["insertions"], add["metadata"]["git"]["deletions"]) == (13, 0)
    assert add["created_at"] == "2024-01-10T09:00:00+01:00"  # the author's own offset
    assert not any("@" in repr(r) for r in read_git(repo, user="ann"))


def test_choice_with_reason_is_a_decision_and_merge_has_no_files(shop):
    repo, shas = shop
    records = by_name(list(read_git(repo, user="ann")), shas)
    sqlite, merge = records["sqlite"], records["merge"]
    assert sqlite["type"] == "decision"
    assert sqlite["text"] == ("Store orders in SQLite instead of JSON files\n\n"
                              "Two writers at once corrupted orders.json; SQLite locks the file for us.\n\n"
                              "Files: db.py (+3 -0)")
    assert sqlite["created_at"] == "2024-02-10T08:30:00-05:00"
    assert merge["text"] == "Merge branch 'storage'" and merge["type"] == "episodic"
    assert merge["metadata"]["git"] | {"commit": None} == {
        "repo": "shop", "commit": None, "author": "Ann Example", "files": [], "insertions": 0, "deletions": 0}


def test_files_line_names_thirty_then_counts_the_rest(shop):
    repo, shas = shop
    fixtures = by_name(list(read_git(repo, user="ann")), shas)["fixtures"]
    line = fixtures["text"].split("\n\n")[-1]
    assert line.startswith("Files: fixtures/order_00.json (+1 -0), ")
    assert line.endswith("fixtures/order_29.json (+1 -0), and 5 more")
    assert len(fixtures["metadata"]["git"]["files"]) == 35
    assert fixtures["metadata"]["git"]["insertions"] == 35


def test_since_max_and_rev(shop):
    repo, shas = shop

    def commits(**kwargs) -> list[str]:
        return [r["metadata"]["git"]["commit"] for r in read_git(repo, user="ann", **kwargs)]

    # A bare date is its midnight UTC: the move at 12:00 that day is in, the add is not.
    assert commits(since="2024-02-01") == [shas[n] for n in ("fixtures", "merge", "sqlite", "move")]
    assert commits(since="2024-02-01T12:00:01Z") == [shas[n] for n in ("fixtures", "merge", "sqlite")]
    # 13:30 at +02:00 is 11:30 UTC, before the move.
    assert commits(since="2024-02-01T13:30:00+02:00")[-1] == shas["move"]
    assert commits(since="2030-01-01") == []
    assert commits(max_commits=2) == [shas["fixtures"], shas["merge"]]
    assert commits(rev=shas["move"]) == [shas["move"], shas["add"]]
    assert commits(rev="storage", max_commits=1) == [shas["sqlite"]]
    assert commits(rev="HEAD~1", since="2024-02-05") == [shas["merge"], shas["sqlite"]]


def test_any_folder_inside_the_tree_and_a_bare_clone(shop, tmp_path):
    repo, shas = shop
    inside = list(read_git(repo / "docs", user="ann"))
    assert inside[0]["id"] == f"git:ann/shop:{shas['fixtures'][:12]}" and inside[0]["_source"] == str(repo)
    assert by_name(inside, shas)["move"]["metadata"]["git"]["files"] == ["app.py", "docs/notes.txt"]
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(tmp_path / "shop.git")], check=True,
                   env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"})
    bare = list(read_git(tmp_path / "shop.git", user="ann"))
    assert [r["id"] for r in bare] == [r["id"] for r in inside]
    assert bare[0]["source"] == "git:shop"


def test_stopping_early_ends_the_git_process(shop, monkeypatch):
    repo, _ = shop
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    records = read_git(repo, user="ann")
    assert next(records)["id"].startswith("git:ann/shop:")
    records.close()
    assert "log" in started[-1].args  # the rev-parse calls before it ran through subprocess.run
    assert all(proc.returncode is not None for proc in started)


def test_git_variables_of_the_caller_do_not_redirect_the_read(shop, tmp_path, monkeypatch):
    """Inside a git hook GIT_DIR names the hook's repository; the folder asked for wins."""
    repo, shas = shop
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    assert next(read_git(repo, user="ann"))["metadata"]["git"]["commit"] == shas["fixtures"]


@pytest.mark.parametrize("kwargs, name", [
    ({"since": "last week"}, "--since"),
    ({"since": "2024-13-01"}, "--since"),
    ({"since": "01/02/2024"}, "--since"),
    ({"max_commits": 0}, "--max"),
    ({"max_commits": -3}, "--max"),
    ({"rev": "no-such-branch"}, "rev"),
    ({"rev": "--all"}, "rev"),
    ({"user": ""}, "user"),
    ({"name": "my/shop"}, "repo_name"),
])
def test_bad_arguments_are_refused_before_reading(shop, kwargs, name):
    repo, _ = shop
    with pytest.raises(InvalidArgument) as raised:
        read_git(repo, **{"user": "ann", **kwargs})  # raised at the call, not at the first record
    assert raised.value.name == name


def test_a_folder_outside_any_repository_is_refused(shop, tmp_path, monkeypatch):
    repo, _ = shop
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # even if tmp is inside some repository
    for folder in (plain, tmp_path / "missing", repo / ".git", repo / "app.py"):
        with pytest.raises(InvalidArgument, match="must be a folder inside a git repository") as raised:
            read_git(folder, user="ann")
        assert raised.value.name == "source" and raised.value.received == str(folder)
        assert "git -C <folder> status" in str(raised.value)


@pytest.mark.parametrize("subject, body, expected", [
    ("Use uv instead of pip", "", True),
    ("Switch the cache to Redis", "Memcached lost keys on restart, because it keeps nothing on disk.", True),
    ("Pin numpy to 1.26", "", True),
    ("pinned ray==2.9.3", "", True),
    ("Split the parser", "Why: one file had grown past 900 lines.", True),
    ("We decided on monthly releases", "", True),
    ("Refactor: one helper instead of two copies", "No behaviour change.", False),
    ("Fix typo in README", "", False),
    ("Pinned memories rank first", "", False),
    ("Docs: comments say what and why", "", False),
    ("Add the export command", "Signed-off-by: Ann Because <ann@example.org>", False),
])
def test_is_decision(subject, body, expected):
    assert is_decision(subject, body) is expected


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="a source tree without its git history")
def test_this_repository():
    records = list(read_git(REPO, user="ann", max_commits=200))
    assert records and len({r["id"] for r in records}) == len(records)
    assert all(r["id"].startswith("git:") and r["text"] for r in records)
