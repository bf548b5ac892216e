#!/usr/bin/env python
"""Where a concurrency-1 request's time goes in an inline HelixAPI replica.

    RAY_SERVE_ENABLE_HA_PROXY=1 .venv/bin/python scripts/profile_serve_replica.py \\
        --store /tmp/helixbench/recall/store-100000 [--replicas 2] [--py-spy DIR]

Serves a hard-linked copy of ``--store`` with the inline graph (``bench_serve.py``'s
setup: API keys, the same queries), then runs one concurrency-1 HTTP loop and reports:

- in-process recall p50 before Ray starts (two encoder threads: the ratios' baseline)
  and per stage with one encoder thread (what a replica runs);
- the HTTP p50 / p95 and the replicas' per-stage p50 (``GET /v1/stats``);
- CPU seconds per request of every process on the host during the loop, and of each
  replica thread (``/proc/<pid>/task``);
- with ``--idle-s N``, the CPU every process takes while the application waits for
  requests, over N seconds (Ray's and Serve's background work, which a request shares
  the two cores with);
- with ``--py-spy DIR``, a raw py-spy profile of every replica during the loop (py-spy
  slows the replicas: read its proportions, not its times).

Ray is started here and shut down at the end (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serve as bs  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(path: str) -> float:
    stat = open(path).read()
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def processes() -> dict[int, tuple[str, float]]:
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = open(f"/proc/{entry}/cmdline").read().replace("\0", " ").strip()[:80]
            out[int(entry)] = (name, cpu_seconds(f"/proc/{entry}/stat"))
        except OSError:
            continue
    return out


def threads(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            out[int(tid)] = (comm, cpu_seconds(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
    return out


def stages_in_process(store: Path, queries: list[dict[str, str]], warmup: int) -> dict[str, float]:
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.store.generation import Generation

    recaller = Recaller(Generation.open_current(store), get_embedder(threads=1))
    for q in queries[:warmup]:
        recaller.recall(q["query"], user=q["user"], budget_tokens=512)
    seen = collections.defaultdict(list)
    for q in queries[warmup:]:
        for stage, ms in recaller.recall(q["query"], user=q["user"], budget_tokens=512).timings_ms.items():
            seen[stage].append(ms)
    return {stage: round(float(np.percentile(v, 50)), 2) for stage, v in seen.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--idle-s", type=float, default=0.0, help="also measure N seconds of idle CPU per process")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="also record each replica with py-spy into DIR")
    args = ap.parse_args()

    prepared = bs.prepare(Path(args.store), argparse.Namespace(requests=args.requests, warmup=args.warmup, seed=0))
    store, queries = prepared["store"], prepared["queries"]
    one_thread = stages_in_process(store, queries, args.warmup)
    bs.log(f"in-process, one encoder thread, p50 per stage: {json.dumps(one_thread)}")

    import httpx
    import ray
    from ray import serve

    from helix_ray.serve.app import ServeArgs, build_app
    from helix_ray.store.keys import KeyStore
    from helix_ray.serve.server import start_ray

    start_ray(num_cpus=2)
    try:
        keys = {u: KeyStore(store).create(u)[0] for u in sorted({q["user"] for q in queries})}
        bodies = [({"query": q["query"], "budget_tokens": 512}, {"Authorization": f"Bearer {keys[q['user']]}"})
                  for q in queries]
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(ServeArgs(store=str(store), retriever_replicas=(args.replicas, args.replicas),
                                      graph="inline")),
                  name="helix", route_prefix="/", logging_config={"enable_access_log": False, "log_level": "WARNING"})
        url = f"http://127.0.0.1:{args.port}"
        asyncio.run(bs.http_phase(url, bodies[: args.warmup], 1, args.max_seconds))
        replicas = [p for p, (name, _) in processes().items() if name.startswith("ray::ServeReplica:helix:HelixAPI")]
        if args.idle_s:
            idle_before = processes()
            time.sleep(args.idle_s)
            idle_after = processes()
            idle = sorted(((idle_after[p][1] - idle_before.get(p, ("", 0.0))[1], idle_after[p][0])
                           for p in idle_after), reverse=True)
            total = sum(s for s, _ in idle)
            print(f"idle for {args.idle_s:.0f} s: {100 * total / args.idle_s:.1f} % of one core in all")
            for seconds, name in idle[:10]:
                print(f"  {100 * seconds / args.idle_s:5.1f} %  {name}")
        if args.py_spy:
            Path(args.py_spy).mkdir(parents=True, exist_ok=True)
            for pid in replicas:
                subprocess.Popen([str(ROOT / ".venv" / "bin" / "py-spy"), "record", "-p", str(pid), "-d",
                                  str(int(args.max_seconds)), "-r", "250", "-f", "raw", "-o",
                                  f"{args.py_spy}/replica-{pid}.txt"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before, before_threads = processes(), {pid: threads(pid) for pid in replicas}
        http = asyncio.run(bs.http_phase(url, bodies[args.warmup:], 1, args.max_seconds))
        after = processes()
        bs.log(f"HTTP, concurrency 1: {http}")
        n = http["n"]
        used = sorted(((after[p][1] - before.get(p, ("", 0.0))[1], after[p][0]) for p in after), reverse=True)
        for seconds, name in used[:12]:
            print(f"  {1000 * seconds / n:6.2f} ms CPU per request  {name}")
        for pid in replicas:
            now = threads(pid)
            top = sorted(((now[t][1] - before_threads[pid].get(t, ("", 0.0))[1], now[t][0]) for t in now), reverse=True)
            print(f"  replica {pid} threads, ms CPU per request handled: "
                  + ", ".join(f"{name} {1000 * s / (n / len(replicas)):.2f}" for s, name in top[:4]))
        stats = httpx.get(url + "/v1/stats", headers=bodies[0][1], timeout=30).json()
        print("replica p50 per stage:", json.dumps({k: v["p50"] for k, v in stats["latency_ms"].items()}))
        serve.delete("helix")
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(prepared["work"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
