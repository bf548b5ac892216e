"""The ``helix add`` and ``helix delete`` commands: one memory written or deleted through
the store's Writer, as ``Memory.add`` / ``Memory.delete``, ``POST /v1/memories`` and the
MCP ``remember`` / ``forget`` tools do. Durable in the store's DuckDB file and in the
delta when the command returns; the next recall sees the change and a compaction folds
it into a generation. Imports stay inside the functions (``helix --help`` loads none)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add(args: argparse.Namespace) -> int:
    """``helix add TEXT``: one memory of ``--user`` (``-`` reads the text from stdin)."""
    from helix_ray.errors import InvalidArgument

    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        raise InvalidArgument("TEXT", args.text, "give the memory's text (or - to read it from stdin)")
    record: dict[str, Any] = {"text": text, "user": args.user, "source": "cli"}
    for key in ("id", "type", "project", "session_id"):
        if getattr(args, key) is not None:
            record[key] = getattr(args, key)
    if args.pinned:
        record["pinned"] = True
    with _writer(args.store, "add a memory in", "POST /v1/memories") as mem:
        written = mem.add([record])
    out = {"ids": list(written.ids), "replaced": list(written.replaced), "delta_version": written.delta_version,
           "generation": written.generation}
    if args.json:
        print(json.dumps(out))
    else:
        done = f"replaced {written.ids[0]} (its earlier version is gone)" if written.replaced else \
            f"added {written.ids[0]}"
        print(f"{done}: recallable now, in delta version {written.delta_version} over generation "
              f"{written.generation}")
    return 0


def delete(args: argparse.Namespace) -> int:
    """``helix delete ID``: one memory of ``--user`` (and every chunk of it) deleted."""
    from helix_ray.store.db import DB_FILE

    if not (Path(args.store) / DB_FILE).is_file():  # Memory would create an empty store there
        raise FileNotFoundError(f"Store {args.store} does not exist (no {DB_FILE} in it); give the folder of the "
                                "store that holds the memory.")
    with _writer(args.store, "delete a memory in", "DELETE /v1/memories/{id}") as mem:
        written = mem.delete(args.id, user=args.user)
    out = {"ids": list(written.ids), "delta_version": written.delta_version, "generation": written.generation}
    print(json.dumps(out) if args.json else f"deleted {args.id}: no recall returns it from now on")
    return 0


def _writer(store: str, doing: str, route: str) -> Any:
    """The store opened to write, with no warm-up and no background compaction; a store
    another process holds says what to do instead."""
    from helix_ray.cli_common import open_memory

    return open_memory(store, doing=doing, instead=f"send `{route}` with the user's key (docs/http-api.md)",
                       warm=False, record_access=False, compact_interval_s=None)
