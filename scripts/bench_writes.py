#!/usr/bin/env python
"""Online writes as the delta grows: what one write costs the Writer, and what its new
snapshot costs a replica.

    .venv/bin/python scripts/bench_writes.py --sizes 0,500,1000,2000 --writes 30 \\
        [--tree /path/to/another/checkout]

On a new, empty store (``helix_ray.ingest.run.initialise``) in a temporary folder, in one
process, no Ray: the delta is filled to each of ``--sizes`` pending entries with batch
writes, then ``--writes`` single-memory writes go through
:class:`helix_ray.live.writer.WriterCore` (what ``POST /v1/memories`` runs). For each
write it measures the whole ``add`` (validation, doc2query, both encoders, DuckDB,
inbox, snapshot), the snapshot publication alone, the bytes written under ``delta/``,
and then what a replica does on its next request: read the new snapshot (with the
segment files it already parsed kept, as :class:`StoreViews` keeps them) and run the
first BM25 search over it. Prints p50 / p95 per size. ``--tree`` imports Helix from
another checkout (a worktree of an older commit) to compare in the same session.

``--compact`` then folds every pending write into a generation, as ``helix compact``
and the server's compactor do, and prints its seconds per stage.

``--accesses N,...`` measures the recall hits the same way: the Writer's access record
filled to each number of distinct memory ids (batches of 1,000), then ``--writes``
flushes of 100 new hits (what an ingress sends once a second under load): the Writer's
``accessed`` and a replica's next read of the access file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

WORDS = ("gateway deploy config retry cache token index shard replica kafka postgres latency budget "
         "rollout canary schema migration alert pager quota bucket ledger vault").split()


def text(rng: np.random.Generator, n: int) -> str:
    return f"note {n}: " + " ".join(rng.choice(WORDS, 40))


def files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()} if folder.exists() else {}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,500,1000,2000", help="pending entries before each round of writes")
    ap.add_argument("--writes", type=int, default=30, help="single-memory writes measured per size")
    ap.add_argument("--batch", type=int, default=250, help="memories per write when filling the delta")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                    help="the Helix checkout to import (default: this one)")
    ap.add_argument("--accesses", default="", help="distinct accessed ids before each round of hit flushes "
                                                     "(e.g. 0,10000,50000; empty: skip)")
    ap.add_argument("--store", default=None, help="a store to copy and write into (default: a new, empty one)")
    ap.add_argument("--compact", action="store_true",
                    help="at the end, fold every pending write into a generation (helix compact) and time it")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def print_table(results: list[dict[str, Any]]) -> None:
    """The per-size results as a Markdown table."""
    print("| pending | add p50 / p95 ms | publish p50 / p95 ms | KB written per write | replica load p50 / p95 ms "
          "| first BM25 p50 / p95 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['pending']:,} | {r['add_ms']['p50']} / {r['add_ms']['p95']} | {r['publish_ms']['p50']} / "
              f"{r['publish_ms']['p95']} | {r['kb_written_p50']:,} | {r['replica_load_ms']['p50']} / "
              f"{r['replica_load_ms']['p95']} | {r['first_bm25_ms']['p50']} / {r['first_bm25_ms']['p95']} |")


def live_module(name: str) -> Any:
    """``helix_ray.live.<name>``, or ``helix_ray.serve.<name>`` in a tree from before the
    live store had a package of its own."""
    try:
        return importlib.import_module(f"helix_ray.live.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"helix_ray.serve.{name}")


def main() -> int:
    args = parse_args()
    sys.path.insert(0, args.tree)

    from helix_ray.ingest.run import initialise
    from helix_ray.recall.scope import make_scope

    delta_mod = live_module("delta")
    WriterCore = live_module("writer").WriterCore
    current_delta_version = live_module("delta_format").current_delta_version

    store = Path(tempfile.mkdtemp(prefix="helix-bench-writes-")) / "store"
    if args.store:
        import shutil

        shutil.copytree(args.store, store)
    initialise(store)
    core = WriterCore(store)
    # The store's own users (a write lands among their memories), or five new ones.
    users = [u for (u,) in core.db.con.execute('SELECT DISTINCT "user" FROM memories ORDER BY 1').fetchall()] \
        or [f"u{n}" for n in range(5)]
    cache = delta_mod.SegmentCache() if hasattr(delta_mod, "SegmentCache") else None  # older trees: none

    def replica_load(version: int):
        return delta_mod.DeltaSegment.load(store, version, cache) if cache is not None \
            else delta_mod.DeltaSegment.load(store, version)

    publish_ms: list[float] = []
    publish = core._publish

    def timed_publish(*a, **k):
        clock = time.perf_counter()
        try:
            return publish(*a, **k)
        finally:
            publish_ms.append((time.perf_counter() - clock) * 1000)

    core._publish = timed_publish  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    scope = make_scope(query="retry the kafka gateway", user="u1", budget_tokens=500, k=10)
    written, results = 0, []
    print(f"Helix from {args.tree}; store {store}", flush=True)
    for size in [int(s) for s in args.sizes.split(",")]:
        while written < size:
            n = min(args.batch, size - written)
            core.add([{"text": text(rng, written + i), "user": users[(written + i) % len(users)]} for i in range(n)],
                     user=None)
            written += n
        replica_load(current_delta_version(store))  # the replica is up to date before the round
        add, load, lexical, wrote = [], [], [], []
        publish_ms.clear()
        for _ in range(args.writes):
            before = files(store / "delta")
            clock = time.perf_counter()
            core.add([{"text": text(rng, written), "user": users[written % len(users)]}], user=None)
            add.append((time.perf_counter() - clock) * 1000)
            written += 1
            after = files(store / "delta")
            wrote.append(sum(size for name, size in after.items() if before.get(name) != size))
            clock = time.perf_counter()
            snapshot = replica_load(current_delta_version(store))
            load.append((time.perf_counter() - clock) * 1000)
            clock = time.perf_counter()
            snapshot.lexical_search("retry the kafka gateway", scope, 1, None, top_k=50)
            lexical.append((time.perf_counter() - clock) * 1000)

        def pct(values: list[float]) -> dict[str, float]:
            return {"p50": round(float(np.percentile(values, 50)), 2), "p95": round(float(np.percentile(values, 95)), 2)}

        row = {"pending": size, "add_ms": pct(add), "publish_ms": pct(publish_ms), "replica_load_ms": pct(load),
               "first_bm25_ms": pct(lexical), "kb_written_p50": round(float(np.median(wrote)) / 1024, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    print_table(results)
    hits = [access_round(core, store, int(n), args.writes) for n in args.accesses.split(",") if n]
    for row in hits:
        print(json.dumps(row), flush=True)
    compaction = None
    if args.compact:
        out = core.compact()
        compaction = {"folded": out["folded"], "seconds": out["seconds"], "embedded": out["ingest"]["embedded"],
                      "reused": out["ingest"].get("reused", 0), "stages": out["ingest"]["seconds"]}
        print(json.dumps({"compaction": compaction}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "accesses": hits,
                                               "compaction": compaction}, indent=1))
    return 0


def access_round(core: Any, store: Path, distinct: int, flushes: int) -> dict[str, Any]:
    """The access record filled to ``distinct`` ids, then ``flushes`` batches of 100 new
    hits: the Writer's ``accessed`` and a replica's next read, p50 / p95 ms."""
    try:
        access_log = live_module("access_log")
    except ImportError:  # an older tree: the access file's code is in writer.py
        access_log = live_module("writer")
    if hasattr(access_log, "AccessTail"):
        tail = access_log.AccessTail(access_log.accesses_path(store))
        read = tail.read
    else:  # an older tree: the replica re-read the whole file when it changed
        from helix_ray.serve import shells
        from helix_ray.store.pointer import Pointer

        read = Pointer(access_log.accesses_path(store), shells._read_accesses).read
    now = int(time.time() * 1_000_000)
    have = len(core.recent_accesses)
    while have < distinct:
        n = min(1000, distinct - have)
        core.accessed([(f"hit-{have + i}", "u1", now + have + i) for i in range(n)])
        have += n
    read()
    accessed, reads = [], []
    for f in range(flushes):
        batch = [(f"hit-{i % max(distinct, 1)}", "u1", now + distinct + f * 100 + i) for i in range(100)]
        clock = time.perf_counter()
        core.accessed(batch)
        accessed.append((time.perf_counter() - clock) * 1000)
        clock = time.perf_counter()
        read()
        reads.append((time.perf_counter() - clock) * 1000)

    def pct(values: list[float]) -> dict[str, float]:
        return {"p50": round(float(np.percentile(values, 50)), 2), "p95": round(float(np.percentile(values, 95)), 2)}

    return {"distinct_accessed": distinct, "writer_accessed_ms": pct(accessed), "replica_read_ms": pct(reads),
            "file_kb": round(access_log.accesses_path(store).stat().st_size / 1024, 1)}


if __name__ == "__main__":
    sys.exit(main())
