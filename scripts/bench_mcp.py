#!/usr/bin/env python
"""``helix mcp`` latency beside in-process recall, on the same store in the same run.

    .venv/bin/python scripts/bench_mcp.py [--store DIR --user USER] [--recalls 200] [--writes 30] [--adds 3]

On a copy of ``--store`` (default: the shipped sample, ingested into a temporary
folder with ``runner="local"``), in order:

1. ``Memory.recall`` in this process (``record_access=False``) for the golden queries
   of ``--user`` (``tests/golden_queries.jsonl``), cycled to ``--recalls`` calls;
2. the same calls as MCP ``recall`` tool calls, through the SDK's stdio client, to
   ``helix mcp --store COPY --user USER`` in a subprocess (the round trip an agent pays:
   JSON-RPC over pipes, the shells over generation + delta, the packed text);
3. ``--writes`` MCP ``remember`` calls (durable in the delta before each answer);
4. ``--adds`` ``Memory.add`` calls of one memory each (an ingest per call), for contrast.

Prints p50 / p95 / mean in milliseconds per row. The first five calls of each recall
row are warm-up and not counted. No Ray.
"""

from __future__ import annotations

import argparse
import asyncio
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
WARMUP = 5


def row(name: str, ms: list[float]) -> str:
    a = np.asarray(ms)
    return (f"{name:<44} n={len(a):>4}  p50 {np.percentile(a, 50):8.2f}  p95 {np.percentile(a, 95):8.2f}  "
            f"mean {a.mean():8.2f} ms")


def sample_store(folder: Path) -> Path:
    from helix_ray.ingest.run import ingest

    sample = ROOT / "helix_ray" / "samples" / "atlas"
    store = folder / "store"
    ingest([sample / "memories.jsonl", sample / "notes", sample / "transcript.jsonl"], store, runner="local",
           show_progress=False)
    return store


def queries(user: str, n: int) -> list[str]:
    golden = [json.loads(line) for line in (ROOT / "tests" / "golden_queries.jsonl").read_text().splitlines() if line]
    mine = [q["query"] for q in golden if q["user"] == user] or [q["query"] for q in golden]
    return [mine[i % len(mine)] for i in range(n + WARMUP)]


def in_process(store: Path, user: str, qs: list[str]) -> list[float]:
    from helix_ray.memory import Memory

    out = []
    with Memory(store, record_access=False) as mem:
        for q in qs:
            clock = time.perf_counter()
            mem.recall(q, user=user, budget_tokens=1024)
            out.append((time.perf_counter() - clock) * 1000)
    return out[WARMUP:]


async def over_mcp(store: Path, user: str, qs: list[str], writes: int) -> tuple[list[float], list[float], float]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "helix_ray.cli", "mcp", "--store", str(store),
                                                                 "--user", user],
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    clock = time.perf_counter()
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            started = (time.perf_counter() - clock) * 1000
            recalls = []
            for q in qs:
                clock = time.perf_counter()
                result = await s.call_tool("recall", {"query": q, "budget_tokens": 1024})
                recalls.append((time.perf_counter() - clock) * 1000)
                assert not result.is_error, result.content
            remembers = []
            for n in range(writes):
                text = f"Benchmark note {n}: the {uuid.uuid4().hex[:6]} job retries three times before paging."
                clock = time.perf_counter()
                result = await s.call_tool("remember", {"text": text})
                remembers.append((time.perf_counter() - clock) * 1000)
                assert not result.is_error, result.content
    return recalls[WARMUP:], remembers, started


def memory_add(store: Path, user: str, adds: int) -> list[float]:
    from helix_ray.memory import Memory

    out = []
    with Memory(store, record_access=False) as mem:
        for n in range(adds):
            clock = time.perf_counter()
            mem.add([{"text": f"Added note {n} {uuid.uuid4().hex[:6]}: deploys freeze on Fridays.", "user": user}])
            out.append((time.perf_counter() - clock) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="a store to copy (default: the shipped sample, ingested now)")
    ap.add_argument("--user", default="dana")
    ap.add_argument("--recalls", type=int, default=200)
    ap.add_argument("--writes", type=int, default=30)
    ap.add_argument("--adds", type=int, default=3, help="Memory.add calls for contrast (0: none)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="helix-bench-mcp-") as tmp:
        folder = Path(tmp)
        if args.store:
            store = folder / "store"
            shutil.copytree(args.store, store)
        else:
            store = sample_store(folder)
        qs = queries(args.user, args.recalls)
        local = in_process(store, args.user, qs)
        mcp_recall, mcp_remember, started = asyncio.run(over_mcp(store, args.user, qs, args.writes))
        adds = memory_add(store, args.user, args.adds) if args.adds else []
    print(f"store: {args.store or 'shipped sample'}, user {args.user}; `helix mcp` ready in {started:.0f} ms")
    print(row("Memory.recall (in process)", local))
    print(row("MCP recall (stdio round trip)", mcp_recall))
    print(row("MCP remember (durable, in the delta)", mcp_remember))
    if adds:
        print(row("Memory.add, one memory (an ingest per call)", adds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
