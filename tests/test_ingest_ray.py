"""The ingest pipeline on a real local Ray (started by the test, shut down after)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from helix_ray.config import IngestConfig
from helix_ray.store.db import StoreDB
from helix_ray.store.generation import Generation
from helix_ray.ingest.run import ingest
from pipelines.ingest import RayTasks, _longest_first
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


class _SeenAsTwoNodes(RayTasks):
    """This one-node Ray taken for a cluster of two nodes: the kNN searches are given
    their rows' vectors and the index's bytes through the object store, as units that
    run on a node without the store's disk are."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes = 2


@pytest.mark.parametrize("spread", [False, True], ids=["one-node", "searches-anywhere"])
def test_ray_runner_matches_local_runner(tmp_path, local_ray, monkeypatch, spread):
    if spread:
        monkeypatch.setattr("pipelines.ingest.RayTasks", _SeenAsTwoNodes)
    # Small blocks and batches so the 300 memories stream through Ray Data as 5 blocks of
    # 64 rows, each cut into 32-row batches: the same batches the local runner embeds.
    monkeypatch.setattr("pipelines.ingest.BLOCK", 64)
    monkeypatch.setattr("helix_ray.ingest.run.BATCH", 32)
    # Tenants of 40 memories or more get an HNSW index: built and searched by Ray tasks
    # on the ray runner, here on the local one.
    monkeypatch.setattr("helix_ray.ingest.dense.SEARCH_BLOCK", 16)
    config = IngestConfig(hnsw_min_rows=40)
    sources = [SAMPLE / "memories.jsonl", SAMPLE / "notes", SAMPLE / "transcript.jsonl", SAMPLE / "bad_records.jsonl"]
    on_ray = ingest(sources, tmp_path / "ray", runner="ray", show_progress=False, config=config)
    local = ingest(sources, tmp_path / "local", runner="local", config=config)
    assert on_ray.published and on_ray.accepted == 300 and on_ray.quarantined == 8
    for field in ("read", "accepted", "quarantined", "duplicates", "new", "embedded", "total_memories"):
        assert getattr(on_ray, field) == getattr(local, field), field
    a, b = Generation.open_current(tmp_path / "ray"), Generation.open_current(tmp_path / "local")
    assert a.memories.equals(b.memories)
    np.testing.assert_array_equal(a.vectors, b.vectors)
    assert a.manifest["counts"] == b.manifest["counts"]
    indexed = [p for p in a.manifest["partitions"] if p["dense"]]
    assert indexed and any(p["end"] - p["start"] > 16 for p in indexed)  # several search units
    (node,) = on_ray.work_units  # Ray's one node ran them: a build and one search or more per index
    assert on_ray.work_units[node] > 2 * len(indexed) and local.work_units["local"] > 2 * len(indexed)
    assert [p for p in b.manifest["partitions"] if p["dense"]] == indexed
    for part in indexed:
        assert (a.path / part["dense"]).read_bytes() == (b.path / part["dense"]).read_bytes()
    for x, y in zip(a.knn, b.knn):
        np.testing.assert_array_equal(x, y)
    ids = a.memories.column("id").to_pylist()
    with StoreDB(tmp_path / "ray") as x, StoreDB(tmp_path / "local") as y:
        expansions = x.expansions_for(ids)
        assert expansions == y.expansions_for(ids)
    # the transcript's turns take their previous turn's words, through Ray Data as locally
    texts = {" ".join(t.split()) for t in a.memories.column("text").to_pylist()}
    assert sum(bool(lines) and lines[-1] in texts for lines in expansions.values()) > 10


def test_ray_runner_incremental_embeds_only_new(tmp_path, local_ray):
    # The embedding actor asks for every CPU of this Ray: the stage's read tasks, which
    # wait for the rows while the actor starts, must need none (or they never run).
    config = IngestConfig(embed_actors=1, embed_actor_cpus=local_ray.cluster_resources()["CPU"])
    store = tmp_path / "store"
    reports = []

    def run() -> None:
        reports.append(ingest([SAMPLE / "memories.jsonl"], store, config=config, show_progress=False))
        reports.append(ingest([SAMPLE / "memories.jsonl", SAMPLE / "transcript.jsonl"], store, config=config,
                              show_progress=False))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=600)
    assert not worker.is_alive(), "the ingest did not finish in 10 minutes (actors starving the read tasks?)"
    first, again = reports
    assert again.embedded == 50 and again.unchanged == first.accepted
    assert again.total_memories == first.total_memories + 50


def test_blocks_go_to_the_actors_costliest_first():
    texts = ["a" * n for n in (5, 5, 5, 900, 10, 10, 40, 40, 40, 3)]
    # blocks of 3 rows, model batches of 2: [0:3] costs 2·5 + 5 = 15, [3:6] 2·10 + 900,
    # [6:9] 2·40 + 40, [9:10] 3
    assert _longest_first(texts, 3, 2) == [3, 6, 0, 9]
    # blocks of 4: [0:4] 2·5 + 2·900 (the 900-char text pads its model batch), [4:8]
    # 2·10 + 2·40, [8:10] 2·40 (sorted: 3, 40)
    assert _longest_first(texts, 4, 2) == [0, 4, 8]
    # reversed, model batches of 4: [0:4] 4·40, [4:8] 4·900, [8:10] 2·5
    assert _longest_first(texts[::-1], 4, 4) == [4, 0, 8]
    # a short last block stays last even when it costs the most: sent early, the actor
    # stage would bundle it with the next block into other batches (other vectors)
    assert _longest_first(["a"] * 8 + ["a" * 500], 4, 2) == [0, 4, 8]
    assert _longest_first([], 3, 2) == []
