"""Shared fixtures: the stores of the query-path tests, and the Serve stage shells.

Each store is built once per session with the real ingest pipeline (``runner="local"``:
never Ray), the real embedding model and a real DuckDB file under a pytest temp folder.
Plain helpers and the data the stores are made of are in ``tests/helpers.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import tenant_records

SAMPLES = Path(__file__).resolve().parents[1] / "helix_ray" / "samples" / "atlas"

# --------------------------------------------------------------------------- tenants


@pytest.fixture(scope="session")
def tenant_store(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """(store folder, id → record) for a four-tenant store with shared vocabulary.

    Every tenant gets an HNSW index (``hnsw_min_rows=0``) so tests can run the dense leg
    through HNSW (``dense.exact_below=0``) as well as through the binary scan."""
    from helix_ray.config import IngestConfig, load_config
    from helix_ray.ingest.run import ingest

    records = tenant_records()
    folder = tmp_path_factory.mktemp("tenants")
    source = folder / "tenants.jsonl"
    import json

    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    store = folder / "store"
    config = load_config(IngestConfig, overrides={"hnsw_min_rows": 0})
    report = ingest([source], store, config=config, runner="local", show_progress=False)
    assert report.published and report.quarantined == 0 and report.duplicates == 0, report
    return store, {r["id"]: r for r in records}


@pytest.fixture(scope="session")
def tenant_memory(tenant_store):
    """A read-side :class:`helix_ray.Memory` over :func:`tenant_store` (no access log, so
    recalls do not change later rankings) and no warm-up (tests count the stages' calls)."""
    from helix_ray.memory import Memory

    store, _ = tenant_store
    mem = Memory(store, record_access=False, warm=False)
    yield mem
    mem.close()


# --------------------------------------------------------------------------- atlas sample set


@pytest.fixture(scope="session")
def atlas_memory(tmp_path_factory):
    """The shipped sample set (memories, notes, transcript) ingested once."""
    from helix_ray.memory import Memory
    from helix_ray.ingest.run import ingest

    store = tmp_path_factory.mktemp("atlas") / "store"
    report = ingest([SAMPLES / "memories.jsonl", SAMPLES / "notes", SAMPLES / "transcript.jsonl"], store,
                    runner="local", show_progress=False)
    assert report.published, report
    mem = Memory(store, record_access=False, warm=False)
    yield mem
    mem.close()


# --------------------------------------------------------------------------- Serve shells


@pytest.fixture()
def shells(tenant_store, tmp_path):
    """The five shells over a private copy of the tenant store, in this process."""
    import shutil

    from helix_ray.serve import shells as sh

    store = tmp_path / "store"
    shutil.copytree(tenant_store[0], store)
    writer = sh.WriterShell(store, compact_interval_s=3600)
    parts = {"embedder": sh.EmbedderShell(), "bm25": sh.BM25Shell(store), "dense": sh.DenseShell(store),
             "ranker": sh.RankerShell(store), "writer": writer, "store": store}
    yield parts
    writer._stop.set()
    writer.core.close()
