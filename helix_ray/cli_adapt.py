"""The ``helix adapt`` command: the query adapter of a store, fitted from a JSONL file of
labelled queries or from the feedback the store recorded. The fitting is
:func:`helix_ray.recall.adapter.fit_store`'s; this module reads the pairs and prints.
Imports stay inside the function (``helix --help`` loads none of them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def adapt(args: argparse.Namespace) -> int:
    """``helix adapt``: fit the store's query adapter on labelled queries or on feedback
    (or remove it), and print the cross-validated gain."""
    from helix_ray.errors import InvalidArgument
    from helix_ray.recall import adapter

    path = Path(args.store) / adapter.ADAPTER_FILE
    if args.remove:
        existed = path.exists()
        path.unlink(missing_ok=True)
        out = {"removed": existed, "path": str(path)}
        print(json.dumps(out) if args.json else ("removed " if existed else "no adapter at ") + str(path))
        return 0
    if bool(args.pairs) == bool(args.from_feedback):
        raise InvalidArgument("--pairs", args.pairs, "give either a JSONL file of labelled queries (--pairs) or "
                              "--from-feedback, or --remove")
    pairs = []
    if args.from_feedback:
        from helix_ray.store.db import DB_FILE, StoreDB

        if not (Path(args.store) / DB_FILE).is_file():
            raise InvalidArgument("--store", args.store, f"it must be a Helix store (a folder with {DB_FILE})")
        with StoreDB(Path(args.store), read_only=True) as db:
            pairs = db.feedback_pairs(args.users)
        adapter.require_feedback(pairs, args.users, how="Memory.feedback or the server's POST /v1/feedback")
    elif args.users:
        raise InvalidArgument("--user", args.users, "it filters --from-feedback; a --pairs file names its users")
    for n, line in enumerate(Path(args.pairs).read_text(encoding="utf-8").splitlines() if args.pairs else [],
                             start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row["memory_ids"]
            pairs.append({"query": str(row["query"]), "user": str(row["user"]),
                          "memory_ids": [str(i) for i in (ids if isinstance(ids, list) else [ids])]})
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{args.pairs} line {n}", line[:120],
                                  'each line must be a JSON object {"query": str, "user": str, "memory_ids": '
                                  f"[str, ...]}} ({exc})") from None
    report = adapter.fit_store(args.store, pairs, ridge=args.ridge, force=args.force)
    if args.json:
        print(json.dumps(report))
    else:
        cv = report["cv_mrr@10"]
        adapted = cv[f"ridge={report['ridge']:g}"]
        print(f"{report['queries']} distinct queries from {report['pairs']} pairs ({report['skipped_queries']} "
              f"without a memory the current generation holds for that user; {report['skipped_ids']} ids skipped); "
              f"ridge {report['ridge']:g}; cross-validated MRR@10 raw {cv['identity']:.4f} → adapted {adapted:.4f} "
              f"(gain {report['cv_gain']:+.4f} ± {report['cv_gain_stderr']:.4f})")
        print(f"saved to {report['path']}" if report["saved"] else
              "not saved: the gain is not above twice its standard error (use --force to save it anyway)")
    return 0
