"""Small builders shared by tests (data the tests make themselves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "helix_ray" / "samples" / "atlas"
LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def memory(i: int, text: str, user: str = "dana", **extra: Any) -> dict[str, Any]:
    return {"id": f"m{i:03d}", "text": text, "user": user,
            "created_at": f"2025-03-{1 + i % 28:02d}T10:00:00Z", **extra}
