#!/usr/bin/env python
"""Ingest throughput: the full Ray Data pipeline against an in-process embed-only baseline.

    nohup .venv/bin/python scripts/bench_ingest.py --json /tmp/helixbench/ingest.json \
        > /tmp/helixbench/ingest.log 2>&1 &

For each dataset — (a) LoCoMo's 5,882 turns (``--locomo``, read in place, never copied)
and (b) a synthetic set of ``--n`` memories (``scripts/synthetic.py``, written to the
work folder) — it:

1. runs ``helix_ray.ingest.run.ingest(..., runner="ray")`` into a fresh temporary store,
   with Ray started cold by the pipeline (and ``ray.shutdown()`` after, in-process;
   never ``ray stop``);
2. as the baseline, embeds exactly the texts the pipeline embedded (read and validated
   again in this process, minus the rows the pipeline dropped as duplicates, in input
   order) with ``helix_ray.embedder.get_embedder().embed_passages`` called on the same
   ``helix_ray.ingest.run.BATCH``-row chunks the pipeline's Embed stage gets (the embedder
   sorts each call's texts by length, then runs model batches of
   ``IngestConfig().embedder.batch_size``), in this process, model already loaded.

It reports memories/s, the pipeline's seconds per stage (``IngestReport.seconds``), the
total, the ratio pipeline / embed-only with and without Ray's start-up, CPU seconds of
both sides, and the peak memory (PSS summed over this process and its descendants: the
Ray processes it starts). The machine may be shared: pipeline and baseline alternate
(``--repeats`` rounds) and the fastest run of each side is compared; read ratios measured
in the same run, not absolute times across runs.

On the synthetic set the baseline can embed a sample of the batches
(``--baseline-fraction``): each sampled batch is exactly a batch the pipeline embedded.

``--nodes N`` (N ≥ 2): each round then also runs the pipeline on the same data on a
cluster of N ``ray start`` nodes of this host (``helix_ray.local_cluster.LocalCluster``,
``--node-cpus`` logical CPUs each, started before the run and stopped after, not timed),
joined with ``RAY_ADDRESS`` from a new process of this script. Before that driver leaves
the cluster it asks the cluster's state API where the embedding actors ran and which
blocks each transformed; the script prints, per node, the actors, blocks, rows and
memories/s (rows / the embed stage's wall time), and the one-node and N-node runs side
by side. Nodes of one host share its cores: this reports the scheduling, not a speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PIPELINE_ENV: dict[str, str] = {}  # --pipeline-env: set only while the pipeline (and its Ray) runs
STAGE_ORDER = ("ray_start", "read_validate", "dedup", "expand_embed_annotate", "assemble", "publish", "record")


# ----------------------------------------------------------------------------- machine and memory


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    versions = {}
    for mod in ("ray", "numpy", "pyarrow", "usearch", "bm25s", "fastembed", "onnxruntime", "datasketch"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing module is just not reported
            pass
    git: dict[str, Any] = {}
    try:
        git["head"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--short", "--", "helix_ray", "pipelines"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        git["dirty"] = [line.strip() for line in dirty if line.strip()]
    except Exception:  # noqa: BLE001
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git,
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_gib": mem_gib,
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_start": os.getloadavg(),
        "host_processes_busy": _busy_processes(),
    }


def _busy_processes(limit: int = 5) -> list[str]:
    """Other processes using CPU right now (to say honestly that the machine was shared)."""
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,rss,comm", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=5).stdout.splitlines()[1 : limit + 1]
        return [" ".join(line.split()) for line in out]
    except Exception:  # noqa: BLE001
        return []


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


_TICK = os.sysconf("SC_CLK_TCK")


#: smaps_rollup's PSS lines: all of it, then its heap (anon), mapped files and shared
#: memory (Ray's object store lives in shared memory).
_PSS_KINDS = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}


def tree_stats(root: int | None = None, parts: dict[str, dict[str, float]] | None = None,
               ) -> tuple[float, int, dict[int, float]]:
    """PSS (MiB) of ``root`` and all its descendants, how many processes that is, and
    each one's CPU seconds so far (user + system). PSS splits shared pages (Ray's object
    store, memory maps) between their mappers, so the sum does not double count them.
    ``parts``, when given, is filled with each kind of process's PSS, MiB, by kind of
    page (:data:`_PSS_KINDS`; :func:`process_kind`)."""
    root = root or os.getpid()
    kids = _children_map()
    todo, total, count, cpu = [root], 0, 0, {}
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
            fields = stat[stat.rfind(")") + 2 :].split()
            cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICK
            kinds: dict[str, float] = {}
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    name = _PSS_KINDS.get(line.split(" ", 1)[0])
                    if name is not None:
                        kinds[name] = int(line.split()[1]) / 1024
            if "pss" not in kinds:
                continue
            total += kinds["pss"] * 1024
            count += 1
            if parts is not None:
                into = parts.setdefault(process_kind(pid, root), {})
                for name, mib in kinds.items():
                    into[name] = into.get(name, 0.0) + mib
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024, count, cpu


def process_kind(pid: int, root: int) -> str:
    """What a process of the tree is: ``driver`` (this one), a Ray worker by its title
    (``ray::MapWorker(...)``, ``ray::IDLE``), else its program's name (raylet, gcs_server)."""
    if pid == root:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return "?"
    title = argv[0].decode(errors="replace")
    if title.startswith("ray::"):
        return title.split(" ", 1)[0][:60]
    words = [a.decode(errors="replace") for a in argv if a]
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return Path(script or title).name[:60]


def tree_pss_mib(root: int | None = None) -> tuple[float, int]:
    mib, count, _ = tree_stats(root)
    return mib, count


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process, MiB."""
    cur = peak = 0.0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


class MemorySampler:
    """Samples this process tree every ``interval`` seconds: the peak PSS, and the CPU
    seconds each process used (a process that exits between samples loses at most one
    interval). CPU seconds are less sensitive than wall time to other load on the host.

    Reading ``smaps_rollup`` walks every mapped page of a process: sampled often over the
    pipeline's many Ray processes, it takes a noticeable share of a core from the run it
    measures, so the interval is 3 s."""

    def __init__(self, interval: float = 3.0):
        self.interval = interval
        self.peak_mib = 0.0
        self.peak_procs = 0
        self.peak_parts: dict[str, dict[str, float]] = {}  # at the peak: kind of process → PSS by kind of page
        self._cpu: dict[int, float] = {}
        self._cpu0: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        parts: dict[str, dict[str, float]] = {}
        mib, procs, cpu = tree_stats(parts=parts)
        if mib > self.peak_mib:
            self.peak_mib, self.peak_procs, self.peak_parts = mib, procs, parts
        self._cpu.update(cpu)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    @property
    def cpu_s(self) -> float:
        return sum(v - self._cpu0.get(pid, 0.0) for pid, v in self._cpu.items())

    def __enter__(self) -> "MemorySampler":
        self._cpu0 = tree_stats()[2]
        self.load_start = os.getloadavg()[0]
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.load_end = os.getloadavg()[0]


# ----------------------------------------------------------------------------- the benchmark


def embedded_texts(source: Path, fmt: str, store: Path) -> list[str]:
    """The texts the pipeline embedded, in its order: every accepted row (read and
    validated again here) whose id made it into the published generation."""
    from helix_ray.ingest import stages
    from helix_ray.ingest.sources import source_items
    from helix_ray.store.generation import Generation

    tasks, _ = source_items(source, fmt, user=ingest_config().validation.default_user)  # a tree: a task per file
    out = [r for task in tasks for r in stages.read_and_validate(task, config=ingest_config())]
    rows = [json.loads(r["payload"]) for r in out if r["ok"]]
    latest: dict[str, str] = {}
    for row in rows:  # a repeated id: the later record wins, as in the pipeline
        latest[row["id"]] = row["text"]
    kept = set(Generation.open_current(store).memories.column("id").to_pylist())
    return [text for mid, text in latest.items() if mid in kept]


#: Ingest settings for every run of this script (``--no-late`` turns late interaction off).
INGEST_OVERRIDES: dict[str, Any] = {}
#: ``--warm-ray``: one Ray for every round, started before the first (a notebook's case:
#: the first round still pays Ray Data's first execution, later ones do not).
WARM_RAY = False


def ingest_config():
    """The ``IngestConfig`` the pipeline and the baseline both use."""
    from helix_ray.config import IngestConfig, load_config

    return load_config(IngestConfig, overrides=INGEST_OVERRIDES) if INGEST_OVERRIDES else IngestConfig()


@contextlib.contextmanager
def environ(values: dict[str, str], also: tuple[str, ...] = ()) -> Iterator[None]:
    """``values`` in this process's environment for the block; they and ``also`` as they
    were, after."""
    saved = {k: os.environ.get(k) for k in (*values, *also)}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_pipeline(source: Path, fmt: str, store: Path, env: dict[str, str] | None = None,
                 probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    """One pipeline run. ``env``: set for it besides ``PIPELINE_ENV`` (a cluster's
    ``RAY_ADDRESS``); ``probe``: called after the run, while this driver is still in Ray,
    its result under ``"probe"``."""
    import ray

    from helix_ray.ingest.run import ingest

    if ray.is_initialized() and not WARM_RAY:
        ray.shutdown()
    # RAY_AUTH_MODE restored too: joining a cluster turns token mode on for this process
    # (runtime.send_auth_token), which a later Ray of its own must not inherit.
    with environ({**PIPELINE_ENV, **(env or {})}, also=("RAY_AUTH_MODE",)):  # inherited by the Ray it starts
        if WARM_RAY and not ray.is_initialized():  # a notebook's Ray, started before (not timed)
            from helix_ray.runtime import ensure_ray

            ensure_ray()
        with MemorySampler() as mem:
            t0 = time.perf_counter()
            report = ingest([source], store, fmt=fmt, runner="ray", config=ingest_config(), show_progress=False)
            total = time.perf_counter() - t0
        probed = probe() if probe is not None else None
        if not WARM_RAY:
            ray.shutdown()
    seconds = dict(report.seconds)
    return {
        "report": report.as_dict(),
        "total_s": round(total, 3),
        "ray_start_s": seconds.get("ray_start", 0.0),
        "total_without_ray_start_s": round(total - seconds.get("ray_start", 0.0), 3),
        "stages_s": seconds,
        "unaccounted_s": round(total - sum(seconds.values()), 3),
        "peak_pss_mib": round(mem.peak_mib, 1),
        "peak_processes": mem.peak_procs,
        "peak_pss_by_process_mib": {k: {n: round(v, 1) for n, v in kinds.items()}
                                    for k, kinds in sorted(mem.peak_parts.items(), key=lambda kv: -kv[1]["pss"])},
        "cpu_s": round(mem.cpu_s, 1),
        "loadavg_1min": [mem.load_start, mem.load_end],
        **({"probe": probed} if probe is not None else {}),
    }


def run_embed_only(texts: list[str], fraction: float = 1.0, sorted_reference: bool = False) -> dict[str, Any]:
    """Embed ``texts`` in the pipeline's chunks (same order, same chunk size).

    With ``fraction`` < 1, only every k-th batch (k = round(1 / fraction)) is embedded and
    the time is scaled up by texts: batches keep their exact composition (and so their
    padding), and rows arrive in an order unrelated to length, so the sample's cost per
    text estimates the whole. ``sorted_reference`` also times the same sample sorted by
    length as a whole before chunking (the least padding any batching can reach).
    """
    from helix_ray.embedder import get_embedder, iter_batches
    from helix_ray.ingest.run import BATCH

    config = ingest_config().embedder
    t0 = time.perf_counter()
    embedder = get_embedder(config)
    embedder.embed_passages(["warm up the session"])
    load = time.perf_counter() - t0
    batches = list(iter_batches(texts, BATCH))
    step = max(1, round(1 / fraction)) if fraction < 1 else 1
    sample = batches[::step]
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        n = 0
        for batch in sample:
            n += len(embedder.embed_passages(batch))
        seconds = time.perf_counter() - t0
    scale = len(texts) / n if n else 1.0
    out = {"texts": len(texts), "texts_timed": n, "sample_every_kth_batch": step, "chunk": BATCH,
           "batch_size": config.batch_size,
           "model_load_s": round(load, 3), "embed_s_measured": round(seconds, 3),
           "embed_s": round(seconds * scale, 3), "estimated": step > 1,
           "per_s": round(n / seconds, 1) if seconds else None, "peak_pss_mib": round(mem.peak_mib, 1),
           "cpu_s": round(mem.cpu_s * scale, 1), "loadavg_1min": [mem.load_start, mem.load_end]}
    late = ingest_config().late_interaction
    if late.enabled:  # the pipeline's second encoder, on the same chunks, timed apart
        from helix_ray.token_encoder import get_token_encoder

        encoder = get_token_encoder(late.max_tokens)
        encoder.encode_passages(["warm up the session"])
        t0 = time.perf_counter()
        for batch in sample:
            encoder.encode_passages(batch)
        late_s = time.perf_counter() - t0
        out["late_encode_s"] = round(late_s * scale, 3)
        out["embed_both_s"] = round((seconds + late_s) * scale, 3)
    if sorted_reference:
        flat = sorted((t for b in sample for t in b), key=len)
        t0 = time.perf_counter()
        for batch in iter_batches(flat, BATCH):
            embedder.embed_passages(batch)
        sorted_s = time.perf_counter() - t0
        out["length_sorted_embed_s"] = round(sorted_s * scale, 3)
        out["length_sorted_per_s"] = round(len(flat) / sorted_s, 1) if sorted_s else None
    return out


# ----------------------------------------------------------------------------- several nodes

#: ``--nodes``: with 2 or more, each round also runs the pipeline on a local cluster of
#: that many ``ray start`` nodes (helix_ray.local_cluster), of ``--node-cpus`` each.
NODES = 1
NODE_CPUS = 1
#: What this script's own flags a run on the cluster repeats (set by main).
CHILD_FLAGS: list[str] = []
TRANSFORM_ACTOR = "MapBatches(Transform)"  # in the name Ray Data gives the embedding actors' class


def embed_calls() -> dict[str, Any]:
    """What the cluster's state API (its dashboard) says of this driver's job, asked while
    the driver is still in Ray: the nodes, head first, and the embedding actors and their
    finished calls, each with its node. Task events reach the GCS about once a second:
    asked again until two answers agree."""
    import ray
    from ray.util.state import list_actors, list_tasks

    job = ray.get_runtime_context().get_job_id()
    nodes = [n["NodeID"] for n in sorted(ray.nodes(), key=lambda n: "node:__internal_head__" not in n["Resources"])]
    calls: list[dict[str, Any]] = []
    for _ in range(10):
        time.sleep(1.5)
        tasks = list_tasks(filters=[("job_id", "=", job), ("type", "=", "ACTOR_TASK")], limit=10_000, detail=True,
                           raise_on_missing_output=False)
        now = [{"node_id": t.node_id, "actor_id": t.actor_id, "created_ms": t.creation_time_ms,
                "start_ms": t.start_time_ms, "end_ms": t.end_time_ms}
               for t in tasks if TRANSFORM_ACTOR in t.name and t.name.endswith(".submit") and t.state == "FINISHED"]
        if now and len(now) == len(calls):
            break
        calls = now
    actors = [{"node_id": a.node_id, "actor_id": a.actor_id, "state": a.state}
              for a in list_actors(filters=[("job_id", "=", job)], limit=10_000, raise_on_missing_output=False)
              if TRANSFORM_ACTOR in a.class_name]
    return {"nodes": nodes, "calls": calls, "actors": actors}


def per_node(probe: dict[str, Any], rows: int, stage_s: float, block: int) -> list[dict[str, Any]]:
    """Per node (head first): its embedding actors, the blocks they transformed (one
    call each), the rows, and memories/s (rows / ``stage_s``, the stage's wall time; and
    rows / the seconds its actors were busy). Every block holds ``block`` rows but the
    last, which is handed out last: the latest-created call holds the remainder. Rows
    are None when the calls do not add up to ``rows``."""
    calls = probe["calls"]
    last = max(calls, key=lambda c: c["created_ms"] or 0) if calls else None
    short = rows - (len(calls) - 1) * block if calls else 0
    known = bool(calls) and 0 < short <= block
    out = []
    for index, node in enumerate(probe["nodes"]):
        mine = [c for c in calls if c["node_id"] == node]
        n_rows = sum(short if c is last else block for c in mine) if known else None
        busy = sum(((c["end_ms"] or 0) - (c["start_ms"] or 0)) / 1000 for c in mine)
        out.append({
            "node": "head" if index == 0 else f"worker {index}", "node_id": node[:8],
            "actors": sum(a["node_id"] == node for a in probe["actors"]), "blocks": len(mine), "rows": n_rows,
            "busy_s": round(busy, 1),
            "mem_per_s": round(n_rows / stage_s, 1) if n_rows is not None and stage_s else None,
            "mem_per_busy_s": round(n_rows / busy, 1) if n_rows is not None and busy else None,
        })
    return out


def asked() -> dict[str, Any]:
    """:func:`embed_calls`, or the error it met: the run's own figures stand without it."""
    try:
        return embed_calls()
    except Exception as exc:  # noqa: BLE001 - the state API's errors: reported, after the cluster stops
        return {"error": f"{type(exc).__name__}: {exc}"}


def cluster_pipeline(source: Path, fmt: str, store: Path) -> dict[str, Any]:
    """The pipeline on a local cluster of ``NODES`` nodes started here (not timed) and
    stopped after, the driver joining with ``RAY_ADDRESS``; the nodes are this process's
    children, so its memory and CPU figures count them. Per node, where the embedding ran."""
    from helix_ray.local_cluster import LocalCluster
    from pipelines.ingest import BLOCK

    # The nodes' workers import helix_ray and pipelines from this checkout.
    paths = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    cluster = LocalCluster(nodes=NODES, cpus=NODE_CPUS)
    with environ({**PIPELINE_ENV, "PYTHONPATH": os.pathsep.join(paths)}):  # the nodes' processes inherit it
        t0 = time.perf_counter()
        cluster.start()
        started = time.perf_counter() - t0
    try:
        joined = {k: v for k, v in cluster.env().items() if k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        pipe = run_pipeline(source, fmt, store, env=joined, probe=asked)
    except BaseException:
        # Printed now: once the cluster stops, Ray ends a driver still in it before Python
        # would print the error.
        traceback.print_exc()
        raise
    finally:
        import ray

        ray.shutdown()
        cluster.stop()
    probe = pipe.pop("probe")
    if "error" in probe:
        raise SystemExit(f"the cluster's state API did not answer: {probe['error']}")
    nodes = per_node(probe, pipe["report"]["embedded"], pipe["stages_s"].get("expand_embed_annotate", 0.0), BLOCK)
    return dict(pipe, nodes=NODES, cpus_per_node=NODE_CPUS, cluster_start_s=round(started, 1), per_node=nodes,
                embed_calls=probe)


def run_cluster_pipeline(source: Path, fmt: str, store: Path) -> dict[str, Any]:
    """:func:`cluster_pipeline` in a new process of this script: joining a cluster turns
    Ray's token mode on with the cluster's token, for good, in the process that joins,
    and the one-node runs start a Ray of their own in this one."""
    spec = {"source": str(source), "fmt": fmt, "store": str(store), "out": str(store) + ".cluster.json"}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    done = subprocess.run([sys.executable, __file__, *CHILD_FLAGS, "--cluster-pipeline", json.dumps(spec)], env=env)
    if done.returncode:
        raise SystemExit(f"the pipeline on {NODES} nodes failed (exit {done.returncode})")
    return json.loads(Path(spec["out"]).read_text())


def bench_one(name: str, source: Path, fmt: str, work: Path, fraction: float = 1.0,
              sorted_reference: bool = True, repeats: int = 1) -> dict[str, Any]:
    """``repeats`` rounds of (pipeline, embed-only), alternating, so slow spells of the
    shared machine hit both sides; the ratios use the fastest run of each side."""
    pipes, bases, clustered = [], [], []
    for rep_no in range(repeats):
        store = work / f"store-{name}"
        if store.exists():
            shutil.rmtree(store)
        print(f"[{name}] round {rep_no + 1}/{repeats}: pipeline (runner=ray) on {source} ...", flush=True)
        pipe = run_pipeline(source, fmt, store)
        print(f"[{name}] pipeline done in {pipe['total_s']:.1f}s ({pipe['cpu_s']:.0f} CPU-s): "
              f"{json.dumps(pipe['stages_s'])}", flush=True)
        rep = pipe["report"]
        texts = embedded_texts(source, fmt, store)
        if len(texts) != rep["embedded"]:
            print(f"[{name}] WARNING: baseline has {len(texts)} texts, pipeline embedded {rep['embedded']}", flush=True)
        print(f"[{name}] embed-only baseline on {len(texts)} texts (fraction {fraction}) ...", flush=True)
        base = run_embed_only(texts, fraction, sorted_reference and rep_no == repeats - 1)
        print(f"[{name}] embed-only: {json.dumps(base)}", flush=True)
        pipes.append(pipe)
        bases.append(base)
        if NODES > 1:  # the same data, right after, so the one-node figure is of the same spell
            shutil.rmtree(store)
            print(f"[{name}] round {rep_no + 1}/{repeats}: pipeline on {NODES} nodes of {NODE_CPUS} CPU(s) ...",
                  flush=True)
            multi = run_cluster_pipeline(source, fmt, store)
            print(f"[{name}] pipeline on {NODES} nodes done in {multi['total_s']:.1f}s ({multi['cpu_s']:.0f} CPU-s): "
                  f"{json.dumps(multi['stages_s'])}; per node {json.dumps(multi['per_node'])}", flush=True)
            clustered.append(multi)
    pipe = min(pipes, key=lambda p: p["total_s"])
    base = min(bases, key=lambda b: b["embed_s"])
    base = dict(base, **{k: v for k, v in bases[-1].items() if k.startswith("length_sorted")})
    rep = pipe["report"]
    n = rep["embedded"]
    out = {
        "dataset": name, "source": str(source), "format": fmt, "repeats": repeats,
        "read": rep["read"], "accepted": rep["accepted"], "quarantined": rep["quarantined"],
        "duplicates": rep["duplicates"], "embedded": n, "total_memories": rep["total_memories"],
        "pipeline": pipe, "embed_only": base, "all_pipeline_runs": pipes, "all_embed_only_runs": bases,
        "pipeline_mem_per_s": round(n / pipe["total_s"], 1),
        "files": _files(source, fmt), "pipeline_files_per_s": round(_files(source, fmt) / pipe["total_s"], 1),
        "pipeline_mem_per_s_without_ray_start": round(n / pipe["total_without_ray_start_s"], 1),
        "ratio_pipeline_over_embed_only": round(pipe["total_s"] / base["embed_s"], 3),
        "ratio_pipeline_over_embed_only_without_ray_start": round(pipe["total_without_ray_start_s"] / base["embed_s"], 3),
        "ratio_embed_stage_over_embed_only": round(pipe["stages_s"].get("expand_embed_annotate", 0) / base["embed_s"], 3),
        "ratio_cpu_s": round(min(p["cpu_s"] for p in pipes) / min(b["cpu_s"] for b in bases), 3),
        "ratio_per_round": [round(p["total_s"] / b["embed_s"], 3) for p, b in zip(pipes, bases)],
        # the fastest of each side, as above (the round with the fastest sentence
        # embedding need not have the fastest token encoding)
        "ratio_pipeline_over_both_encoders": round(pipe["total_s"] / min(b["embed_both_s"] for b in bases), 3)
        if "embed_both_s" in base else None,
        "ratio_per_round_both_encoders": [round(p["total_s"] / b["embed_both_s"], 3) for p, b in zip(pipes, bases)]
        if "embed_both_s" in base else None,
        "store_bytes": sum(p.stat().st_size for p in (work / f"store-{name}").rglob("*") if p.is_file()),
    }
    if clustered:
        out["cluster"] = nodes_summary(pipe, pipes, clustered)
    return out


def nodes_summary(one: dict[str, Any], pipes: list[dict[str, Any]], clustered: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """``one``, the fastest of the rounds on one node (``pipes``: a Ray of its own each),
    beside the fastest on the cluster."""
    multi = min(clustered, key=lambda p: p["total_s"])
    n = multi["report"]["embedded"]
    return {
        "nodes": multi["nodes"], "cpus_per_node": multi["cpus_per_node"], "one_node": one, "multi_node": multi,
        "all_multi_node_runs": clustered, "per_node": multi["per_node"],
        "ratio_multi_over_one": round(multi["total_s"] / one["total_s"], 3),
        "ratio_multi_over_one_without_ray_start": round(multi["total_without_ray_start_s"]
                                                        / one["total_without_ray_start_s"], 3),
        "ratio_embed_stage_multi_over_one": round(multi["stages_s"].get("expand_embed_annotate", 0)
                                                  / one["stages_s"].get("expand_embed_annotate", 1), 3),
        "ratio_per_round": [round(m["total_s"] / p["total_s"], 3) for p, m in zip(pipes, clustered)],
        "multi_node_mem_per_s": round(n / multi["total_s"], 1),
    }


def nodes_table(results: list[dict[str, Any]]) -> str:
    """One node against several, and per node where the embedding ran."""
    lines = []
    for r in results:
        c = r.get("cluster")
        if not c:
            continue
        one, multi = c["one_node"], c["multi_node"]
        lines += [f"\n{r['dataset']}: one node (a Ray of its own) vs {c['nodes']} `ray start` nodes of "
                  f"{c['cpus_per_node']} CPU(s), same session (fastest round of each)",
                  "| | one node | " + f"{c['nodes']} nodes | ratio |", "|---|---:|---:|---:|"]
        for label, key, ratio in (("pipeline total s", "total_s", "ratio_multi_over_one"),
                                  ("without Ray start / join s", "total_without_ray_start_s",
                                   "ratio_multi_over_one_without_ray_start")):
            lines.append(f"| {label} | {one[key]:.1f} | {multi[key]:.1f} | {c[ratio]:.2f}× |")
        for stage in STAGE_ORDER:
            a, b = one["stages_s"].get(stage, 0.0), multi["stages_s"].get(stage, 0.0)
            lines.append(f"| {stage} s | {a:.1f} | {b:.1f} | " + (f"{b / a:.2f}× |" if a else "– |"))
        lines.append(f"| memories/s | {r['pipeline_mem_per_s']:.0f} | {c['multi_node_mem_per_s']:.0f} | |")
        lines.append(f"| CPU-s (driver + Ray) | {one['cpu_s']:.0f} | {multi['cpu_s']:.0f} | |")
        lines.append(f"| peak PSS MiB | {one['peak_pss_mib']:,.0f} | {multi['peak_pss_mib']:,.0f} | |")
        lines.append(f"| ratio per round | | | {', '.join(f'{x:.2f}×' for x in c['ratio_per_round'])} |")
        stage_s = multi["stages_s"].get("expand_embed_annotate", 0.0)
        lines += [f"\nper node ({c['nodes']}-node run; memories/s = rows / the embed stage's {stage_s:.1f} s)",
                  "| node | embedding actors | blocks (calls) | rows | memories/s | actors busy s | rows / busy s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for node in c["per_node"]:
            lines.append(f"| {node['node']} ({node['node_id']}) | {node['actors']} | {node['blocks']} | {node['rows']} | "
                         f"{node['mem_per_s']} | {node['busy_s']} | {node['mem_per_busy_s']} |")
    return "\n".join(lines)


def _files(source: Path, fmt: str) -> int:
    """Files read: a source tree's (``--code``), else one."""
    from helix_ray.ingest.sources import source_items

    return len(source_items(source, fmt, user=ingest_config().validation.default_user)[0]) if fmt == "code" else 1


def table(results: list[dict[str, Any]]) -> str:
    cols = [r["dataset"] for r in results]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]

    def row(label: str, values: list[Any]) -> None:
        lines.append(f"| {label} | " + " | ".join(str(v) for v in values) + " |")

    row("read / accepted / duplicates", [f"{r['read']:,} / {r['accepted']:,} / {r['duplicates']:,}" for r in results])
    row("embedded (new memories)", [f"{r['embedded']:,}" for r in results])
    row("files read / files per s", [f"{r['files']:,} / {r['pipeline_files_per_s']:.1f}" for r in results])
    for stage in STAGE_ORDER:
        row(f"pipeline: {stage} s", [f"{r['pipeline']['stages_s'].get(stage, 0):.1f}" for r in results])
    row("pipeline: unaccounted s", [f"{r['pipeline']['unaccounted_s']:.1f}" for r in results])
    row("**pipeline total s** (fastest round)", [f"**{r['pipeline']['total_s']:.1f}**" for r in results])
    row("pipeline total without Ray start s", [f"{r['pipeline']['total_without_ray_start_s']:.1f}" for r in results])
    row("pipeline memories/s (with / without Ray start)",
        [f"{r['pipeline_mem_per_s']:.0f} / {r['pipeline_mem_per_s_without_ray_start']:.0f}" for r in results])
    row("embed-only s (model load excluded; fastest round)",
        [f"{r['embed_only']['embed_s']:.1f}" + (f" (est. from 1/{r['embed_only']['sample_every_kth_batch']} of batches)"
                                                  if r['embed_only']['estimated'] else "") for r in results])
    row("embed-only passages/s", [f"{r['embed_only']['per_s']:.0f}" for r in results])
    if all("length_sorted_embed_s" in r["embed_only"] for r in results):
        row("reference: embed-only, length-sorted batches s",
            [f"{r['embed_only']['length_sorted_embed_s']:.1f} ({r['embed_only']['length_sorted_per_s']:.0f}/s)" for r in results])
    row("embed-only model load s", [f"{r['embed_only']['model_load_s']:.1f}" for r in results])
    row("**ratio pipeline / embed-only**", [f"**{r['ratio_pipeline_over_embed_only']:.2f}×**" for r in results])
    if all(r.get("ratio_pipeline_over_both_encoders") for r in results):
        row("sentence embedding + token encoding s (fastest round)",
            [f"{min(b['embed_both_s'] for b in r['all_embed_only_runs']):.1f}" for r in results])
        row("**ratio pipeline / (sentence embedding + token encoding)**",
            [f"**{r['ratio_pipeline_over_both_encoders']:.2f}×**" for r in results])
        row("ratio per round (pipeline / both encoders)",
            [", ".join(f"{x:.2f}×" for x in r["ratio_per_round_both_encoders"]) for r in results])
    row("ratio without Ray start", [f"{r['ratio_pipeline_over_embed_only_without_ray_start']:.2f}×" for r in results])
    row("ratio per round (pipeline / embed-only)", [", ".join(f"{x:.2f}×" for x in r["ratio_per_round"]) for r in results])
    row("CPU-s pipeline (driver + Ray) / embed-only",
        [f"{min(p['cpu_s'] for p in r['all_pipeline_runs']):.0f} / {min(b['cpu_s'] for b in r['all_embed_only_runs']):.0f}"
         f" ({r['ratio_cpu_s']:.2f}×)" for r in results])
    row("ratio embed stage / embed-only", [f"{r['ratio_embed_stage_over_embed_only']:.2f}×" for r in results])
    row("peak PSS pipeline (driver + Ray) MiB", [f"{r['pipeline']['peak_pss_mib']:,.0f}" for r in results])
    row("of it, by process (heap / mapped files / object store) MiB",
        ["; ".join(f"{name} {kinds['pss']:,.0f} ({kinds.get('anon', 0):,.0f} / {kinds.get('file', 0):,.0f} / "
                   f"{kinds.get('shmem', 0):,.0f})"
                   for name, kinds in list(r["pipeline"].get("peak_pss_by_process_mib", {}).items())[:4])
         for r in results])
    row("peak PSS embed-only MiB", [f"{r['embed_only']['peak_pss_mib']:,.0f}" for r in results])
    row("store size MiB", [f"{r['store_bytes'] / 2**20:,.0f}" for r in results])
    return "\n".join(lines)


def _default_locomo() -> str | None:
    """LoCoMo under HELIX_DATA (the folder holding the benchmarks), if it is set."""
    data = os.environ.get("HELIX_DATA")
    return str(Path(data) / "locomo" / "locomo10.json") if data else None


def child_flags(args: argparse.Namespace) -> list[str]:
    """The flags that shape one pipeline run, for :func:`run_cluster_pipeline`'s child."""
    flags = [f"--nodes={args.nodes}", f"--node-cpus={args.node_cpus}"]
    flags += [f"--pipeline-env={item}" for item in args.pipeline_env]
    if args.data_no_progress_timeout is not None:
        flags.append(f"--data-no-progress-timeout={args.data_no_progress_timeout}")
    if args.no_late:
        flags.append("--no-late")
    if args.code:
        flags.append(f"--code={args.code}")
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--locomo", default=_default_locomo(),
                    help="LoCoMo locomo10.json, read in place (default: under $HELIX_DATA)")
    ap.add_argument("--n", type=int, default=100_000, help="synthetic memories (0 skips the synthetic set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic", default=None, help="reuse this synthetic JSONL instead of generating one")
    ap.add_argument("--skip-locomo", action="store_true")
    ap.add_argument("--baseline-fraction", type=float, default=1.0,
                    help="embed only every k-th batch of the synthetic set for the baseline (k = 1/fraction) and "
                         "scale the time up; 1.0 (default) embeds all of it")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of (pipeline, embed-only) for LoCoMo; the fastest of each counts")
    ap.add_argument("--synthetic-repeats", type=int, default=1, help="the same for the synthetic set")
    ap.add_argument("--no-sorted-reference", action="store_true",
                    help="skip the extra length-sorted embed-only timing")
    ap.add_argument("--pipeline-env", action="append", default=[], metavar="VAR=VALUE",
                    help="environment for the pipeline's Ray processes only, e.g. OMP_NUM_THREADS=2 (Ray sets "
                         "OMP_NUM_THREADS=1 in workers with a fractional CPU, and onnxruntime follows it)")
    ap.add_argument("--data-no-progress-timeout", type=float, default=None, metavar="SECONDS",
                    help="set RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S for the pipeline (-1 disables Ray Data's "
                         "watchdog, which fails a run whose operator makes no progress for that long)")
    ap.add_argument("--work", default=None, help="work folder for stores and data (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--warm-ray", action="store_true",
                    help="start Ray once, before the first round, and keep it for every round (as a notebook does); "
                         "rounds then leave out Ray's start")
    ap.add_argument("--code", default=None, metavar="TREE",
                    help="also a source tree read with --format code (e.g. the installed ray package)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="2 or more: each round also runs the pipeline on a local cluster of that many `ray start` "
                         "nodes, reports where the embedding ran per node, and compares it with the one-node run")
    ap.add_argument("--node-cpus", type=int, default=1,
                    help="logical CPUs each of those nodes advertises (default 1: two nodes advertise the two a "
                         "one-node Ray gets on a 2-core host)")
    ap.add_argument("--cluster-pipeline", default=None, help=argparse.SUPPRESS)  # run_cluster_pipeline's child
    ap.add_argument("--no-late", action="store_true",
                    help="ingest without late-interaction tokens (the pipeline then embeds with one encoder, the "
                         "embed-only baseline's)")
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.no_late:
        INGEST_OVERRIDES["late_interaction"] = {"enabled": False}
    if args.code:  # code memories name no user
        INGEST_OVERRIDES["validation"] = {"default_user": "bench"}
    global WARM_RAY, NODES, NODE_CPUS
    WARM_RAY = args.warm_ray
    NODES, NODE_CPUS = args.nodes, args.node_cpus
    if NODES < 1 or NODE_CPUS < 1:
        raise SystemExit("--nodes and --node-cpus take 1 or more")
    if NODES > 1 and WARM_RAY:
        raise SystemExit("--warm-ray keeps one Ray of this process's own for every round; not with --nodes")
    CHILD_FLAGS[:] = child_flags(args)
    for item in args.pipeline_env:
        key, _, value = item.partition("=")
        PIPELINE_ENV[key] = value
    if args.data_no_progress_timeout is not None:  # read when the driver's DataContext is created
        os.environ["RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S"] = str(args.data_no_progress_timeout)
    if args.cluster_pipeline:
        spec = json.loads(args.cluster_pipeline)
        done = cluster_pipeline(Path(spec["source"]), spec["fmt"], Path(spec["store"]))
        Path(spec["out"]).write_text(json.dumps(done))
        return 0
    info = machine_info()
    info["pipeline_env"] = dict(PIPELINE_ENV)
    info["data_no_progress_timeout_s"] = args.data_no_progress_timeout
    print(json.dumps(info), flush=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="helix-bench-ingest-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        if not args.skip_locomo:
            if not args.locomo:
                raise SystemExit("--locomo is required unless --skip-locomo (or set HELIX_DATA to the folder "
                                 "holding locomo/locomo10.json)")
            locomo = Path(args.locomo).resolve()
            results.append(bench_one("locomo", locomo, "locomo", work, 1.0, not args.no_sorted_reference, args.repeats))
        if args.n:
            if args.synthetic:
                synth = Path(args.synthetic)
            else:
                from synthetic import write_jsonl

                synth = work / f"synthetic-{args.n}-seed{args.seed}.jsonl"
                t0 = time.perf_counter()
                stats = write_jsonl(args.n, str(synth), seed=args.seed)
                print(f"[synthetic] wrote {synth} in {time.perf_counter() - t0:.1f}s: {json.dumps(stats)}", flush=True)
            results.append(bench_one(f"synthetic-{args.n // 1000}k", synth, "jsonl", work, args.baseline_fraction,
                                     not args.no_sorted_reference, args.synthetic_repeats))
        if args.code:
            results.append(bench_one("code", Path(args.code).resolve(), "code", work, args.baseline_fraction,
                                     not args.no_sorted_reference, args.synthetic_repeats))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    print()
    print(table(results))
    if NODES > 1:
        print(nodes_table(results))
    print(f"\nload average start {info['loadavg_start']} end {info['loadavg_end']}")
    if PIPELINE_ENV:
        print(f"pipeline's Ray processes ran with {PIPELINE_ENV}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results, "table": table(results),
                                               "nodes_table": nodes_table(results)}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
