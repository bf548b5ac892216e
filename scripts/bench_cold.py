#!/usr/bin/env python
"""An agent's first recall of a session, with and without the warm-up, on one store.

    .venv/bin/python scripts/bench_cold.py --store DIR [--user USER] [--rounds 3] [--wait 5] [--queries 40]

Each round starts two fresh processes, one opening ``Memory(store)`` with ``warm=True``
(the default) and one with ``warm=False``, in alternating order. Each sleeps ``--wait``
seconds after opening (an agent's session starts, then the model thinks before its
first tool call), then times its first recall and ``--queries`` more of the same user.
Queries are seeded from the user's memories (``bench_mcp.store_queries``); ``--user``
defaults to the store's largest tenant.

Prints, per mode: the first recall's milliseconds (median over rounds, and each round's),
the later recalls' p50 / p95, and the first recall as a multiple of that p95. The page
cache is the host's: a process is cold, the files may not be (drop the cache first, as
root, to measure a cold disk).
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def one_process(store: str, user: str, queries: list[str], warm: bool, wait: float) -> dict:
    """Runs in a fresh process: open, wait, time the first recall and the rest."""
    from helix_ray.memory import Memory

    clock = time.perf_counter()
    mem = Memory(store, record_access=False, warm=warm)
    open_ms = (time.perf_counter() - clock) * 1000
    time.sleep(wait)
    times = []
    for query in queries:
        clock = time.perf_counter()
        mem.recall(query, user=user)
        times.append((time.perf_counter() - clock) * 1000)
    mem.close()
    return {"open_ms": open_ms, "first_ms": times[0], "rest_ms": times[1:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--user")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=5.0, help="seconds between opening and the first recall")
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(one_process(**spec)))
        return 0

    from bench_mcp import store_queries

    from helix_ray.recall.warm import largest_tenant
    from helix_ray.store.generation import Generation

    user = args.user or largest_tenant(Generation.open_current(Path(args.store)))
    queries = store_queries(Path(args.store), user, args.queries + 1, seed=0)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for warm in ((True, False) if round_ % 2 == 0 else (False, True)):
            spec = {"store": args.store, "user": user, "queries": queries, "warm": warm, "wait": args.wait}
            out = subprocess.run([sys.executable, __file__, "--store", args.store, "--child", json.dumps(spec)],
                                 capture_output=True, text=True, check=True)
            runs[warm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"store {args.store}, user {user}, {args.rounds} rounds, first recall {args.wait:g} s after opening")
    print(f"{'mode':<12} {'first ms (median; each round)':<36} {'later p50':>9} {'later p95':>9} {'first / p95':>11}")
    for warm in (True, False):
        firsts = [r["first_ms"] for r in runs[warm]]
        rest = np.concatenate([r["rest_ms"] for r in runs[warm]])
        p50, p95 = np.percentile(rest, [50, 95])
        each = ", ".join(f"{f:.0f}" for f in firsts)
        print(f"{'warm=True' if warm else 'warm=False':<12} {np.median(firsts):>7.0f}  ({each}){'':<{max(0, 26 - len(each))}}"
              f" {p50:>9.1f} {p95:>9.1f} {np.median(firsts) / p95:>10.1f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
