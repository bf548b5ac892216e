"""Helix on Ray Serve: the recall graph as deployments, and the HTTP API over the live
store (:mod:`helix_ray.live`: the Writer, the delta, compaction, recall over both).

Module map, in flow order::

    api.py          HTTP request/response models, the settings patch schema (no Ray)
    errors.py       Helix errors as HTTP statuses; errors across a replica boundary
    shells.py       the deployment shells over Recaller.plan / live.recall / WriterCore (no Ray)
    deployments.py  the shells as Serve deployments (fractional CPUs, autoscaling)
    ratelimit.py    the per-key token bucket
    audit.py        admin requests recorded in the store's audit log
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
