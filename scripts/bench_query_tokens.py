#!/usr/bin/env python
"""Recall latency on a store with late-interaction tokens: the query's token encoding run
before the legs (inline) against on a second thread alongside them (overlapped).

    .venv/bin/python scripts/bench_query_tokens.py --store /tmp/helixbench/locomo \\
        --locomo path/to/locomo10.json [--rounds 3] [--queries 300]

The store is any Helix store ingested with late interaction on (the default), here
LoCoMo's turns (``helix ingest path/to/locomo10.json --store DIR``); the
queries are LoCoMo's questions, each asked as its conversation's user. In one process,
model loaded and pages warm, the two modes alternate for ``--rounds`` rounds of the
same queries (the host drifts: compare within a round). Prints p50 / p95 of the whole
recall and p50 per stage per mode and round, and checks that both modes return the same
items.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def questions(path: Path, count: int, seed: int) -> list[tuple[str, str]]:
    data = json.loads(path.read_text())
    pairs = [(conv["sample_id"], qa["question"]) for conv in data for qa in conv["qa"] if qa.get("question")]
    rng = np.random.default_rng(seed)
    return [pairs[i] for i in rng.permutation(len(pairs))[:count]]


def _default_locomo() -> str | None:
    """LoCoMo under HELIX_DATA (the folder holding the benchmarks), if it is set."""
    data = os.environ.get("HELIX_DATA")
    return str(Path(data) / "locomo" / "locomo10.json") if data else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--locomo", default=_default_locomo(), help="locomo10.json (default: under $HELIX_DATA)")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="onnxruntime threads of both query encoders (0: what helix_ray.Memory picks)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.recall.threads import encoder_threads
    from helix_ray.store.generation import Generation

    generation = Generation.open_current(Path(args.store))
    if generation.late is None:
        print(f"{args.store} has no late-interaction tokens; ingest it with late interaction on", file=sys.stderr)
        return 2
    threads = args.threads or encoder_threads(generation)
    recaller = Recaller(generation, get_embedder(threads=threads), threads=threads)
    print(f"query encoder threads: {threads or 'onnxruntime default'}", flush=True)
    if not args.locomo:
        ap.error("--locomo is required (or set HELIX_DATA to the folder holding locomo/locomo10.json)")
    asked = questions(Path(args.locomo), args.queries + args.warmup, args.seed)
    answers: dict[bool, list[list[str]]] = {}
    for overlap in (False, True):
        recaller._overlap_tokens = overlap
        for user, q in asked[: args.warmup]:
            recaller.recall(q, user=user)
    for rnd in range(1, args.rounds + 1):
        for overlap in (False, True):
            recaller._overlap_tokens = overlap
            wall, stages, ids = [], {}, []
            for user, q in asked[args.warmup:]:
                clock = time.perf_counter()
                result = recaller.recall(q, user=user)
                wall.append((time.perf_counter() - clock) * 1000.0)
                ids.append([item.id for item in result.items])
                for stage, ms in result.timings_ms.items():
                    stages.setdefault(stage, []).append(ms)
            answers[overlap] = ids
            p50 = {s: round(float(np.percentile(v, 50)), 2) for s, v in stages.items() if s != "total"}
            print(f"round {rnd} {'overlapped' if overlap else 'inline    '}: recall p50 {np.percentile(wall, 50):6.2f} "
                  f"p95 {np.percentile(wall, 95):6.2f} ms | stages p50 {json.dumps(p50)}", flush=True)
    same = sum(a == b for a, b in zip(answers[False], answers[True]))
    print(f"same items in both modes: {same} of {len(answers[False])} queries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
