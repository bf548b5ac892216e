#!/usr/bin/env python
"""Served recall over in-process recall with no Ray on the host during the in-process
blocks, alternated so that the host's drift cancels out.

    RAY_SERVE_ENABLE_HA_PROXY=1 .venv/bin/python scripts/bench_serve_strict.py \\
        --store /tmp/helixbench/recall/store-100000 [--rounds 4] [--requests 300]

``bench_serve.py`` gives two ratios for "Serve time ≤ 1.5× the in-process time": against
in-process recall measured once before Ray starts (the quiet host a notebook user has,
but minutes away from the HTTP phase on a host whose speed drifts within minutes),
and against in-process blocks alternated with HTTP blocks while Serve runs idle (no
drift, but Ray's own background work — its many context switches a second — then slows the
in-process side too). This script takes both conditions at once: each round runs an
in-process block with no Ray on the host and an HTTP block on a Ray and Serve started for
it and shut down after it, in alternating order (in-process first in even rounds). The
in-process blocks run in a child process started before any Ray (the embedder and the
generation loaded and warmed once), which waits on a pipe while Ray runs.

Prints each round's p50 / p95 for both, their ratios, and the median ratio over rounds.
Ray is started and shut down here (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serve as bs  # noqa: E402


def child(store: Path, count: int, warmup: int, seed: int) -> int:
    """The in-process side: load, warm up, then one block per line read from stdin. Its
    answers go to stdout behind :data:`REPLY`; anything else printed goes to stderr."""
    reply, sys.stdout = sys.stdout, sys.stderr
    queries = bs.queries_for(store, count + warmup, seed)
    recaller = bs.recaller_for(store)
    bs.in_process(store, queries[:warmup], 0, recaller)
    print(REPLY + "{}", file=reply, flush=True)
    for _ in sys.stdin:
        bs.in_process(store, queries[:warmup], 0, recaller)  # warmed up again: its caches aged while Ray ran
        print(REPLY + json.dumps(bs.in_process(store, queries[warmup:], 0, recaller)), file=reply, flush=True)
    return 0


REPLY = "helix-in-process "


def read_reply(proc: subprocess.Popen) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(REPLY):
            return dict(json.loads(line[len(REPLY):]))
    raise SystemExit(f"the in-process child ended (exit code {proc.wait()})")


def http_block(store: Path, bodies: list[tuple[dict, dict]], args: argparse.Namespace) -> dict[str, Any]:
    """Start Ray and Serve, deploy the inline graph, warm up, let it settle, one
    concurrency-1 loop, shut down. A new port each time: the last Ray's may linger."""
    import ray
    from ray import serve

    from helix_ray.runtime import spare_port
    from helix_ray.serve.app import ServeArgs, build_app
    from helix_ray.serve.server import start_ray

    port = spare_port()

    out: dict[str, Any] = {}
    clock = time.perf_counter()
    environ = dict(os.environ)  # start_ray draws HAProxy's ports into it: new ones each round
    start_ray(num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ServeArgs(store=str(store), retriever_replicas=(1, 1), graph="inline")),
                  name="helix", route_prefix="/",
                  logging_config={"enable_access_log": False, "log_level": "WARNING"})
        up = time.perf_counter() - clock
        url = f"http://127.0.0.1:{port}"
        asyncio.run(bs.http_phase(url, bodies[: args.warmup], 1, 60.0))
        time.sleep(args.quiet_s)  # Ray's own start-up work done
        if args.settle_s:
            asyncio.run(bs.http_phase(url, bodies * 100, 1, args.settle_s))
        out = asyncio.run(bs.http_phase(url, bodies[args.warmup:], 1, 120.0))
        out["ray_up_s"] = round(up, 1)
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environ)
    if out["errors"] or out["n"] < len(bodies) - args.warmup:
        raise SystemExit(f"the HTTP block did not answer every request: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=300, help="requests per block (after warm-up)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="unmeasured HTTP load after the warm-up (the replica's pages and caches)")
    ap.add_argument("--quiet-s", type=float, default=20.0,
                    help="pause between the application's start and the settling load (Ray's start-up work)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="pause after Ray's shutdown before an in-process block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(Path(args.store), args.requests, args.warmup, args.seed)

    from helix_ray.store.keys import KeyStore
    from helix_ray.serve.server import starts_own_ray

    if not starts_own_ray():  # a cluster it joined would lose its Serve applications at each round's end
        raise SystemExit("RAY_ADDRESS is set: this benchmark starts and shuts down a Ray of its own for each "
                         "HTTP block, on a host with no other Ray running. Unset RAY_ADDRESS.")

    work = Path(tempfile.mkdtemp(prefix="helix-bench-strict-"))
    store = bs.linked_copy(Path(args.store), work / "store")
    queries = bs.queries_for(store, args.requests + args.warmup, args.seed)
    keys = {u: KeyStore(store).create(u)[0] for u in sorted({q["user"] for q in queries})}
    bodies = [({"query": q["query"], "budget_tokens": 512}, {"Authorization": f"Bearer {keys[q['user']]}"})
              for q in queries]
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--store", str(store), "--requests",
                             str(args.requests), "--warmup", str(args.warmup), "--seed", str(args.seed)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    read_reply(proc)  # loaded and warmed up
    rounds = []
    try:
        for r in range(args.rounds):
            blocks: dict[str, dict[str, Any]] = {}
            for kind in (("in_process", "http") if r % 2 == 0 else ("http", "in_process")):
                if kind == "in_process":
                    time.sleep(args.idle_s)  # Ray's processes gone, the host settled
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    blocks[kind] = read_reply(proc)
                else:
                    blocks[kind] = http_block(store, bodies, args)
                bs.log(f"round {r} {kind}: {blocks[kind]}")
            h, ip = blocks["http"], blocks["in_process"]
            rounds.append({"round": r, "in_process": ip, "http": h,
                           "ratio_p50": round(h["p50"] / ip["p50"], 2), "ratio_p95": round(h["p95"] / ip["p95"], 2)})
            bs.log(f"round {r}: HTTP / in-process p50 {rounds[-1]['ratio_p50']}, p95 {rounds[-1]['ratio_p95']}")
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    median = {q: round(float(np.median([o[f"ratio_{q}"] for o in rounds])), 2) for q in ("p50", "p95")}
    print("| round | in-process p50 / p95 ms (no Ray) | HTTP p50 / p95 ms | HTTP / in-process p50 / p95 |")
    print("|---:|---:|---:|---:|")
    for o in rounds:
        print(f"| {o['round']} | {o['in_process']['p50']} / {o['in_process']['p95']} | {o['http']['p50']} / "
              f"{o['http']['p95']} | {o['ratio_p50']} / {o['ratio_p95']} |")
    print(f"| median | | | **{median['p50']} / {median['p95']}** |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": median}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
