"""The CLI as a finished tool: --version, quarantine, doctor, exit codes that mean
something, errors that name the flag typed, and one default budget for CLI and HTTP.

One real store (the shipped sample's memories and bad records, plus a Markdown folder
with an empty section) is built once with the real ingest (``runner="local"``); tests
that break a store break a copy of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helix_ray.cli import main
from tests.helpers import SAMPLE

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
    assert [(r["id"], r["_position"]) for r in rows] == [
        ("md:sub/ops.md#deploy", "sub/ops.md, section 'Deploy'"), ("md:sub/ops.md#empty", "sub/ops.md, section 'Empty'")]
    (single,) = [r for r in read_markdown(tmp_path / "sub" / "ops.md") if r["text"]]
    assert (single["id"], single["_position"]) == ("md:ops.md#deploy", "ops.md, section 'Deploy'")


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
    (lambda s: _truncate(s / "generations" / "000001" / "vectors.f32.npy"), "files", "vectors.f32.npy does not read"),
    (lambda s: (s / "generations" / "000001" / "graph" / "types.npy").unlink(), "files", "graph/types.npy is missing"),
    (lambda s: _shorten(s / "generations" / "000001" / "minhash.npy"), "files",
     "minhash.npy has 10 rows; the manifest implies 204"),
    (lambda s: (s / "CURRENT").write_text("7\n"), "current", "CURRENT names generation 7, but"),
    (lambda s: (s / "CURRENT").write_text("seven\n"), "current", "CURRENT holds 'seven\\n'"),
    (_manifest_version, "manifest", "format_version 99 (this Helix reads 1)"),
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
    from helix_ray.serve.keys import KeyStore

    KeyStore(copy).create("dana")
    assert helix(capsys, "doctor", "--store", str(copy))[0] == 0
    os.chmod(copy / "keys.json", 0o644)
    code, out, _ = helix(capsys, "doctor", "--store", str(copy))
    assert code == 1 and "PROBLEM  keys      keys.json has mode 0644" in out and f"chmod 600 {copy}/keys.json" in out


def test_doctor_says_a_running_process_holds_the_database(copy, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; "
                               f"c = duckdb.connect({str(copy / 'helix.duckdb')!r}); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code, out, _ = helix(capsys, "doctor", "--store", str(copy))
    finally:
        holder.communicate("", timeout=30)
    assert code == 1 and f"helix.duckdb is held by process {holder.pid} (a running `helix serve`" in out
    assert "ok       files" in out  # the checks that do not need the database still ran


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
