"""A source tree and its git history through the whole ingest: linked in the graph,
re-read incrementally, symbols that left the tree deleted, recalled from the CLI."""

from __future__ import annotations

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
    assert {"code:shop:auth.py::check_key", "code:shop:server.py::handle_request"} <= ids
    assert not any("generated" in i for i in ids), "a .gitignore'd folder is not read"
    types = dict(zip(gen.memories.column("id").to_pylist(), gen.memories.column("type").to_pylist()))
    commits = sorted(i for i in ids if i.startswith("git:shop:"))
    assert sorted(types[c] for c in commits) == ["decision", "episodic"]
    decision = next(c for c in commits if types[c] == "decision")
    # The commit that touched server.py reaches that file's functions through the graph,
    # and a caller reaches the function it calls.
    assert _row(gen, "code:shop:server.py::start_proxy") in _two_hops(gen, _row(gen, decision))
    assert _row(gen, "code:shop:auth.py::check_key") in _two_hops(gen, _row(gen, "code:shop:server.py::handle_request"))


def test_a_tree_read_again_embeds_what_changed_and_deletes_what_left(tmp_path, repo):
    store = tmp_path / "store"
    first = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    (repo / "auth.py").write_text("\n\n" + AUTH.replace('return "k-" + user', 'return "key-" + user'))  # moved, 1 changed
    (repo / "server.py").write_text(SERVER.split("\n\ndef start_proxy")[0] + "\n")  # start_proxy removed
    second = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert second.embedded == 1, "only rotate_key's text changed"
    assert second.removed == 1 and second.total_memories == first.total_memories - 1
    gen = Generation.open_current(store)
    assert "code:shop:server.py::start_proxy" not in gen.columns.id_to_row
    with StoreDB(store) as db:
        assert db.known_hashes()["code:shop:server.py::start_proxy"][1], "marked deleted in the database"
    # A file skipped this time (no longer UTF-8) keeps its memories.
    (repo / "auth.py").write_bytes(b"def check_key(\xff):\n    pass\n")
    third = ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    assert third.removed == 0
    assert "code:shop:auth.py::check_key" in Generation.open_current(store).columns.id_to_row


def test_a_subfolder_read_whole_deletes_only_under_it(tmp_path, repo):
    (repo / "lib").mkdir()
    (repo / "lib" / "util.py").write_text("def helper_one():\n    return 1\n\n\ndef helper_two():\n    return 2\n")
    store = tmp_path / "store"
    ingest([repo], store, fmt="code", runner="local", config=_user("dev"))
    (repo / "lib" / "util.py").write_text("def helper_one():\n    return 1\n")
    report = ingest([repo / "lib"], store, fmt="code", runner="local", config=_user("dev"))
    assert report.removed == 1
    ids = Generation.open_current(store).columns.id_to_row
    assert "code:shop:lib/util.py::helper_two" not in ids and "code:shop:auth.py::check_key" in ids


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
    top = _first_id(capsys.readouterr().out)
    assert top == "code:shop:auth.py::check_key"
    assert main(["recall", "why is HAProxy opt-in?", "--store", store, "--user", "dev", "--json"]) == 0
    assert _first_id(capsys.readouterr().out).startswith("git:shop:")


def _first_id(out: str) -> str:
    import json

    return json.loads(out)["items"][0]["id"]


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
