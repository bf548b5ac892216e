#!/usr/bin/env python
"""Ingest into a large store: what a compaction of a few hundred new memories costs.

    .venv/bin/python scripts/bench_compact.py --store /tmp/helixbench/recall/store-100000 \\
        --new 300 --runs 3 [--tree /path/to/another/checkout]

Copies ``--store`` to a temporary folder, then ``--runs`` times ingests ``--new`` new
memories spread over the store's users (``runner="local"``, what ``helix compact`` and
the server's compactor run), and prints each run's seconds per stage. The first run
reads a generation the copy came with; the later ones read the generation the run
before published. Late interaction is on when the store holds token vectors.
``--tree`` imports Helix from another checkout (a worktree of an older commit) to
compare in the same session.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("gateway deploy config retry cache token index shard replica kafka postgres latency budget "
         "rollout canary schema migration alert pager quota bucket ledger vault").split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a store to copy and ingest into")
    ap.add_argument("--new", type=int, default=300, help="new memories per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from helix_ray.config import IngestConfig
    from helix_ray.store.generation import Generation
    from helix_ray.ingest.run import ingest

    root = Path(tempfile.mkdtemp(prefix="helix-bench-compact-"))
    store = root / "store"
    shutil.copytree(args.store, store)
    gen = Generation.open_current(store)
    users = sorted(gen.partitions)
    config = IngestConfig(late_interaction={"enabled": gen.late is not None})
    print(f"Helix from {args.tree}; {gen.size:,} memories, {len(users)} users; late interaction "
          f"{'on' if gen.late is not None else 'off'}", flush=True)
    rng = np.random.default_rng(0)
    runs = []
    try:
        for run in range(args.runs):
            rows = [{"id": f"bench-{run}-{i}", "user": users[i % len(users)],
                     "text": f"note {run}-{i}: " + " ".join(rng.choice(WORDS, 30))} for i in range(args.new)]
            source = root / f"new-{run}.jsonl"
            source.write_text("\n".join(json.dumps(r) for r in rows))
            t0 = time.perf_counter()
            report = ingest([source], store, config=config, runner="local", show_progress=False)
            seconds = round(time.perf_counter() - t0, 2)
            runs.append({"run": run, "seconds": seconds, "stages": report.as_dict().get("seconds"),
                         "memories": report.total_memories})
            print(f"run {run}: {seconds:.2f} s  {json.dumps(runs[-1]['stages'])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": args.tree, "store": args.store, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
