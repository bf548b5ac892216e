"""Shared stores for the query-path tests.

Each store is built once per session with the real ingest pipeline (``runner="local"``:
never Ray), the real embedding model and a real DuckDB file under a pytest temp folder.
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

import pytest

from helix_ray.schema import MEMORY_TYPES

SAMPLES = Path(__file__).resolve().parents[1] / "helix_ray" / "samples" / "atlas"

# --------------------------------------------------------------------------- tenants

TENANT_USERS = ("alice", "bob", "carol", "dave")
TENANT_PROJECTS = ("atlas", "beacon", None)
TENANT_START = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)

#: Shared vocabulary: every tenant remembers (nearly) the same sentences, so a leak
#: across tenants would be easy to make and easy to see.
TENANT_TOPICS = (
    "We moved the billing database from MySQL to Postgres to get transactional DDL for migrations.",
    "The deploy pipeline runs the database migrations before rolling the gateway pods.",
    "Redis is the cache in front of the billing service and its keys expire after ten minutes.",
    "Kafka consumers lag whenever the shard rebalance overlaps the nightly backup window.",
    "To rotate the API keys, run the rotate script and then restart every gateway pod.",
    "The checksum of every shard is verified after the nightly backup finishes.",
    "Short commit messages in the imperative mood are preferred for this repository.",
    "The Grafana dashboard for gateway latency lives in the observability folder.",
    "The March outage came from connection pool exhaustion on the Postgres primary.",
    "Integration tests run in CI against a real Postgres container started by pytest.",
    "Search fuses BM25 and dense vector results with reciprocal rank fusion.",
    "The on-call engineer pages the database owner when replication lag passes a minute.",
    "Backups are copied to object storage and restored into staging every Friday.",
    "The gateway rejects requests larger than eight megabytes with status 413.",
)
TENANT_SUFFIXES = (
    "Noted during the Tuesday review.",
    "Confirmed with the on-call engineer.",
    "Written down after the retro.",
    "Mentioned again in the planning meeting.",
)

#: A unique exact error string that only one memory (alice's) contains.
STRONG_ERROR = "ZQX-4471 checksum mismatch in shard 9"
STRONG_ID = "alice-strong"


def tenant_records() -> list[dict]:
    """Seeded memory records for :data:`TENANT_USERS` (ids start with the user)."""
    rng = random.Random(20250101)
    records = []
    for user in TENANT_USERS:
        topics = rng.sample(range(len(TENANT_TOPICS)), 11)
        for n, t in enumerate(topics):
            created = TENANT_START + dt.timedelta(days=rng.randrange(0, 300), minutes=rng.randrange(0, 600))
            records.append({
                "id": f"{user}-{n:02d}",
                "text": f"{TENANT_TOPICS[t]} {rng.choice(TENANT_SUFFIXES)}",
                "user": user,
                "project": rng.choice(TENANT_PROJECTS),
                "type": rng.choice(MEMORY_TYPES),
                "created_at": created.isoformat(),
                "session_id": f"{user}-s{rng.randrange(3)}",
                "source": "api",
            })
    records.append({
        "id": STRONG_ID,
        "text": f"{STRONG_ERROR} appeared in the restore log when the backup replayed a truncated segment; "
                "re-running the restore from the previous snapshot fixed it.",
        "user": "alice",
        "project": "atlas",
        "type": "episodic",
        "created_at": (TENANT_START + dt.timedelta(days=200)).isoformat(),
        "source": "api",
    })
    return records


@pytest.fixture(scope="session")
def tenant_store(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """(store folder, id → record) for a four-tenant store with shared vocabulary.

    Every tenant gets an HNSW index (``hnsw_min_rows=0``) so tests can run the dense leg
    through HNSW (``dense.exact_below=0``) as well as through the binary scan."""
    from helix_ray.config import IngestConfig, load_config
    from pipelines.ingest import ingest

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
    recalls do not change later rankings)."""
    from helix_ray.memory import Memory

    store, _ = tenant_store
    mem = Memory(store, record_access=False)
    yield mem
    mem.close()


# --------------------------------------------------------------------------- atlas sample set


@pytest.fixture(scope="session")
def atlas_memory(tmp_path_factory):
    """The shipped sample set (memories, notes, transcript) ingested once."""
    from helix_ray.memory import Memory
    from pipelines.ingest import ingest

    store = tmp_path_factory.mktemp("atlas") / "store"
    report = ingest([SAMPLES / "memories.jsonl", SAMPLES / "notes", SAMPLES / "transcript.jsonl"], store,
                    runner="local", show_progress=False)
    assert report.published, report
    mem = Memory(store, record_access=False)
    yield mem
    mem.close()
