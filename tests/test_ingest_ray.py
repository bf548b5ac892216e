"""The ingest pipeline on a real local Ray (started by the test, shut down after)."""

from __future__ import annotations

import numpy as np
import pytest

from helix_ray.store.generation import Generation
from pipelines.ingest import ingest
from tests.helpers import SAMPLE

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from helix_ray.runtime import ensure_ray

    started = not ray.is_initialized()
    ensure_ray()
    yield ray
    if started:
        ray.shutdown()


def test_ray_runner_matches_local_runner(tmp_path, local_ray, monkeypatch):
    # Small blocks and batches so the 300 memories stream through Ray Data as 5 blocks of
    # 64 rows, each cut into 32-row batches: the same batches the local runner embeds.
    monkeypatch.setattr("pipelines.ingest.BLOCK", 64)
    monkeypatch.setattr("pipelines.ingest.BATCH", 32)
    sources = [SAMPLE / "memories.jsonl", SAMPLE / "notes", SAMPLE / "transcript.jsonl", SAMPLE / "bad_records.jsonl"]
    on_ray = ingest(sources, tmp_path / "ray", runner="ray", show_progress=False)
    local = ingest(sources, tmp_path / "local", runner="local")
    assert on_ray.published and on_ray.accepted == 300 and on_ray.quarantined == 8
    for field in ("read", "accepted", "quarantined", "duplicates", "new", "embedded", "total_memories"):
        assert getattr(on_ray, field) == getattr(local, field), field
    a, b = Generation.open_current(tmp_path / "ray"), Generation.open_current(tmp_path / "local")
    assert a.memories.equals(b.memories)
    np.testing.assert_allclose(a.vectors, b.vectors, atol=1e-6)
    assert a.manifest["counts"] == b.manifest["counts"]


def test_ray_runner_incremental_embeds_only_new(tmp_path, local_ray):
    store = tmp_path / "store"
    first = ingest([SAMPLE / "memories.jsonl"], store, runner="ray", show_progress=False)
    again = ingest([SAMPLE / "memories.jsonl", SAMPLE / "transcript.jsonl"], store, runner="ray", show_progress=False)
    assert again.embedded == 50 and again.unchanged == first.accepted
    assert again.total_memories == first.total_memories + 50
