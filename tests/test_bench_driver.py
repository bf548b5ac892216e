"""``scripts/bench_driver.py`` on a few hundred synthetic memories: the real ingest job,
every memory's vector given, so no text reaches the encoders. The memory and seconds
themselves are the script's to print, not a test's to judge."""

from __future__ import annotations

import json

from helix_ray.store.generation import Generation
from tests.helpers import load_script


def test_the_script_ingests_every_memory_with_the_vector_it_gives(tmp_path):
    out = tmp_path / "out.json"
    assert load_script("bench_driver").main(["--n", "300", "--users", "2", "--runner", "local",
                                             "--work", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["embedded"] == 0 and result["reused"] == result["memories"] > 250  # a few near-duplicates go
    assert result["driver_peak_rss_mib"] >= result["driver_rss_before_mib"] > 0
    assert result["driver_peak_rss_mib"] >= result["driver_peak_anon_mib"] > 0
    assert {"dedup", "assemble", "publish", "record"} <= set(result["stages_s"])
    frames = result["driver_peak_anon_by_frame_mib"]  # where in helix_ray the heap peaked, highest first
    assert any(k.split(":")[0].endswith(".py") for k in frames) and max(frames.values()) <= result["driver_peak_anon_mib"]
    assert list(frames.values()) == sorted(frames.values(), reverse=True)
    generation = Generation.open_current(tmp_path / "store")
    assert generation.size == result["memories"] and len({*generation.memories.column("user").to_pylist()}) == 2
