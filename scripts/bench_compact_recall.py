#!/usr/bin/env python
"""Recall latency while a compaction runs, beside recall on an idle store, in one process.

    .venv/bin/python scripts/bench_compact_recall.py --store /tmp/helixbench/recall/store-100000 \\
        --new 300 --rounds 3 --nice 0,10,19 [--work DIR] [--json PATH]

On a copy of ``--store`` (in ``--work``, default a temporary folder; the store given is
only read), with no Ray, as an open :class:`helix_ray.Memory` does: recall runs in this
thread, one query after the other; a compaction runs in a second thread at each
``--nice`` value (how much nicer than the process it runs: what the background
compactor does with :data:`helix_ray.live.compactor.COMPACT_NICE`, through the same
:func:`~helix_ray.live.compactor.lower_priority`; the thread is started fresh for each
compaction, since a thread cannot lower its nice value again). Each round, for each nice
value (their order rotates from round to round):

1. ``--new`` memories of the largest tenant are written with ``Memory.add`` (embedded
   at write, as the Writer does; not timed);
2. ``--idle`` recalls of that tenant, with nothing else running: the idle baseline,
   next to the compaction in time;
3. ``Memory.compact`` in the second thread, and recalls in this one until it returns.

A store whose DuckDB file holds no memories (``scripts/derived_store.py`` builds such
stores) first gets the record an ingest would have left (``bench_mcp.record_generation``).
Recall hits are not recorded (``record_access=False``), so the only other work is the
compaction. Prints, per nice value, recall p50 / p95 idle and during compactions, their
ratio, the recall milliseconds lost per compaction (the recalls during it, less as many
at the round's idle median: the median over compactions) and the compactions' seconds.
The p95 ratio alone misleads when a change shortens the compaction: the recalls it no
longer overlaps are dropped from the window, not the slow ones.

``--busy thread,process`` adds a row per kind, for each nice value: ``--idle`` recalls
beside a pure-Python busy loop in a second thread of this process, or in another
process, at that nice value, beside as many idle ones. It tells what work beside recall
costs it by where the work runs: a process competes for the cores alone, which its nice
value settles; a thread also for this process's GIL, which no nice value does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def compact_in_thread(mem: Any, nice: int, out: dict[str, Any]) -> threading.Thread:
    """Start ``mem.compact()`` in a new thread made ``nice`` nicer first; ``out`` gets
    the report, its seconds and the nice value the thread ran at."""
    from helix_ray.live.compactor import lower_priority

    def run() -> None:
        out["nice_value"] = lower_priority(nice)
        clock = time.perf_counter()
        try:
            out["report"] = mem.compact()
        except Exception as exc:  # noqa: BLE001 - reported by the caller, with the round it ended
            out["report"] = {"published": False, "error": repr(exc)}
        out["seconds"] = time.perf_counter() - clock

    thread = threading.Thread(target=run, name=f"bench-compact-nice{nice}", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def busy_loop(kind: str, nice: int) -> Iterator[None]:
    """A pure-Python busy loop ``nice`` nicer than this process for the block: in a
    second thread of it (``thread``) or in a process of its own (``process``)."""
    from helix_ray.live.compactor import lower_priority

    if kind == "process":
        loop = subprocess.Popen([sys.executable, "-c", f"import os\nos.nice({nice})\nwhile True: pass"])
        try:
            yield
        finally:
            loop.kill()
            loop.wait()
        return
    stop = threading.Event()

    def spin() -> None:
        lower_priority(nice)
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name=f"bench-busy-nice{nice}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="the store to copy (read only)")
    ap.add_argument("--new", type=int, default=300, help="memories written before each compaction")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nice", default="0,10,19", help="comma-separated nice increments of the compaction's thread")
    ap.add_argument("--idle", type=int, default=100, help="idle recalls before each compaction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="folder for the copy (default: a temporary one)")
    ap.add_argument("--busy", default="", help="comma-separated: thread, process (rows beside a busy loop)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    nices = [int(v) for v in args.nice.split(",")]
    kinds = [k for k in args.busy.split(",") if k]
    if any(k not in ("thread", "process") for k in kinds):
        raise SystemExit(f"--busy takes thread and process; got {args.busy!r}")

    from bench_add import stats
    from bench_compact import WORDS
    from bench_mcp import record_generation, store_queries

    from helix_ray.config import IngestConfig
    from helix_ray.memory import Memory
    from helix_ray.store.generation import Generation

    rng = np.random.default_rng(args.seed)
    rows: dict[int, dict[str, Any]] = {n: {"idle": [], "during": [], "compaction_s": [], "lost_ms": [],
                                           "thread_nice": None} for n in nices}
    beside: dict[tuple[str, int], tuple[list[float], list[float]]] = {}  # (kind, nice) → idle, busy recalls
    with tempfile.TemporaryDirectory(prefix="helix-bench-compact-recall-", dir=args.work) as tmp:
        store = Path(tmp) / "store"
        shutil.copytree(args.store, store)
        record_generation(store)
        generation = Generation.open_current(store)
        user = max(generation.partitions, key=lambda u: generation.partitions[u][1] - generation.partitions[u][0])
        start, end = generation.partitions[user]
        size, late = generation.size, bool(generation.manifest.get("late"))
        queries = store_queries(store, user, 200, args.seed)
        config = IngestConfig.model_validate({"late_interaction": {"enabled": late}})
        print(f"store {args.store}: {size:,} memories; tenant {user} ({end - start:,}); late-interaction "
              f"tokens: {late}; {args.new} writes per compaction", flush=True)
        with Memory(store, ingest=config, record_access=False, compact_interval_s=None) as mem:
            mem.ready()
            asked = 0

            def recall() -> float:
                nonlocal asked
                clock = time.perf_counter()
                mem.recall(queries[asked % len(queries)], user=user)
                asked += 1
                return (time.perf_counter() - clock) * 1000

            for _ in range(20):  # warm-up
                recall()
            for round_ in range(args.rounds):
                for nice in nices[round_ % len(nices):] + nices[:round_ % len(nices)]:
                    mem.add([{"id": f"bench-{round_}-{nice}-{i}", "user": user,
                              "text": f"note {round_}-{i}: " + " ".join(rng.choice(WORDS, 30))}
                             for i in range(args.new)])
                    idle = [recall() for _ in range(args.idle)]
                    out: dict[str, Any] = {}
                    thread = compact_in_thread(mem, nice, out)
                    during = [recall()]  # at least one, however soon the compaction ends
                    while thread.is_alive():
                        during.append(recall())
                    thread.join()
                    if not out.get("report", {}).get("published"):
                        raise SystemExit(f"the compaction published nothing: {out.get('report')}")
                    rows[nice]["idle"] += idle
                    rows[nice]["during"] += during
                    rows[nice]["compaction_s"].append(round(out["seconds"], 2))
                    rows[nice]["lost_ms"].append(float(np.sum(during) - len(during) * np.median(idle)))
                    rows[nice]["thread_nice"] = out["nice_value"]
                    print(f"round {round_} nice +{nice} (thread at {out['nice_value']}): compaction "
                          f"{out['seconds']:.1f} s, {len(during)} recalls during it; p95 idle "
                          f"{np.percentile(idle, 95):.1f} ms, during {np.percentile(during, 95):.1f} ms", flush=True)
            for kind in kinds:
                for nice in nices:
                    idle = [recall() for _ in range(args.idle)]
                    with busy_loop(kind, nice):
                        during = [recall() for _ in range(args.idle)]
                    beside[(kind, nice)] = (idle, during)

    print("\n| compaction thread | recall p50 / p95 idle, ms | during a compaction | p95 ratio | recalls during "
          "| recall ms lost per compaction | compaction s |\n|---|---|---|---:|---:|---:|---|")
    summary: dict[Any, Any] = {}
    for nice in nices:
        quiet, busy = stats(rows[nice]["idle"]), stats(rows[nice]["during"])
        ratio = round(busy["p95"] / quiet["p95"], 2)
        lost = round(float(np.median(rows[nice]["lost_ms"])), 1)
        summary[nice] = {"idle": quiet, "during": busy, "p95_ratio": ratio, "compaction_s": rows[nice]["compaction_s"],
                         "lost_ms": rows[nice]["lost_ms"], "thread_nice": rows[nice]["thread_nice"]}
        seconds = ", ".join(f"{s:.1f}" for s in rows[nice]["compaction_s"])
        print(f"| nice +{nice} | {quiet['p50']} / {quiet['p95']} | {busy['p50']} / {busy['p95']} | {ratio:.2f}× "
              f"| {busy['n']} | {lost} | {seconds} |")
    for (kind, nice), (idle, during) in beside.items():
        quiet, busy = stats(idle), stats(during)
        ratio = round(busy["p95"] / quiet["p95"], 2)
        summary[f"busy {kind} +{nice}"] = {"idle": quiet, "during": busy, "p95_ratio": ratio}
        label = "a Python thread" if kind == "thread" else "a process"
        print(f"| busy loop in {label}, +{nice} | {quiet['p50']} / {quiet['p95']} | {busy['p50']} / {busy['p95']} "
              f"| {ratio:.2f}× | {busy['n']} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps({"store": args.store, "memories": size, "user": user, "new": args.new,
                                               "rows": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
