#!/usr/bin/env python
"""``Memory.add`` latency on a large store: the Writer's write path beside a whole ingest
of one record, in the same run.

    .venv/bin/python scripts/bench_add.py --store DIR --user USER [--adds 50] [--ingests 3] [--work DIR]

On a copy of ``--store`` (in ``--work``, default a temporary folder; the store given is
only read), in one process, no Ray:

1. a store whose DuckDB file holds no memories (``scripts/derived_store.py`` builds
   such stores) first gets the record an ingest would have left of its generation
   (``bench_mcp.record_generation``): the Writer looks ids up there, and an ingest
   builds the next generation from it;
2. ``Memory.add`` of one new memory of ``--user``, ``--adds`` times after one that
   loads the encoders: validated, embedded, logged in DuckDB, published to the delta;
   after each, a ``Memory.recall`` of its unique word, which must find it. With
   ``--turns``, every second add is a conversation turn of the session of the user's
   latest stored memory (episodic, dated now), which takes that session's context as it
   is written (:mod:`helix_ray.live.session_context`): timed as its own row;
3. ``Memory.compact``: the writes folded into a generation;
4. ``--ingests`` times, what ``Memory.add`` ran before it took the Writer's path: the
   record written to an fsynced JSONL file and a whole ingest of it, publishing a
   generation (``Memory.ingest``).

The ingest settings follow the store: late-interaction tokens only when its generation
has them (otherwise the first compaction or ingest would encode the tokens of every
memory). Prints p50 / p95 / mean in milliseconds per row, and the generation numbers.
"""

from __future__ import annotations

import argparse
import json
import os
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


def stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": len(a), "p50": round(float(np.percentile(a, 50)), 1), "p95": round(float(np.percentile(a, 95)), 1),
            "mean": round(float(a.mean()), 1)}


def note(user: str) -> tuple[str, dict[str, str]]:
    """A new memory of ``user`` with a word no other memory holds, and that word."""
    word = "bench" + uuid.uuid4().hex[:10]
    return word, {"user": user, "text": f"The {word} deploy freezes on Fridays after the release review."}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="the store to copy (read only)")
    ap.add_argument("--user", required=True, help="whose memories are added")
    ap.add_argument("--adds", type=int, default=50, help="timed Memory.add calls of one memory")
    ap.add_argument("--ingests", type=int, default=3, help="timed whole ingests of one record (the old path)")
    ap.add_argument("--work", default=None, help="folder for the copy (default: a temporary one)")
    ap.add_argument("--turns", action="store_true", help="every second add a turn of a stored session")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)

    from bench_mcp import record_generation

    from helix_ray.config import IngestConfig
    from helix_ray.memory import Memory
    from helix_ray.store.generation import Generation, current_generation_number

    with tempfile.TemporaryDirectory(prefix="helix-bench-add-", dir=args.work) as tmp:
        store = Path(tmp) / "store"
        clock = time.perf_counter()
        shutil.copytree(args.store, store)
        copied_s = time.perf_counter() - clock
        recorded_s = record_generation(store)
        generation = Generation.open_current(store)
        size, late = generation.size, bool(generation.manifest.get("late"))
        config = IngestConfig.model_validate({"late_interaction": {"enabled": late}})
        rows: dict[str, list[float]] = {"add": [], "turn": [], "recall": [], "ingest": []}
        start, end = generation.partitions[args.user]
        session = generation.memories.column("session_id")[end - 1].as_py()  # the user's latest memory's
        with Memory(store, ingest=config, record_access=False, compact_interval_s=None) as mem:
            mem.ready()
            first = current_generation_number(store)
            mem.add([note(args.user)[1]])  # loads the passage encoders
            for n in range(args.adds):
                word, record = note(args.user)
                turn = args.turns and n % 2 == 1 and session is not None
                if turn:
                    record.update(type="episodic", session_id=session)
                clock = time.perf_counter()
                mem.add([record])
                rows["turn" if turn else "add"].append((time.perf_counter() - clock) * 1000)
                clock = time.perf_counter()
                found = mem.recall(word, user=args.user, k=3).items
                rows["recall"].append((time.perf_counter() - clock) * 1000)
                assert found and word in found[0].text, f"the add of {word!r} was not recalled at once"
            after_adds = current_generation_number(store)
            clock = time.perf_counter()
            compaction = mem.compact()
            compact_s = time.perf_counter() - clock
            for n in range(args.ingests):
                word, record = note(args.user)
                path = Path(tmp) / f"old-path-{n}.jsonl"
                clock = time.perf_counter()
                with open(path, "w", encoding="utf-8") as fh:  # the inbox file the old path wrote
                    fh.write(json.dumps({**record, "source": "api"}) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                report = mem.ingest([path], format="jsonl")
                rows["ingest"].append((time.perf_counter() - clock) * 1000)
                assert report.published
            last = current_generation_number(store)

    names = {"add": "`Memory.add`, one memory (Writer: log + delta)",
             "turn": "`Memory.add`, one conversation turn of a stored session (its context mixed in)",
             "recall": "`Memory.recall` right after it (finds it)",
             "ingest": "a whole ingest of one record (the path `Memory.add` took before)"}
    print(f"store {args.store}: {size:,} memories, user {args.user}, late-interaction tokens: {late}; copied in "
          f"{copied_s:.1f} s" + (f", its generation recorded in DuckDB in {recorded_s:.1f} s" if recorded_s else ""))
    print(f"generation {first} before the adds, {after_adds} after them (none built per add); the compaction of "
          f"{compaction.get('folded')} writes took {compact_s:.1f} s (generation {compaction.get('generation')}); "
          f"after the ingests, generation {last}")
    print("| p50 / p95 / mean ms | n | p50 | p95 | mean |\n|---|---:|---:|---:|---:|")
    out = {}
    for key, ms in rows.items():
        if ms:
            s = out[key] = stats(ms)
            print(f"| {names[key]} | {s['n']} | {s['p50']:.1f} | {s['p95']:.1f} | {s['mean']:.1f} |")
    if rows["add"] and rows["ingest"]:
        print(f"ingest / add, p50: {np.percentile(rows['ingest'], 50) / np.percentile(rows['add'], 50):.0f}×")
    if args.json:
        Path(args.json).write_text(json.dumps({"store": args.store, "memories": size, "user": args.user, "rows": out,
                                               "compaction_s": compact_s}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
