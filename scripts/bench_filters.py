#!/usr/bin/env python
"""In-process recall with and without scope filters (project, types, time window).

    .venv/bin/python scripts/bench_filters.py --store /tmp/helixbench/late/store-1000000 \\
        [--queries 200] [--tree /path/to/another/checkout]

A filter is a mask over the tenant's whole row range, built once per retriever leg:
on the 10^6 store (one tenant) that mask is what a filtered recall adds. Prints p50 / p95
per filter and the BM25 and dense legs' p50 (the stages that read the mask). The filter
values are taken from the store: the commonest project and the two commonest types of
the first 10,000 rows of the first query's tenant. ``--tree`` imports Helix from another
checkout (a worktree of an older commit) to compare, on the same store and queries.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_serve import queries_for, recaller_for  # puts this checkout on sys.path: --tree goes before it

    sys.path.insert(0, args.tree)
    assert "helix_ray" not in sys.modules
    import helix_ray

    args.tree = str(Path(helix_ray.__file__).resolve().parent.parent)

    store = Path(args.store)
    queries = queries_for(store, args.queries + args.warmup, args.seed)
    recaller = recaller_for(store)
    start, end = recaller.generation.partitions[queries[0]["user"]]  # one tenant's rows
    head = recaller.generation.memories.slice(start, min(end - start, 10_000))
    project = collections.Counter(p for p in head.column("project").to_pylist() if p).most_common(1)[0][0]
    types = [t for t, _ in collections.Counter(head.column("type").to_pylist()).most_common(2)]
    filters = {"none": {}, "project": {"project": project}, "types": {"types": types},
               "since": {"since": "2025-01-01"}, "all three": {"project": project, "types": types, "since": "2025-01-01"}}
    print(f"Helix from {args.tree}; {recaller.generation.size:,} memories; project={project!r}, types={types}")
    for q in queries[: args.warmup]:
        recaller.recall(q["query"], user=q["user"], budget_tokens=512)
    out = {}
    for name, kw in filters.items():
        times, legs = [], collections.defaultdict(list)
        for q in queries[args.warmup:]:
            clock = time.perf_counter()
            result = recaller.recall(q["query"], user=q["user"], budget_tokens=512, **kw)
            times.append((time.perf_counter() - clock) * 1000)
            timings = result.timings_ms if hasattr(result, "timings_ms") else result["timings_ms"]
            for leg in ("bm25", "dense"):
                if leg in timings:  # the dense leg does not run where BM25's signal is strong
                    legs[leg].append(timings[leg])
        out[name] = {"p50": round(float(np.percentile(times, 50)), 2), "p95": round(float(np.percentile(times, 95)), 2),
                     **{f"{leg}_p50": round(float(np.median(v)), 2) for leg, v in legs.items()}}
        print(f"  {name:>10}: {out[name]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": args.tree, "store": args.store, "filters": filters,
                                               "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
