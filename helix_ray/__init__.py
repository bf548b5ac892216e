"""Helix: memory recall for coding agents.

The front door is :class:`Memory`: open a store, ingest records, ``recall`` a query.
Everything else is importable from its stage module (``helix_ray.recall.fuse`` …).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Memory", "MemoryRecord", "RecallResult", "RecallItem", "RetrievalConfig", "IngestConfig", "HelixError"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from helix_ray.config import IngestConfig, RetrievalConfig
    from helix_ray.errors import HelixError
    from helix_ray.memory import Memory
    from helix_ray.recall.result import RecallItem, RecallResult
    from helix_ray.schema import MemoryRecord

_LAZY = {
    "Memory": "helix_ray.memory",
    "MemoryRecord": "helix_ray.schema",
    "RecallResult": "helix_ray.recall.result",
    "RecallItem": "helix_ray.recall.result",
    "RetrievalConfig": "helix_ray.config",
    "IngestConfig": "helix_ray.config",
    "HelixError": "helix_ray.errors",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `helix --help` and `import helix_ray` stay instant.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'helix_ray' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
