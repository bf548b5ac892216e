#!/usr/bin/env python
"""In-process recall latency at 10^5 and 10^6 memories, against a dense-only baseline.

    nohup .venv/bin/python scripts/bench_recall.py --sizes 100000,1000000 \
        --work /tmp/helixbench/recall --json /tmp/helixbench/recall.json > /tmp/helixbench/recall.log 2>&1 &

The stores are derived from a smaller embedded base set (``scripts/derived_store.py``), so
BM25, HNSW, the graph and MinHash are the real thing without embedding every memory.
By default (``--late``, the default ``IngestConfig``) the stores carry late-interaction
token vectors (each memory its base memory's, encoded for real) and the query process
encodes each query's tokens and re-scores the candidates by MaxSim (stage ``late``; the
query encoding is ``embed_tokens``, overlapped with the rest on a second core, and
``wait_tokens`` what the late stage still waited for it); ``--no-late`` builds stores
without them.

**Tenants.** Below ``--single-tenant-from`` memories the Zipf tenants of
``synthetic.py`` (10^5: 40 users, the largest ~25k); from it on, one tenant holds every
memory (the worst case for one query).

**Queries.** ``--queries`` seeded queries (a third each: exact identifiers taken from a
memory of the tenant, natural-language paraphrases anchored on one of its identifiers,
short vague questions), users drawn in proportion to tenant size, after ``--warmup``
warm-up queries. Each query runs through the full pipeline and through the baseline —
dense only (fusion weights ``{"dense": 1, "bm25": 0}``, graph expansion off; late
interaction, ranking, diversity and packing unchanged) — alternating which goes first.
The query phase runs in a fresh subprocess, so its RSS is that of a serving process (mapped
generation + encoders), not of the builder; it opens the generation as ``helix_ray.memory``
does (with tokens: half the cores for each of the two query encoders, the query's tokens
encoded alongside). It first reads the generation's files once (``--no-prefault`` skips
that) so the OS page cache holds them, as on a serving host in steady state. It runs
once per ``--query-env``: by default with the inherited environment and with
``OMP_NUM_THREADS=1`` — what Ray sets in a worker with a fractional CPU, such as a Serve
replica — because multi-threaded OpenBLAS adds hand-off cost to the query path's small
matrix products on a busy host (docs/benchmarks.md).

``--reuse`` (with ``--work`` and ``--keep-stores`` on the earlier run) skips the build and
re-runs the queries on a kept store (``--no-late`` keeps its stores apart, in ``store-N-nolate``).

``--against REF`` (``main``, a commit) also runs every query phase with the code of that
git ref, exported with ``git archive`` into ``--work``, on the same stores and queries,
the two processes alternating which goes first; the report adds, per size and query
env, the full pipeline's stages under both and the ratio of their totals: a change
measured against its base in one run, on one host state.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import random
import shutil
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

from bench_ingest import machine_info, rss_mib, tree_pss_mib  # noqa: E402
from synthetic import VAGUE, VERBS  # noqa: E402

from against import export_ref  # noqa: E402
from derived_store import base_set, base_tokens, build_store, dist, log, top1_cosine  # noqa: E402

STAGES = ("embed", "route", "bm25", "dense", "fuse", "expand", "late", "embed_tokens", "wait_tokens", "rank",
          "diversify", "pack", "total")


# ----------------------------------------------------------------------------- queries


def make_queries(store: Path, count: int, seed: int) -> list[dict[str, str]]:
    """Seeded queries over the published generation: exact identifiers, paraphrases, vague."""
    from helix_ray.ingest import entities
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(store)
    rng = random.Random(f"queries-{seed}")
    users = list(gen.partitions)
    sizes = [gen.partitions[u][1] - gen.partitions[u][0] for u in users]
    memories = gen.memories
    people = ["Alice", "Bob", "Priya", "Kenji", "Noor", "Mateo", "Grace", "Omar"]
    out = []
    while len(out) < count:
        user = rng.choices(users, sizes)[0]
        start, end = gen.partitions[user]
        kind = ("identifier", "paraphrase", "vague")[len(out) % 3]
        if kind == "vague":
            q = rng.choice(VAGUE).replace("{person}", rng.choice(people))
            out.append({"query": q, "user": user, "kind": kind})
            continue
        row = rng.randrange(start, end)
        text = memories.column("text")[row].as_py()
        mtype = memories.column("type")[row].as_py()
        keys = [e.split(":", 1) for e in entities.extract(text)]
        anchors = [v for k, v in keys if k in ("identifier", "path", "error")]
        if not anchors:
            continue
        anchor = rng.choice(anchors)
        if kind == "identifier":
            q = rng.choice(["{a}", "{a}", "where is {a}", "{a} error", "what does {a} do", "{a} {b}"]).format(
                a=anchor, b=rng.choice(anchors))
        else:
            q = {
                "decision": ["why did we decide that about {a}?", "what was the reasoning behind the {a} choice",
                             "did we agree on anything for {a}"],
                "procedural": ["how do I {v} {a}?", "what are the steps for {a}", "remind me how to run {a}"],
                "code": ["where is {a} handled and what breaks there?", "how did we fix the problem in {a}",
                         "what goes wrong with {a}"],
                "episodic": ["what happened with {a} last time?", "when did we last touch {a}",
                             "was there an incident involving {a}"],
                "semantic": ["what do we know about {a}?", "what should I keep in mind about {a}",
                             "explain {a} to me"],
            }[mtype]
            q = rng.choice(q).format(a=anchor, v=rng.choice(VERBS))
        out.append({"query": q, "user": user, "kind": kind})
    return out


def pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p95": round(float(np.percentile(a, 95)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "mean": round(float(a.mean()), 3)}


def query_phase(store: Path, queries_file: Path, warmup: int, prefault: bool = True) -> dict[str, Any]:
    """Runs in a fresh process: open the generation, warm up, time every query twice."""
    from helix_ray.config import EmbedderConfig, FusionConfig, GraphConfig, RetrievalConfig
    from helix_ray.embedder import DIM, get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.recall.threads import encoder_threads
    from helix_ray.store.generation import Generation

    spec = json.loads(queries_file.read_text())
    prefault_s = None
    if prefault:  # read the generation's files once: steady-state page cache, as on a serving host
        t0 = time.perf_counter()
        for path in sorted((store / "generations").rglob("*")):
            if path.is_file():
                with open(path, "rb") as fh:
                    while fh.read(1 << 24):
                        pass
        prefault_s = round(time.perf_counter() - t0, 2)
    rss0 = rss_mib()[0]
    t0 = time.perf_counter()
    full_cfg = RetrievalConfig()
    base_cfg = RetrievalConfig(fusion=FusionConfig(weights={"dense": 1.0, "bm25": 0.0}),
                               graph=GraphConfig(enabled=False))
    gen = Generation.open_current(store, expect_embedder=EmbedderConfig().name, expect_dim=DIM)
    # as helix_ray.memory.Memory opens one: with tokens, half the cores per query encoder, run side by side
    threads = encoder_threads(gen, full_cfg)
    embedder = get_embedder(None, threads)
    recaller = Recaller(gen, embedder, full_cfg, threads=threads)  # builds MemoryColumns (per-row arrays)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mib()[0]
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    t0 = time.perf_counter()
    first = recaller.recall(spec["warmup"][0]["query"], user=spec["warmup"][0]["user"], now=now)
    first_query_s = time.perf_counter() - t0
    for q in spec["warmup"][1:warmup]:
        recaller.recall(q["query"], user=q["user"], now=now)
        recaller.recall(q["query"], user=q["user"], now=now, config=base_cfg)
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "dense_only": []}
    for i, q in enumerate(spec["queries"]):
        order = (("full", full_cfg), ("dense_only", base_cfg))
        for name, cfg in (order if i % 2 == 0 else order[::-1]):
            res = recaller.recall(q["query"], user=q["user"], now=now, config=cfg)
            runs[name].append({"kind": q["kind"], "timings": res.timings_ms, "items": len(res.items),
                               "router_skip": res.flags.get("router_skip", False),
                               "strong_signal_skip": res.flags.get("strong_signal_skip", False),
                               "dense_first_pass": res.flags.get("dense_first_pass"),
                               "late_scored": res.flags.get("late", 0),
                               "graph_nodes": (res.flags.get("graph") or {}).get("subgraph_nodes"),
                               "graph_method": (res.flags.get("graph") or {}).get("method")})
    rss_end, rss_peak = rss_mib()
    pss, _ = tree_pss_mib()
    out: dict[str, Any] = {"git": machine_info()["git"], "env": {k: os.environ.get(k) for k in (
                               "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "HELIX_EMBED_THREADS")},
                           "late": gen.late is not None, "encoder_threads": threads,
                           "loadavg": os.getloadavg(), "prefault_s": prefault_s, "load_s": round(load_s, 2), "first_query_ms": round(first_query_s * 1000, 1),
                           "first_query_timings": first.timings_ms,
                           "rss_mib": {"start": round(rss0), "after_open": round(rss_loaded), "end": round(rss_end),
                                       "peak": round(rss_peak), "pss_end": round(pss)}}
    for name, rows in runs.items():
        stages = {s: pct([r["timings"].get(s, 0.0) for r in rows]) for s in STAGES}
        by_kind = {k: pct([r["timings"]["total"] for r in rows if r["kind"] == k]) for k in ("identifier", "paraphrase", "vague")}
        by_path = {}
        for path in sorted({str(r["dense_first_pass"]) for r in rows}):
            sel = [r["timings"]["total"] for r in rows if str(r["dense_first_pass"]) == path]
            by_path[path] = pct(sel) | {"n": len(sel)}
        out[name] = {
            "n": len(rows), "stages_ms": stages, "total_by_kind_ms": by_kind, "total_by_dense_path_ms": by_path,
            "router_skips": sum(r["router_skip"] for r in rows),
            "strong_signal_skips": sum(r["strong_signal_skip"] for r in rows),
            "mean_items": round(float(np.mean([r["items"] for r in rows])), 2),
            "mean_late_scored": round(float(np.mean([r["late_scored"] for r in rows])), 1),
            "graph_subgraph_nodes": pct([r["graph_nodes"] for r in rows if r["graph_nodes"] is not None] or [0]),
            "graph_bfs_fallbacks": sum(1 for r in rows if r["graph_method"] == "bfs"),
        }
    full_total = np.array([r["timings"]["total"] for r in runs["full"]])
    base_total = np.array([r["timings"]["total"] for r in runs["dense_only"]])
    out["ratio_full_over_dense_only"] = {
        "p50": round(float(np.percentile(full_total, 50) / np.percentile(base_total, 50)), 2),
        "p95": round(float(np.percentile(full_total, 95) / np.percentile(base_total, 95)), 2),
        "per_query_median": round(float(np.median(full_total / base_total)), 2),
    }
    dense_leg = np.array([r["timings"]["dense"] for r in runs["dense_only"]])
    out["ratio_full_over_dense_leg"] = {
        "p50": round(float(np.percentile(full_total, 50) / np.percentile(dense_leg, 50)), 2),
        "p95": round(float(np.percentile(full_total, 95) / np.percentile(dense_leg, 95)), 2),
    }
    return out


# ----------------------------------------------------------------------------- report


def _q(r: dict[str, Any], variant: str) -> dict[str, Any]:
    return r.get("query_variants", {}).get(variant) or r["query"]


def stage_table(results: list[dict[str, Any]], variant: str) -> str:
    heads = []
    for r in results:
        heads += [f"{r['label']} full p50/p95/p99", f"{r['label']} dense-only p50/p95/p99"]
    lines = [f"| stage (ms), query env: {variant} | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for s in STAGES:
        cells = []
        for r in results:
            for name in ("full", "dense_only"):
                p = _q(r, variant)[name]["stages_ms"][s]
                cells.append(f"{p['p50']:.2f} / {p['p95']:.2f} / {p['p99']:.2f}")
        label = f"**{s}**" if s == "total" else s
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    variants = list(results[0].get("query_variants", {"default": None})) if results else ["default"]
    lines = []
    for variant in variants:
        lines += [stage_table(results, variant), ""]
    lines.append("| | " + " | ".join(r["label"] for r in results) + " |")
    lines.append("|---|" + "---:|" * len(results))

    def row(label: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(str(fn(r)) for r in results) + " |")

    row("late-interaction tokens: late/ MiB, tokens (dim)",
        lambda r: f"{r['build']['late']['bytes'] / 2**20:,.0f}, {r['build']['late']['tokens']:,} "
                  f"({r['build']['late']['dim']})" if r["build"].get("late") else "none (--no-late)")
    row("memories / tenants / with HNSW", lambda r: f"{r['build']['counts']['memories']:,} / {r['build']['partitions']} / {r['build']['hnsw_partitions']}")
    row("largest tenant", lambda r: f"{r['build']['largest_tenant']:,}")
    row("graph edges", lambda r: f"{r['build']['counts']['edges']:,}")
    row("build s (rows, vectors, minhash, annotate, assemble, publish)", lambda r: f"{r['build']['build_s']:,.0f}")
    row("builder peak RSS MiB", lambda r: f"{r['build']['peak_rss_mib']:,.0f}")
    row("store size MiB", lambda r: f"{r['build']['store_bytes'] / 2**20:,.0f}")
    row("top-1 NN cosine p5/p50/p95 (store)", lambda r: "{p5:.3f} / {p50:.3f} / {p95:.3f}".format(**r["nn_cosine_store"]))
    for v in variants:
        row(f"**ratio full / dense-only total p50, p95** ({v})",
            lambda r, v=v: f"**{_q(r, v)['ratio_full_over_dense_only']['p50']}×, {_q(r, v)['ratio_full_over_dense_only']['p95']}×**")
        row(f"ratio full total / dense leg alone p50, p95 ({v})",
            lambda r, v=v: f"{_q(r, v)['ratio_full_over_dense_leg']['p50']}×, {_q(r, v)['ratio_full_over_dense_leg']['p95']}×")
        row(f"full: total p95 by kind, identifier / paraphrase / vague ({v})",
            lambda r, v=v: " / ".join(f"{_q(r, v)['full']['total_by_kind_ms'][k]['p95']:.1f}" for k in ("identifier", "paraphrase", "vague")))
    q0 = variants[0]
    row("full: strong-signal skips / router skips", lambda r: f"{_q(r, q0)['full']['strong_signal_skips']} / {_q(r, q0)['full']['router_skips']}")
    row("full / dense-only: candidates scored by MaxSim (mean)",
        lambda r: f"{_q(r, q0)['full']['mean_late_scored']} / {_q(r, q0)['dense_only']['mean_late_scored']}")
    row("full: dense first pass (n)", lambda r: ", ".join(f"{k}: {v['n']}" for k, v in _q(r, q0)['full']['total_by_dense_path_ms'].items()))
    row("full: PPR subgraph nodes p50/p95; BFS fallbacks",
        lambda r: f"{_q(r, q0)['full']['graph_subgraph_nodes']['p50']:.0f} / {_q(r, q0)['full']['graph_subgraph_nodes']['p95']:.0f}; {_q(r, q0)['full']['graph_bfs_fallbacks']}")
    row("query process: read store files once (page cache) s", lambda r: f"{_q(r, q0).get('prefault_s')}")
    row("query process: open + columns s", lambda r: f"{_q(r, q0)['load_s']:.1f}")
    row("query process: first (cold) query ms", lambda r: f"{_q(r, q0)['first_query_ms']:.0f}")
    row("query process RSS after open / end / peak MiB",
        lambda r: f"{_q(r, q0)['rss_mib']['after_open']:,} / {_q(r, q0)['rss_mib']['end']:,} / {_q(r, q0)['rss_mib']['peak']:,}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default="100000,1000000", help="comma-separated store sizes")
    ap.add_argument("--base", type=int, default=20000, help="distinct base texts embedded for real")
    ap.add_argument("--sigma", type=float, default=0.02, help="per-dimension noise added to a base vector")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--single-tenant-from", type=int, default=1_000_000,
                    help="stores of at least this many memories hold one tenant")
    ap.add_argument("--late", action=argparse.BooleanOptionalAction, default=True,
                    help="late-interaction token vectors in the stores (the default IngestConfig); --no-late: "
                         "none, and recall ranks by the sentence cosine alone")
    ap.add_argument("--hnsw-threads", type=int, default=0, help="IngestConfig.hnsw_threads for the build")
    ap.add_argument("--work", default=None, help="folder for stores and the base-vector cache (default: temp, removed)")
    ap.add_argument("--keep-stores", action="store_true", help="keep the built stores in --work")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a store an earlier run kept in --work (same size, sigma, seed) instead of building")
    ap.add_argument("--query-env", default="default,OMP_NUM_THREADS=1",
                    help="comma-separated environments for the query process: 'default' (inherit) or VAR=VALUE. "
                         "OMP_NUM_THREADS=1 is what Ray gives a worker with a fractional CPU (a Serve replica): "
                         "OpenBLAS and onnxruntime then use one thread")
    ap.add_argument("--no-prefault", action="store_true",
                    help="skip reading the generation's files once before the queries (then the 10^6 store's "
                         "first hundreds of queries fault pages in, if the OS evicted them since the build)")
    ap.add_argument("--against", metavar="REF",
                    help="also run each query phase with the code of this git ref (e.g. main), exported into "
                         "--work, on the same store and queries, the two alternating which goes first; print both "
                         "and their ratio")
    ap.add_argument("--json", default=None)
    ap.add_argument("--query-phase", nargs=2, metavar=("STORE", "QUERIES_JSON"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def base_for(args: argparse.Namespace, work: Path) -> tuple[list[str], list[str | None], np.ndarray, Any,
                                                             dict[str, Any]]:
    """The base set, with its own top-1 NN cosine distribution and median length in its
    info, and its token vectors (None with ``--no-late``)."""
    base_texts, base_types, base_vectors, base_info = base_set(args.base, args.seed, work)
    sample = np.random.default_rng(args.seed).choice(len(base_vectors), min(1000, len(base_vectors)), replace=False)
    base_info["nn_cosine_base"] = dist(top1_cosine(base_vectors, sample))
    base_info["words_p50"] = float(np.median([len(t.split()) for t in base_texts]))
    tokens = None
    if args.late:
        tokens, base_info["late"] = base_tokens(base_texts, args.seed, work)
    log(f"base set: {json.dumps(base_info)}")
    return base_texts, base_types, base_vectors, tokens, base_info


def store_for(args: argparse.Namespace, n: int, label: str, work: Path, base_texts: list[str],
              base_types: list[str | None], base_vectors: np.ndarray, tokens: Any) -> tuple[Path, dict[str, Any]]:
    """The store of ``n`` memories in ``work``: reused with ``--reuse`` when kept, else built."""
    late = "" if args.late else "-nolate"
    store = work / f"store-{n}{late}"
    build_file = work / f"build-{n}-sigma{args.sigma}-seed{args.seed}{late}.json"
    users = 1 if n >= args.single_tenant_from else None
    kept = json.loads(build_file.read_text()) if args.reuse and build_file.is_file() else None
    if kept is not None and (kept.get("late") is not None) != args.late:  # a kept store of the other kind
        log(f"== {label}: the store kept in {store} {'lacks' if args.late else 'has'} token vectors: building anew")
        kept = None
    if kept is not None and (store / "CURRENT").is_file():
        build = kept
        build["reused"] = True
        log(f"== {label}: reusing the store built earlier in {store}")
    else:
        if store.exists():
            shutil.rmtree(store)
        log(f"== {label}: building {n:,} memories ({'one tenant' if users == 1 else 'Zipf tenants'}) in {store}")
        build = build_store(n, store, users=users, base_texts=base_texts, base_types=base_types,
                            base_vectors=base_vectors, sigma=args.sigma, seed=args.seed,
                            hnsw_threads=args.hnsw_threads, base_tokens=tokens)
        build_file.write_text(json.dumps(build))
    log(f"build: {json.dumps(build)}")
    return store, build


def store_nn_cosine(store: Path, seed: int) -> dict[str, float]:
    """Top-1 NN cosine over 500 sampled memories of the store."""
    from helix_ray.store.generation import Generation

    gen = Generation.open_current(store)
    vectors = gen.vectors
    sample = np.random.default_rng(seed + 1).choice(len(vectors), min(500, len(vectors)), replace=False)
    t0 = time.perf_counter()
    nn = dist(top1_cosine(np.asarray(vectors, dtype=np.float32), np.sort(sample)))
    log(f"top-1 NN cosine over 500 sampled memories: {nn} ({time.perf_counter() - t0:.0f}s)")
    del gen, vectors
    gc.collect()
    return nn


def run_phase(script: Path, args: argparse.Namespace, store: Path, qfile: Path, env: dict[str, str]) -> dict[str, Any]:
    """One query phase: ``script`` (this one, or a ref's copy, which imports its own
    helix_ray) in a fresh process."""
    proc = subprocess.run([sys.executable, str(script), "--warmup", str(args.warmup), "--query-phase",
                           str(store), str(qfile)] + (["--no-prefault"] if args.no_prefault else []),
                          capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"query phase of {script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def query_variants(args: argparse.Namespace, store: Path, qfile: Path, label: str,
                   against: Path | None = None, turn: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The query phase once per ``--query-env``, each in a fresh process; with
    ``against`` (a ref's exported tree), that tree's too, the two alternating which goes
    first (``turn``: how many phases of the run came before, so the alternation goes on
    across sizes). Returns (this code's, the ref's) results by variant."""
    variants: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    for i, variant in enumerate(v for v in args.query_env.split(",") if v):
        env = dict(os.environ)
        if variant != "default":
            key, _, value = variant.partition("=")
            env[key] = value
        sides = [("this", Path(__file__))] + ([("ref", against / "scripts" / "bench_recall.py")] if against else [])
        for side, script in sides if (i + turn) % 2 == 0 else sides[::-1]:
            log(f"query phase [{variant}] {side} ({args.queries} queries + {args.warmup} warm-up, fresh process) ...")
            q = run_phase(script, args, store, qfile, env)
            (variants if side == "this" else theirs)[variant] = q
            log(f"{label} [{variant}] {side}: full p50/p95 {q['full']['stages_ms']['total']['p50']:.1f}/"
                f"{q['full']['stages_ms']['total']['p95']:.1f} ms; dense-only "
                f"{q['dense_only']['stages_ms']['total']['p50']:.1f}/"
                f"{q['dense_only']['stages_ms']['total']['p95']:.1f} ms")
    return variants, theirs


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The tables this run prints (and writes in ``--json``)."""
    return table(results) + ("\n\n" + against_table(results) if args.against else "")


def against_table(results: list[dict[str, Any]]) -> str:
    """This code beside ``--against``'s, per size and query env: the full pipeline's
    stages p50 / p95 and the ratio of the totals."""
    lines = []
    for r in results:
        ref = r["against"]["ref"]
        for variant, theirs in r["against"]["variants"].items():
            ours = r["query_variants"][variant]["full"]["stages_ms"]
            other = theirs["full"]["stages_ms"]
            lines += [f"| {r['label']}, full, {variant}: stage ms p50 / p95 | this code | {ref} | this / {ref} p50, p95 |",
                      "|---|---:|---:|---:|"]
            for s in STAGES:
                a, b = ours.get(s), other.get(s)
                if a is None or b is None:
                    continue
                ratio = (f"{a['p50'] / b['p50']:.2f}×, {a['p95'] / b['p95']:.2f}×"
                         if b["p50"] > 0 and b["p95"] > 0 else "")
                label = f"**{s}**" if s == "total" else s
                lines.append(f"| {label} | {a['p50']:.2f} / {a['p95']:.2f} | {b['p50']:.2f} / {b['p95']:.2f} | {ratio} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if args.query_phase:  # the child process
        result = query_phase(Path(args.query_phase[0]), Path(args.query_phase[1]), args.warmup, not args.no_prefault)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    info = machine_info()
    print(json.dumps(info), flush=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="helix-bench-recall-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        against, ref_sha = export_ref(args.against, work) if args.against else (None, None)
        base_texts, base_types, base_vectors, tokens, base_info = base_for(args, work)
        for n in [int(s) for s in args.sizes.split(",") if s]:
            label = f"10^{round(np.log10(n))}" if n in (10**5, 10**6) else f"{n:,}"
            store, build = store_for(args, n, label, work, base_texts, base_types, base_vectors, tokens)
            nn = store_nn_cosine(store, args.seed)
            queries = make_queries(store, args.queries + args.warmup, args.seed)
            qfile = work / f"queries-{n}.json"
            qfile.write_text(json.dumps({"warmup": queries[: args.warmup], "queries": queries[args.warmup :]}))
            variants, theirs = query_variants(args, store, qfile, label, against,
                                              turn=len(results) * len([v for v in args.query_env.split(",") if v]))
            query = next(iter(variants.values()))
            results.append({"label": label, "n": n, "sigma": args.sigma, "late": args.late, "build": build,
                            "nn_cosine_store": nn,
                            "query": query, "query_variants": variants, "loadavg": os.getloadavg()})
            if against is not None:
                results[-1]["against"] = {"ref": args.against, "commit": ref_sha, "variants": theirs}
            if args.json:  # write as we go: a later size may take long or fail
                Path(args.json).write_text(json.dumps({"machine": info, "base": base_info, "results": results,
                                                       "table": report(results, args)}, indent=1))
            if not args.keep_stores:
                shutil.rmtree(store, ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    print()
    print(report(results, args))
    print(f"\nbase set: {json.dumps(base_info)}")
    print(f"load average start {info['loadavg_start']} end {info['loadavg_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "base": base_info, "results": results,
                                               "table": report(results, args)}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
