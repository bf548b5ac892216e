"""A source tree and its git history through the whole ingest: linked in the graph,
re-read incrementally, symbols that left the tree deleted, recalled from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.run import ingest
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation

AUTH = '''"""API keys."""


def check_key(presented: str, stored: str) -> bool:
    """Whether an API key matches the stored one, in constant time."""
    import hmac

    return hmac.compare_digest(presented, stored)


def rotate_key(user: str) -> str:
    """A new key for ``user``; the old one stops working."""
    return "k-" + user
'''

SERVER = '''from auth import check_key


def handle_request(headers: dict) -> int:
    """Refuse a request whose key does not match."""
    if not check_key(headers.get("key", ""), "secret"):
        return 401
    return 200


def start_proxy(port: int) -> None:
    """Start the optional HAProxy ingress on ``port``."""
    print("haproxy", port)
'''


def _git(repo: Path, *args: str, date: str = "2025-05-01T10:00:00+00:00") -> None:
    env = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=Dana", "-c", "user.email=dana@example.com", *args],
                   check=True, capture_output=True, env=env)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "shop"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    (root / "auth.py").write_text(AUTH)
    (root / "server.py").write_text(SERVER)
    (root / ".gitignore").write_text("build/\n")
    (root / "build").mkdir()
    (root / "build" / "generated.py").write_text("def generated():\n    return 1\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "Check API keys on every request")
    (root / "server.py").write_text(SERVER.replace("print(", "print('opt-in',"))
    _git(root, "commit", "-qam", "Make the HAProxy ingress opt-in\n\nWe keep HAProxy opt-in because it needs a binary "
         "most users do not have, and handle_request works without it.", date="2025-06-01T10:00:00+00:00")
    return root


def _row(gen: Generation, memory_id: str) -> int:
    return gen.columns.id_to_row[memory_id]


def _two_hops(gen: Generation, row: int) -> set[int]:
    """The memories one entity node away from ``row`` (mention edges)."""
    g, n = gen.graph, gen.memories.num_rows
    out: set[int] = set()
    for node in g.indices[g.indptr[row]:g.indptr[row + 1]]:
        if node >= n:
            out |= {int(m) for m in g.indices[g.indptr[node]:g.indptr[node + 1]] if m < n}
    return out - {row}


def test_a_tree_and_its_commits_become_linked_memories(tmp_path, repo):
    store = tmp_path / "store"
    code = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert code.quarantined == 0 and code.accepted >= 5
    history = ingest([repo], store, fmt="git", runner="local", config=_user("dev"))
    assert history.accepted == 2
    gen = Generation.open_current(store)
    ids = set(gen.memories.column("id").to_pylist())
    assert {"code:dev/shop:auth.py::check_key", "code:dev/shop:server.py::handle_request"} <= ids
    assert not any("generated" in i for i in ids), "a .gitignore'd folder is not read"
    types = dict(zip(gen.memories.column("id").to_pylist(), gen.memories.column("type").to_pylist()))
    commits = sorted(i for i in ids if i.startswith("git:dev/shop:"))
    assert sorted(types[c] for c in commits) == ["decision", "episodic"]
    decision = next(c for c in commits if types[c] == "decision")
    # The commit that touched server.py reaches that file's functions through the graph,
    # and a caller reaches the function it calls.
    assert _row(gen, "code:dev/shop:server.py::start_proxy") in _two_hops(gen, _row(gen, decision))
    caller = _row(gen, "code:dev/shop:server.py::handle_request")
    assert _row(gen, "code:dev/shop:auth.py::check_key") in _two_hops(gen, caller)


def test_a_tree_read_again_embeds_what_changed_and_deletes_what_left(tmp_path, repo):
    store = tmp_path / "store"
    first = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    (repo / "auth.py").write_text("\n\n" + AUTH.replace('return "k-" + user', 'return "key-" + user'))  # moved, 1 changed
    (repo / "server.py").write_text(SERVER.split("\n\ndef start_proxy")[0] + "\n")  # start_proxy removed
    second = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert second.embedded == 1, "only rotate_key's text changed"
    assert second.removed == 1 and second.total_memories == first.total_memories - 1
    gen = Generation.open_current(store)
    assert "code:dev/shop:server.py::start_proxy" not in gen.columns.id_to_row
    with StoreDB(store) as db:
        assert db.known_hashes()["code:dev/shop:server.py::start_proxy"][1], "marked deleted in the database"
    # A file skipped this time (no longer UTF-8) keeps its memories.
    (repo / "auth.py").write_bytes(b"def check_key(\xff):\n    pass\n")
    third = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert third.removed == 0
    assert "code:dev/shop:auth.py::check_key" in Generation.open_current(store).columns.id_to_row


def test_a_subfolder_read_whole_deletes_only_under_it(tmp_path, repo):
    (repo / "lib").mkdir()
    (repo / "lib" / "util.py").write_text("def helper_one():\n    return 1\n\n\ndef helper_two():\n    return 2\n")
    store = tmp_path / "store"
    ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    (repo / "lib" / "util.py").write_text("def helper_one():\n    return 1\n")
    report = ingest([repo / "lib"], store, fmt="code", runner="local", config=_user("dev"))
    assert report.removed == 1
    ids = Generation.open_current(store).columns.id_to_row
    assert "code:dev/shop:lib/util.py::helper_two" not in ids and "code:dev/shop:auth.py::check_key" in ids


def test_commit_options_are_for_git_sources_only(tmp_path, repo):
    with pytest.raises(InvalidArgument, match="--since"):
        ingest([repo], tmp_path / "store", fmt="code", runner="local", since="2025-01-01")
    report = ingest([repo], tmp_path / "store", fmt="git", runner="local", config=_user("dev"), max_commits=1)
    assert report.accepted == 1


def test_the_cli_recalls_the_function_and_the_decision(tmp_path, repo, capsys):
    from helix_ray.cli import main

    store = str(tmp_path / "store")
    for fmt in ("code", "git"):
        assert main(["ingest", str(repo), "--format", fmt, "--store", store, "--user", "dev", "--runner", "local",
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["recall", "where are API keys checked?", "--store", store, "--user", "dev", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["items"][0]["id"] == "code:dev/shop:auth.py::check_key"
    assert answer["flags"]["intent"] == {"read": "code", "applied": True, "tests": False}
    assert main(["recall", "why is HAProxy opt-in?", "--store", store, "--user", "dev", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["items"][0]["id"].startswith("git:dev/shop:")
    assert answer["flags"]["intent"] == {"read": "history", "applied": True}


TEST_AUTH = '''from auth import check_key


def test_api_keys_are_checked():
    """Where API keys are checked: a wrong API key is refused, the right API key accepted."""
    assert not check_key("wrong", "secret")
    assert check_key("secret", "secret")
'''


def test_a_question_for_code_gets_the_code_before_its_tests(tmp_path, repo, capsys):
    """A test that repeats the question's words does not displace the code it tests,
    unless the question asks for tests."""
    from helix_ray.cli import main

    (repo / "tests").mkdir()
    (repo / "tests" / "test_auth.py").write_text(TEST_AUTH)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "Test the key check", date="2025-07-01T10:00:00+00:00")
    store = str(tmp_path / "store")
    assert main(["ingest", str(repo), "--format", "code", "--store", store, "--user", "dev", "--runner", "local",
                 "--no-progress"]) == 0
    capsys.readouterr()
    test_id = "code:dev/shop:tests/test_auth.py::test_api_keys_are_checked"
    for question, first, tests in [("where are API keys checked?", "code:dev/shop:auth.py::check_key", False),
                                   ("which test checks the API keys?", test_id, True)]:
        assert main(["recall", question, "--store", store, "--user", "dev", "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        ranked = [item["id"] for item in sorted(answer["items"], key=lambda item: item["rank"])]
        assert ranked[0] == first, ranked
        assert test_id in ranked and answer["flags"]["intent"] == {"read": "code", "applied": True, "tests": tests}


GATE = '''"""The gate every request passes before its body is read: where API keys are checked.

A request without a valid API key is refused (401) before any endpoint runs, and a
user's API key on an admin route is refused too (403). Keys are checked in constant time.
"""

import hmac

ADMIN_ROUTES = ("/v1/admin",)


def refusal(headers: dict, path: str, keys: dict) -> int | None:
    presented = headers.get("authorization", "").removeprefix("Bearer ")
    record = keys.get(presented[:8])
    if record is None or not hmac.compare_digest(record["sha256"], presented):
        return 401
    if path.startswith(ADMIN_ROUTES) and not record["admin"]:
        return 403
    return None
'''


def test_a_question_for_code_gets_the_function_before_its_modules_docstring(tmp_path, capsys):
    """Protects: a module memory whose docstring repeats the question's words ranking
    above the function that does it (``rank.container_share``); with the share off, the
    module comes first."""
    from helix_ray.cli import main

    repo = _make_repo(tmp_path / "gateway", {"gate.py": GATE})
    store = str(tmp_path / "store")
    assert main(["ingest", str(repo), "--format", "code", "--store", store, "--user", "dev", "--runner", "local",
                 "--no-progress"]) == 0
    off = tmp_path / "off.yaml"
    off.write_text("rank:\n  container_share: 0.0\n")
    capsys.readouterr()
    for extra, first in [((), "refusal"), (("--config", str(off)), "<module>")]:
        assert main(["recall", "where are API keys checked?", "--store", store, "--user", "dev", "--json",
                     *extra]) == 0
        answer = json.loads(capsys.readouterr().out)
        ranked = [item["id"] for item in sorted(answer["items"], key=lambda item: item["rank"])]
        assert ranked[0] == f"code:dev/gateway:gate.py::{first}", ranked


TEST_GATE = '''"""Where API keys are checked: the gate refuses a request without a valid API key."""

from gate import refusal


def test_a_wrong_api_key_is_refused():
    assert refusal({"authorization": "Bearer wrong"}, "/v1/recall", {}) == 401
'''


def test_a_test_takes_no_share_of_its_modules_score_when_the_question_is_not_about_tests(tmp_path, capsys):
    """Protects: a test function lifted above the code it tests by its test module's
    docstring; the question asks for code, so only the code it favours takes a share."""
    from helix_ray.cli import main

    repo = _make_repo(tmp_path / "gateway", {"gate.py": GATE, "test_gate.py": TEST_GATE})
    store = str(tmp_path / "store")
    assert main(["ingest", str(repo), "--format", "code", "--store", store, "--user", "dev", "--runner", "local",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["recall", "where are API keys checked?", "--store", store, "--user", "dev", "--json"]) == 0
    ranked = [item["id"] for item in sorted(json.loads(capsys.readouterr().out)["items"], key=lambda item: item["rank"])]
    code, test = "code:dev/gateway:gate.py::refusal", "code:dev/gateway:test_gate.py::test_a_wrong_api_key_is_refused"
    assert ranked.index(code) < ranked.index(test), ranked


def _cli_ingest(repo: Path, store: Path, fmt: str, *extra: str) -> int:
    from helix_ray.cli import main

    return main(["ingest", str(repo), "--format", fmt, "--store", str(store), "--runner", "local", "--no-progress",
                 "--json", *extra])


def test_two_users_ingest_one_repository_into_one_store(tmp_path, repo, capsys):
    """Ids name their user: the second user's read of the same tree and history is
    accepted whole (no id conflict), linked within that user's memories, and each user
    recalls their own memories only."""
    from helix_ray.cli import main

    store = tmp_path / "store"
    for user in ("dev", "ops"):
        for fmt in ("code", "git"):
            assert _cli_ingest(repo, store, fmt, "--user", user) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["quarantined"] == 0 and report["new"] == report["accepted"] > 0, (user, fmt, report)
    gen = Generation.open_current(store)
    ids = gen.columns.id_to_row
    for user in ("dev", "ops"):
        decision = next(i for i in ids if i.startswith(f"git:{user}/shop:")
                        and gen.memories.column("type")[ids[i]].as_py() == "decision")
        linked = {gen.memories.column("id")[r].as_py() for r in _two_hops(gen, ids[decision])}
        assert f"code:{user}/shop:server.py::start_proxy" in linked
        assert all(i.startswith((f"code:{user}/", f"git:{user}/")) for i in linked), "links stay in the tenant"
        assert main(["recall", "where are API keys checked?", "--store", str(store), "--user", user, "--json"]) == 0
        items = json.loads(capsys.readouterr().out)["items"]
        assert items[0]["id"] == f"code:{user}/shop:auth.py::check_key"
        assert all(item["id"].startswith((f"code:{user}/shop:", f"git:{user}/shop:")) for item in items)


def _make_repo(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    _git(root, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (root / rel).write_text(text)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", f"Add {', '.join(files)}")
    return root


def test_two_repositories_in_folders_of_one_name_are_kept_apart_by_their_names(tmp_path):
    billing = _make_repo(tmp_path / "work" / "app", {"invoice.py": "def total(lines):\n    return sum(lines)\n"})
    search = _make_repo(tmp_path / "home" / "app", {"index.py": "def lookup(term):\n    return [term]\n"})
    store = tmp_path / "store"
    with pytest.raises(InvalidArgument, match="one name names one repository") as raised:
        ingest([billing, search], store, fmt="code", runner="local", config=_user("dev"))
    assert raised.value.name == "repo_name"
    for folder, name in ((billing, "billing"), (search, "search")):
        assert ingest([folder], store, fmt="code", runner="local", config=_user("dev"), repo_name=name).removed == 0
        assert ingest([folder], store, fmt="git", runner="local", config=_user("dev"), repo_name=name).accepted == 1
    ids = set(Generation.open_current(store).columns.id_to_row)
    assert {"code:dev/billing:invoice.py::total", "code:dev/search:index.py::lookup"} <= ids
    assert sum(i.startswith(("git:dev/billing:", "git:dev/search:")) for i in ids) == 2


def test_a_repository_named_by_default_like_another_of_the_store_is_refused(tmp_path, capsys):
    """Protects: a second run's repository of the same folder name read whole marked the
    first's memories of its other files deleted. Refused before anything is written, for
    its code and its commits; named otherwise (``--repo-name``), both are kept."""
    billing = _make_repo(tmp_path / "work" / "app", {"invoice.py": "def total(lines):\n    return sum(lines)\n"})
    search = _make_repo(tmp_path / "home" / "app", {"index.py": "def lookup(term):\n    return [term]\n"})
    store = tmp_path / "store"
    assert ingest([billing], store, fmt="code", runner="local", config=_user("dev")).new == 1
    before = set(Generation.open_current(store).columns.id_to_row)
    for fmt in ("code", "git"):
        assert _cli_ingest(search, store, fmt, "--user", "dev") == 2
        err = capsys.readouterr().err
        assert (f"Got --repo-name='app'; that name, taken by default from the folder's, already names {billing} in "
                "this store for user dev") in err
        assert f"give it its own --repo-name; if {billing} moved to {search}, pass --repo-name app" in err
    assert set(Generation.open_current(store).columns.id_to_row) == before == {"code:dev/app:invoice.py::total"}
    assert ingest([search], store, fmt="code", runner="local", config=_user("dev"), repo_name="search").new == 1
    assert set(Generation.open_current(store).columns.id_to_row) == before | {"code:dev/search:index.py::lookup"}


def test_a_moved_repository_read_under_its_old_name_keeps_its_memories_once(tmp_path):
    app = _make_repo(tmp_path / "work" / "app", {"invoice.py": "def total(lines):\n    return sum(lines)\n"})
    store = tmp_path / "store"
    assert ingest([app], store, fmt="code", runner="local", config=_user("dev")).new == 1
    (tmp_path / "home").mkdir()
    moved = app.rename(tmp_path / "home" / "app")
    with pytest.raises(InvalidArgument, match="already names") as raised:
        ingest([moved], store, fmt="code", runner="local", config=_user("dev"))
    assert raised.value.name == "repo_name"
    report = ingest([moved], store, fmt="code", runner="local", config=_user("dev"), repo_name="app")
    assert (report.new, report.unchanged, report.removed) == (0, 1, 0), report
    assert ingest([moved], store, fmt="git", runner="local", config=_user("dev")).new == 1, "the name moved with it"
    ids = Generation.open_current(store).columns.id_to_row
    assert [i for i in ids if i.startswith("code:")] == ["code:dev/app:invoice.py::total"]


def test_memory_ingest_names_the_repository(tmp_path, repo):
    from helix_ray import Memory

    with Memory(tmp_path / "store", ingest=_user("dev"), warm=False) as mem:
        report = mem.ingest(repo, format="git", repo_name="shop-v2")
    assert report.accepted == 2
    ids = Generation.open_current(tmp_path / "store").columns.id_to_row
    assert sorted(i.rpartition(":")[0] for i in ids) == ["git:dev/shop-v2", "git:dev/shop-v2"]


@pytest.mark.parametrize("name", ["my app", "team/app", "app:v2", "", "a" * 101])
def test_a_bad_repo_name_is_refused_saying_what_a_name_may_hold(tmp_path, repo, capsys, name):
    assert _cli_ingest(repo, tmp_path / "store", "code", "--user", "dev", "--repo-name", name) == 2
    err = capsys.readouterr().err
    assert f"Got --repo-name={name!r}" in err and "each a letter, digit, '.', '_' or '-'" in err
    assert not (tmp_path / "store").exists(), "refused before the store is touched"


def test_a_tree_or_history_needs_its_user_and_repo_name_needs_a_tree_or_history(tmp_path, repo, capsys):
    for fmt in ("code", "git"):
        assert _cli_ingest(repo, tmp_path / "store", fmt) == 2
        assert "Got --user=None; code and commit memories are one user's" in capsys.readouterr().err
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "a note", "user": "dev"}\n')
    assert _cli_ingest(notes, tmp_path / "store", "jsonl", "--repo-name", "shop") == 2
    assert "--repo-name applies to --format code and --format git only" in capsys.readouterr().err


def _old_ids(repo: Path, user: str) -> list[dict]:
    """``user``'s memories of ``repo`` as a store made before ids named their user holds
    them: ``code:shop:...`` and ``git:shop:...`` (newest commit first)."""
    from helix_ray.ingest.sources import read_source, source_items

    tasks = source_items(repo, "code", user=user)[0] + source_items(repo, "git", user=user)[0]
    records = [r for t in tasks for r in read_source(t["path"], t["format"], **json.loads(t["options"]))]
    return [{**{k: v for k, v in r.items() if not k.startswith("_")}, "id": r["id"].replace(f":{user}/", ":", 1)}
            for r in records]


def test_a_store_whose_ids_do_not_name_their_user_is_renamed_by_the_next_read(tmp_path, repo):
    """Ingesting again a repository that a store made before ids named their user holds
    replaces that user's old ids with today's, so nothing is recalled twice: all of a
    tree (a symbol gone since is removed), and the commits read (one not read this time
    keeps its old id until it is). Another user's old ids stay theirs: there, dev read
    the code and the older commit, ops the newest commit (dev's read of it was refused)."""
    old = _old_ids(repo, "dev")
    newest, older = (r["id"] for r in old if r["id"].startswith("git:"))
    old = [{**r, "user": "ops"} if r["id"] == newest else r for r in old]
    old.append({**old[0], "id": "code:shop:server.py::retired", "text": "def retired():\n    pass"})
    source = tmp_path / "old.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in old))
    store = tmp_path / "store"
    assert ingest([source], store, fmt="jsonl", runner="local").accepted == len(old)
    dev_code = [r["id"] for r in old if r["id"].startswith("code:shop:")]

    code = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert (code.renamed, code.removed, code.quarantined) == (len(dev_code) - 1, 1, 0)  # removed: retired
    history = ingest([repo], store, fmt="git", runner="local", config=_user("dev"), max_commits=1)
    assert (history.new, history.renamed, history.quarantined) == (1, 0, 0), "ops's old id of it stays ops's"
    assert older in Generation.open_current(store).columns.id_to_row, "the commit not read keeps its old id"
    assert ingest([repo], store, fmt="git", runner="local", config=_user("dev")).renamed == 1
    ids = set(Generation.open_current(store).columns.id_to_row)
    assert not ids & {*dev_code, older}
    assert {i.replace(":", ":dev/", 1) for i in [*dev_code, newest, older] if "retired" not in i} <= ids
    assert newest in ids
    with StoreDB(store) as db:
        known = db.known_hashes()
        assert all(known[i][1] for i in [*dev_code, older]), "marked deleted in the database"
def _user(user: str):
    from helix_ray.config import IngestConfig

    return IngestConfig().model_copy(update={"validation": IngestConfig().validation.model_copy(
        update={"default_user": user})})


@pytest.mark.ray
def test_a_tree_reads_one_file_per_task_on_ray(tmp_path, repo):
    """On Ray Data each file is its own read task, its options (JSON text) intact."""
    import ray

    from helix_ray.runtime import ensure_ray

    started = not ray.is_initialized()
    ensure_ray()
    try:
        on_ray = ingest([repo], tmp_path / "ray", fmt="code", runner="ray", show_progress=False, config=_user("dev"))
    finally:
        if started:
            ray.shutdown()
    local = ingest([repo], tmp_path / "local", fmt="code", runner="local", config=_user("dev"))
    assert on_ray.accepted == local.accepted > 0
    a, b = Generation.open_current(tmp_path / "ray"), Generation.open_current(tmp_path / "local")
    assert a.memories.column("id").to_pylist() == b.memories.column("id").to_pylist()
    np.testing.assert_allclose(np.asarray(a.vectors), np.asarray(b.vectors), atol=1e-6)


def test_the_cli_offers_every_source_format():
    """The CLI keeps its own list (``helix --help`` imports no ingest code): the same one."""
    from helix_ray import cli
    from helix_ray.ingest import sources

    assert cli.FORMATS == sources.FORMATS
