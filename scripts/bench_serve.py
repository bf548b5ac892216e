#!/usr/bin/env python
"""HTTP recall through Ray Serve, next to in-process recall and a Serve echo app, in one run.

    .venv/bin/python scripts/bench_serve.py --store /path/to/store-100000 \\
        --requests 300 --json /tmp/bench-serve.json

For each ``--store`` (served from a hard-linked copy, so the original is never written):

1. **in-process**: ``Recaller.recall`` on the same generation, same queries, in this process
   (concurrency 1: the floor the Serve graph adds hops to) — before Ray starts (the
   baseline of the ratios), and again after the HTTP loops with Ray and Serve running idle
   (their background work shares the two cores: what any process here then gets);
2. **echo**: a Serve app with the same hops as ``--graph`` and none of the work (split:
   FastAPI ingress → ``Plan`` → two legs passed the plan's response → ``Finish``;
   compact: ingress → one deployment; inline: the ingress alone, with the same replica
   count) — so ``helix / echo`` separates Helix's work from Serve's fixed cost;
3. **helix**: the Helix application (``helix_ray.serve.app.build_app``, API keys on, one
   key per tenant) over HTTP on 127.0.0.1;
4. **paired** (``--paired-rounds N``, after the concurrency-1 phases): in-process and HTTP
   recall on the same queries in alternating blocks, so the ratio of the two is taken
   minutes apart at most, not across the whole run (the baseline of step 1 drifts with
   the host over an hour; docs/benchmarks.md);
5. **during compactions** (``--compact-rounds N``, last): each round writes
   ``--compact-writes`` memories of one user over HTTP, then recalls at concurrency 1
   for ``--compact-idle`` requests on the idle store, then ``POST /v1/admin/compact``
   and recalls until it has returned and ``--compact-settle-s`` more seconds have
   passed (the replicas open and warm the new generation after it is published).
   The Writer compacts in its own process, as a server always does.

HTTP loops are bounded by ``--requests`` and ``--max-seconds`` per phase, at concurrency 1
(one keep-alive client) and ``--concurrency`` (asyncio workers sharing a connection
pool), with ``--client`` aiohttp (default) or httpx; ``--settle-s`` first runs each
phase's load unmeasured, so autoscaling (``--replicas 1 2``, what ``helix serve`` runs)
has followed it, and each phase reports the replicas running at its end. Queries come from ``scripts/bench_recall.py``'s ``make_queries`` (identifiers,
paraphrases, vague; users weighted by tenant size). After the loops the script reads
``/proc/<pid>/smaps`` of every replica and reports its RSS and PSS, in total and for the
mappings of the generation's files alone (what several replicas share through the page
cache). Ray is started here, locally, with ``--num-cpus`` logical CPUs, and stopped at
the end (never ``ray stop``). With ``--cluster-nodes N`` it is instead a multi-node Ray of
N ``ray start`` nodes on this machine (``--num-cpus`` each, ``helix_ray.local_cluster``),
which this process joins as ``helix serve`` does with ``RAY_ADDRESS``; each phase then
also reports its replicas per node.

``--against REF`` (``main``, a commit) first runs this script as it is at that git ref
(exported with ``git archive``, importing its own ``helix_ray``) with the same
arguments, then this code's run, and adds a table of the two: in-process and HTTP
recall p50 / p95 and the replicas' PSS, with the ratios. The runs are back to back, not
interleaved: run it twice in a row when a ratio sits within the host's drift.
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
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if not len(arr):
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    return {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in (50, 95, 99)}


# ----------------------------------------------------------------------------- store and queries


def linked_copy(src: Path, dst: Path) -> Path:
    """``CURRENT`` and the current generation, hard-linked (generations are immutable);
    the copy gets its own DuckDB file, keys and delta."""
    from helix_ray.store.generation import current_generation_number

    number = current_generation_number(src)
    if number is None:
        raise SystemExit(f"{src} has no published generation")
    (dst / "generations").mkdir(parents=True)
    name = f"{number:06d}"
    shutil.copytree(src / "generations" / name, dst / "generations" / name, copy_function=os.link)
    (dst / "CURRENT").write_text(f"{number}\n")
    return dst


def queries_for(store: Path, count: int, seed: int) -> list[dict[str, str]]:
    from bench_recall import make_queries

    return make_queries(store, count, seed)


def recaller_for(store: Path):
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.recall.threads import encoder_threads
    from helix_ray.store.generation import Generation

    generation = Generation.open_current(store)
    threads = encoder_threads(generation)  # as helix_ray.Memory: half the cores each when the encoders overlap
    return Recaller(generation, get_embedder(threads=threads), threads=threads)


def in_process(store: Path, queries: list[dict[str, str]], warmup: int, recaller: Any = None) -> dict[str, Any]:
    recaller = recaller if recaller is not None else recaller_for(store)
    for q in queries[:warmup]:
        recaller.recall(q["query"], user=q["user"], budget_tokens=512)
    times = []
    started = time.perf_counter()
    for q in queries:
        clock = time.perf_counter()
        recaller.recall(q["query"], user=q["user"], budget_tokens=512)
        times.append((time.perf_counter() - clock) * 1000)
    wall = time.perf_counter() - started
    return {"n": len(times), **pct(times), "rps": round(len(times) / wall, 1)}


async def paired_rounds(store: Path, url: str, queries: list[dict[str, str]], bodies: list[tuple[dict, dict]],
                        rounds: int, warmup: int, client: str) -> dict[str, Any]:
    """In-process recall and HTTP recall at concurrency 1 on the same queries, in
    alternating blocks (in-process first in even rounds, HTTP first in odd ones), Serve
    running and idle during the in-process block: the host's drift between the blocks is
    minutes shorter than between the phases above, and the order cancels out. Returns
    each round's two p50 / p95 and their ratios, and the median ratio over rounds."""
    recaller = recaller_for(store)
    in_process(store, queries[:warmup], 0, recaller)  # warm-up only: the model and pages in this process
    out = []
    for r in range(rounds):
        blocks: dict[str, dict[str, Any]] = {}
        for kind in (("in_process", "http") if r % 2 == 0 else ("http", "in_process")):
            if kind == "in_process":
                blocks[kind] = in_process(store, queries, 0, recaller)
            else:
                blocks[kind] = await http_phase(url, bodies, 1, 600.0, client)
        h, ip = blocks["http"], blocks["in_process"]
        out.append({"round": r, "in_process": {k: ip[k] for k in ("p50", "p95")}, "http": {k: h[k] for k in ("p50", "p95")},
                    "ratio_p50": round(h["p50"] / ip["p50"], 2), "ratio_p95": round(h["p95"] / ip["p95"], 2)})
        log(f"  paired round {r}: {out[-1]}")
    return {"rounds": out,
            "median_ratio_p50": round(float(np.median([o["ratio_p50"] for o in out])), 2),
            "median_ratio_p95": round(float(np.median([o["ratio_p95"] for o in out])), 2)}


# ----------------------------------------------------------------------------- the echo app


def echo_app(graph: str = "split", replicas: int = 1):
    """The Helix graph's hops without its work: the fixed cost of the graph on this machine.

    split: ingress → plan → two legs given the plan's response → finish (four hops);
    compact: ingress → one ``Whole`` deployment (one hop); inline: the ingress alone, with
    as many replicas as Helix's inline ingress gets (``replicas``)."""
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()
    light = {"ray_actor_options": {"num_cpus": 0.05}, "max_ongoing_requests": 64}

    @serve.deployment(**light)
    class Plan:
        def plan(self, query: str, user: str) -> dict:
            return {"query": query, "user": user, "vector": np.zeros(384, np.float32)}

    @serve.deployment(**light)
    class Leg:
        async def search(self, plan: dict) -> dict:
            return {"rows": np.arange(100, dtype=np.int64), "scores": np.zeros(100, np.float32)}

    @serve.deployment(**light)
    class Finish:
        async def finish(self, plan: dict, a: dict, b: dict) -> dict:
            return {"query": plan["query"], "items": [], "n": len(a["rows"]) + len(b["rows"])}

    @serve.deployment(**light)
    class Whole:
        async def recall(self, query: str, user: str) -> dict:
            return {"query": query, "items": [], "n": 200}

    @serve.deployment(ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=128)
    @serve.ingress(app)
    class Echo:
        def __init__(self, plan=None, lexical=None, dense=None, finish=None, whole=None):
            self.p, self.l, self.d, self.f, self.w = plan, lexical, dense, finish, whole

        @app.post("/v1/recall")
        async def recall(self, body: dict) -> dict:
            if self.w is not None:
                return await self.w.recall.remote(body["query"], body.get("user", ""))
            if self.p is None:
                return {"query": body["query"], "items": [], "n": 200}
            plan = self.p.plan.remote(body["query"], body.get("user", ""))
            return await self.f.finish.remote(plan, self.l.search.remote(plan), self.d.search.remote(plan))

    if graph == "inline":
        return Echo.options(num_replicas=replicas).bind()
    if graph == "compact":
        return Echo.bind(whole=Whole.options(num_replicas=replicas).bind())
    return Echo.bind(Plan.bind(), Leg.options(name="LegA").bind(), Leg.options(name="LegB").bind(), Finish.bind())


# ----------------------------------------------------------------------------- HTTP loops


async def http_phase(url: str, bodies: list[tuple[dict, dict]], concurrency: int, max_seconds: float,
                     client: str = "aiohttp") -> dict[str, Any]:
    """``bodies`` are (json, headers); each worker takes the next until all are sent or
    time is up. Returns latency percentiles (ms), throughput and error count. Each
    request's time includes reading and decoding the JSON answer, as a caller would.

    ``client``: ``aiohttp`` (Ray Serve's own dependency) or ``httpx``. The client runs in
    this process, on the same two cores, and its time per request is part of every
    figure, and httpx's is the larger (docs/benchmarks.md)."""
    times: list[float] = []
    errors: dict[int, int] = {}
    next_index = 0
    deadline = time.monotonic() + max_seconds

    async def loop(post) -> None:
        nonlocal next_index
        while next_index < len(bodies) and time.monotonic() < deadline:
            body, headers = bodies[next_index]
            next_index += 1
            clock = time.perf_counter()
            status = await post(body, headers)
            times.append((time.perf_counter() - clock) * 1000)
            if status != 200:
                errors[status] = errors.get(status, 0) + 1

    started = time.perf_counter()
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as session:
            async def post_httpx(body: dict, headers: dict) -> int:
                response = await session.post("/v1/recall", json=body, headers=headers)
                if response.status_code == 200:
                    response.json()
                return response.status_code

            started = time.perf_counter()
            await asyncio.gather(*(loop(post_httpx) for _ in range(concurrency)))
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def post_aiohttp(body: dict, headers: dict) -> int:
                async with session.post(url + "/v1/recall", json=body, headers=headers) as response:
                    if response.status == 200:
                        await response.json()
                    else:
                        await response.read()
                    return response.status

            started = time.perf_counter()
            await asyncio.gather(*(loop(post_aiohttp) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "client": client, "n": len(times), **pct(times),
            "rps": round(len(times) / wall, 1), "errors": errors}


def running_replicas(app: str) -> dict[str, int]:
    """Replicas RUNNING per deployment of ``app`` (autoscaling moves them between phases)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: d.replica_states.get("RUNNING", 0) for name, d in status.deployments.items()}


# ----------------------------------------------------------------------------- memory


def replica_processes() -> dict[int, str]:
    """pid → deployment name of every process of this host that is a replica of an
    application named ``helix`` (``ray::ServeReplica:helix:Ranker.finish`` → "Ranker")."""
    out = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica:helix:" in cmd:
            out[int(pid_dir.name)] = cmd.split("ServeReplica:helix:", 1)[1].split()[0].split(".")[0]
    return out


def replica_memory(store: Path) -> list[dict[str, Any]]:
    """RSS/PSS (MiB) of every Helix replica, total and for the generation's mapped files."""
    out = []
    gen_dir = str(store.resolve() / "generations")
    for pid, name in replica_processes().items():
        pid_dir = Path(f"/proc/{pid}")
        total = {"rss": 0, "pss": 0}
        mapped = {"rss": 0, "pss": 0}
        current = None
        try:
            for line in (pid_dir / "smaps").read_text().splitlines():
                parts = line.split()
                if not parts:
                    continue
                if not parts[0].endswith(":") or len(parts) > 3 and "-" in parts[0]:
                    current = parts[-1] if len(parts) >= 6 else None
                    continue
                key = parts[0][:-1]
                if key in ("Rss", "Pss"):
                    kb = int(parts[1])
                    total[key.lower()] += kb
                    if current and current.startswith(gen_dir):
                        mapped[key.lower()] += kb
        except OSError:
            continue
        out.append({"replica": name, "pid": pid,
                    "rss_mib": round(total["rss"] / 1024, 1), "pss_mib": round(total["pss"] / 1024, 1),
                    "generation_rss_mib": round(mapped["rss"] / 1024, 1),
                    "generation_pss_mib": round(mapped["pss"] / 1024, 1)})
    return sorted(out, key=lambda r: r["replica"])


# ----------------------------------------------------------------------------- main


def prepare(source: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A hard-linked copy of ``source``, its queries, and in-process recall on it — run
    before Ray starts, so the baseline is the quiet host a notebook user has."""
    from helix_ray.store.generation import Generation

    work = Path(tempfile.mkdtemp(prefix="helix-bench-serve-"))
    store = linked_copy(source, work / "store")
    if args.compact_rounds:  # the Writer looks ids up there, and a compaction records what it folds
        from bench_mcp import record_generation

        record_generation(store)
    gen = Generation.open_current(store)
    log(f"store {source} ({gen.size:,} memories, {len(gen.partitions)} users) → {store}")
    queries = queries_for(store, args.requests + args.warmup, args.seed)
    result: dict[str, Any] = {"store": str(source), "memories": gen.size, "users": len(gen.partitions)}
    log("in-process recall (concurrency 1), before Ray starts")
    result["in_process"] = in_process(store, queries[args.warmup:], args.warmup)
    log(f"  {result['in_process']}")
    return {"work": work, "store": store, "queries": queries, "result": result}


def bench_store(prepared: dict[str, Any], args: argparse.Namespace, port: int) -> dict[str, Any]:
    from ray import serve

    from helix_ray.serve.app import ServeArgs, build_app
    from helix_ray.store.keys import KeyStore

    store, queries, result = prepared["store"], prepared["queries"], prepared["result"]
    keys = {u: KeyStore(store).create(u)[0] for u in sorted({q["user"] for q in queries})}
    admin = {"Authorization": f"Bearer {KeyStore(store).create('bench-admin', admin=True)[0]}"}
    bodies = [({"query": q["query"], "budget_tokens": 512}, {"Authorization": f"Bearer {keys[q['user']]}"})
              for q in queries]
    log("deploying helix and echo")
    clock = time.perf_counter()
    serve.run(build_app(ServeArgs(store=str(store), retriever_replicas=tuple(args.replicas), graph=args.graph)),
              name="helix", route_prefix="/", logging_config={"enable_access_log": False, "log_level": "WARNING"})
    serve.run(echo_app(args.graph, args.replicas[0]), name="echo", route_prefix="/echo",
              logging_config={"enable_access_log": False, "log_level": "WARNING"})
    result["deploy_s"] = round(time.perf_counter() - clock, 1)
    url = f"http://127.0.0.1:{port}"

    async def phases() -> dict[str, Any]:
        out: dict[str, Any] = {}
        await http_phase(url, bodies[: args.warmup], 1, args.max_seconds, args.client)
        await http_phase(url + "/echo", bodies[: args.warmup], 1, args.max_seconds, args.client)
        for c in (1, args.concurrency):
            for app, base in (("echo", url + "/echo"), ("helix", url)):
                if args.settle_s > 0:  # the same load, unmeasured, until autoscaling has followed it
                    await http_phase(base, bodies * 1000, c, args.settle_s, args.client)
                log(f"{app}: concurrency {c}")
                out[f"{app}_c{c}"] = await http_phase(base, bodies[args.warmup:], c, args.max_seconds, args.client)
                out[f"{app}_c{c}"]["replicas"] = running_replicas(app)
                if args.dashboard:
                    from helix_ray.serve.server import replicas_per_node

                    out[f"{app}_c{c}"]["per_node"] = replicas_per_node(app, args.dashboard)
                log(f"  {out[f'{app}_c{c}']}")
            if c == 1 and args.paired_rounds:  # before the concurrency-8 load scales the replicas up
                log(f"paired rounds: in-process and HTTP (concurrency 1) alternated, {args.paired_rounds} rounds")
                result["paired"] = await paired_rounds(store, url, queries[args.warmup:], bodies[args.warmup:],
                                                       args.paired_rounds, args.warmup, args.client)
                result["paired"]["replicas"] = running_replicas("helix")
        if args.compact_rounds:
            writer = bodies[args.warmup][1]  # the first query's user writes
            log(f"recall during compactions: {args.compact_rounds} rounds of {args.compact_writes} writes")
            result["compaction"] = await during_compactions(url, bodies[args.warmup:], writer, admin, args)
            log(f"  {result['compaction']['idle']} / {result['compaction']['during']}")
        return out

    result["http"] = asyncio.run(phases())
    log("in-process recall again, Ray and Serve running idle")
    result["in_process_serve_idle"] = in_process(store, queries[args.warmup:], args.warmup)
    log(f"  {result['in_process_serve_idle']}")
    import httpx

    # Per-stage and per-hop p50/p95 as the ingress saw them (all helix phases together).
    stats = httpx.get(url + "/v1/stats", headers=bodies[0][1], timeout=30).json()
    result["serve_stats_latency"] = stats.get("latency_ms")
    result["replicas"] = replica_memory(store)
    h1, e1, ip = result["http"]["helix_c1"], result["http"]["echo_c1"], result["in_process"]
    idle = result["in_process_serve_idle"]
    result["ratios"] = {
        "helix_http_over_in_process_p50": round(h1["p50"] / ip["p50"], 2),
        "helix_http_over_in_process_p95": round(h1["p95"] / ip["p95"], 2),
        "helix_http_over_in_process_serve_idle_p50": round(h1["p50"] / idle["p50"], 2),
        "helix_http_over_in_process_serve_idle_p95": round(h1["p95"] / idle["p95"], 2),
        "helix_http_minus_echo_p50_ms": round(h1["p50"] - e1["p50"], 2),
    }
    if "paired" in result:
        result["ratios"]["paired_median_p50"] = result["paired"]["median_ratio_p50"]
        result["ratios"]["paired_median_p95"] = result["paired"]["median_ratio_p95"]
    serve.delete("helix")
    serve.delete("echo")
    return result


async def during_compactions(url: str, bodies: list[tuple[dict, dict]], writer: dict, admin: dict,
                             args: argparse.Namespace) -> dict[str, Any]:
    """Step 5 of the module's docstring: recall latencies (ms) idle and during each
    compaction and its settling, at concurrency 1, and each compaction's report."""
    import aiohttp
    from bench_compact import WORDS

    rng = np.random.default_rng(args.seed)
    idle: list[float] = []
    during: list[float] = []
    reports: list[dict[str, Any]] = []
    asked = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def post(path: str, body: Any, headers: dict, status: int) -> Any:
            async with session.post(url + path, json=body, headers=headers) as response:
                answer = await response.json()
                if response.status != status:
                    raise SystemExit(f"POST {path} answered {response.status}: {answer}")
                return answer

        async def recall() -> float:
            nonlocal asked
            body, headers = bodies[asked % len(bodies)]
            asked += 1
            clock = time.perf_counter()
            await post("/v1/recall", body, headers, 200)
            return (time.perf_counter() - clock) * 1000

        for round_ in range(args.compact_rounds):
            notes = [{"text": f"note {round_}-{i}: " + " ".join(rng.choice(WORDS, 30))}
                     for i in range(args.compact_writes)]
            await post("/v1/memories", {"memories": notes}, writer, 201)
            idle += [await recall() for _ in range(args.compact_idle)]
            compaction = asyncio.create_task(post("/v1/admin/compact", None, admin, 200))
            clock = time.perf_counter()
            settle_until = None
            while settle_until is None or time.monotonic() < settle_until:
                during.append(await recall())
                if settle_until is None and compaction.done():
                    settle_until = time.monotonic() + args.compact_settle_s
            report = await compaction
            reports.append({"seconds_with_settle": round(time.perf_counter() - clock, 2),
                            **{k: report.get(k) for k in ("mode", "seconds", "folded", "generation")}})
            log(f"  round {round_}: {reports[-1]}; p95 idle {np.percentile(idle, 95):.1f} ms, during "
                f"{np.percentile(during, 95):.1f} ms")
    quiet, busy = pct(idle), pct(during)
    return {"idle": {"n": len(idle), **quiet}, "during": {"n": len(during), **busy},
            "p95_ratio": round(busy["p95"] / quiet["p95"], 2), "compactions": reports}


def table(results: list[dict[str, Any]], concurrency: int) -> str:
    lines = ["| memories | path | conc. | p50 ms | p95 ms | p99 ms | req/s |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for label, ip in (("before Ray starts", r["in_process"]), ("Serve idle", r["in_process_serve_idle"])):
            lines.append(f"| {r['memories']:,} | in-process Recaller.recall, {label} | 1 | {ip['p50']} | "
                         f"{ip['p95']} | {ip['p99']} | {ip['rps']} |")
        for app in ("echo", "helix"):
            for c in (1, concurrency):
                h = r["http"][f"{app}_c{c}"]
                replicas = ", ".join(f"{name} {n}" for name, n in h.get("replicas", {}).items()) or "?"
                if "per_node" in h:  # replicas per node, head first
                    replicas += "; per node " + ", ".join(f"{name} {'+'.join(map(str, n))}"
                                                         for name, n in h["per_node"].items())
                lines.append(f"| {r['memories']:,} | HTTP {app} ({h.get('client', 'httpx')}; {replicas}) "
                             f"| {c} | {h['p50']} | {h['p95']} | {h['p99']} | {h['rps']} |")
    compacted = [r for r in results if "compaction" in r]
    if compacted:
        lines.append("")
        lines.append("| memories | recall p50 / p95 idle, ms | during a compaction and the swap | p95 ratio | "
                     "recalls during | compaction s |")
        lines.append("|---:|---|---|---:|---:|---|")
        for r in compacted:
            c = r["compaction"]
            seconds = ", ".join(str(x["seconds"]) for x in c["compactions"])
            lines.append(f"| {r['memories']:,} | {c['idle']['p50']} / {c['idle']['p95']} | {c['during']['p50']} / "
                         f"{c['during']['p95']} | **{c['p95_ratio']}×** | {c['during']['n']} | {seconds} |")
    paired = [r for r in results if "paired" in r]
    if paired:
        lines.append("")
        lines.append("| memories | paired round | in-process p50 / p95 ms | HTTP p50 / p95 ms | HTTP / in-process p50 / p95 |")
        lines.append("|---:|---:|---:|---:|---:|")
        for r in paired:
            for o in r["paired"]["rounds"]:
                lines.append(f"| {r['memories']:,} | {o['round']} | {o['in_process']['p50']} / {o['in_process']['p95']} "
                             f"| {o['http']['p50']} / {o['http']['p95']} | {o['ratio_p50']} / {o['ratio_p95']} |")
            lines.append(f"| {r['memories']:,} | median | | | **{r['paired']['median_ratio_p50']} / "
                         f"{r['paired']['median_ratio_p95']}** |")
    lines.append("")
    lines.append("| memories | replica | RSS MiB | PSS MiB | generation files RSS | generation files PSS |")
    lines.append("|---:|---|---:|---:|---:|---:|")
    for r in results:
        for rep in r["replicas"]:
            lines.append(f"| {r['memories']:,} | {rep['replica']} | {rep['rss_mib']} | {rep['pss_mib']} | "
                         f"{rep['generation_rss_mib']} | {rep['generation_pss_mib']} |")
    return "\n".join(lines)


def shut_down(cluster: Any, work: list[Path]) -> None:
    """Serve and the Ray this process started or joined (never ``ray stop``), then the
    ``ray start`` cluster if any, and the scratch folders, whatever fails on the way."""
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    finally:
        if cluster is not None:
            cluster.stop()
        for folder in work:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--store", action="append", required=True, help="a store to serve (repeat for several sizes)")
    ap.add_argument("--requests", type=int, default=300, help="requests per phase (after warm-up)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="time cap per phase")
    ap.add_argument("--replicas", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"),
                    help="DenseANN/BM25 replicas (autoscaling min and max)")
    ap.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the local Ray")
    ap.add_argument("--graph", choices=("split", "compact", "inline"), default="split",
                    help="ServeArgs.graph of the Helix app (the echo app gets the same hops)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the HTTP client of the loops (in this process; its cost is in every figure)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="before each measured phase, the same load unmeasured for this long (autoscaling "
                         "follows it: with --replicas 1 2 a concurrency-8 phase then runs on two replicas)")
    ap.add_argument("--paired-rounds", type=int, default=0,
                    help="after the phases, this many rounds of in-process and HTTP concurrency-1 recall on the "
                         "same queries, alternated (the ratio with the host's drift paired out)")
    ap.add_argument("--compact-rounds", type=int, default=0,
                    help="last, this many rounds of recall idle and during a compaction (POST /v1/admin/compact)")
    ap.add_argument("--compact-writes", type=int, default=300, help="memories written before each compaction")
    ap.add_argument("--compact-idle", type=int, default=60, help="idle recalls before each compaction")
    ap.add_argument("--compact-settle-s", type=float, default=2.0,
                    help="recall goes on this long after a compaction returns: the replicas' swap")
    ap.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0: a free one)")
    ap.add_argument("--proxy-location", choices=("EveryNode", "HeadOnly"), default=None,
                    help="Serve's HTTP proxies (default: Serve's own, EveryNode): with --cluster-nodes, "
                         "HeadOnly keeps one proxy for the cluster")
    ap.add_argument("--cluster-nodes", type=int, default=0,
                    help="serve on a multi-node Ray of this many `ray start` nodes on this machine, --num-cpus "
                         "logical CPUs each (helix_ray.local_cluster; 0: one local Ray, as helix serve starts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", metavar="REF",
                    help="first run this script as it is at git ref REF (e.g. main; exported with git archive into "
                         "a temporary folder, importing its own helix_ray) with the same arguments, then this "
                         "code's run, and print the two side by side")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.dashboard = None  # a multi-node cluster's dashboard (replicas per node)
    if args.against:
        from against import run_ref

        log(f"--against {args.against}: the same run with that ref's code first")
        ref_run = run_ref("bench_serve.py", args.against, argv if argv is not None else sys.argv[1:])
        theirs = {"ref": ref_run["ref"], "commit": ref_run["commit"], **ref_run["results"]}
    else:
        theirs = None

    from ray import serve

    from helix_ray.runtime import spare_port
    from helix_ray.serve.server import start_ray

    port = args.port or spare_port()
    prepared = [prepare(Path(store), args) for store in args.store]
    cluster = None
    results = []
    try:
        if args.cluster_nodes:
            from helix_ray.local_cluster import LocalCluster

            log(f"starting a {args.cluster_nodes}-node Ray with `ray start` ({args.num_cpus} CPUs each)")
            clock = time.perf_counter()
            cluster = LocalCluster(nodes=args.cluster_nodes, cpus=args.num_cpus).start()
            os.environ.update(cluster.env())  # RAY_ADDRESS and its token file: joined as helix serve joins
            args.dashboard = cluster.dashboard_url
            log(f"  up in {time.perf_counter() - clock:.1f} s at {cluster.address}; joining it and starting "
                f"Serve on 127.0.0.1:{port}")
        else:
            log(f"starting a local Ray ({args.num_cpus} CPUs) and Serve on 127.0.0.1:{port}")
        start_ray(num_cpus=args.num_cpus)
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    **({"proxy_location": args.proxy_location} if args.proxy_location else {}))
        for p in prepared:
            results.append(bench_store(p, args, port))
    finally:
        shut_down(cluster, [p["work"] for p in prepared])
    print(table(results, args.concurrency))
    print(json.dumps([r["ratios"] for r in results], indent=1))
    if theirs is not None:
        print()
        print(against_table(results, theirs["results"], args.against, args.concurrency))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_avg": os.getloadavg(), "results": results,
                                               **({"against": theirs} if theirs is not None else {})},
                                              indent=1, default=str))
    return 0


def against_table(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], ref: str, concurrency: int) -> str:
    """Each store's HTTP recall (Helix, concurrency 1 and ``concurrency``), in-process
    recall and replicas' PSS, in this run and in ``ref``'s, with their ratio."""
    lines = [f"| memories | measure | this code | {ref} | this / {ref} |", "|---:|---|---:|---:|---:|"]
    for a, b in zip(ours, theirs):
        rows = [("in-process p50 / p95 ms", a["in_process"], b["in_process"])]
        rows += [(f"HTTP helix, concurrency {c}, p50 / p95 ms", a["http"][f"helix_c{c}"], b["http"][f"helix_c{c}"])
                 for c in (1, concurrency)]
        for label, x, y in rows:
            lines.append(f"| {a['memories']:,} | {label} | {x['p50']} / {x['p95']} | {y['p50']} / {y['p95']} | "
                         f"{x['p50'] / y['p50']:.2f}×, {x['p95'] / y['p95']:.2f}× |")
        pss_a, pss_b = (sum(rep["pss_mib"] for rep in r["replicas"]) for r in (a, b))
        lines.append(f"| {a['memories']:,} | replicas' PSS, MiB in all | {pss_a:,.0f} | {pss_b:,.0f} | "
                     f"{pss_a / pss_b:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
