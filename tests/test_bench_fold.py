"""``scripts/bench_fold.py`` on a small real store: the same writes compacted as a fold
and as a rebuild, each followed by timed recalls, with the real models and DuckDB. The
numbers themselves are the script's to print, not a test's to time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helix_ray.ingest.run import ingest
from tests.helpers import load_script, memory, write_jsonl


ROWS = [memory(i, f"The {word} service retries its queue every {i + 2} seconds after a timeout.")
        for i, word in enumerate(("gateway", "billing", "kiln", "ledger", "pager", "vault"))]


def small_store(tmp_path):
    store = tmp_path / "store"
    assert ingest([write_jsonl(tmp_path / "base.jsonl", ROWS)], store, runner="local", show_progress=False).published
    return store


def test_the_script_folds_and_rebuilds_the_same_writes(tmp_path):
    store = small_store(tmp_path)
    out = tmp_path / "out.json"
    assert load_script("bench_fold").main(["--store", str(store), "--user", "dana", "--new", "4", "--rounds", "2",
                                           "--queries", "3", "--work", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["round"], r["mode"]) for r in result] == [(0, "fold"), (0, "rebuild"), (1, "rebuild"), (1, "fold")]
    assert all(r["memories"] == len(ROWS) and r["folded"] == 4 and r["seconds"] > 0 for r in result)
    assert store.is_dir() and not list(tmp_path.glob("helix-bench-fold-*"))  # the copies are gone


def test_the_script_times_recall_over_segments_of_each_size(tmp_path):
    store = small_store(tmp_path)
    out = tmp_path / "out.json"
    assert load_script("bench_fold").main(["--store", str(store), "--user", "dana", "--segment-rows", "0,4",
                                           "--queries", "3", "--work", str(tmp_path), "--json", str(out)]) == 0
    assert [r["segment_rows"] for r in json.loads(out.read_text())] == [0, 4]


def test_the_script_sets_a_refs_run_beside_its_own(tmp_path, capsys):
    """``--against HEAD``: the committed copy of the script runs first with the same
    arguments (its own --json), then this one, and the medians of both are printed."""
    if subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: there is no ref to compare against")
    store = small_store(tmp_path)
    assert load_script("bench_fold").main(["--store", str(store), "--user", "dana", "--new", "2", "--rounds", "1",
                                           "--queries", "2", "--work", str(tmp_path), "--against", "HEAD",
                                           "--json", str(tmp_path / "out.json")]) == 0
    printed = capsys.readouterr().out
    assert "| compaction, medians | this code | HEAD | this / HEAD |" in printed
    assert sum(line.startswith(("| fold: ", "| rebuild: ")) for line in printed.splitlines()) == 6
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2  # this run's rows only
