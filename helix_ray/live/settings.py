"""The live retrieval settings of a served store: ``serve-settings.json``.

``PATCH /v1/settings`` deep-merges into these overrides and ``DELETE /v1/settings``
drops them; the Writer writes the file (one writer, under its lock) and every ingress
replica reads it with one ``stat`` per request (the ingress's ``HelixAPI.config``), as
``helix mcp`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helix_ray.config import deep_merge
from helix_ray.live.inputs import check_settings
from helix_ray.store.pointer import write_text_atomic

SETTINGS_FILE = "serve-settings.json"


def settings_path(store: Path) -> Path:
    return Path(store) / SETTINGS_FILE


def read_settings(store: Path) -> dict[str, Any]:
    """The live retrieval overrides set through ``PATCH /v1/settings`` ({} if none)."""
    try:
        return json.loads(settings_path(store).read_text())
    except FileNotFoundError:
        return {}


def patch_settings(store: Path, patch: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Merge ``patch`` into the live overrides of ``store``, check the result against
    ``base`` (the deployment's own overrides), persist it; the caller holds the writer's lock."""
    merged = deep_merge(read_settings(store), patch)
    check_settings(base, merged, patch)  # raises InvalidArgument, naming the bad key
    write_text_atomic(settings_path(store), json.dumps(merged, indent=1, sort_keys=True))
    return merged


def reset_settings(store: Path) -> dict[str, Any]:
    """Drop the live overrides of ``store``."""
    settings_path(store).unlink(missing_ok=True)
    return {}
