#!/usr/bin/env python
"""A served store under mixed traffic for minutes: what drifts, and what must never happen.

    RAY_SERVE_ENABLE_HA_PROXY=1 .venv/bin/python scripts/soak_serve.py \\
        --store /tmp/helixbench/recall/store-100000 --minutes 15 [--graph inline|split] \\
        [--clients 4] [--compact-interval-s 120] [--compact-max-pending 400] [--json OUT]

    # load levels: a run of --minutes per client count, on one server, 90 % recall / 10 % write
    nice -n 19 .venv/bin/python scripts/soak_serve.py --store /tmp/helixbench/recall/store-100000 \\
        --clients 8,32,64 --minutes 10 --mix recall=90,write=10 --json /tmp/load.json

Serves a hard-linked copy of ``--store`` (``bench_serve.py``'s setup: a local Ray of two
CPUs, API keys, the application of ``helix serve``) and runs ``--clients`` clients for
``--minutes``, each picking its next request at random from ``--mix``; by default recall
(70 %), a write of one memory or of a batch of five (14 %), a PATCH of a memory's text
(5 %), a DELETE (5 %), GET /v1/stats (4 %), a PATCH of the live settings with an admin
key (2 %). Background compaction runs every ``--compact-interval-s`` or at
``--compact-max-pending`` writes, so generations are published and swapped while
requests flow.

Several client counts (``--clients 8,32,64``) are run one after another on the same
server and store, ``--minutes`` each. Each level reports its requests per second, p50 /
p99 of the mix's recalls and of its writes (the POST) answered, and of those refused, its
answers by status (429 and 503, the server's refusals, apart from the other 5xx) and the
RSS and PSS of every process of the Ray started here (Serve replicas, proxy, controller,
raylet, GCS, dashboard, idle workers: the descendants of this process) at its start and
every ``--rss-every-s``. Its memory verdict compares each process's RSS at the end with
its first sample after ``--warmup-s``: "flat" unless one grew by more than
``--flat-ratio`` and 8 MiB.

Every memory the soak writes carries a word of its own, so recall can look for it:

- a write is looked for (recall of its word) right after its 201, again every 50 ms
  until it is found or 1 s has passed: found later or never is counted;
- a PATCHed memory must come back under its new word;
- a deleted memory must never come back: looked for at once, and every deleted memory
  again at the end, after the compactions;
- no answer may hold a memory the soak wrote for another user.

Every ``--sample-s`` seconds it prints the window's recall p50 / p95, its errors by
status, the generation and the writes pending, and per deployment the replicas' RSS,
PSS, open files and threads (``/proc``), and the store's size on disk — what a server
left running for days would show growing. It exits 1 when an invariant above broke or a
request got a 5xx.

Ray is started here and shut down at the end (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serve as bs  # noqa: E402

#: The default mix: each request kind and its weight (``--mix`` names a subset with its own).
OPS = (("recall", 70), ("write", 10), ("batch", 4), ("patch", 5), ("delete", 5), ("stats", 4), ("settings", 2))
#: A process whose RSS grew by less than this (MiB) is flat whatever its ratio.
FLAT_FLOOR_MIB = 8.0
VISIBLE_WITHIN_S = 1.0
TIMEOUT_S = 60.0


WORDS = ("cache queue index parser worker lease shard replica token budget schema migration retry timeout "
         "socket buffer cursor ledger quota tenant router planner vector graph commit branch rollback").split()


def sentence() -> str:
    """Ten words at random: two soak memories share few shingles, so ingest's near-duplicate
    removal keeps both (as it would two real notes)."""
    return " ".join(random.sample(WORDS, 10)) + "."


def word() -> str:
    """A token no memory of the store holds: BM25 finds exactly the memories that carry it."""
    return "soak" + uuid.uuid4().hex[:12]


def parse_mix(text: str) -> tuple[tuple[str, int], ...]:
    """``recall=90,write=10`` as ``(("recall", 90), ("write", 10))``; kinds from :data:`OPS`."""
    kinds = dict(OPS)
    mix = []
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in kinds or not weight.strip().isdigit():
            raise SystemExit(f"Got --mix {text!r}; it must be KIND=WEIGHT pairs separated by commas, KIND one of "
                             f"{', '.join(kinds)} and WEIGHT a whole number, e.g. recall=90,write=10.")
        mix.append((name.strip(), int(weight)))
    if not sum(w for _, w in mix):
        raise SystemExit(f"Got --mix {text!r}; at least one weight must be above 0.")
    return tuple(mix)


def parse_clients(text: str) -> list[int]:
    """``8,32,64`` as ``[8, 32, 64]``."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"Got --clients {text!r}; it must be client counts of 1 or more separated by commas, "
                         "e.g. 8,32,64.")
    return levels


class Soak:
    def __init__(self, url: str, keys: dict[str, str], admin: str, queries: list[dict[str, str]],
                 mix: tuple[tuple[str, int], ...] = OPS):
        self.url, self.keys, self.admin, self.queries, self.mix = url, keys, admin, queries, mix
        self.users = sorted(keys)
        self.owner: dict[str, str] = {}  # id → user, of every memory the soak wrote
        self.live: dict[str, tuple[str, str]] = {}  # id → (user, word it is found by now)
        self.deleted: dict[str, tuple[str, str]] = {}  # id → (user, its last word)
        self.window: list[float] = []
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}  # the first answer of each kind of error
        self.broken: list[str] = []
        self.visible_ms: list[float] = []
        self.session: Any = None
        # This level's (--clients): operations, answers by status (0: none, or not in TIMEOUT_S),
        # and the latency of the mix's recalls and writes answered, and of those refused (429, 503).
        self.level_ops: dict[str, int] = {}
        self.statuses: dict[int, int] = {}
        self.latency_ms: dict[str, list[float]] = {"recall": [], "write": [], "refused": []}

    def new_level(self) -> None:
        """Start a level's counts afresh; the totals, and what the soak wrote and deleted, go on."""
        self.level_ops, self.statuses = {}, {}
        self.latency_ms = {"recall": [], "write": [], "refused": []}

    def note_latency(self, kind: str, status: int, since: float) -> None:
        """The latency of one of the mix's requests, under ``kind`` if answered, else under
        "refused" if the server refused it (429, 503)."""
        if status < 300 or status in (429, 503):
            self.latency_ms[kind if status < 300 else "refused"].append((time.perf_counter() - since) * 1000)

    def _fail(self, what: str) -> None:
        if len(self.broken) < 50:
            self.broken.append(what)
        self.counts["invariant_broken"] = self.counts.get("invariant_broken", 0) + 1

    async def call(self, method: str, path: str, user: str | None, body: Any = None,
                   admin: bool = False) -> tuple[int, Any]:
        import aiohttp

        key = self.admin if admin else self.keys[user or self.users[0]]
        route = f"{method} {path.split('/')[2] if path.count('/') > 1 else path}"
        try:
            async with self.session.request(method, self.url + path, json=body,
                                            headers={"Authorization": f"Bearer {key}"}) as response:
                status, text = response.status, await response.text()
            try:
                data = json.loads(text)
            except ValueError:  # Serve's own answers (its proxy refusing a request) are plain text
                data = text
        except asyncio.TimeoutError:  # no answer within the client's timeout: as bad as a 5xx
            status, data = 0, f"no answer within {TIMEOUT_S} s"
        except aiohttp.ClientError as exc:  # the connection refused or dropped: no answer either
            status, data = 0, f"no answer: {type(exc).__name__}: {exc}"
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status >= 400 or status == 0:
            label = f"{route} {status or 'no answer'}"
            self.errors[label] = self.errors.get(label, 0) + 1
            self.examples.setdefault(label, str(data)[:300])
            if status >= 500 or status == 0:
                self._fail(f"{label}: {str(data)[:200]}")
        return status, data

    async def recall(self, user: str, query: str, timed: bool = False) -> list[str]:
        clock = time.perf_counter()
        status, data = await self.call("POST", "/v1/recall", user, {"query": query, "budget_tokens": 512})
        if timed:
            self.window.append((time.perf_counter() - clock) * 1000)
            self.note_latency("recall", status, clock)
        if status != 200:
            return []
        ids = [item["id"] for item in data["items"]]
        for memory_id in ids:
            if self.owner.get(memory_id, user) != user:
                self._fail(f"user {user!r} was given {memory_id!r}, written for {self.owner[memory_id]!r}")
        return ids

    async def found_within(self, user: str, memory_id: str, tag: str, limit_s: float) -> float | None:
        """Seconds until recall of ``tag`` returns ``memory_id`` (None: not within ``limit_s``)."""
        started = time.perf_counter()
        while True:
            if memory_id in await self.recall(user, tag):
                return time.perf_counter() - started
            if time.perf_counter() - started > limit_s:
                return None
            await asyncio.sleep(0.05)

    async def write(self, user: str, batch: int) -> None:
        tags = [word() for _ in range(batch)]
        records = [{"text": f"Soak note {t}: {sentence()}", "type": "semantic", "project": "soak"} for t in tags]
        clock = time.perf_counter()
        status, data = await self.call("POST", "/v1/memories", user, records if batch > 1 else records[0])
        self.note_latency("write", status, clock)
        if status != 201:
            return
        for memory_id, tag in zip(data["ids"], tags):
            self.owner[memory_id] = user
            self.live[memory_id] = (user, tag)
        memory_id, tag = data["ids"][0], tags[0]
        seconds = await self.found_within(user, memory_id, tag, VISIBLE_WITHIN_S)
        if seconds is None:
            self._fail(f"write {memory_id!r} of {user!r} not recalled within {VISIBLE_WITHIN_S} s of its 201")
        else:
            self.visible_ms.append(seconds * 1000)

    async def patch(self) -> None:
        if not self.live:
            return
        memory_id = random.choice(list(self.live))
        user, _ = self.live.pop(memory_id)
        tag = word()
        status, _ = await self.call("PATCH", f"/v1/memories/{memory_id}", user,
                                    {"text": f"Soak note {tag}: {sentence()}"})
        if status != 200:
            return
        self.live[memory_id] = (user, tag)
        if await self.found_within(user, memory_id, tag, VISIBLE_WITHIN_S) is None:
            self._fail(f"patched {memory_id!r} not recalled by its new text within {VISIBLE_WITHIN_S} s")

    async def delete(self) -> None:
        if not self.live:
            return
        memory_id = random.choice(list(self.live))
        user, tag = self.live.pop(memory_id)
        status, _ = await self.call("DELETE", f"/v1/memories/{memory_id}", user)
        if status != 200:
            return
        self.deleted[memory_id] = (user, tag)
        if memory_id in await self.recall(user, tag):
            self._fail(f"deleted {memory_id!r} recalled right after its DELETE was answered")

    async def worker(self, deadline: float) -> None:
        names, weights = zip(*self.mix)
        while time.monotonic() < deadline:
            op = random.choices(names, weights)[0]
            self.counts[op] = self.counts.get(op, 0) + 1
            self.level_ops[op] = self.level_ops.get(op, 0) + 1
            user = random.choice(self.users)
            if op == "recall":
                q = random.choice(self.queries)
                await self.recall(q["user"], q["query"], timed=True)
            elif op in ("write", "batch"):
                await self.write(user, 5 if op == "batch" else 1)
            elif op == "patch":
                await self.patch()
            elif op == "delete":
                await self.delete()
            elif op == "stats":
                await self.call("GET", "/v1/stats", None, admin=True)
            else:
                await self.call("PATCH", "/v1/settings", None, {"diversity": {"mmr_lambda": random.choice([0.5, 0.6])}},
                                admin=True)

    async def final_checks(self) -> dict[str, int]:
        """Every deleted memory again (after the compactions), and a sample of the live ones."""
        resurrected = 0
        for memory_id, (user, tag) in list(self.deleted.items()):
            if memory_id in await self.recall(user, tag):
                resurrected += 1
                self._fail(f"deleted {memory_id!r} recalled at the end")
        sample = random.sample(list(self.live.items()), min(200, len(self.live)))
        lost = 0
        for memory_id, (user, tag) in sample:
            if memory_id not in await self.recall(user, tag):
                lost += 1
                self._fail(f"live {memory_id!r} of {user!r} not recalled by its word at the end")
        return {"deleted_checked": len(self.deleted), "resurrected": resurrected,
                "live_checked": len(sample), "live_lost": lost}


def process_stats(pids: dict[int, str]) -> dict[str, dict[str, float]]:
    """Per deployment: replicas, RSS and PSS (MiB), open files and threads, summed."""
    out: dict[str, dict[str, float]] = {}
    for pid, name in pids.items():
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().split("\n")
            kb = {line.split()[0][:-1]: int(line.split()[1]) for line in rollup[1:] if line.split()}
            status = {line.split(":")[0]: line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                      .splitlines() if line.startswith(("RssAnon", "RssFile"))}
            mapped = {part.split("/generations/")[1][:6] for part in Path(f"/proc/{pid}/maps").read_text().split()
                      if "/generations/" in part}
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            threads = len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        row = out.setdefault(name, {"replicas": 0, "rss_mib": 0.0, "pss_mib": 0.0, "anon_mib": 0.0, "file_mib": 0.0,
                                    "gens_mapped": 0, "fds": 0, "threads": 0})
        row["replicas"] += 1
        row["rss_mib"] += round(kb.get("Rss", 0) / 1024, 1)
        row["pss_mib"] += round(kb.get("Pss", 0) / 1024, 1)
        row["anon_mib"] += round(int(status.get("RssAnon", 0)) / 1024, 1)
        row["file_mib"] += round(int(status.get("RssFile", 0)) / 1024, 1)
        row["gens_mapped"] = max(row["gens_mapped"], len(mapped))  # the most any one replica maps
        row["fds"] += fds
        row["threads"] += threads
    return out


def replica_pids(store: Path) -> dict[int, str]:
    """This application's replicas: those that map or hold open a file of ``store`` (another
    Helix served on this host has replicas of the same names)."""
    mine = {}
    root = str(store.resolve())
    for pid, name in bs.replica_processes().items():
        try:
            if root in Path(f"/proc/{pid}/maps").read_text():
                mine[pid] = name
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root):
                    mine[pid] = name
                    break
        except OSError:
            continue
    return mine


def ray_processes(store: Path) -> dict[int, str]:
    """pid → role of every process of the Ray this script started (its descendants:
    ``ray.init`` starts the GCS, raylet and dashboard, the raylet the workers), and of
    this application's replicas wherever they run: a deployment's name, "proxy",
    "controller", "raylet", "gcs", or the program's name ("dashboard.py", "IDLE" for a
    pooled worker)."""
    children: dict[int, list[int]] = {}
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                parent = int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(pid_dir.name))
    out: dict[int, str] = {}
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        out[pid] = process_role(argv)
    return {**out, **replica_pids(store)}


def process_role(argv: list[str]) -> str:
    """What a Ray process is, from its command line (see :func:`ray_processes`)."""
    line = " ".join(argv)
    if "ServeReplica:helix:" in line:
        return line.split("ServeReplica:helix:", 1)[1].split()[0].split(".")[0]
    for marker, role in (("ProxyActor", "proxy"), ("ServeController", "controller"), ("gcs_server", "gcs")):
        if marker in line:
            return role
    if os.path.basename(argv[0]) == "raylet" or "/raylet " in line:
        return "raylet"
    if argv[0].startswith("ray::"):
        return argv[0][5:].split()[0] or "worker"
    program = os.path.basename(argv[0])
    script = next((arg for arg in argv[1:] if arg and not arg.startswith("-")), None)
    return os.path.basename(script) if program.startswith("python") and script else program


def process_memory(pids: dict[int, str]) -> dict[str, dict[str, Any]]:
    """str(pid) → role, RSS and PSS (MiB) of each live process of ``pids``."""
    out: dict[str, dict[str, Any]] = {}
    for pid, role in pids.items():
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().split("\n")
        except OSError:  # ended, or another user's
            continue
        kb = {line.split()[0][:-1]: int(line.split()[1]) for line in rollup[1:] if line.split()}
        out[str(pid)] = {"role": role, "rss_mib": round(kb.get("Rss", 0) / 1024, 1),
                         "pss_mib": round(kb.get("Pss", 0) / 1024, 1)}
    return out


def memory_verdict(samples: list[dict[str, Any]], warmup_s: float, flat_ratio: float) -> dict[str, Any]:
    """Each process's RSS at the end over its RSS in the first sample taken ``warmup_s`` or
    more into the level: "flat" unless one grew by more than ``flat_ratio`` and
    :data:`FLAT_FLOOR_MIB`; "n/a" with fewer than two samples after the warm-up. The end is
    the lower of the last two samples: a compaction's passing peak in the last one is not
    growth, what stays is."""
    after = [sample for sample in samples if sample["t_s"] >= warmup_s]
    if len(after) < 2:
        return {"verdict": f"n/a: {len(after)} sample(s) {warmup_s:g} s or more into the level, two needed"}
    base, ends = after[0], after[-2:] if len(after) > 2 else after[-1:]
    rows = {}
    for pid, row in after[-1]["processes"].items():
        seen = [sample["processes"][pid]["rss_mib"] for sample in ends if pid in sample["processes"]]
        before = base["processes"].get(pid)
        if before is None:  # started after the warm-up (a replica the autoscaler added)
            continue
        end = min(seen)
        rows[f"{row['role']} {pid}"] = {"rss_mib": [before["rss_mib"], end],
                                         "ratio": round(end / max(before["rss_mib"], 0.1), 3)}
    grew = {name: row for name, row in rows.items()
            if row["ratio"] > flat_ratio and row["rss_mib"][1] - row["rss_mib"][0] > FLAT_FLOOR_MIB}
    worst = max(rows, key=lambda name: rows[name]["ratio"]) if rows else None
    return {"verdict": "grew" if grew else "flat", "baseline_t_s": base["t_s"], "last_t_s": after[-1]["t_s"],
            "worst": {worst: rows[worst]} if worst else {}, "grew": grew, "by_process": rows}


def level_summary(clients: int, seconds: float, soak: Soak, rss: list[dict[str, Any]],
                  args: argparse.Namespace) -> dict[str, Any]:
    """One level's figures: throughput, latency of recall and of writes, answers by status,
    every process's memory per sample and the verdict on it."""
    statuses = soak.statuses
    requests = sum(statuses.values())
    errors = {"429": statuses.get(429, 0), "503": statuses.get(503, 0),
              "5xx_other": sum(n for code, n in statuses.items() if code >= 500 and code != 503),
              "4xx_other": sum(n for code, n in statuses.items() if 400 <= code < 500 and code != 429),
              "no_answer": statuses.get(0, 0)}
    latency = {kind: {**bs.pct(values), "n": len(values)} for kind, values in soak.latency_ms.items()}
    return {"clients": clients, "seconds": round(seconds, 1), "requests": requests,
            "requests_per_s": round(requests / seconds, 2), "ops": dict(soak.level_ops),
            "ops_per_s": round(sum(soak.level_ops.values()) / seconds, 2), "recall_ms": latency["recall"],
            "write_ms": latency["write"], "refused_ms": latency["refused"], "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "errors": errors, "rss_samples": rss,
            "memory": memory_verdict(rss, args.warmup_s, args.flat_ratio)}


def disk_mib(store: Path) -> dict[str, float]:
    """MiB on disk per top-level entry of the store (generations, delta, inbox, the
    DuckDB file, ...) and in all; a hard-linked file counts once; files and MiB."""
    seen: set[int] = set()
    out: dict[str, float] = {}
    for root, _, files in os.walk(store):
        top = Path(root).relative_to(store).parts[:1]
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                key = top[0] if top else name
                out[key] = out.get(key, 0.0) + st.st_blocks * 512 / 2**20
                out[key + " files"] = out.get(key + " files", 0) + 1
    out = {k: round(v, 1) for k, v in sorted(out.items())}
    out["total"] = round(sum(v for k, v in out.items() if not k.endswith(" files")), 1)
    return out


async def run_level(args: argparse.Namespace, store: Path, soak: Soak, clients: int) -> dict[str, Any]:
    """``clients`` workers for ``--minutes``, with every process's memory sampled at the
    start and every ``--rss-every-s``, and once more at the end."""
    soak.new_level()
    rss: list[dict[str, Any]] = []
    started = time.monotonic()

    def sample() -> None:
        rss.append({"t_s": round(time.monotonic() - started, 1), "processes": process_memory(ray_processes(store))})

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(args.rss_every_s)

    bs.log(f"level: {clients} clients for {args.minutes} min")
    watcher = asyncio.get_running_loop().create_task(sampler())
    await asyncio.gather(*(soak.worker(started + args.minutes * 60) for _ in range(clients)))
    watcher.cancel()
    seconds = time.monotonic() - started
    if seconds - rss[-1]["t_s"] > 5:
        sample()
    level = level_summary(clients, seconds, soak, rss, args)
    bs.log(level_line(level))
    return level


def level_line(level: dict[str, Any]) -> str:
    rss = {}
    for row in level["rss_samples"][-1]["processes"].values():
        rss[row["role"]] = rss.get(row["role"], 0.0) + row["rss_mib"]
    memory = level["memory"]
    worst = next(iter(memory.get("worst", {}).items()), None)
    return (f"{level['clients']:>3} clients: {level['requests_per_s']:.1f} req/s ({level['ops_per_s']:.1f} ops/s)  "
            f"recall p50 {level['recall_ms']['p50']} p99 {level['recall_ms']['p99']} ms (n {level['recall_ms']['n']})  "
            f"write p50 {level['write_ms']['p50']} p99 {level['write_ms']['p99']} ms (n {level['write_ms']['n']})  "
            f"errors {level['errors']}" + (f" (refused in p50 {level['refused_ms']['p50']} p99 "
                                           f"{level['refused_ms']['p99']} ms)" if level["refused_ms"]["n"] else "")
            + f"  memory {memory['verdict']}"
            + (f" (worst {worst[0]} x{worst[1]['ratio']})" if worst else "")
            + "  RSS MiB " + ", ".join(f"{role} {mib:.0f}" for role, mib in sorted(rss.items())))


async def run(args: argparse.Namespace, store: Path, url: str, soak: Soak) -> dict[str, Any]:
    import aiohttp

    samples = []
    started = time.monotonic()

    async def sampler() -> None:
        while True:
            await asyncio.sleep(args.sample_s)
            window, soak.window = soak.window, []
            _, stats = await soak.call("GET", "/v1/stats", None, admin=True)
            sample = {"t_s": round(time.monotonic() - started), **bs.pct(window), "recalls": len(window),
                      "generation": stats.get("generation"), "pending": stats.get("delta", {}).get("pending"),
                      "errors": dict(soak.errors), "broken": soak.counts.get("invariant_broken", 0),
                      "processes": process_stats(replica_pids(store)), "disk_mib": disk_mib(store)}
            samples.append(sample)
            procs = "  ".join(f"{name} x{int(p['replicas'])} rss {p['rss_mib']:.0f} (anon {p['anon_mib']:.0f}, file "
                              f"{p['file_mib']:.0f}) pss {p['pss_mib']:.0f} gens {p['gens_mapped']} "
                              f"fd {int(p['fds'])} thr {int(p['threads'])}"
                              for name, p in sorted(sample["processes"].items()))
            bs.log(f"t={sample['t_s']}s recall p50 {sample['p50']} p95 {sample['p95']} ({len(window)})  "
                   f"gen {sample['generation']} pending {sample['pending']}  broken {sample['broken']}  "
                   f"errors {sample['errors']}  {procs}")
            bs.log(f"    disk MiB {sample['disk_mib']}")

    connector = aiohttp.TCPConnector(limit=max(args.clients) + 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
        soak.session = session
        watcher = asyncio.get_running_loop().create_task(sampler())
        levels = [await run_level(args, store, soak, clients) for clients in args.clients]
        watcher.cancel()
        bs.log("final checks: every deleted memory, 200 live ones")
        final = await soak.final_checks()
        _, stats = await soak.call("GET", "/v1/stats", None, admin=True)
    return {"levels": levels, "samples": samples, "final": final, "last_compaction": stats.get("last_compaction"),
            "generation": stats.get("generation"), "counts": soak.counts, "errors": soak.errors,
            "error_examples": soak.examples,
            "broken": soak.broken, "visible_ms": bs.pct(soak.visible_ms) | {"n": len(soak.visible_ms)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a store to serve (from a hard-linked copy)")
    ap.add_argument("--minutes", type=float, default=15.0, help="per level of --clients")
    ap.add_argument("--graph", choices=("split", "compact", "inline"), default="inline")
    ap.add_argument("--clients", "--concurrency", type=parse_clients, default=[4],
                    help="concurrent clients; several, comma-separated (8,32,64), are run one after another")
    ap.add_argument("--mix", type=parse_mix, default=OPS,
                    help="request kinds and weights, e.g. recall=90,write=10 (default: " +
                         ",".join(f"{name}={weight}" for name, weight in OPS) + ")")
    ap.add_argument("--max-queued-requests", type=int, default=None,
                    help="the application's max_queued_requests (default: ServeArgs')")
    ap.add_argument("--rss-every-s", type=float, default=60.0, help="every process's memory, this often per level")
    ap.add_argument("--warmup-s", type=float, default=60.0,
                    help="the memory verdict's baseline: the first sample this far into a level")
    ap.add_argument("--flat-ratio", type=float, default=1.10,
                    help="a process whose RSS grew by more than this ratio (and 8 MiB) fails the memory verdict")
    ap.add_argument("--compact-interval-s", type=float, default=120.0)
    ap.add_argument("--compact-max-pending", type=int, default=400)
    ap.add_argument("--ingest-config", default=None,
                    help="ingest YAML for writes and compaction (a store built without token vectors needs "
                         "late_interaction.enabled false, or its first compaction encodes every memory's tokens)")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    random.seed(args.seed)

    from ray import serve

    from helix_ray.runtime import spare_port
    from helix_ray.serve.app import ServeArgs, build_app
    from helix_ray.store.keys import KeyStore
    from helix_ray.serve.server import start_ray

    work = Path(tempfile.mkdtemp(prefix="helix-soak-"))
    store = bs.linked_copy(Path(args.store), work / "store")
    if (Path(args.store) / "helix.duckdb").is_file():  # the memories the generation holds, for compaction
        shutil.copy(Path(args.store) / "helix.duckdb", store / "helix.duckdb")
    queries = bs.queries_for(store, 2000, args.seed)
    keys = {u: KeyStore(store).create(u)[0] for u in sorted({q["user"] for q in queries})}
    admin = KeyStore(store).create("soak-admin", admin=True)[0]
    port = spare_port()
    try:
        bs.log(f"starting a local Ray ({args.num_cpus} CPUs) and Serve on 127.0.0.1:{port}; store {store}")
        start_ray(num_cpus=args.num_cpus)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        bounded = {} if args.max_queued_requests is None else {"max_queued_requests": args.max_queued_requests}
        serve.run(build_app(ServeArgs(store=str(store), graph=args.graph, retriever_replicas=(1, 2),
                                      compact_interval_s=args.compact_interval_s,
                                      compact_max_pending=args.compact_max_pending,
                                      ingest_config=args.ingest_config, **bounded)),
                  name="helix", route_prefix="/", logging_config={"enable_access_log": False, "log_level": "WARNING"})
        bs.log(f"soaking for {args.minutes} min per level: {args.clients} clients, {len(keys)} users, "
               f"graph {args.graph}, mix {dict(args.mix)}")
        result = asyncio.run(run(args, store, f"http://127.0.0.1:{port}", Soak(f"http://127.0.0.1:{port}", keys,
                                                                                  admin, queries, args.mix)))
    finally:
        bs.shut_down(None, [work])
    first, last = result["samples"][0], result["samples"][-1]  # --sample-s: at least one per 30 s
    growth = {name: {k: round(last["processes"][name][k] - p[k], 1)
                     for k in ("rss_mib", "pss_mib", "anon_mib", "file_mib", "fds", "threads")}
              for name, p in first["processes"].items() if name in last["processes"]}
    result["growth_first_to_last_sample"] = growth
    result["disk_growth_mib"] = {k: round(v - first["disk_mib"].get(k, 0), 1) for k, v in last["disk_mib"].items()}
    print(json.dumps({k: result[k] for k in ("counts", "errors", "error_examples", "final", "visible_ms", "generation",
                                             "growth_first_to_last_sample", "disk_growth_mib", "broken")},
                     indent=1, default=str))
    for level in result["levels"]:
        print(level_line(level))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1, default=str))
    failed = bool(result["broken"])  # a 5xx is one too
    print("FAILED: see 'broken'" if failed else "held: no 5xx, every invariant kept")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
