#!/usr/bin/env python
"""A compaction that folds pending writes into a segment, beside one that rebuilds every
file, on the same writes and store, in the same run.

    .venv/bin/python scripts/bench_fold.py --store DIR --user USER [--new 1000] [--rounds 2] [--queries 100]

Each round makes two copies of ``--store`` (the store given is only read; ``--work``
holds the copies, default a temporary folder), and on each, in one process, no Ray:
``Memory.add`` of the same ``--new`` memories of ``--user`` (encoded then, as a served
write is), then ``Memory.compact`` as a fold (``IngestConfig.fold`` set so that it folds)
on one copy and as a rebuild (``fold.max_rows`` 0: the ingest pipeline over every file,
today's behaviour below ``fold.min_base_rows``) on the other, alternating which goes
first. After each compaction, ``--queries`` recalls of the user's golden or generated
questions (after 5 warm-up) time the recall that follows: with the writes in a segment
(searched as the delta is) or in the generation's own files.

Prints one row per compaction and the fold / rebuild ratio of the medians; ``--json``
writes the rows.

``--against REF`` (``main``, a commit) first runs this script as it is at that git ref
(``scripts/against.py``) with the same arguments, then this code's, and adds the
medians of the two side by side.

``--segment-rows 0,1000,5000`` instead times recall over a generation with that many
segment rows: on a copy of ``--store``, a segment of ``--user``'s first N base rows
under new ids (their vectors, MinHash and text; no token vectors), as a fold would add
them (``publish_segment``), then ``--queries`` recalls.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

def writes(user: str, n: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    words = ("gateway deploy config retry cache token index shard replica kafka postgres latency budget "
             "rollout canary schema migration alert pager quota bucket ledger vault").split()
    return [{"id": f"fold-{seed}-{i}", "user": user,
             "text": f"Note {uuid.uuid4().hex[:8]}: " + " ".join(rng.choice(words, 24))} for i in range(n)]


def timed_recalls(mem, user: str, questions: list[str]) -> dict[str, float]:
    """p50 and p95 ms of ``mem.recall`` over ``questions``, the warm-up ones untimed."""
    from bench_mcp import WARMUP

    ms = []
    for i, q in enumerate(questions):
        clock = time.perf_counter()
        mem.recall(q, user=user)
        if i >= WARMUP:
            ms.append((time.perf_counter() - clock) * 1000)
    return {"recall_p50_ms": round(float(np.percentile(ms, 50)), 2),
            "recall_p95_ms": round(float(np.percentile(ms, 95)), 2)}


def one(source: Path, work: Path, user: str, rows: list[dict[str, str]], questions: list[str], mode: str) -> dict:
    from bench_mcp import record_generation

    from helix_ray.config import IngestConfig
    from helix_ray.memory import Memory
    from helix_ray.store.generation import Generation

    store = work / f"store-{mode}"
    shutil.copytree(source, store)
    try:
        record_generation(store)
        generation = Generation.open_current(store)
        late = bool(generation.manifest.get("late"))
        fold = {"min_base_rows": 0, "max_rows": len(rows), "max_share": 1.0} if mode == "fold" else {"max_rows": 0}
        config = IngestConfig.model_validate({"late_interaction": {"enabled": late}, "fold": fold})
        with Memory(store, ingest=config, record_access=False, compact_interval_s=None) as mem:
            mem.ready()
            mem.add(rows)
            clock = time.perf_counter()
            report = mem.compact()
            seconds = time.perf_counter() - clock
            assert report["published"] and report.get("mode", "rebuild") == {"fold": "segment"}.get(mode, mode), report
            recall = timed_recalls(mem, user, questions)
        return {"mode": mode, "memories": generation.size, "folded": report["folded"], "seconds": round(seconds, 3),
                **recall}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def segment_of(source: Path, user: str, n: int):
    """A segment of ``user``'s first ``n`` rows of ``source``'s generation, under new ids
    and seqs, in the delta's row format."""
    import pyarrow as pa

    from helix_ray.live.delta_format import NOT_FOLDED, delta_schema
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(source)
    start, end = gen.partitions[user]
    rows = np.arange(start, min(start + n, end))
    table = gen.memories.take(pa.array(rows))
    vectors = np.asarray(gen.vectors[rows]).astype(np.float32)
    minhash = np.asarray(gen.minhash[rows])
    m = len(rows)
    cols = {"seq": np.arange(1, m + 1) + 10**9, "id": [f"segment-{i}" for i in range(m)], "user": [user] * m,
            "text": table.column("text"), "lexical": table.column("text"), "type": table.column("type"),
            "project": table.column("project"), "session_id": table.column("session_id"),
            "created_at": table.column("created_at").cast(pa.int64()), "salience": table.column("salience"),
            "confidence": table.column("confidence"), "pinned": table.column("pinned"),
            "n_tokens": table.column("n_tokens"),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), vectors.shape[1]),
            "minhash": pa.FixedSizeListArray.from_arrays(pa.array(minhash.ravel(), pa.uint32()), minhash.shape[1]),
            "folded_into": [NOT_FOLDED] * m, "late_codes": [None] * m, "late_scales": [None] * m,
            "record": [None] * m, "computed_by": [None] * m}
    schema = delta_schema(vectors.shape[1], minhash.shape[1])
    return pa.table({name: cols[name] for name in schema.names}, schema=schema)


def recall_over_segments(source: Path, work: Path, user: str, n: int, questions: list[str]) -> dict:
    from helix_ray.memory import Memory
    from helix_ray.store.generation import DEAD_SCHEMA
    from helix_ray.store.publish import publish_segment

    store = work / f"store-segment-{n}"
    shutil.copytree(source, store)
    try:
        if n:
            publish_segment(store, segment_of(source, user, n), DEAD_SCHEMA.empty_table())
        with Memory(store, record_access=False, compact_interval_s=None) as mem:
            mem.ready()
            return {"segment_rows": n, **timed_recalls(mem, user, questions)}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--store", required=True, help="the store to copy (read only)")
    ap.add_argument("--user", required=True, help="whose memories are written")
    ap.add_argument("--new", type=int, default=1000, help="pending writes each compaction folds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queries", type=int, default=100, help="timed recalls after each compaction")
    ap.add_argument("--work", default=None, help="folder for the copies (default: a temporary one)")
    ap.add_argument("--segment-rows", default=None,
                    help="comma-separated segment sizes: time recall over each instead (see above)")
    ap.add_argument("--against", metavar="REF",
                    help="first run this script as it is at git ref REF (e.g. main) with the same arguments, then "
                         "this code's run, and print the median seconds and recall of the two side by side")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)

    from bench_mcp import queries

    theirs = None
    if args.against and args.segment_rows:
        raise SystemExit("--against compares compactions; run --segment-rows alone")
    if args.against:
        from against import run_ref

        theirs = run_ref("bench_fold.py", args.against, argv if argv is not None else sys.argv[1:])
    out = []
    if args.segment_rows:
        with tempfile.TemporaryDirectory(prefix="helix-bench-fold-", dir=args.work) as tmp:
            questions = queries(Path(args.store), args.user, args.queries)
            for n in [int(x) for x in args.segment_rows.split(",")]:
                out.append(recall_over_segments(Path(args.store), Path(tmp), args.user, n, questions))
                print(json.dumps(out[-1]), flush=True)
        base = next((o for o in out if o["segment_rows"] == 0), None)
        print("| segment rows | recall p50 / p95 ms | p50 / no segment |\n|---:|---|---:|")
        for o in out:
            ratio = f"{o['recall_p50_ms'] / base['recall_p50_ms']:.2f}" if base else "-"
            print(f"| {o['segment_rows']:,} | {o['recall_p50_ms']} / {o['recall_p95_ms']} | {ratio} |")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="helix-bench-fold-", dir=args.work) as tmp:
        questions = queries(Path(args.store), args.user, args.queries)
        for r in range(args.rounds):
            rows = writes(args.user, args.new, seed=r)
            for mode in (("fold", "rebuild") if r % 2 == 0 else ("rebuild", "fold")):
                row = {"round": r, **one(Path(args.store), Path(tmp), args.user, rows, questions, mode)}
                out.append(row)
                print(json.dumps(row), flush=True)
    print("| compaction | memories | writes | seconds | recall after, p50 / p95 ms |\n|---|---:|---:|---|---|")
    for mode in ("fold", "rebuild"):
        mine = [o for o in out if o["mode"] == mode]
        seconds = ", ".join(str(o["seconds"]) for o in mine)
        recall = ", ".join(f"{o['recall_p50_ms']} / {o['recall_p95_ms']}" for o in mine)
        print(f"| {mode} | {mine[0]['memories']:,} | {mine[0]['folded']:,} | {seconds} | {recall} |")
    med = {m: float(np.median([o["seconds"] for o in out if o["mode"] == m])) for m in ("fold", "rebuild")}
    print(f"fold / rebuild, median seconds: {med['fold'] / med['rebuild']:.3f}")
    if theirs is not None:
        print(against_table(out, theirs["results"], args.against))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def against_table(ours: list[dict], theirs: list[dict], ref: str) -> str:
    """Per compaction mode, the medians of this run's rounds and of ``ref``'s: seconds
    and the recall after it (p50 / p95), with their ratios."""
    lines = [f"| compaction, medians | this code | {ref} | this / {ref} |", "|---|---:|---:|---:|"]
    for mode in ("fold", "rebuild"):
        for key, label in (("seconds", "seconds"), ("recall_p50_ms", "recall after, p50 ms"),
                           ("recall_p95_ms", "recall after, p95 ms")):
            a = float(np.median([o[key] for o in ours if o["mode"] == mode]))
            b = float(np.median([o[key] for o in theirs if o["mode"] == mode]))
            lines.append(f"| {mode}: {label} | {a:.2f} | {b:.2f} | {a / b:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
