"""``scripts/bench_compact_recall.py`` on a small real store: recall idle and during
compactions whose thread runs at each nice value asked for, with the real models and
DuckDB. The numbers themselves are the script's to print, not a test's to time."""

from __future__ import annotations

import json
import sys

from helix_ray.ingest.run import ingest
from tests.helpers import load_script, memory, write_jsonl


def test_the_script_compacts_at_each_nice_value_and_reports_recall_around_it(tmp_path):
    rows = [memory(i, f"The {word} service retries its queue every {i + 2} seconds after a timeout.")
            for i, word in enumerate(("gateway", "billing", "kiln", "ledger", "pager", "vault"))]
    store = tmp_path / "store"
    assert ingest([write_jsonl(tmp_path / "base.jsonl", rows)], store, runner="local", show_progress=False).published
    bench = load_script("bench_compact_recall")
    out = tmp_path / "out.json"
    assert bench.main(["--store", str(store), "--new", "3", "--rounds", "1", "--nice", "0,19", "--idle", "4",
                       "--busy", "thread,process", "--work", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["memories"] == len(rows) and result["new"] == 3
    assert sorted(result["rows"]) == ["0", "19", "busy process +0", "busy process +19", "busy thread +0",
                                      "busy thread +19"]
    for name, row in result["rows"].items():
        assert row["idle"]["n"] == 4
        if name.startswith("busy"):
            assert row["during"]["n"] == 4 and row["p95_ratio"] > 0
        else:
            assert row["during"]["n"] >= 1 and len(row["compaction_s"]) == 1 and len(row["lost_ms"]) == 1
    if sys.platform == "linux":  # lower_priority's value: None when asked for no change
        assert result["rows"]["0"]["thread_nice"] is None
        assert result["rows"]["19"]["thread_nice"] == 19
