#!/usr/bin/env python
"""Stage 3's near-duplicate search as a compaction or an incremental ingest runs it: a
store's current generation (its MinHash signatures and texts) plus ``--new`` memories
made from some of its texts (a third of them near-copies, so some old memories are
dropped for the newer copies and the reverse), searched whole and, where
the checkout has it, visiting only what the new memories can change (``settled``).

    .venv/bin/python scripts/bench_dedup.py --store /tmp/helixbench/recall/store-100000 \\
        [--new 300] [--tree /path/to/another/checkout]

Prints seconds and the number of items dropped per way; both ways must drop the same.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                    help="the Helix checkout to import (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from helix_ray.ingest.dedup import find_duplicates, signatures
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(Path(args.store))
    users = gen.memories.column("user").to_pylist()
    texts = gen.memories.column("text").to_pylist()
    sigs = np.asarray(gen.minhash)
    shingle = 2  # the ingest default (configs/ingest.yaml)
    # A store ingest built is deduplicated; one scripts/bench_recall.py built is not (it
    # skips stage 3): its duplicates are dropped first, as its next compaction would.
    clock = time.perf_counter()
    gone = {i for i, _, _ in find_duplicates(users, sigs, [(False, i, i) for i in range(len(users))],
                                             threshold=args.threshold, texts=texts, shingle=shingle)}
    if gone:
        keep = [i for i in range(len(users)) if i not in gone]
        users, texts, sigs = [users[i] for i in keep], [texts[i] for i in keep], sigs[keep]
    print(json.dumps({"settling": {"dropped": len(gone), "seconds": round(time.perf_counter() - clock, 3)}}))
    rng = np.random.default_rng(0)
    pick = rng.choice(len(texts), args.new, replace=False)
    fresh = [texts[i] + " again" if k % 3 == 0 else f"fresh note {k} about " + texts[(i + 1) % len(texts)][:80]
             for k, i in enumerate(pick)]
    all_users = users + [users[i] for i in pick]
    all_texts = texts + fresh
    all_sigs = np.concatenate([sigs, signatures(fresh, num_perm=sigs.shape[1], shingle=shingle)])
    preference = [(False, i, i) for i in range(len(all_users))]
    ways = {"whole": {}}
    if "settled" in inspect.signature(find_duplicates).parameters:
        ways["settled"] = {"settled": len(users)}
    out, found = {}, {}
    for name, extra in ways.items():
        clock = time.perf_counter()
        dropped = find_duplicates(all_users, all_sigs, preference, threshold=args.threshold, texts=all_texts,
                                  shingle=shingle, **extra)
        out[name] = {"seconds": round(time.perf_counter() - clock, 3), "dropped": len(dropped)}
        found[name] = sorted(dropped)
        print(json.dumps({"tree": args.tree, "memories": len(users), "new": args.new, "way": name, **out[name]}),
              flush=True)
    if any(f != found["whole"] for f in found.values()):
        print("the two ways dropped different items", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
