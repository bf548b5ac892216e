#!/usr/bin/env python
"""What the ingest driver holds at scale, without the encoders' time.

    .venv/bin/python scripts/bench_driver.py --n 200000 --work /tmp/helixbench/driver

Writes ``--n`` synthetic memories (``scripts/synthetic.py``, one tenant by default, as
the 10^6 store of ``bench_recall.py``), then runs the real ``helix ingest`` job on them
(``runner="ray"``: read and validate on Ray Data) with every memory's vector given, as a
compaction gives the vectors its writes computed (``ingest(..., computed=...)``): the
encoders do not run, and every other stage does — dedup, doc2query, entities, the
sorted rows, kNN, HNSW, graph, BM25, publish and the DuckDB record. Late interaction is
off (a given vector has no token vectors to go with it).

The vectors are those of ``bench_recall.py``'s derived stores in shape, not in meaning:
one of 5,000 random unit vectors plus N(0, σ²) noise per dimension, renormalised, so a
memory has close neighbours as real near-duplicates do.

It prints the driver's peak RSS (``VmHWM``), its peak heap alone (``RssAnon``, sampled:
without the pages of files it maps, which the kernel can drop; overall, per stage, and
at the places in the code where it peaked highest)
and its RSS just before the ingest (the vectors given, held by this script), the peak
PSS of the driver and every Ray process together, the run's seconds per stage
(``IngestReport.seconds``) and the units of work (index builds, kNN searches, the graph) each node
ran. Memory does not drift with the host's load; seconds do (compare runs made side by
side).

``--nodes N`` (N ≥ 2) runs the job on a cluster of N ``ray start`` nodes of this host
(``helix_ray.local_cluster.LocalCluster``, ``--node-cpus`` each), this process joining it
as the driver: the kNN searches spread over the nodes. On one host the nodes share its
cores, so this shows where the work runs, not a speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ingest import MemorySampler, environ, rss_mib  # noqa: E402


def given_vectors(path: Path, n: int, seed: int, sigma: float) -> dict:
    """The ``Computed`` outputs of every row of ``path`` (by the id ingest gives it),
    vectors held as float16 (the precision a generation stores)."""
    from derived_store import derived_vectors

    from helix_ray.config import IngestConfig
    from helix_ray.embedder import DIM
    from helix_ray.ingest.normalize import normalise_one
    from helix_ray.ingest.stages import Computed

    validation = IngestConfig().validation
    when = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)  # every synthetic row has its own created_at
    rng = np.random.default_rng(seed)
    bases = rng.standard_normal((5000, DIM)).astype(np.float32)
    bases /= np.linalg.norm(bases, axis=1, keepdims=True)
    computed: dict[str, Computed] = {}
    with open(path, encoding="utf-8") as fh:  # a block of rows and their float32 vectors at a time
        while block := [normalise_one(json.loads(line), validation, default_time=when)
                        for line in itertools.islice(fh, 65536)]:
            vectors = derived_vectors(bases, rng.integers(0, len(bases), len(block)), rng, sigma)
            computed.update((row["id"], Computed(row["text"], "[]", v))
                            for row, v in zip(block, vectors.astype(np.float16)))
    if len(computed) != n:
        raise SystemExit(f"{path} holds {len(computed)} distinct ids; expected {n}")
    return computed


class AnonPeak:
    """The driver's peak anonymous memory (``RssAnon``: its heap, without the pages of
    files it maps, which the kernel can drop), sampled every ``interval`` seconds, overall
    and per ingest stage (``by_stage``: the stage that was running, or the step after it
    until the next one starts), and per place in the code (``by_frame``: the innermost
    ``helix_ray`` lines the main thread was running, the two closest), which names what
    raised a peak."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak_mib = interval, 0.0
        self.stage = "start"
        self.by_stage: dict[str, float] = {}
        self.by_frame: dict[str, float] = {}
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            with open("/proc/self/status") as fh:
                mib = next(int(line.split()[1]) / 1024 for line in fh if line.startswith("RssAnon:"))
            where = _where(sys._current_frames().get(self._main))
            self.peak_mib = max(self.peak_mib, mib)
            self.by_stage[self.stage] = max(self.by_stage.get(self.stage, 0.0), mib)
            self.by_frame[where] = max(self.by_frame.get(where, 0.0), mib)
            if self._stop.wait(self.interval):
                return

    def top_frames(self, n: int = 12) -> dict[str, int]:
        """The ``n`` places in the code with the highest peaks, highest first."""
        return {k: round(v) for k, v in sorted(self.by_frame.items(), key=lambda kv: -kv[1])[:n]}

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def following(self, run_module: Any) -> Iterator[None]:
        """Names each sample by the stage ``run_module`` (``helix_ray.ingest.run``) times."""
        timed = run_module.timed

        @contextlib.contextmanager
        def named(report: Any, name: str) -> Iterator[None]:
            self.stage = name
            with timed(report, name):
                yield
            self.stage = f"after {name}"

        run_module.timed = named
        try:
            yield
        finally:
            run_module.timed = timed


def _where(frame: Any) -> str:
    """``path:line function`` of the two innermost ``helix_ray`` frames from ``frame`` out
    (``-`` when the thread runs none: the script's own code, or a library's)."""
    places = []
    while frame is not None and len(places) < 2:
        name = frame.f_code.co_filename
        if f"{os.sep}helix_ray{os.sep}" in name:
            places.append(f"{name.rsplit(os.sep + 'helix_ray' + os.sep, 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(places) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000, help="synthetic memories")
    ap.add_argument("--users", type=int, default=1, help="tenants (one by default: one HNSW index, one graph)")
    ap.add_argument("--work", required=True, help="folder for the JSONL and the store (kept out of the repo)")
    ap.add_argument("--runner", choices=("ray", "local"), default="ray")
    ap.add_argument("--sigma", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--nodes", type=int, default=1, help="with 2 or more: a local cluster of that many nodes")
    ap.add_argument("--node-cpus", type=int, default=1, help="logical CPUs each of those nodes advertises")
    args = ap.parse_args(argv)
    if args.nodes > 1 and args.runner != "ray":
        raise SystemExit("--nodes runs the job on a Ray cluster: not with --runner local")

    from synthetic import write_jsonl

    from helix_ray.config import IngestConfig, LateInteractionConfig
    from helix_ray.ingest import run as run_module
    from helix_ray.ingest.run import ingest

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / f"synthetic-{args.n}-u{args.users}-seed{args.seed}.jsonl"
    if not source.is_file():
        write_jsonl(args.n, str(source), seed=args.seed, users=args.users)
    computed = given_vectors(source, args.n, args.seed, args.sigma)
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    before = rss_mib()[0]
    config = IngestConfig(late_interaction=LateInteractionConfig(enabled=False))
    with contextlib.ExitStack() as stack:
        if args.nodes > 1:
            from helix_ray.local_cluster import LocalCluster

            # The nodes' workers import helix_ray from this checkout; the object store
            # holds the searches' inputs (the index and each unit's rows).
            paths = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
            stack.enter_context(environ({"PYTHONPATH": os.pathsep.join(paths)}))
            cluster = stack.enter_context(LocalCluster(nodes=args.nodes, cpus=args.node_cpus,
                                                       object_store_bytes=2_000_000_000))
            stack.enter_context(environ({k: v for k, v in cluster.env().items()
                                         if k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}))
        t0 = time.perf_counter()
        with MemorySampler() as sampler, AnonPeak() as anon, anon.following(run_module):
            report = ingest([source], store, fmt="jsonl", config=config, runner=args.runner, show_progress=False,
                            computed=computed)
        seconds = time.perf_counter() - t0
        if args.runner == "ray":
            import ray

            ray.shutdown()
    out = {
        "n": args.n, "users": args.users, "runner": args.runner, "memories": report.total_memories,
        "reused": report.reused, "embedded": report.embedded,
        "driver_rss_before_mib": round(before), "driver_peak_rss_mib": round(rss_mib()[1]),
        "driver_peak_anon_mib": round(anon.peak_mib),
        "driver_peak_anon_by_stage_mib": {k: round(v) for k, v in anon.by_stage.items()},
        "driver_peak_anon_by_frame_mib": anon.top_frames(),
        "tree_peak_pss_mib": round(sampler.peak_mib), "seconds": round(seconds, 1), "stages_s": report.seconds,
        "nodes": args.nodes, "work_units": report.work_units,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
