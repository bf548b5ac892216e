"""Helix on Ray Serve: the recall graph as deployments, the HTTP API, online writes.

Module map, in flow order::

    api.py          HTTP request/response models, error sentences, settings checks (no Ray)
    keys.py         API keys → users (keys.json in the store folder)
    delta_format.py the delta's files: segment schema, manifests, tombstones
    delta.py        a loaded delta snapshot, searched beside the generation; the merge
    access_log.py   the recent recall hits the replicas read (delta/ACCESSES.jsonl)
    settings.py     the live retrieval overrides (serve-settings.json)
    views.py        per-replica generations and delta snapshots; the hot swap
    shells.py       the deployment shells over Recaller.plan / legs / finish (no Ray)
    writer.py       the single DuckDB writer: its state, the log replay, snapshots
    writes.py       the write path: POST, PATCH, DELETE of memories
    compaction.py   folding the delta into the next generation
    deployments.py  the shells as Serve deployments (fractional CPUs, autoscaling)
    gate.py         the ASGI gate: API keys and body size before a body is read
    responses.py    errors and recall answers as HTTP responses
    bodies.py       parsing and checking a write's body
    fanout.py       the split graph's fan-out, timeouts and degraded answers
    app.py          the FastAPI ingress, its endpoints and ``build_app`` (configs/serve.yaml)
    server.py       ``helix serve``: start or join Ray, deploy, run

Imports are lazy: ``import helix_ray.serve`` does not import Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "ServeArgs", "run"]

_LAZY = {
    "build_app": "helix_ray.serve.app",
    "ServeArgs": "helix_ray.serve.app",
    "run": "helix_ray.serve.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'helix_ray.serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
