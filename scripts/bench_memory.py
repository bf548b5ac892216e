#!/usr/bin/env python
"""What one recall process holds: memory and latency of ``Memory.recall`` on one store,
beside another checkout of Helix (a baseline) in the same run.

    .venv/bin/python scripts/bench_memory.py --store DIR [--baseline-tree OLD_CHECKOUT \\
        --baseline-store OLD_DIR] [--rounds 3] [--queries 120]

Each round starts a fresh process per tree, in alternating order: it opens
``Memory(store)`` without the warm-up, answers one question, then ``--queries`` more
(seeded from the largest tenant's memories, ``bench_mcp.store_queries``), and reports
its RSS, USS and PSS (``/proc/<pid>/smaps_rollup``), the MiB of the store's files it
maps (largest first), and the recalls' p50 / p95. USS is
what the process holds alone: its heap, the columns it built, the pages it wrote; PSS
adds its share of the pages it maps with others. ``--baseline-store`` is the same data
as the baseline writes it (a store's format may differ between versions).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def one_process(store: str, user: str, queries: list[str]) -> dict:
    """Runs in a fresh process, with the tree to measure first on ``sys.path``."""
    import inspect

    import psutil

    from helix_ray.memory import Memory

    options = {"warm": False} if "warm" in inspect.signature(Memory).parameters else {}
    mem = Memory(store, record_access=False, **options)
    mem.recall(queries[0], user=user)
    times = []
    for query in queries[1:]:
        clock = time.perf_counter()
        mem.recall(query, user=user)
        times.append((time.perf_counter() - clock) * 1000)
    info = psutil.Process().memory_full_info()
    return {"rss": info.rss / 2**20, "uss": info.uss / 2**20, "pss": info.pss / 2**20, "ms": times,
            "mapped": mapped_store(Path(store).resolve())}


def mapped_store(store: Path) -> dict[str, float]:
    """MiB of each of the store's files this process has mapped (``Rss`` of its mappings
    in ``/proc/self/smaps``): what the page faults of its reads brought into it."""
    mapped: dict[str, float] = {}
    name = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 6 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            name = head[5] if head[5].startswith(str(store)) else None
        elif name and head[:1] == ["Rss:"]:
            key = Path(name).relative_to(store).as_posix().split("/", 2)[-1]  # without generations/<n>/
            mapped[key] = mapped.get(key, 0.0) + int(head[1]) / 1024
    return mapped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--baseline-tree", help="another checkout of Helix to measure beside this one")
    parser.add_argument("--baseline-store", help="the store as the baseline writes it (default: --store)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=120)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        sys.path.insert(0, spec.pop("tree"))
        print(json.dumps(one_process(**spec)))
        return 0

    from bench_mcp import store_queries

    sys.path.insert(0, str(ROOT))
    from helix_ray.recall.warm import largest_tenant
    from helix_ray.store.generation import Generation

    user = largest_tenant(Generation.open_current(Path(args.store)))
    assert user is not None, f"{args.store} holds no memories"
    queries = store_queries(Path(args.store), user, args.queries + 1, seed=0)
    trees = {"this": (str(ROOT), args.store)}
    if args.baseline_tree:
        trees["baseline"] = (args.baseline_tree, args.baseline_store or args.store)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
            tree, store = trees[name]
            spec = {"tree": tree, "store": store, "user": user, "queries": queries}
            out = subprocess.run([sys.executable, __file__, "--store", store, "--child", json.dumps(spec)],
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"user {user}, {args.queries} recalls per process after one, {args.rounds} rounds (medians)")
    print(f"{'tree':<10} {'RSS MiB':>8} {'USS MiB':>8} {'PSS MiB':>8} {'p50 ms':>7} {'p95 ms':>7}   p50 per round")
    for name, rows in runs.items():
        med = {k: float(np.median([r[k] for r in rows])) for k in ("rss", "uss", "pss")}
        p50s = [float(np.percentile(r["ms"], 50)) for r in rows]
        p95s = [float(np.percentile(r["ms"], 95)) for r in rows]
        print(f"{name:<10} {med['rss']:>8.0f} {med['uss']:>8.0f} {med['pss']:>8.0f} {np.median(p50s):>7.1f} "
              f"{np.median(p95s):>7.1f}   {', '.join(f'{p:.1f}' for p in p50s)}")
    for name, rows in runs.items():
        files = {f: float(np.median([r["mapped"].get(f, 0.0) for r in rows])) for r in rows for f in r["mapped"]}
        top = sorted(files.items(), key=lambda kv: -kv[1])[:6]
        print(f"{name:<10} maps {sum(files.values()):,.0f} MiB of the store: "
              + ", ".join(f"{f} {mib:,.0f}" for f, mib in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
