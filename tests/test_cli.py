"""The CLI as a finished tool: --version, quarantine, doctor, exit codes that mean
something, errors that name the flag typed, one default budget for CLI and HTTP, and
quiet output: an ingest's own progress, nothing from Ray unless --verbose.

One real store (the shipped sample's memories and bad records, plus a Markdown folder
with an empty section) is built once with the real ingest (``runner="local"``); tests
that break a store break a copy of it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from helix_ray.cli import main
from tests.helpers import SAMPLE, memory, write_jsonl

NOTES = {"sub/ops.md": "---\nuser: dana\n---\n# Ops\n\n## Deploy\nRun make deploy from the release branch.\n\n## Empty\n\n"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from helix_ray.ingest.run import ingest

    folder = tmp_path_factory.mktemp("cli")
    for name, text in NOTES.items():
        (folder / "notes" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "notes" / name).write_text(text)
    report = ingest([SAMPLE / "memories.jsonl", SAMPLE / "bad_records.jsonl", folder / "notes"], folder / "store",
                    runner="local", show_progress=False)
    assert report.published and report.quarantined == 9, report
    return folder / "store"


@pytest.fixture()
def copy(store, tmp_path) -> Path:
    """A private copy of :func:`store`, to break."""
    return Path(shutil.copytree(store, tmp_path / "store"))


def helix(capsys, *args: str) -> tuple[int, str, str]:
    """``helix ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- --version


def test_version_prints_the_package_version():
    from helix_ray import __version__

    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "--version"], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout == f"helix {__version__}\n"


# --------------------------------------------------------------------------- quarantine


def test_quarantine_lists_code_sentence_file_and_position(store, capsys):
    code, out, _ = helix(capsys, "quarantine", "--store", str(store))
    assert code == 0
    bad = str(SAMPLE / "bad_records.jsonl")
    assert f"bad_time       {bad} · line 7\n" in out
    assert "created_at='not-a-date' is not a time" in out
    assert "ops.md · sub/ops.md, section 'Empty'" in out  # the file is in the position, not only the title
    assert out.splitlines()[-1].startswith("-- 9 quarantined records (in all: empty_text ×3,")


def test_quarantine_as_json_splits_reason_into_code_and_sentence(store, capsys):
    code, out, _ = helix(capsys, "quarantine", "--store", str(store), "--json")
    listed = json.loads(out)
    assert code == 0 and listed["total"] == 9 and len(listed["records"]) == 9
    markdown = [r for r in listed["records"] if r["position"].startswith("sub/ops.md")]
    assert [(r["reason"], r["sentence"], r["position"]) for r in markdown] == [
        ("empty_text", "text is empty or only whitespace", "sub/ops.md, section 'Empty'")]
    assert markdown[0]["source"].endswith("notes/sub/ops.md") and markdown[0]["quarantined_at"].endswith("Z")


def test_quarantine_filters_by_reason_and_limits(store, capsys):
    _, out, _ = helix(capsys, "quarantine", "--store", str(store), "--reason", "bad_time", "--json")
    listed = json.loads(out)
    assert listed["total"] == 1 and [r["position"] for r in listed["records"]] == ["line 7"]
    _, out, _ = helix(capsys, "quarantine", "--store", str(store), "--limit", "2")
    assert out.splitlines()[-1].startswith("-- 2 of 9 quarantined records")
    assert sum(line.startswith(("empty_text", "missing_text")) for line in out.splitlines()) == 2


def test_an_unknown_reason_names_the_reasons_the_store_holds(store, capsys):
    code, _, err = helix(capsys, "quarantine", "--store", str(store), "--reason", "late")
    assert code == 2 and err.startswith("helix quarantine: Got --reason='late'; the reason codes this store holds "
                                        "are empty_text, ")
    assert "bad_time" in err and "wrong_type" in err
    code, _, err = helix(capsys, "quarantine", "--store", str(store), "--limit", "0")
    assert code == 2 and "Got --limit=0" in err


def test_markdown_positions_name_the_file_and_ids_stay(tmp_path):
    from helix_ray.ingest.sources import read_markdown

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ops.md").write_text(NOTES["sub/ops.md"])
    rows = list(read_markdown(tmp_path))
    top = tmp_path.name
    assert [(r["_md_section"], r["_position"]) for r in rows] == [
        (f"{top}/sub/ops.md#deploy", "sub/ops.md, section 'Deploy'"),
        (f"{top}/sub/ops.md#empty", "sub/ops.md, section 'Empty'")]
    (single,) = [r for r in read_markdown(tmp_path / "sub" / "ops.md") if r["text"]]
    assert (single["_md_section"], single["_position"]) == ("sub/ops.md#deploy", "ops.md, section 'Deploy'")


# --------------------------------------------------------------------------- doctor


def test_doctor_passes_a_healthy_store(store, capsys):
    code, out, err = helix(capsys, "doctor", "--store", str(store))
    assert code == 0 and not err
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["ok", name] for name in ("folder", "database", "current", "manifest", "files", "keys")]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shorten(path: Path) -> None:
    import numpy as np

    np.save(path, np.load(path)[:10])


def _manifest_version(store: Path) -> None:
    path = store / "generations" / "000001" / "manifest.json"
    path.write_text(path.read_text().replace('"format_version": 1', '"format_version": 99'))


@pytest.mark.parametrize("damage, name, says", [
    (lambda s: _truncate(s / "generations" / "000001" / "vectors.f16.npy"), "files", "vectors.f16.npy does not read"),
    (lambda s: (s / "generations" / "000001" / "graph" / "types.npy").unlink(), "files", "graph/types.npy is missing"),
    (lambda s: _shorten(s / "generations" / "000001" / "minhash.npy"), "files",
     "minhash.npy has 10 rows; the manifest implies 204"),
    (lambda s: (s / "CURRENT").write_text("7\n"), "current", "CURRENT names generation 7, but"),
    (lambda s: (s / "CURRENT").write_text("seven\n"), "current", "CURRENT holds 'seven\\n'"),
    (_manifest_version, "manifest", "format_version 99 (this Helix reads 1 and 2)"),
    (lambda s: (s / "helix.duckdb").write_bytes(b"not a database" * 100), "database", "does not open"),
    (lambda s: (s / "helix.duckdb").unlink(), "database", "helix.duckdb is missing"),
    (lambda s: (s / "keys.json").write_text("{\"keys\": 3}"), "keys", "keys.json is not a Helix key list"),
])
def test_doctor_names_each_problem_and_how_to_fix_it(copy, capsys, damage, name, says):
    damage(copy)
    code, out, err = helix(capsys, "doctor", "--store", str(copy))
    problem = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert code == 1 and len(problem) == 1 and problem[0].split()[1] == name and says in problem[0], out
    fix = out.splitlines()[out.splitlines().index(problem[0]) + 1]
    assert fix.strip().startswith("fix: ") and err == f"helix doctor: 1 problem in {copy}.\n"


def test_doctor_wants_keys_readable_by_their_owner_only(copy, capsys):
    from helix_ray.store.keys import KeyStore

    KeyStore(copy).create("dana")
    assert helix(capsys, "doctor", "--store", str(copy))[0] == 0
    os.chmod(copy / "keys.json", 0o644)
    code, out, _ = helix(capsys, "doctor", "--store", str(copy))
    assert code == 1 and "PROBLEM  keys      keys.json has mode 0644" in out and f"chmod 600 {copy}/keys.json" in out


@contextlib.contextmanager
def database_held(store: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``store``'s DuckDB file open (read-write) while the block runs."""
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; "
                               f"c = duckdb.connect({str(store / 'helix.duckdb')!r}); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.communicate("", timeout=30)


def test_doctor_says_a_running_process_holds_the_database(copy, capsys):
    with database_held(copy) as holder:
        code, out, _ = helix(capsys, "doctor", "--store", str(copy))
    assert code == 1 and f"helix.duckdb is held by process {holder.pid} (a running `helix serve`" in out
    assert "ok       files" in out  # the checks that do not need the database still ran


def test_recall_from_a_store_another_process_holds_says_how_to_ask_it(copy, capsys):
    with database_held(copy):
        code, out, err = helix(capsys, "recall", "NATS", "--store", str(copy), "--user", "dana")
    assert code != 0 and out == ""
    assert f"Cannot recall from {copy}: another process holds its database" in err
    assert "`POST /v1/recall`" in err and "`helix mcp --server URL --key KEY`" in err


def test_add_then_recall_then_delete_from_the_command_line(copy, capsys, monkeypatch):
    """`helix add` writes one memory through the Writer: the next `helix recall` (another
    Memory, as another process would open) finds it; `helix delete` of another user's id
    is refused, of the owner's removes it; a text from stdin longer than a chunk is
    stored as chunks; an empty text is refused with what to give."""
    fact = "The staging cluster's TLS certificates renew on the third day of each month."
    code, out, _ = helix(capsys, "add", fact, "--store", str(copy), "--user", "dana", "--type", "procedural",
                         "--json")
    assert code == 0
    memory_id = json.loads(out)["ids"][0]
    asked = ("recall", "when do the staging TLS certificates renew?", "--store", str(copy), "--user", "dana", "--json")
    code, out, _ = helix(capsys, *asked)
    found = {i["id"]: i for i in json.loads(out)["items"]}
    assert code == 0 and memory_id in found and found[memory_id]["type"] == "procedural"
    code, _, err = helix(capsys, "delete", memory_id, "--store", str(copy), "--user", "lee")
    assert code == 2 and memory_id in err
    code, out, _ = helix(capsys, "delete", memory_id, "--store", str(copy), "--user", "dana")
    assert code == 0 and out.startswith(f"deleted {memory_id}")
    code, out, _ = helix(capsys, *asked)
    assert memory_id not in {i["id"] for i in json.loads(out)["items"]}

    long_note = "\n\n".join(f"Paragraph {n}: the ledger service settles payouts in batches. " * 12 for n in range(8))
    monkeypatch.setattr(sys, "stdin", io.StringIO(long_note))
    code, out, _ = helix(capsys, "add", "-", "--store", str(copy), "--user", "dana", "--id", "ledger-notes")
    assert code == 0 and out.startswith("added ledger-notes: recallable now")
    code, out, _ = helix(capsys, "recall", "how does the ledger settle payouts?", "--store", str(copy), "--user",
                         "dana", "--json")
    assert code == 0 and any(i["id"].startswith("ledger-notes#chunk") for i in json.loads(out)["items"])
    code, out, _ = helix(capsys, "add", "The ledger settles payouts daily.", "--store", str(copy), "--user", "dana",
                         "--id", "ledger-notes")
    assert code == 0 and out.startswith("replaced ledger-notes (its earlier version is gone): recallable now")
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    code, _, err = helix(capsys, "add", "-", "--store", str(copy), "--user", "dana")
    assert code == 2 and "give the memory's text" in err
    code, _, err = helix(capsys, "delete", memory_id, "--store", str(copy.parent / "typo"), "--user", "dana")
    assert code == 2 and "does not exist" in err and not (copy.parent / "typo").exists()


def test_add_to_a_store_another_process_holds_says_how_to_write_there(copy, capsys):
    with database_held(copy):
        code, _, err = helix(capsys, "add", "a note", "--store", str(copy), "--user", "dana")
    assert code != 0 and f"Cannot add a memory in {copy}: another process holds its database" in err
    assert "`POST /v1/memories`" in err


def test_a_recall_narrowed_to_nothing_says_which_flags_narrowed_it(store, capsys):
    code, out, err = helix(capsys, "recall", "how do I rotate the API keys", "--store", str(store), "--user", "dana",
                           "--project", "nope", "--type", "decision")
    assert code == 0 and out == "(no memories matched)\n"
    assert err == ("helix recall: no memory of user 'dana' matched within --project nope, --type decision; leave "
                   "them out to search all.\n")


def test_recall_and_stats_refuse_a_folder_that_is_not_a_store(tmp_path, capsys):
    """They read a store: a folder without one is a mistyped --store, and is left as it was."""
    (tmp_path / "notes").mkdir()
    for args in (("recall", "anything", "--user", "dana"), ("stats",)):
        code, _, err = helix(capsys, *args, "--store", str(tmp_path / "notes"))
        assert code == 2 and "holds no helix.duckdb: it is not a Helix store" in err, err
        code, _, err = helix(capsys, *args, "--store", str(tmp_path / "typo"))
        assert code == 2 and "does not exist" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "notes"] and not any((tmp_path / "notes").iterdir())


def test_stats_of_a_store_another_process_holds_says_how_to_read_them(copy, capsys):
    with database_held(copy):
        code, _, err = helix(capsys, "stats", "--store", str(copy))
    assert code != 0 and f"Cannot read the stats of {copy}: another process holds its database" in err
    assert "`GET /v1/stats`" in err


def test_stats_lines_up_its_counts(copy, capsys):
    code, out, _ = helix(capsys, "stats", "--store", str(copy))
    lines = out.splitlines()
    assert code == 0 and any(line.strip().startswith("pending_writes: ") for line in lines)
    assert len({line.index(": ") for line in lines}) == 1, out
    by_user = next(line for line in lines if line.strip().startswith("by_user: "))
    assert json.loads(by_user.split(": ", 1)[1])["dana"] > 0  # nested counts as JSON, not Python's repr


def test_compact_says_what_it_folded(copy, capsys):
    assert helix(capsys, "add", "Kite retries three times.", "--store", str(copy), "--user", "dana")[0] == 0
    code, out, _ = helix(capsys, "compact", "--store", str(copy))
    assert code == 0 and re.fullmatch(r"published generation 2: folded 1 write and 0 deletions, 0 left in the "
                                      r"delta, in [0-9.]+ s\n", out), out
    code, out, _ = helix(capsys, "compact", "--store", str(copy))
    assert code == 0 and out == "nothing to compact: generation 2 stays\n"
    code, _, err = helix(capsys, "compact", "--store", str(copy.parent / "typo"))
    assert code == 2 and "does not exist" in err and not (copy.parent / "typo").exists()


def test_doctor_on_a_missing_folder(tmp_path, capsys):
    code, out, _ = helix(capsys, "doctor", "--store", str(tmp_path / "nope"))
    assert code == 1 and out.startswith(f"PROBLEM  folder    {tmp_path / 'nope'} is missing")
    assert not (tmp_path / "nope").exists()


# --------------------------------------------------------------------------- exit codes and flags


def test_an_ingest_that_accepts_nothing_exits_1_and_says_why(tmp_path, capsys):
    code, _, err = helix(capsys, "ingest", str(SAMPLE / "bad_records.jsonl"), "--store", str(tmp_path / "a"),
                         "--runner", "local", "--no-progress")
    assert code == 1 and err == (f"helix ingest: accepted nothing: all 8 records were quarantined; `helix quarantine "
                                 f"--store {tmp_path / 'a'}` lists them with their reasons.\n")
    (tmp_path / "empty.jsonl").write_text("")
    code, out, err = helix(capsys, "ingest", str(tmp_path / "empty.jsonl"), "--store", str(tmp_path / "b"),
                           "--runner", "local", "--json")
    assert code == 1 and json.loads(out)["read"] == 0 and "accepted nothing: the sources held no records" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "ops.md").write_text("# Ops\n\n## Deploy\nRun make deploy.\n\n## Rollback\nRun make undo.\n")
    code, _, err = helix(capsys, "ingest", str(tmp_path / "notes"), "--store", str(tmp_path / "c"), "--runner", "local",
                         "--no-progress")
    assert code == 1 and err == ("helix ingest: accepted nothing: none of the 2 records names its user: pass --user "
                                 "NAME (or give each record a user; in a Markdown file, a front matter line `user: "
                                 "NAME`).\n")


def test_an_ingest_that_accepts_something_exits_0(store, tmp_path, capsys):
    """The same records again are accepted (unchanged): not an ingest that accepted nothing."""
    shutil.copytree(store, tmp_path / "store")
    code, _, err = helix(capsys, "ingest", str(SAMPLE / "memories.jsonl"), "--store", str(tmp_path / "store"),
                         "--runner", "local", "--no-progress")
    assert code == 0 and not err


def test_a_recall_for_a_user_without_memories_says_so(store, capsys):
    code, out, err = helix(capsys, "recall", "why NATS", "--store", str(store), "--user", "dnaa")
    assert code == 0 and out == "(no memories matched)\n"
    assert err.startswith(f"helix recall: user 'dnaa' has no memories in generation 1 of {store}; check --user")
    code, out, err = helix(capsys, "recall", "why NATS", "--store", str(store), "--user", "dana", "--json")
    assert code == 0 and json.loads(out)["items"] and not err


def test_errors_name_the_flag_typed(store, capsys):
    for args, says in [(("--budget", "0"), "Got --budget=0; it must be a whole number of tokens > 0"),
                       (("--k", "0"), "Got --k=0; it must be a whole number from 1 to 200"),
                       (("--since", "yesterday"), "Got --since='yesterday'; it must be an ISO-8601 time"),
                       (("--project", " "), "Got --project=' '")]:
        code, _, err = helix(capsys, "recall", "why NATS", "--store", str(store), "--user", "dana", *args)
        assert code == 2 and err.startswith(f"helix recall: {says}"), err
    code, _, err = helix(capsys, "recall", " ", "--store", str(store), "--user", "dana")
    assert code == 2 and "Got query=' '" in err  # the positional keeps its name


# --------------------------------------------------------------------------- one default budget


def test_cli_and_http_default_to_the_settings_budget(store, tmp_path, capsys):
    from helix_ray.config import DEFAULT_BUDGET_TOKENS, RetrievalConfig
    from helix_ray.serve.api import RecallRequest

    assert RetrievalConfig().default_budget_tokens == DEFAULT_BUDGET_TOKENS
    schema = RecallRequest.model_json_schema()
    assert schema["required"] == ["query"] and f"{DEFAULT_BUDGET_TOKENS})" in \
        schema["properties"]["budget_tokens"]["description"]
    assert RecallRequest(query="x").budget_tokens is None  # the ingress then takes default_budget_tokens
    _, out, _ = helix(capsys, "recall", "why NATS", "--store", str(store), "--user", "dana", "--json")
    assert json.loads(out)["budget_tokens"] == DEFAULT_BUDGET_TOKENS
    (tmp_path / "retrieval.yaml").write_text("default_budget_tokens: 77\n")
    _, out, _ = helix(capsys, "recall", "why NATS", "--store", str(store), "--user", "dana", "--json",
                      "--config", str(tmp_path / "retrieval.yaml"))
    assert json.loads(out)["budget_tokens"] == 77 and json.loads(out)["total_tokens"] <= 77


def test_config_errors_name_the_flag_and_the_file(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("foo: 1\n")
    code, _, err = helix(capsys, "ingest", str(SAMPLE / "bad_records.jsonl"), "--store", str(tmp_path / "s"),
                         "--runner", "local", "--config", str(tmp_path / "bad.yaml"))
    assert code == 2 and err.startswith(f"helix ingest: Got --config='{tmp_path / 'bad.yaml'}'; it is not valid: foo: ")
    code, _, err = helix(capsys, "serve", "--store", str(tmp_path / "s"), "--retrieval-config", str(tmp_path / "no.yaml"))
    assert code == 2 and err == (f"helix serve: Got --retrieval-config='{tmp_path / 'no.yaml'}'; it must be an "
                                 "existing YAML file.\n")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_serve_refuses_no_auth_on_an_address_other_machines_reach(tmp_path, capsys, host):
    """Protects: a keyless server is never exposed; refused before Ray starts (no store made)."""
    code, _, err = helix(capsys, "serve", "--store", str(tmp_path / "s"), "--host", host, "--no-auth")
    assert code == 2 and err.startswith(f"helix serve: Got --host={host!r}; a server without API keys (--no-auth) "
                                        "binds a loopback address only"), err
    assert "drop --no-auth" in err and not (tmp_path / "s").exists()


def test_loopback_names_and_addresses():
    from helix_ray.runtime import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.0.2.7", "", "no such host.invalid"))


# --------------------------------------------------------------------------- quiet output and progress

#: The shapes of what Ray prints: its Python loggers, its C++ core ("[... E pid tid]
#: core_worker.cc"), its workers' output ("(raylet) ..."), Ray Data's plans and progress,
#: its warnings, and colour codes.
RAY_SHAPES = [re.compile(p) for p in (
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+(DEBUG|INFO|WARNING|ERROR|CRITICAL) ",
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\]",
    r"^\(\w[^)]*\) ",
    r"Running Dataset|Execution plan|execution finished|row/s\]|Progress bars|object store|Warning:|Token authentication",
    "\x1b\\[",
)]

#: A small source: three memories and a record without text (quarantined).
TEXTS = ("We chose NATS JetStream over Kafka for the event bus: one binary, no ZooKeeper.",
         "Rotate the API keys with `make rotate-keys`; the old ones stay valid for a day.",
         "The staging database is reset every Monday at 06:00 UTC from the nightly snapshot.")


def _source(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "small.jsonl", [memory(i, t) for i, t in enumerate(TEXTS)] + [{"user": "dana"}])


def _ray_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(shape.search(line) for shape in RAY_SHAPES)]


def _stage_lines(err: str) -> list[str]:
    return [re.sub(r" \(\d+\.\d s\)$", " (T)", line) for line in err.splitlines()]


def test_an_ingest_off_a_terminal_prints_a_line_per_stage_and_its_report(tmp_path, capsys):
    """Not on a terminal (a pipe, a log file), ingest shows one plain line per stage on
    stderr and its report on stdout: nothing else."""
    store = str(tmp_path / "store")
    code, out, err = helix(capsys, "ingest", str(_source(tmp_path)), "--store", store, "--runner", "local")
    assert code == 0 and not _ray_lines(out + err)
    assert _stage_lines(err) == ["read + validate: 4 records, 1 quarantined (T)",
                                 "dedup: 3 new, 0 updated, 0 unchanged, 0 dropped as near-duplicates (T)",
                                 "embed: 3 embedded (T)",
                                 "assemble: 3 memories (T)",
                                 "publish: generation 1 (T)"]
    assert out.splitlines()[:2] == ["read 4 records: 3 accepted, 1 quarantined",
                                    "  new 3, updated 0, unchanged 0, dropped as near-duplicates 0, embedded 3"]
    assert "generation 1: published, 3 memories" in out
    code, out, err = helix(capsys, "ingest", str(_source(tmp_path)), "--store", store, "--runner", "local")
    assert code == 0 and _stage_lines(err) == ["read + validate: 4 records, 1 quarantined (T)",
                                               "dedup: 0 new, 0 updated, 3 unchanged, 0 dropped as near-duplicates (T)"]
    assert "generation 1: unchanged (nothing new), 3 memories" in out


def test_an_ingest_that_accepts_nothing_shows_its_stages_then_says_why(tmp_path, capsys):
    code, out, err = helix(capsys, "ingest", str(SAMPLE / "bad_records.jsonl"), "--store", str(tmp_path / "a"),
                           "--runner", "local")
    assert code == 1 and "no generation: nothing to publish, 0 memories" in out
    assert _stage_lines(err) == ["read + validate: 8 records, 8 quarantined (T)",
                                 "dedup: 0 new, 0 updated, 0 unchanged, 0 dropped as near-duplicates (T)",
                                 "helix ingest: accepted nothing: all 8 records were quarantined; `helix quarantine "
                                 f"--store {tmp_path / 'a'}` lists them with their reasons."]


def test_verbose_is_taken_by_the_commands_that_may_start_ray(tmp_path, capsys, monkeypatch):
    from helix_ray import runtime
    from helix_ray.cli import _parser

    monkeypatch.setattr(runtime, "_ray_output", False)  # process-wide: put back after the test
    for argv in (["ingest", "x", "--store", "s", "-v"], ["compact", "--store", "s", "--verbose"], ["demo", "-v"],
                 ["serve", "--store", "s", "--verbose"]):
        assert _parser().parse_args(argv).verbose, argv
    assert not _parser().parse_args(["ingest", "x", "--store", "s"]).verbose
    code, _, _ = helix(capsys, "ingest", str(SAMPLE / "bad_records.jsonl"), "--store", str(tmp_path / "a"),
                       "--runner", "local", "--verbose")
    assert code == 1 and runtime.ray_output_shown()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frames(text: str) -> list[str]:
    return [frame for frame in text.rstrip("\n").split("\r\x1b[K") if frame]


def test_on_a_terminal_an_ingest_draws_one_bar(monkeypatch):
    """One line, redrawn in place, that only moves forward and ends done at 100 %."""
    from helix_ray import runtime
    from helix_ray.ingest.progress import shown
    from helix_ray.ingest.run import IngestReport

    monkeypatch.setattr(runtime, "_ray_output", False)
    monkeypatch.setenv("TERM", "xterm")
    report = IngestReport(read=4, accepted=3, quarantined=1, new=3, embedded=3, total_memories=3)
    terminal = _Terminal()
    with shown(report, True, terminal) as progress:
        for name in ("ray_start", "read_validate", "dedup", "expand_embed_annotate"):
            progress.stage(name)
        progress.advance(3)
        for name in ("assemble", "publish", "record"):
            progress.stage(name)
        report.generation, report.published = 1, True
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = _frames(text)
    percents = [int(re.search(r"(\d+)%", frame).group(1)) for frame in frames]  # type: ignore[union-attr]
    assert percents == sorted(percents) and percents[0] == 0
    assert any(frame.startswith("embed ") and "3/3 rows" in frame for frame in frames)
    assert frames[-1].startswith("done ") and " 100%" in frames[-1]

    terminal = _Terminal()
    with pytest.raises(RuntimeError), shown(IngestReport(), True, terminal) as progress:
        progress.stage("read_validate")
        raise RuntimeError("a source went away")
    assert _frames(terminal.getvalue())[-1].startswith("failed ")

    monkeypatch.setattr(runtime, "_ray_output", True)  # Ray writes lines of its own: no bar to tear
    terminal = _Terminal()
    with shown(IngestReport(read=2), True, terminal) as progress:
        progress.stage("read_validate")
    assert _stage_lines(terminal.getvalue()) == ["read + validate: 2 records, 0 quarantined (T)"]


@pytest.mark.ray
def test_an_ingest_on_ray_prints_only_its_own_lines(tmp_path):
    """`helix ingest --runner ray` as a user runs it (a local Ray of its own), its output
    a pipe: the stage lines and the report, not a line from Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "ingest", str(_source(tmp_path)), "--store",
                           str(tmp_path / "store"), "--runner", "ray"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _ray_lines(done.stdout + done.stderr), done.stderr
    assert _stage_lines(done.stderr) == ["start Ray: ready (T)",
                                         "read + validate: 4 records, 1 quarantined (T)",
                                         "dedup: 3 new, 0 updated, 0 unchanged, 0 dropped as near-duplicates (T)",
                                         "embed: 3 embedded (T)",
                                         "assemble: 3 memories (T)",
                                         "publish: generation 1 (T)"], done.stderr
    assert "generation 1: published, 3 memories" in done.stdout


def test_a_key_that_expires_is_refused_from_then_on(tmp_path, capsys, monkeypatch):
    import datetime as dt

    from helix_ray.cli import main
    from helix_ray.errors import Unauthorized
    from helix_ray.store import keys as keys_mod

    store = tmp_path / "store"
    assert main(["keys", "list", "--store", str(store)]) == 2  # a mistyped store: said, not an empty list
    assert f"Store {store} does not exist" in capsys.readouterr().err
    store.mkdir()
    assert main(["keys", "list", "--store", str(store)]) == 0
    assert capsys.readouterr().err.startswith(f"helix keys: store {store} has no keys")
    assert main(["keys", "create", "--store", str(store), "--user", "dana", "--expires", "12h"]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert "valid until" in out.err
    assert main(["keys", "list", "--store", str(store)]) == 0
    assert "expires=" in capsys.readouterr().out
    store_keys = keys_mod.KeyStore(store)
    assert store_keys.user_for(key) == "dana"  # valid now
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=12, seconds=1)
    monkeypatch.setattr(keys_mod, "_now", lambda: later)
    with pytest.raises(Unauthorized, match=r"expired at .*helix keys create"):
        store_keys.user_for(key)
    # a key without --expires is valid until revoked
    forever, _ = store_keys.create("lee")
    assert store_keys.user_for(forever) == "lee"
    assert main(["keys", "create", "--store", str(store), "--user", "dana", "--expires", "soon"]) == 2
    assert "Got --expires='soon'" in capsys.readouterr().err


def test_a_recall_on_a_terminal_lists_the_best_memory_first():
    """The packed order puts the best at both ends for an agent's context; a person reads
    top-down, so the terminal lists by rank, and says the context's order differs."""
    from helix_ray.cli_common import format_answer

    def item(i: str, rank: int) -> dict:
        return {"id": i, "type": "semantic", "rank": rank, "score": 1.0 / rank, "n_tokens": 5, "truncated": False,
                "text": f"text of {i}", "created_at": "2025-03-18T14:02:11+00:00"}

    answer = {"items": [item("a", 1), item("c", 3), item("b", 2)], "flags": {}, "timings_ms": {"total": 1.0},
              "total_tokens": 15, "budget_tokens": 100, "generation": 1}
    lines = format_answer(answer).splitlines()
    assert [line.split()[0:2] for line in lines if line.startswith("[")] == [["[1]", "a"], ["[2]", "b"], ["[3]", "c"]]
    assert lines[0] == "[1] a · semantic · 2025-03-18 14:02 · score 1.000 · 5 tok"
    assert "best at both ends" in lines[-1]


def test_a_recall_says_which_ranks_the_budget_left_out(store, capsys):
    """Items ranked but left out to keep within the token budget are counted in the
    flags, and the terminal names their ranks, so a gap in the numbering is explained."""
    args = ("recall", "how do I rotate the API keys", "--store", str(store), "--user", "dana", "--budget", "60")
    code, out, _ = helix(capsys, *args, "--json", "--explain")
    assert code == 0
    answer = json.loads(out)
    over = answer["flags"]["over_budget"]
    assert over >= 1 and over == [row["dropped_by"] for row in answer["explain"]].count("budget")
    code, out, _ = helix(capsys, *args)
    shown = {item["rank"] for item in answer["items"]}
    missing = [r for r in range(1, len(shown) + over + 1) if r not in shown]
    assert code == 0 and len(missing) == over
    assert f"{', '.join(map(str, missing))} did not fit the 60-token budget" in out.splitlines()[-1]
    code, out, _ = helix(capsys, *args, "--explain")  # no time in the question: no window column to show
    assert code == 0 and "dropped_by" in out and "window_rank" not in out


def test_a_reader_that_goes_away_ends_the_command_quietly(store):
    """`helix stats | head -1`: the pipe closed before helix writes ends it as SIGPIPE
    ends a Unix tool (exit 141), without a traceback."""
    reader, writer = os.pipe()
    os.close(reader)  # gone before helix writes a byte
    try:
        done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "stats", "--store", str(store)], stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_the_ingest_report_names_the_nodes_that_shared_the_knn_searches():
    from helix_ray.cli_common import format_report
    from helix_ray.ingest.run import IngestReport

    report = IngestReport(read=3, accepted=3, new=3, generation=1, published=True, total_memories=3,
                          work_units={"fb72f273" + "0" * 48: 6})
    assert "units of work" not in format_report(report)  # one node: nothing to tell
    report.work_units["a671aae8" + "0" * 48] = 4
    assert "  units of work per node: fb72f273 6, a671aae8 4" in format_report(report).splitlines()


def test_a_recall_takes_the_moment_it_is_asked_and_the_turns_before_it(store, capsys):
    """--now reads "last week" against the day given (default: the clock); each --context
    turn is embedded and searched apart from the query (its timings say so)."""
    args = ("recall", "and what broke last week?", "--store", str(store), "--user", "dana", "--json")
    code, out, _ = helix(capsys, *args, "--now", "2025-03-25", "--context", "why did we pin uvicorn?")
    answer = json.loads(out)
    assert code == 0 and answer["flags"]["time"]["window"]["core_start"].startswith("2025-03-17")
    assert "embed_context" in answer["timings_ms"]
    code, out, _ = helix(capsys, *args)
    answer = json.loads(out)
    assert code == 0 and answer["flags"]["time"]["window"]["core_start"] > "2026"
    assert "embed_context" not in answer["timings_ms"]
    code, _, err = helix(capsys, *args, "--now", "last tuesday")
    assert code == 2 and err.startswith("helix recall: Got --now='last tuesday'"), err


def test_a_recall_in_a_terminal_says_how_it_read_the_time_and_dates_each_memory(store, capsys):
    """The text answer shows the window a time expression was read as, and says so when
    no candidate falls in it (the window then changed nothing: a question asked on
    another day needs --now); each memory shows when it was made."""
    args = ("recall", "and what broke last week?", "--store", str(store), "--user", "dana")
    code, out, _ = helix(capsys, *args, "--now", "2025-03-25")
    read = [line for line in out.splitlines() if line.startswith("-- time:")]
    assert code == 0 and len(read) == 1 and read[0].startswith("-- time: 'last week' read as 2025-03-17 – 2025-03-23; "
                                                                "it raised "), out
    assert re.search(r"^\[1\] \S+ · \w+ · 2025-\d\d-\d\d \d\d:\d\d · score ", out, re.M), out
    code, out, _ = helix(capsys, *args, "--now", "2031-06-12")
    assert code == 0 and "-- time: 'last week' read as 2031-06-02 – 2031-06-08; no candidate was made in it" in out
    # Asked in Berlin: the days are Berlin's, not those of the window's UTC bounds.
    code, out, _ = helix(capsys, *args, "--now", "2025-06-10T09:00:00+02:00", "--json")
    assert code == 0 and json.loads(out)["flags"]["time"]["window"]["core_start"] == "2025-06-02T00:00:00+02:00"
    code, out, _ = helix(capsys, *args, "--now", "2025-06-10T09:00:00+02:00")
    assert code == 0 and "-- time: 'last week' read as 2025-06-02 – 2025-06-08" in out, out
    code, out, _ = helix(capsys, "recall", "how do I rotate the API keys", "--store", str(store), "--user", "dana")
    assert code == 0 and "-- time:" not in out


def test_each_commands_help_says_what_it_does():
    """`helix CMD --help` heads with the line `helix --help` lists CMD by, nested
    commands (`helix keys create`) too."""
    import argparse

    from helix_ray.cli import _parser

    def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for listed in action._choices_actions:
                    yield (*path, listed.dest), listed.help, action.choices[listed.dest]
                    yield from commands(action.choices[listed.dest], (*path, listed.dest))

    found = list(commands(_parser()))
    assert {path for path, _, _ in found} >= {("mcp",), ("ingest",), ("keys",), ("keys", "create")}
    for path, listed, parser in found:
        description = " ".join(parser.format_help().split("\n\n")[1].split())
        assert description.lower().startswith(listed.lower()), path


def test_a_journal_of_dated_headings_answers_a_question_about_a_day(tmp_path, capsys):
    """Notes under dated headings are stored as of those days, so a question naming a time
    finds the entry of that time among entries that say nearly the same thing."""
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "queue.md").write_text(
        "# Queue log\n\n## 2024-02-01\n\nSet the queue retry limit to 8 after the Redis outage.\n\n"
        "## 2024-04-12\n\nLowered the queue retry limit to 3 to cut duplicate emails.\n\n"
        "## 2024-05-03\n\nRaised the queue retry limit to 5 for the payment worker.\n")
    store = tmp_path / "store"
    code, _, err = helix(capsys, "ingest", str(journal), "--store", str(store), "--user", "dev", "--runner", "local",
                         "--no-progress")
    assert code == 0, err
    code, out, _ = helix(capsys, "recall", "what did we set the queue retry limit to in early May 2024?", "--store",
                         str(store), "--user", "dev", "--now", "2024-06-01T09:00:00+00:00", "--json")
    answer = json.loads(out)
    assert code == 0 and answer["flags"]["time"]["window"]["expression"] == "in early May 2024"
    best = min(answer["items"], key=lambda i: i["rank"])
    assert "limit to 5" in best["text"] and best["created_at"].startswith("2024-05-03T12:00:00")
    assert {i["created_at"][:10] for i in answer["items"]} <= {"2024-02-01", "2024-04-12", "2024-05-03"}


def test_recall_says_when_no_memory_is_about_the_question(store, capsys):
    """flags.match gives the closest candidate's cosine; below dense.weak_match_below the
    text output says the store likely holds nothing on the question's topic."""
    code, out, _ = helix(capsys, "recall", "best hiking trails in Patagonia", "--store", str(store), "--user",
                         "dana", "--json")
    match = json.loads(out)["flags"]["match"]
    assert code == 0 and match["weak"] and match["cosine"] < match["below"] == 0.64
    code, out, _ = helix(capsys, "recall", "best hiking trails in Patagonia", "--store", str(store), "--user", "dana")
    assert code == 0 and "-- weak match: the closest memory's cosine with the question is 0." in out
    code, out, _ = helix(capsys, "recall", "how do I rotate the API keys", "--store", str(store), "--user", "dana")
    assert code == 0 and "weak match" not in out


def test_the_weak_match_reads_the_encoders_own_vectors_under_a_query_adapter(copy):
    """A query adapter moves the query vector away from the encoder's, which the
    threshold was set on: the flag reads the encoder's own vector (and a follow-up's
    context turns'), so an adapter that scrambles the vectors changes no verdict."""
    import numpy as np

    from helix_ray import Memory
    from helix_ray.config import IngestConfig
    from helix_ray.embedder import DIM
    from helix_ray.recall.adapter import QueryAdapter

    asked = [("best hiking trails in Patagonia", None), ("how are credentials for the API rotated?", None),
             ("and how long does the old one keep working?", ["how do I rotate the API keys?"])]

    def verdicts() -> list[tuple[bool, bool]]:
        with Memory(copy, warm=False, compact_interval_s=None) as mem:
            flags = [mem.recall(q, user="dana", context=c).flags for q, c in asked]
        return [(bool(f.get("query_adapter")), f["match"]["weak"]) for f in flags]

    assert verdicts() == [(False, True), (False, False), (False, False)]
    rotation, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((DIM, DIM)))
    QueryAdapter(rotation.astype(np.float32), IngestConfig().embedder.name, 1.0, 10).save(copy)
    assert verdicts() == [(True, True), (True, False), (True, False)]


def test_the_weak_match_reads_a_follow_up_by_its_context_and_names_a_narrowed_scope(store):
    """A follow-up ("and how long…?") is about what its context turns are about: not a
    weak match when they find the topic. Within a narrowed scope (a project), a weak
    match speaks of the scope, not the whole store."""
    from helix_ray import Memory
    from helix_ray.recall.result import weak_match_note

    follow_up = "and how long does the old one keep working?"
    with Memory(store, warm=False, compact_interval_s=None) as mem:
        alone = mem.recall(follow_up, user="dana").flags["match"]
        asked = mem.recall(follow_up, user="dana", context=["how do I rotate the API keys?"]).flags["match"]
        assert alone["weak"] and not asked["weak"] and asked["cosine"] > alone["cosine"]
        scoped = mem.recall("best hiking trails in Patagonia", user="dana", project="atlas").flags
        whole = mem.recall("best hiking trails in Patagonia", user="dana").flags
    assert scoped["match"]["filtered"] and "memories in this scope (its project" in weak_match_note(scoped)
    assert not whole["match"]["filtered"] and "the store likely holds nothing" in weak_match_note(whole)
