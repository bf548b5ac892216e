"""The evaluation runner end to end on a tiny BEIR fixture: real ingest (local runner),
the real embedding model, every system on the same store, and the paired comparisons."""

from __future__ import annotations

import pytest

from helix_ray.eval.beir import load_beir
from helix_ray.eval.runner import evaluate, format_table
from tests.helpers import REPO

MINI = REPO / "tests" / "fixtures" / "eval" / "mini_beir"


def test_evaluate_compares_each_system_with_each_baseline(tmp_path):
    evalset = load_beir(MINI)
    report = evaluate(evalset, systems=["bm25", "dense", "helix", "helix-no-vector"], workdir=tmp_path,
                      show_progress=False)
    assert set(report.comparisons) == {"helix", "helix-no-vector"}  # baselines are not compared with each other
    # Serve's answer while its Embedder is down: BM25 through the later stages, scored.
    assert report.systems["helix-no-vector"]["recall@10"] >= 0.5 * report.systems["bm25"]["recall@10"] > 0
    against = report.comparisons["helix"]
    assert set(against) == {"bm25", "dense"}
    for base, metrics in against.items():
        for metric, diff in metrics.items():
            assert diff["n"] == report.queries == len(evalset.queries)
            # The paired mean difference is the difference of the two systems' means.
            expected = report.systems["helix"][metric] - report.systems[base][metric]
            assert diff["delta"] == pytest.approx(expected, abs=2e-4)
            assert diff["ci95"][0] <= diff["delta"] <= diff["ci95"][1]
            assert 0 < diff["p"] <= 1
    lines = format_table(report).splitlines()
    for base in ("bm25", "dense"):
        line = next(line for line in lines if line.strip().startswith(f"helix − {base}: "))
        assert "ndcg@10" in line and "recall@10" in line and "p=" in line
