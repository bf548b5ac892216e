"""The ``helix`` commands that look into a store without changing it: ``quarantine`` and
``doctor``. They print; the reading is :class:`helix_ray.store.db.StoreDB`'s and
:mod:`helix_ray.store.doctor`'s. Imports stay inside the functions (``helix --help``
loads none of them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def quarantine(args: argparse.Namespace) -> int:
    """``helix quarantine``: the rejected records, oldest first, with reason code,
    sentence, source file and position."""
    from helix_ray.errors import InvalidArgument
    from helix_ray.store.db import StoreDB

    store = _existing_store(args.store)
    if args.limit < 1:
        raise InvalidArgument("--limit", args.limit, "it must be a whole number ≥ 1")
    with StoreDB(store, read_only=True) as db:
        reasons = db.quarantine_reasons()
        if args.reason and args.reason not in reasons:
            held = f"the reason codes this store holds are {', '.join(reasons)}" if reasons else \
                "this store's quarantine is empty"
            raise InvalidArgument("--reason", args.reason, held)
        rows = db.quarantine(args.limit, reason=args.reason)
    total = reasons.get(args.reason, 0) if args.reason else sum(reasons.values())
    records = [_record(row) for row in rows]
    if args.json:
        print(json.dumps({"total": total, "records": records}, indent=1, default=str, ensure_ascii=False))
        return 0
    for r in records:
        print(f"{r['reason']:<14} {r['source']} · {r['position']}")
        print(f"{'':<14} {r['sentence']}")
    shown = f"{len(records)} of {total}" if len(records) < total else str(total)
    counts = ", ".join(f"{code} ×{n}" for code, n in reasons.items())
    print(f"-- {shown} quarantined record{'s' if total != 1 else ''}" + (f" (in all: {counts})" if counts else "")
          + ("; --json shows each one's raw input" if records else ""))
    return 0


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """A quarantine row with its reason split into code and sentence."""
    code, _, sentence = str(row["reason"]).partition(": ")
    return {"reason": code, "sentence": sentence, "source": row["source"], "position": row["position"],
            "raw": row["raw"], "ingest_run": row["ingest_run"], "quarantined_at": row["quarantined_at"]}


def _existing_store(folder: str) -> Path:
    """``folder`` as a store with a database; FileNotFoundError saying how to make one."""
    from helix_ray.store.db import DB_FILE

    store = Path(folder)
    if not (store / DB_FILE).is_file():
        what = "does not exist" if not store.exists() else f"holds no {DB_FILE}: it is not a Helix store"
        raise FileNotFoundError(f"Store {folder} {what}; create one with `helix ingest SOURCE --store DIR`, or check "
                                "--store.")
    return store


def doctor(args: argparse.Namespace) -> int:
    """``helix doctor``: one line per check; 0 when every check holds, 1 otherwise."""
    from helix_ray.store.doctor import check_store

    checks = check_store(args.store)
    for check in checks:
        print(f"{'ok' if check.ok else 'PROBLEM':<8} {check.name:<9} {check.found}")
        if check.fix:
            print(f"{'':<8} {'':<9} fix: {check.fix}")
    problems = sum(not c.ok for c in checks)
    if problems:
        print(f"helix doctor: {problems} problem{'s' if problems > 1 else ''} in {args.store}.", file=sys.stderr)
        return 1
    return 0
