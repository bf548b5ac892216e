"""``scripts/bench_recall.py`` end to end on a tiny derived store, with ``--against``:
the query phase runs once with this tree's code and once with a git ref's, exported
into the work folder, and the report sets the two side by side. The numbers themselves
are the script's to print, not a test's to time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_query_phase_runs_with_this_code_and_with_a_refs(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: there is no ref to compare against")
    out = tmp_path / "out.json"
    assert load_script("bench_recall").main([
        "--sizes", "300", "--base", "40", "--queries", "6", "--warmup", "2", "--query-env", "default",
        "--against", "HEAD", "--work", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (size,) = result["results"]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert size["against"]["commit"] == commit.strip()
    theirs = size["against"]["variants"]["default"]
    ours = size["query_variants"]["default"]
    assert theirs["full"]["n"] == ours["full"]["n"] == 6
    assert (tmp_path / f"against-{commit[:12]}" / "helix_ray" / "__init__.py").is_file()
    assert "| 300, full, default: stage ms p50 / p95 | this code | HEAD | this / HEAD p50, p95 |" in result["table"]
    assert "| **total** |" in result["table"].split("this / HEAD")[1]


def test_bench_serve_runs_the_ref_with_the_same_arguments_and_sets_the_runs_side_by_side():
    """``bench_serve --against REF`` gives the ref's copy this run's arguments but its own
    ``--json``, and reports each figure of the two runs with their ratio."""
    bench_serve, against = load_script("bench_serve"), load_script("against")
    argv = ["--store", "S", "--against", "main", "--requests", "50", "--json=/tmp/x.json", "--against=v1",
            "--json", "/tmp/y.json", "--concurrency", "4"]
    assert against.ref_argv(argv) == ["--store", "S", "--requests", "50", "--concurrency", "4"]

    def run(scale: float) -> dict:
        timing = {"p50": 10.0 * scale, "p95": 20.0 * scale}
        return {"memories": 100_000, "in_process": timing, "http": {"helix_c1": timing, "helix_c4": timing},
                "replicas": [{"pss_mib": 600.0 * scale}, {"pss_mib": 400.0 * scale}]}

    lines = bench_serve.against_table([run(1.0)], [run(2.0)], "main", 4).splitlines()
    assert lines[0] == "| memories | measure | this code | main | this / main |"
    assert "| 100,000 | HTTP helix, concurrency 4, p50 / p95 ms | 10.0 / 20.0 | 20.0 / 40.0 | 0.50×, 0.50× |" in lines
    assert lines[-1] == "| 100,000 | replicas' PSS, MiB in all | 1,000 | 2,000 | 0.50× |"
