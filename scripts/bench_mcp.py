#!/usr/bin/env python
"""``helix mcp`` latency beside in-process recall, on the same store in the same run.

    .venv/bin/python scripts/bench_mcp.py [--store DIR --user USER] [--recalls 200] [--writes 30] [--server]

On a copy of ``--store`` (default: the shipped sample, ingested into a temporary
folder with ``runner="local"``), in order:

1. ``Memory.recall`` in this process (``record_access=False``), cycled to ``--recalls``
   calls: the golden queries of ``--user`` (``tests/golden_queries.jsonl``), or, for a
   user with none there (a benchmark store's), seeded queries made from that user's
   memories (:func:`store_queries`);
2. the same calls as MCP ``recall`` tool calls, through the SDK's stdio client, to
   ``helix mcp --store COPY --user USER`` in a subprocess (the round trip an agent pays:
   JSON-RPC over pipes, ``Memory``'s recall over generation + delta, the packed text);
3. ``--writes`` MCP ``remember`` calls (durable in the delta before each answer), after
   one more that loads the write path's encoders;
4. with ``--server``: ``helix serve --store COPY`` on a spare port of 127.0.0.1 (its own
   local Ray), a key for ``--user`` (``helix keys create``), and steps 2–3 again through
   ``helix mcp --server URL --key KEY`` (each tool call one HTTP request to the server);
   the server is then stopped with SIGTERM, as Ctrl-C stops it, and the script checks
   that none of the processes it started (Ray's among them) outlives it.
(``Memory.add``, the same write path in process: ``scripts/bench_add.py``.)

A store without a DuckDB record (``scripts/derived_store.py`` skips it) first gets one
made from its generation (:func:`record_generation`), so the Writer's lookups on each
``remember`` run against every memory, as in an ingested store.

Prints p50 / p95 / mean in milliseconds per row, and with ``--server`` the ratios of the
server path to the in-process one. The first five calls of each recall row and the
warm-up ``remember`` are not counted; each MCP session's first calls are printed apart.
Ray only with ``--server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5
#: Seconds ``helix serve`` may take to answer ``/healthz`` (Ray, Serve, a generation opened per replica).
SERVE_START_S = 600
#: Seconds to wait for the processes of a stopped server to be gone.
SERVE_STOP_S = 120


@dataclass
class McpRun:
    """One ``helix mcp`` session: its start, its first recall and the timed calls (ms)."""

    ready_ms: float = 0.0
    first_recall_ms: float = 0.0
    first_remember_ms: float = 0.0
    recalls: list[float] = field(default_factory=list)
    remembers: list[float] = field(default_factory=list)


def stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": len(a), "p50": round(float(np.percentile(a, 50)), 2), "p95": round(float(np.percentile(a, 95)), 2),
            "mean": round(float(a.mean()), 2)}


def row(name: str, ms: list[float]) -> str:
    s = stats(ms)
    return f"{name:<52} n={s['n']:>4}  p50 {s['p50']:8.2f}  p95 {s['p95']:8.2f}  mean {s['mean']:8.2f} ms"


def ratio(name: str, over: list[float], under: list[float]) -> str:
    a, b = np.asarray(over), np.asarray(under)
    return (f"{name:<52}         p50 {np.percentile(a, 50) / np.percentile(b, 50):7.2f}×  "
            f"p95 {np.percentile(a, 95) / np.percentile(b, 95):7.2f}×  mean {a.mean() / b.mean():7.2f}×")


def sample_store(folder: Path) -> Path:
    from helix_ray.ingest.run import ingest

    sample = ROOT / "helix_ray" / "samples" / "atlas"
    store = folder / "store"
    ingest([sample / "memories.jsonl", sample / "notes", sample / "transcript.jsonl"], store, runner="local",
           show_progress=False)
    return store


def record_generation(store: Path) -> float:
    """Give a store whose ``helix.duckdb`` holds no memories (or that has none) the
    record an ingest would have left of its current generation's memories (the
    ``memories`` table and the generation it describes), without running an ingest;
    returns the seconds it took (0: it had one). The Writer answers ``remember`` with
    lookups in that table (who owns an id, a memory's earlier chunks), and an ingest
    builds the next generation from it: without it they would see an empty store."""
    from helix_ray.schema import MEMORY_SCHEMA
    from helix_ray.store.db import StoreDB
    from helix_ray.store.generation import Generation

    clock = time.perf_counter()
    gen = Generation.open_current(store)
    with StoreDB(store) as db:
        if db.counts()["memories"] or not gen.size:
            return 0.0
        run_id = db.start_run(["bench_mcp: the generation's memories, recorded without an ingest"])
        db.upsert_memories(gen.memories.select([*MEMORY_SCHEMA.names, "content_hash", "n_tokens"]), run_id)
        db.record_generation(gen.number, run_id)
        db.finish_run(run_id, {"memories": gen.size}, gen.number, "recorded")
    return time.perf_counter() - clock


def queries(store: Path, user: str, n: int, seed: int = 0) -> list[str]:
    """``n`` + warm-up queries for ``user``: the golden ones, else :func:`store_queries`."""
    golden = [json.loads(line) for line in (ROOT / "tests" / "golden_queries.jsonl").read_text().splitlines() if line]
    mine = [q["query"] for q in golden if q["user"] == user] or store_queries(store, user, 50, seed)
    return [mine[i % len(mine)] for i in range(n + WARMUP)]


def store_queries(store: Path, user: str, count: int, seed: int) -> list[str]:
    """Seeded queries from ``user``'s memories in the current generation: a third an
    identifier, path or error one of them names; a third a question about one; a third
    the first eight words of a memory."""
    from helix_ray.ingest import entities
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(store)
    if user not in gen.partitions:
        largest = sorted(gen.partitions, key=lambda u: gen.partitions[u][0] - gen.partitions[u][1])[:5]
        raise SystemExit(f"bench_mcp: user {user!r} has no memories in {store}; its largest tenants are "
                         f"{', '.join(largest)}. Give one of them with --user.")
    start, end = gen.partitions[user]
    texts = gen.memories.column("text")
    rng = random.Random(f"bench-mcp-{seed}")
    out: list[str] = []
    while len(out) < count:
        text = texts[rng.randrange(start, end)].as_py()
        anchors = [key.split(":", 1)[1] for key in entities.extract(text)
                   if key.split(":", 1)[0] in ("identifier", "path", "error")]
        kind = len(out) % 3
        if kind == 2 or not anchors:
            out.append(" ".join(text.split()[:8]))
        else:
            anchor = rng.choice(anchors)
            out.append(anchor if kind == 0 else f"what do we know about {anchor}?")
    return out


def in_process(store: Path, user: str, qs: list[str]) -> list[float]:
    from helix_ray.memory import Memory

    out = []
    with Memory(store, record_access=False) as mem:
        for q in qs:
            clock = time.perf_counter()
            mem.recall(q, user=user, budget_tokens=1024)
            out.append((time.perf_counter() - clock) * 1000)
    return out[WARMUP:]


async def over_mcp(mcp_args: list[str], qs: list[str], writes: int, env: dict[str, str]) -> McpRun:
    """``helix mcp MCP_ARGS`` over stdio: ``qs`` as ``recall`` calls, then one warm-up
    and ``writes`` timed ``remember`` calls."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "helix_ray.cli", "mcp", *mcp_args], env=env)
    run = McpRun()
    clock = time.perf_counter()
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            run.ready_ms = (time.perf_counter() - clock) * 1000
            for q in qs:
                clock = time.perf_counter()
                result = await s.call_tool("recall", {"query": q, "budget_tokens": 1024})
                run.recalls.append((time.perf_counter() - clock) * 1000)
                assert not result.is_error, result.content
            for n in range(writes + 1 if writes else 0):  # the first loads the write path's encoders
                text = f"Benchmark note {n}: the {uuid.uuid4().hex[:6]} job retries three times before paging."
                clock = time.perf_counter()
                result = await s.call_tool("remember", {"text": text})
                run.remembers.append((time.perf_counter() - clock) * 1000)
                assert not result.is_error, result.content
    run.first_recall_ms = run.recalls[0]
    run.recalls = run.recalls[WARMUP:]
    if run.remembers:
        run.first_remember_ms, run.remembers = run.remembers[0], run.remembers[1:]
    return run


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` now (Ray's, for a server that started its own Ray)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def still_running(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def through_server(store: Path, user: str, qs: list[str], writes: int,
                   env: dict[str, str]) -> tuple[McpRun, dict[str, Any]]:
    """``helix serve`` on ``store`` (a spare port of 127.0.0.1, a local Ray of its own),
    a key for ``user``, the MCP calls through ``helix mcp --server``; then the server
    stopped and every process it started checked gone."""
    from helix_ray.runtime import spare_port

    env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}  # its own Ray, never a cluster named here
    key = subprocess.run([sys.executable, "-m", "helix_ray.cli", "keys", "create", "--store", str(store), "--user",
                          user], capture_output=True, text=True, check=True, env=env).stdout.split()[-1]
    port = spare_port()
    url = f"http://127.0.0.1:{port}"
    output = store.parent / "serve.log"
    info: dict[str, Any] = {"url": url}
    with open(output, "w") as log:
        clock = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(store), "--host",
                                   "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        started: list[int] = []
        try:
            while not healthy(url):
                if server.poll() is not None or time.perf_counter() - clock > SERVE_START_S:
                    raise RuntimeError(f"helix serve did not answer {url}/healthz; its output:\n"
                                       f"{output.read_text()[-3000:]}")
                time.sleep(0.5)
            info["ready_s"] = round(time.perf_counter() - clock, 2)
            started = descendants(server.pid)
            run = asyncio.run(over_mcp(["--server", url, "--key", key], qs, writes, env))
        finally:
            started = sorted(set(started) | set(descendants(server.pid)))
            server.send_signal(signal.SIGTERM)  # as Ctrl-C: Serve and the Ray it started shut down
            clock = time.perf_counter()
            try:
                info["exit_code"] = server.wait(timeout=SERVE_STOP_S)
            except subprocess.TimeoutExpired:
                server.kill()
                info["exit_code"] = server.wait()
            while still_running(started) and time.perf_counter() - clock < SERVE_STOP_S:
                time.sleep(0.5)
            info["stop_s"] = round(time.perf_counter() - clock, 2)
            info["processes"] = len(started)
            info["left_running"] = still_running(started)
            for pid in info["left_running"]:  # started by the server this function started
                os.kill(pid, signal.SIGKILL)
    return run, info


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:  # not listening yet, or a connection reset while Serve starts
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="a store to copy (default: the shipped sample, ingested now)")
    ap.add_argument("--user", default="dana")
    ap.add_argument("--recalls", type=int, default=200)
    ap.add_argument("--writes", type=int, default=30)
    ap.add_argument("--server", action="store_true",
                    help="also through `helix serve` on the same copy, with `helix mcp --server URL --key KEY`")
    ap.add_argument("--json", default=None, help="write the rows, the session times and the host's load here")
    args = ap.parse_args(argv)
    from bench_ingest import machine_info  # a neighbour in scripts/

    info = machine_info()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="helix-bench-mcp-") as tmp:
        folder = Path(tmp)
        clock = time.perf_counter()
        if args.store:
            store = folder / "store"
            shutil.copytree(args.store, store)
        else:
            store = sample_store(folder)
        prepared_s = time.perf_counter() - clock
        recorded_s = record_generation(store)
        qs = queries(store, args.user, args.recalls)
        local = in_process(store, args.user, qs)
        here = asyncio.run(over_mcp(["--store", str(store), "--user", args.user], qs, args.writes, env))
        served, server = through_server(store, args.user, qs, args.writes, env) if args.server else (None, {})
    rows = {"Memory.recall (in process)": local, "MCP recall, helix mcp --store (stdio)": here.recalls}
    if served is not None:
        rows["MCP recall, helix mcp --server (stdio + HTTP)"] = served.recalls
    rows["MCP remember, helix mcp --store (durable, delta)"] = here.remembers
    if served is not None:
        rows["MCP remember, helix mcp --server (durable, delta)"] = served.remembers
    rows = {name: ms for name, ms in rows.items() if ms}

    print(f"store: {args.store or 'shipped sample'}, user {args.user}; copied or ingested in {prepared_s:.1f} s"
          + (f"; its generation recorded in DuckDB in {recorded_s:.1f} s" if recorded_s else ""))
    print(f"`helix mcp --store` ready in {here.ready_ms:.0f} ms (the store opened as a Memory, its Writer started), "
          f"first recall {here.first_recall_ms:.0f} ms, first remember {here.first_remember_ms:.0f} ms")
    if served is not None:
        print(f"`helix serve` answered /healthz {server['ready_s']:.1f} s after its start; `helix mcp --server` ready "
              f"in {served.ready_ms:.0f} ms, first recall {served.first_recall_ms:.0f} ms, first remember "
              f"{served.first_remember_ms:.0f} ms; stopped (SIGTERM, exit {server['exit_code']}) in "
              f"{server['stop_s']:.1f} s; {server['processes']} processes of its own, "
              f"{len(server['left_running'])} left running"
              + (f" (killed: {server['left_running']})" if server["left_running"] else ""))
    for name, ms in rows.items():
        print(row(name, ms))
    ratios = {}
    if served is not None:
        ratios["recall: --server / --store"] = (served.recalls, here.recalls)
        if served.remembers:
            ratios["remember: --server / --store"] = (served.remembers, here.remembers)
    for name, (over, under) in ratios.items():
        print(ratio(name, over, under))
    wall_s = time.perf_counter() - wall
    print(f"wall time {wall_s:.0f} s")
    if args.json:
        info["loadavg_end"] = os.getloadavg()
        sessions = {"store": vars(here)} | ({"server": vars(served)} if served is not None else {})
        Path(args.json).write_text(json.dumps({
            "machine": info, "args": vars(args), "wall_s": round(wall_s, 1), "prepared_s": round(prepared_s, 2),
            "recorded_s": round(recorded_s, 2), "server": server,
            "rows_ms": {name: stats(ms) for name, ms in rows.items()},
            "sessions": {k: {f: v for f, v in run.items() if f not in ("recalls", "remembers")}
                         for k, run in sessions.items()},
        }, indent=1))
        print(f"wrote {args.json}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
