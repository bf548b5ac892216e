"""Small builders shared by tests (data the tests make themselves), and the helpers the
Serve tests share: a recall over HTTP checked against the documented schema, a recall
through the stage shells in this process, and the HTTP application without Ray; the
search of log files for markers that the log tests share; and loading a script of
``scripts/`` as a module."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterable

import pytest

from helix_ray.schema import MEMORY_TYPES

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "helix_ray" / "samples" / "atlas"
# The benchmarks are not in the repo: HELIX_DATA names the folder that holds them
# (locomo/locomo10.json, scifact/, cosqa/); tests that need one skip without it.
DATA = Path(os.environ["HELIX_DATA"]) if os.environ.get("HELIX_DATA") else None
LOCOMO = DATA / "locomo" / "locomo10.json" if DATA else REPO / "no-such-file"


def load_script(name: str) -> Any:
    """``scripts/<name>.py`` imported as a module (the scripts are not a package),
    registered under ``name`` so that its dataclasses find their module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def memory(i: int, text: str, user: str = "dana", **extra: Any) -> dict[str, Any]:
    return {"id": f"m{i:03d}", "text": text, "user": user,
            "created_at": f"2025-03-{1 + i % 28:02d}T10:00:00Z", **extra}


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


def single_file_tokens(folder: Path, tokens: Any, scales: Any, offsets: Any, **late: Any) -> None:
    """Rewrite generation ``folder``'s tokens in the single-file layout that Helix wrote
    before segments (``late/{tokens,scales,offsets}.npy``), its manifest's ``late``
    updated by ``late`` (e.g. another encoder) and re-sealed, as that Helix sealed it."""
    import shutil

    import numpy as np

    from helix_ray.store.integrity import record_files, seal

    shutil.rmtree(folder / "late")
    (folder / "late").mkdir()
    for name, value in (("tokens", tokens), ("scales", scales), ("offsets", offsets)):
        np.save(folder / "late" / f"{name}.npy", value)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["late"] = {"encoder": manifest["late"]["encoder"], "dim": manifest["late"]["dim"],
                        "tokens": int(offsets[-1]), **late}
    manifest["files"] = record_files(folder)
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))


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


# --------------------------------------------------------------------------- Serve


def recall(client, query: str, **extra) -> dict:
    response = client.post("/v1/recall", json={"query": query, "budget_tokens": 400, "k": 8, **extra})
    assert response.status_code == 200, response.text
    from helix_ray.serve.api import RecallResponse

    # The ingress sends the pipeline's dict without FastAPI's response validation: every
    # answer is held to the documented schema here instead: its types, and no key the
    # schema does not name (a response model would drop those silently).
    answer = response.json()
    assert RecallResponse.model_validate(answer, strict=True).model_dump(exclude_unset=True) == answer
    return answer


def ids(result: dict) -> list[str]:
    return [item["id"] for item in result["items"]]


def local_recall(parts, query: str, user: str = "alice", **config):
    from helix_ray.config import RetrievalConfig

    plan = parts["embedder"].plan(query, user=user, config=RetrievalConfig(**config), budget_tokens=400, k=8)
    lexical = asyncio.run(parts["bm25"].search(plan))
    dense = asyncio.run(parts["dense"].search(plan))
    return plan, lexical, dense, asyncio.run(parts["ranker"].finish(plan, lexical, dense))


class LocalHandle:
    """A Serve ``DeploymentHandle`` stand-in over a shell in this process:
    ``handle.method.remote(...)`` awaits the shell's method in a thread, as Serve runs
    the Writer's sync methods."""

    def __init__(self, shell: Any):
        self.shell = shell

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.shell, name)
        return type("Method", (), {"remote": staticmethod(lambda *a, **k: asyncio.to_thread(method, *a, **k))})()


@contextlib.contextmanager
def ingress_app(store: Path, *, auth: bool = True, **args: Any):
    """The HTTP application of ``helix serve`` without Ray: the ingress over the inline
    graph (it runs every recall stage itself) and a Writer shell, both in this process.
    Yields the FastAPI app, to call with any ASGI client; ``args``: more
    :class:`helix_ray.serve.app.ServeArgs`.

    Serve makes the ingress's endpoints methods whose ``self`` is the replica's servable
    (``serve.get_replica_context().servable_object``): here, this process's ingress."""
    import types

    import ray.serve

    from helix_ray.serve import app as app_module
    from helix_ray.serve import audit, gate, ratelimit
    from helix_ray.serve.shells import WriterShell

    writer = WriterShell(store, compact_interval_s=3600)
    ingress_cls = next(c for c in type.mro(app_module.HelixAPI.func_or_class) if "recall" in vars(c))
    ingress = object.__new__(ingress_cls)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(gate.SERVING, "store", None)  # the ingress registers its key store there
        patch.setitem(ratelimit.SERVING, "limiter", None)  # and its rate limiter
        patch.setitem(audit.SERVING, "store", None)  # and its store, for the audit log
        ingress_cls.__init__(ingress, None, None, None, None, LocalHandle(writer),
                             {"store": str(store), "graph": "inline", "auth": auth, **args})
        context = types.SimpleNamespace(servable_object=ingress)
        patch.setattr(ray.serve, "get_replica_context", lambda: context)
        try:
            yield app_module.api
        finally:
            writer._stop.set()
            writer.core.close()


def wait_healthy(url: str, proc: Any, timeout_s: float = 300) -> bool:
    """Whether `helix serve` (the subprocess ``proc``) answers ``url``/healthz within
    ``timeout_s``; False at once if it exits."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:  # the proxy answers 404 until the application is deployed
            if httpx.get(f"{url}/healthz", timeout=30).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def files_holding(store: Path, needle: str) -> list[str]:
    """The files of ``store`` whose bytes contain ``needle``, but the audit log: it keeps
    the record that a user was forgotten, naming them (:func:`audit_without`)."""
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")
                  if p.is_file() and needle.encode() in p.read_bytes() and p.parts[len(store.parts)] != "audit")


def audit_without(store: Path, text: str) -> list[dict]:
    """The audit log's records, once checked to hold none of ``text`` (a forgotten
    user's memory text)."""
    from helix_ray.store import audit

    assert not [p for p in audit.files(store) if text.encode() in p.read_bytes()]
    return audit.read(store)


def leaks(files: list[Path], needles: dict[str, str]) -> list[str]:
    """``file:line: needle name`` for each line of ``files`` holding a needle, read as
    bytes (a log may hold any bytes), each line shortened around the hit."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            for name, needle in needles.items():
                at = line.find(needle.encode())
                if at >= 0:
                    shown = line[max(0, at - 120):at + 120].decode(errors="replace")
                    found.append(f"{path}:{number}: {name}: …{shown}…")
    return found
