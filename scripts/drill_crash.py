"""Crash drills: SIGKILL a writer mid-write, restart, and count what survived.

    .venv/bin/python scripts/drill_crash.py
        [--scenario memory-add|ingest|ingest-worker|serve-writes|serve-compaction|all]
        [--rounds 3] [--seed 0] [--steps STEP,...] [--targets session,driver,writer] [--work DIR]

Each scenario prints one table row per kill point: the rounds run and how many were
killed before they finished, the memories acknowledged (over all rounds, each checked
by its last acknowledged write), those recovered after the restart, those lost, those
resurrected, and whether the store opened without repair every time (``helix
doctor``'s checks pass after the kill, the restarted writer takes the next write).

- ``memory-add``: a child process runs ``Memory.add`` in a loop (new memories and new
  texts of earlier ones), prints each acknowledged one and compacts after every second
  add. It kills itself at a named step (:data:`STEPS`): of a write (:data:`WRITE_STEPS`:
  the inbox copy fsynced, the log rows inserted and committed, the delta published) or
  of a compaction (its input written; each generation file staged, the folder renamed,
  the database mid-transaction and committed, ``CURRENT`` moved, old generations
  pruned; the log marked folded; the delta published), or the drill kills it at a
  random time (``random``). The next child adds to what the kill left; the drill
  recalls every acknowledged memory with a fresh :class:`helix_ray.Memory`.
- ``ingest``: the same for ``helix ingest --runner local`` (the CLI, in a child) of a
  JSONL file of new records and new texts of earlier ones, killed at a step of
  publishing (:data:`PUBLISH_STEPS`); after the kill a second ingest of the same file
  must complete.
- ``ingest-worker``: ``helix ingest --runner ray`` (the CLI, in a session of its own)
  of :data:`WORKER_RECORDS` synthetic records (``scripts/synthetic.py``) into a fresh
  store; once an embedding actor runs a batch (a process titled :data:`WORKER_TITLE`
  doing ``.submit``) one such actor's process is SIGKILLed, never the driver nor Ray's
  own. Ray Data restarts the actor and retries its batch: the ingest must exit 0 and the
  published generation hold every input id exactly once, with a vector each. Were it to
  fail instead, the same file is ingested again, which must complete likewise.
- ``serve-writes``: ``helix serve`` on a spare port takes a burst of concurrent
  ``POST /v1/memories`` and ``DELETE``s of acknowledged ids, killed at a random time:
  every process of its session (``session``: the driver's process group and the Ray
  workers, which sit in groups of their own), the driver alone (``driver``), or the
  Writer replica's process (``writer``, which Serve replaces; checked on the same
  server). ``helix serve`` then starts again on the same store and port (waiting while
  the killed server's connections close) and recalls every acknowledged memory.
- ``serve-compaction``: the same, killed while ``POST /v1/admin/compact`` runs.

Acknowledged means: ``Memory.add`` or ``helix ingest`` returned, or the server answered
201 / 200 (``ingest-worker``: the input's records; ids found more than once count as
resurrected). A write in flight at the kill may land or not. An acknowledged new text
whose older one is found again, or a deleted memory found at all, counts as resurrected. The
kill points are hooks the child installs on itself (no product code knows about them);
the random ones come from a seeded RNG (``--seed``).

The Serve scenarios start ``helix serve`` twice a round (~20–40 s each); more rounds:
``--scenario serve-writes --rounds 20``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helix_ray.store.generation import VECTORS_FILE, current_generation_number  # noqa: E402

USER = "dana"
WORDS = ("cache queue index parser worker lease shard replica token budget schema migration retry timeout "
         "socket buffer cursor ledger quota tenant router planner vector graph commit branch rollback").split()

#: The generation files (and folders) ``helix_ray.store.publish`` stages, in order: a
#: kill point each, right after the file is written.
STAGED = ("memories.arrow", VECTORS_FILE, "binary.npy", "minhash.npy", "bm25", "mentions.arrow", "knn",
          "graph", "entities.arrow", "late", "manifest.json")
#: Kill points of publishing a generation (a local ingest, or a compaction's), in order.
PUBLISH_STEPS = (*(f"staged:{name}" for name in STAGED), "renamed", "db-uncommitted", "db-committed", "current",
                 "pruned")
#: Kill points of one write through the Writer (``Memory.add``), in order: the inbox copy
#: fsynced, the log rows inserted (uncommitted), committed, the delta snapshot published.
WRITE_STEPS = ("write:inbox", "write:logged", "write:committed", "write:published")
#: Kill points of ``Memory.add``'s scenario: a write's, then those of the compaction that
#: folds the writes (its input written, the generation published, the log marked
#: folded, the delta snapshot without the folded entries).
STEPS = (*WRITE_STEPS, "compact:input", *PUBLISH_STEPS, "compact:folded", "compact:published")
KILLED = -signal.SIGKILL


# ----------------------------------------------------------------------------- what was acknowledged


def sentence(rng: random.Random) -> str:
    """Ten words at random: two drill memories share few shingles, so near-duplicate
    removal keeps both."""
    return " ".join(rng.sample(WORDS, 10))


def tag() -> str:
    """A word no other memory holds: BM25 finds exactly the memory that carries it."""
    return "drill" + uuid.uuid4().hex[:12]


def record(memory_id: str, word: str, rng: random.Random) -> dict[str, Any]:
    return {"id": memory_id, "user": USER, "text": f"Drill note {word}: {sentence(rng)}.", "source": "drill"}


@dataclass
class Ledger:
    """What the writers acknowledged: each live memory's newest word, the words its
    earlier texts had, and the deleted memories' last words. ``tried`` holds the writes
    sent since a memory's last acknowledged one (a put's word, None for a delete): a
    write in flight at the kill may land or not, and either is right."""

    live: dict[str, str] = field(default_factory=dict)
    replaced: dict[str, list[str]] = field(default_factory=dict)
    deleted: dict[str, str] = field(default_factory=dict)
    tried: dict[str, list[str | None]] = field(default_factory=dict)

    def attempt(self, memory_id: str, word: str | None) -> None:
        self.tried.setdefault(memory_id, []).append(word)

    def put(self, memory_id: str, word: str) -> None:
        self.tried.pop(memory_id, None)
        if memory_id in self.live:
            self.replaced.setdefault(memory_id, []).append(self.live[memory_id])
        self.deleted.pop(memory_id, None)
        self.live[memory_id] = word

    def delete(self, memory_id: str) -> None:
        self.tried.pop(memory_id, None)
        self.deleted[memory_id] = self.live.pop(memory_id)

    def take(self, line: str) -> None:
        """One line a child printed: ``try put ID WORD``, ``ack put ID WORD``, ``try
        delete ID`` or ``ack delete ID``."""
        parts = line.split()
        if parts[:2] == ["try", "put"]:
            self.attempt(parts[2], parts[3])
        elif parts[:2] == ["try", "delete"]:
            self.attempt(parts[2], None)
        elif parts[:2] == ["ack", "put"]:
            self.put(parts[2], parts[3])
        elif parts[:2] == ["ack", "delete"]:
            self.delete(parts[2])


@dataclass
class Outcome:
    """One check after a restart."""

    recovered: int
    lost: list[str]
    resurrected: list[str]
    opened: bool
    why: str = ""


def check(ledger: Ledger, found: Callable[[str], dict[str, str]], opened: bool, why: str = "") -> Outcome:
    """Look up every acknowledged memory by its words: ``found(word)`` gives id → text
    of the memories recall returns for that word. A live memory is recovered when its
    last acknowledged text is found, or the text of a write in flight at the kill (or
    nothing, when that write was a delete)."""
    lost, resurrected, recovered = [], [], 0

    def holds(memory_id: str, word: str) -> bool:
        text = found(word).get(memory_id)
        return text is not None and word in text

    for memory_id, word in ledger.live.items():
        in_flight = ledger.tried.get(memory_id, [])
        if any(holds(memory_id, w) for w in [word, *in_flight] if w is not None) or None in in_flight:
            recovered += 1
        else:
            lost.append(memory_id)
        resurrected += [f"{memory_id} (old text)" for old in ledger.replaced.get(memory_id, [])
                        if holds(memory_id, old)]
    for memory_id, word in ledger.deleted.items():
        if memory_id in found(word):
            resurrected.append(memory_id)
        else:
            recovered += 1
    return Outcome(recovered, lost, resurrected, opened, why)


@dataclass
class Row:
    """One kill point's table row. ``acknowledged`` counts memories (a memory written
    three times is checked once, by its last acknowledged write); ``lost`` and
    ``resurrected`` count the distinct memories any check found so."""

    scenario: str
    rounds: int = 0
    kills: int = 0
    acknowledged: int = 0
    recovered: int = 0
    lost: set[str] = field(default_factory=set)
    resurrected: set[str] = field(default_factory=set)
    opened: bool = True
    notes: list[str] = field(default_factory=list)

    def add(self, ledger: Ledger, outcome: Outcome, *, killed: bool) -> None:
        """A round's check, over everything acknowledged so far in this store."""
        self.rounds += 1
        self.kills += killed
        self.acknowledged = len(ledger.live) + len(ledger.deleted)
        self.recovered = outcome.recovered
        self.lost |= set(outcome.lost)
        self.resurrected |= set(outcome.resurrected)
        self.opened = self.opened and outcome.opened
        if outcome.why:
            self.notes.append(outcome.why)
        self.notes += [f"lost {i}" for i in outcome.lost[:3]] + [f"resurrected {i}" for i in outcome.resurrected[:3]]

    def add_ingest(self, r: int, ids: list[str], outcome: Outcome, *, killed: bool) -> None:
        """Round ``r`` of an ingest scenario, whose input held ``ids``, each counted
        (ingests write into a fresh store a round, so the rounds' counts add up)."""
        self.rounds += 1
        self.kills += killed
        self.acknowledged += len(ids)
        self.recovered += outcome.recovered
        self.lost |= {f"round{r}:{i}" for i in outcome.lost}
        self.resurrected |= {f"round{r}:{i}" for i in outcome.resurrected}
        self.opened = self.opened and outcome.opened
        self.notes += [outcome.why] if outcome.why else []
        self.notes += [f"lost {i}" for i in outcome.lost[:3]] + [f"twice {i}" for i in outcome.resurrected[:3]]

    def cells(self) -> list[str]:
        return [self.scenario, str(self.rounds), str(self.kills), str(self.acknowledged), str(self.recovered), str(len(self.lost)),
                str(len(self.resurrected)), "yes" if self.opened else "no"]


HEADER = ["scenario", "rounds", "killed", "acknowledged", "recovered", "lost", "resurrected", "opened without repair"]


def print_row(row: Row) -> None:
    print("| " + " | ".join(row.cells()) + " |", flush=True)
    for note in row.notes[:5]:
        print(f"|   ! {note}", flush=True)


# ----------------------------------------------------------------------------- kill points (in the child)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(step: str, on_call: int, *, writes: bool) -> None:
    """SIGKILL this process at ``step`` (one of :data:`STEPS`). ``writes`` (the
    memory-add child): armed from its ``on_call``-th add (1-based) on, a write's step in
    a write, a compaction's in a compaction; else (``helix ingest``): at a publish step
    of its ``on_call``-th ingest. Wraps the functions each step ends with, in this
    process only."""
    import helix_ray.ingest.run as run
    import helix_ray.live.compaction as compaction
    import helix_ray.live.writes as writes_mod
    import helix_ray.store.db as db
    import helix_ray.store.publish as publish
    from helix_ray.live.writer import WriterCore

    calls = {"n": 0}
    phase = {"now": ""}  # "write" or "compact" while one runs (memory-add)

    def armed(kind: str = "compact") -> bool:
        if not writes:
            return calls["n"] == on_call
        return calls["n"] >= on_call and phase["now"] == kind

    def counted(owner: Any, name: str, kind: str | None) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if kind is None or kind == "write":
                calls["n"] += 1
            if kind is not None:
                phase["now"] = kind
            try:
                return original(*args, **kwargs)
            finally:
                phase["now"] = ""

        setattr(owner, name, wrapped)

    if writes:  # the writes are counted, and a compaction's steps are armed while it runs
        counted(writes_mod, "write_rows", "write")
        counted(compaction, "compact", "compact")
    else:  # `helix ingest`: its ingests are counted
        counted(run, "ingest", None)
    done = publish._Staging.done

    def staged(self: Any, path: Path) -> None:
        done(self, path)
        if armed() and step == f"staged:{path.name}":
            die()

    publish._Staging.done = staged  # type: ignore[method-assign]
    after(publish, "_rename_durably", lambda: armed() and step == "renamed")
    before(db.StoreDB, "record_generation", lambda: armed() and step == "db-uncommitted")
    after(run, "_record", lambda: armed() and step == "db-committed")
    before(run, "prune", lambda: armed() and step == "current")
    after(run, "prune", lambda: armed() and step == "pruned")
    after(writes_mod, "_write_inbox", lambda: armed("write") and step == "write:inbox")
    after(WriterCore, "_drop_superseded", lambda: armed("write") and step == "write:logged")  # in the transaction
    before(WriterCore, "_publish", lambda: armed("write") and step == "write:committed")
    after(WriterCore, "_publish", lambda: armed("write") and step == "write:published")
    after(db.StoreDB, "sibling", lambda: armed() and step == "compact:input")  # the input file is fsynced
    after(compaction, "mark_folded", lambda: armed() and step == "compact:folded")
    after(compaction, "retire_inbox", lambda: armed() and step == "compact:published")


def before(owner: Any, name: str, when: Callable[[], bool]) -> None:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if when():
            die()
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def after(owner: Any, name: str, when: Callable[[], bool]) -> None:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if when():
            die()
        return out

    setattr(owner, name, wrapped)


def child_memory_add(store: Path, seed: int, limit: int) -> None:
    """Add memories one call at a time (every third a new text of an earlier one),
    printing each acknowledged one, and fold them into a generation after every second
    add (``Memory.compact``), until killed or ``limit`` calls."""
    from helix_ray.memory import Memory

    rng = random.Random(seed)
    mem = Memory(store, warm=False, record_access=False, compact_interval_s=None)
    print("ready", flush=True)
    acked: list[str] = []
    for n in range(limit):
        memory_id = rng.choice(acked) if acked and n % 3 == 2 else f"s{seed}-{n}"
        word = tag()
        print(f"try put {memory_id} {word}", flush=True)
        mem.add([record(memory_id, word, rng)])
        acked.append(memory_id)
        print(f"ack put {memory_id} {word}", flush=True)
        if n % 2 == 1:
            mem.compact()
    mem.close()


def child_ingest(store: Path, source: Path) -> int:
    """``helix ingest SOURCE --store STORE --runner local``, in this process."""
    from helix_ray.cli import main

    print("ready", flush=True)
    return main(["ingest", str(source), "--store", str(store), "--runner", "local", "--json"])


def child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("memory-add", "ingest"))
    ap.add_argument("--store", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-at", default=None, choices=STEPS)
    ap.add_argument("--kill-on", type=int, default=1,
                    help="memory-add: from which add on the kill point is armed; ingest: for which ingest")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--source", default=None)
    args = ap.parse_args(argv)
    if args.kill_at:
        install_kill_point(args.kill_at, args.kill_on, writes=args.what == "memory-add")
    if args.what == "memory-add":
        child_memory_add(Path(args.store), args.seed, args.limit)
        return 0
    return child_ingest(Path(args.store), Path(args.source))


# ----------------------------------------------------------------------------- running a child


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def follow(proc: subprocess.Popen, ledger: Ledger, kill_after_s: float | None = None,
           timeout_s: float = 300.0) -> int:
    """Read the child's acknowledgements until it exits; SIGKILL it ``kill_after_s``
    seconds after it says ``ready`` (None: let it run). Returns its exit code (an
    error's stderr is shown)."""
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready"):
                ready.set()
            ledger.take(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_after_s is not None and ready.wait(timeout_s):
        time.sleep(kill_after_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    code = proc.wait(timeout_s)
    reader.join(10)
    if code not in (0, KILLED):
        tail = proc.stderr.read()[-1500:] if proc.stderr else ""
        print(f"  child exited {code}: {tail}", file=sys.stderr, flush=True)
    return code


# ----------------------------------------------------------------------------- local checks


def local_check(store: Path, ledger: Ledger) -> Outcome:
    """After a kill: ``helix doctor``'s checks, then a fresh :class:`Memory` recalls each
    acknowledged memory by its word."""
    from helix_ray.memory import Memory
    from helix_ray.store.doctor import check_store

    problems = [f"{c.name}: {c.found}" for c in check_store(store) if not c.ok]
    with Memory(store, warm=False, record_access=False) as mem:
        def found(word: str) -> dict[str, str]:
            return {item.id: item.text for item in mem.recall(word, user=USER, k=5).items}
        return check(ledger, found, not problems, "; ".join(problems))


def fresh(work: Path, scenario: str, step: str) -> tuple[Path, Ledger, Row]:
    """An empty store folder for ``scenario`` killed at ``step``, its ledger and row."""
    store = work / f"{scenario}-{step.replace(':', '-')}"
    shutil.rmtree(store, ignore_errors=True)
    return store, Ledger(), Row(f"{scenario}@{step}")


def drill_memory_add(work: Path, steps: list[str], rounds: int, rng: random.Random, *,
                     kill_on: int | None = None, show: bool = True) -> list[Row]:
    """``memory-add``: one store per kill point, ``rounds`` children killed in each;
    each child first adds to what the kills before it left. A child is killed at the
    first kill point it meets from its ``kill_on``-th add on (None: the 2nd to 4th, at
    random): a write's in that add, a compaction's in the compaction after it."""
    rows = []
    for step in steps:
        store, ledger, row = fresh(work, "memory-add", step)
        for _ in range(rounds):
            seed = rng.randrange(10**6)
            if step == "random":
                code = follow(spawn("memory-add", "--store", str(store), "--seed", str(seed), "--limit", "10000"),
                              ledger, kill_after_s=rng.uniform(1.0, 8.0))
            else:
                code = follow(spawn("memory-add", "--store", str(store), "--seed", str(seed), "--kill-at", step,
                                    "--kill-on", str(kill_on or rng.randint(2, 4))), ledger)
            outcome = local_check(store, ledger)
            if code not in (0, KILLED):
                outcome.opened, outcome.why = False, f"Memory.add failed after the restart (exit {code})"
            row.add(ledger, outcome, killed=code == KILLED)
        rows.append(row)
        if show:
            print_row(row)
    return rows


def drill_ingest(work: Path, steps: list[str], rounds: int, rng: random.Random) -> list[Row]:
    """``ingest``: each round writes a file of new records and new texts of earlier
    ones, runs ``helix ingest`` on it until the kill, checks the store, then ingests the
    file again: that run must complete."""
    rows = []
    for step in steps:
        store, ledger, row = fresh(work, "ingest", step)
        for r in range(rounds):
            source = store.parent / f"{store.name}-round{r}.jsonl"
            known = list(ledger.live)
            batch = dict((rng.choice(known) if known and n % 3 == 2 else f"r{r}-{n}", tag()) for n in range(20))
            source.write_text("".join(json.dumps(record(i, w, rng)) + "\n" for i, w in batch.items()))
            for i, w in batch.items():
                ledger.attempt(i, w)
            kill = ("--kill-at", step) if step != "random" else ()
            code = follow(spawn("ingest", "--store", str(store), "--source", str(source), *kill), ledger,
                          kill_after_s=rng.uniform(0.1, 2.5) if step == "random" else None)
            if code == 0:  # not killed: acknowledged
                for i, w in batch.items():
                    ledger.put(i, w)
            outcome = local_check(store, ledger)
            again = follow(spawn("ingest", "--store", str(store), "--source", str(source)), Ledger())
            if again != 0:
                outcome.opened, outcome.why = False, f"the ingest after the kill exited {again}"
            elif code != 0:
                for i, w in batch.items():
                    ledger.put(i, w)
            row.add(ledger, outcome, killed=code == KILLED)
        final = local_check(store, ledger)  # the last round's second ingest, checked
        row.add(ledger, final, killed=False)
        row.rounds -= 1
        rows.append(row)
        print_row(row)
    return rows


# ----------------------------------------------------------------------------- a Ray worker lost mid-ingest

#: The records ``ingest-worker`` ingests each round: enough that the embedding actors
#: run batches for tens of seconds on two cores.
WORKER_RECORDS = 2000
#: The process title of a Ray Data embedding actor (``ray::`` and its task after it).
WORKER_TITLE = "ray::MapWorker(MapBatches(Transform))"
#: How long one ``helix ingest`` of a round may run before it counts as hung.
INGEST_TIMEOUT_S = 600.0


def session_processes(sid: int) -> list[Any]:
    """The live processes of session ``sid`` (a child started in a session of its own,
    and the Ray processes it started: they sit in process groups of their own)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (OSError, psutil.Error):
            continue
    return out


def title(proc: Any) -> str:
    """A process's title (Ray pads a worker's with empty arguments)."""
    return " ".join(a for a in proc.info["cmdline"] or [] if a).strip()


def kill_worker(ingest: subprocess.Popen, rng: random.Random, timeout_s: float) -> str:
    """Wait until an embedding actor of ``ingest``'s session runs a batch, let it work a
    random few seconds, then SIGKILL one actor that runs one. Returns what was killed
    ("" when no batch ran before the ingest ended or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while ingest.poll() is None and time.monotonic() < deadline:
        if any(title(p).startswith(WORKER_TITLE + ".submit") for p in session_processes(ingest.pid)):
            break
        time.sleep(0.2)
    else:
        return ""
    time.sleep(rng.uniform(0.0, 8.0))
    busy = [p for p in session_processes(ingest.pid) if title(p).startswith(WORKER_TITLE + ".submit")]
    if not busy or ingest.poll() is not None:
        return ""
    victim = rng.choice(busy)
    try:
        victim.send_signal(signal.SIGKILL)
    except OSError:
        return ""
    return f"{title(victim)} (pid {victim.pid})"


def ray_ingest(store: Path, source: Path, log: Path) -> subprocess.Popen:
    """``helix ingest SOURCE --store STORE --runner ray`` on a local Ray of its own, in a
    session of its own, its output appended to ``log``; its embedding actors restart as
    on a cluster (``embed_actor_restarts`` 3, a config file beside ``log``)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    config = log.with_suffix(".yaml")
    config.write_text("embed_actor_restarts: 3\n")
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "ingest", str(source), "--store", str(store),
                                 "--runner", "ray", "--no-progress", "--config", str(config)],
                                start_new_session=True, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(ingest: subprocess.Popen, timeout_s: float) -> int:
    """``ingest``'s exit code (SIGKILLed past ``timeout_s``), with what is left of its
    session (Ray's processes, once the driver is gone) killed after a grace period."""
    try:
        code = ingest.wait(timeout_s)
    except subprocess.TimeoutExpired:
        ingest.send_signal(signal.SIGKILL)
        code = ingest.wait(30)
    deadline = time.monotonic() + 15
    while session_processes(ingest.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in session_processes(ingest.pid):
        try:
            proc.send_signal(signal.SIGKILL)
        except OSError:
            pass
    return code


def generation_check(store: Path, ids: list[str]) -> Outcome:
    """The published generation against the input's ``ids``: each found once (a chunk
    counts for its parent), with a non-zero vector per row; ``helix doctor``'s checks.
    ``resurrected`` holds the ids found twice or more, and any not in the input."""
    from helix_ray.schema import parent_of
    from helix_ray.store.generation import Generation

    problems = [doctor_problems(store)]
    gen = Generation.open_current(store)
    rows = Counter(parent_of(i) or i for i in gen.memories.column("id").to_pylist())
    lost = [i for i in ids if i not in rows]
    extra = [f"{i} (x{n})" for i, n in rows.items() if n > 1] + [f"{i} (not in the input)" for i in
                                                                  rows.keys() - set(ids)]
    vectors = np.asarray(gen.vectors, dtype=np.float32)
    if len(vectors) != gen.size:
        problems.append(f"{len(vectors)} vectors for {gen.size} rows")
    elif not np.abs(vectors).sum(axis=1).all():
        problems.append(f"{int((np.abs(vectors).sum(axis=1) == 0).sum())} rows without a vector")
    why = "; ".join(p for p in problems if p)
    return Outcome(len(ids) - len(lost), lost, extra, not why, why)


def drill_ingest_worker(work: Path, rounds: int, rng: random.Random, *, records: int = WORKER_RECORDS,
                        show: bool = True) -> Row:
    """``ingest-worker``: each round ingests ``records`` synthetic records into a fresh
    store with ``--runner ray``, SIGKILLs an embedding actor mid-batch, and checks the
    generation published; an ingest that failed is run again first, and must complete."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from synthetic import write_jsonl

    row = Row("ingest-worker")
    for r in range(rounds):
        store = work / f"ingest-worker-round{r}"
        source, log = work / f"ingest-worker-round{r}.jsonl", work / f"ingest-worker-round{r}.log"
        shutil.rmtree(store, ignore_errors=True)
        log.unlink(missing_ok=True)
        write_jsonl(records, str(source), seed=rng.randrange(10**6))
        ids = [json.loads(line)["id"] for line in source.read_text().splitlines()]
        ingest = ray_ingest(store, source, log)
        killed = kill_worker(ingest, rng, timeout_s=INGEST_TIMEOUT_S)
        code = finish(ingest, INGEST_TIMEOUT_S)
        why = "" if code == 0 else f"helix ingest exited {code} after the kill; see {log}"
        if code != 0:
            again = finish(ray_ingest(store, source, log), INGEST_TIMEOUT_S)
            why += "; ingested again: " + ("exit 0" if again == 0 else f"exit {again} too")
        print(f"    round {r}: killed {killed or 'nothing (no batch ran)'}; ingest exited {code}", file=sys.stderr,
              flush=True)
        outcome = generation_check(store, ids) if current_generation_number(store) else Outcome(0, ids, [], False, "")
        outcome.opened = outcome.opened and code == 0
        outcome.why = "; ".join(w for w in (why, outcome.why) if w)
        row.add_ingest(r, ids, outcome, killed=bool(killed))
    if show:
        print_row(row)
    return row


# ----------------------------------------------------------------------------- Serve

#: What a Serve round kills: every process of ``helix serve``'s session (its process
#: group and the Ray workers, which sit in groups of their own), the driver alone, or
#: the Writer replica's process.
SERVE_TARGETS = ("session", "driver", "writer")
WRITER_TITLE = "ServeReplica:helix:Writer"
START_TIMEOUT_S = 300.0


class Server:
    """One ``helix serve`` of ``store`` on a spare 127.0.0.1 port, in a session of its own
    (``scripts/drill_cluster.py`` runs it joined to a cluster too)."""

    def __init__(self, store: Path, log: Path, port: int | None = None, env: dict[str, str] | None = None):
        from helix_ray.runtime import spare_port

        self.store, self.port = store, port or spare_port()
        # A Ray of its own unless ``env`` says otherwise (RAY_ADDRESS: a cluster to join).
        env = dict(env) if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = str(ROOT)
        self.log = log.with_name(f"{log.stem}-{uuid.uuid4().hex[:6]}.log")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(store),
                                          "--port", str(self.port)], start_new_session=True, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = False

    def wait_ready(self) -> bool:
        """Whether this server says it serves (not another one on the port) and answers."""
        import httpx

        if self.ready:
            return True
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "Helix is serving" not in self.log.read_text(errors="replace"):
                time.sleep(0.5)
                continue
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    self.ready = True
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return False

    def session(self) -> list[Any]:
        """The live processes of this server's session (the driver's and Ray's)."""
        return session_processes(self.proc.pid)

    def kill(self, target: str) -> str:
        """SIGKILL ``target`` (one of :data:`SERVE_TARGETS`); returns what was killed."""
        if target == "driver":
            self.proc.send_signal(signal.SIGKILL)
            return f"driver {self.proc.pid}"
        procs = self.session()
        if target == "writer":
            procs = [p for p in procs if WRITER_TITLE in " ".join(p.info["cmdline"] or [])]
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except OSError:
                pass
        return f"{target}: {len(procs)} processes"

    def stop(self) -> None:
        """SIGTERM (``helix serve`` takes Serve and Ray down), then SIGKILL of what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        self.reap()

    def outliving(self, grace_s: float) -> list[str]:
        """The session's processes still there after ``grace_s`` (their titles)."""
        deadline = time.monotonic() + grace_s
        while self.session() and time.monotonic() < deadline:
            time.sleep(0.5)
        return [" ".join(p.info["cmdline"] or [])[:60] for p in self.session()]

    def reap(self) -> None:
        """SIGKILL what is left of the session."""
        for proc in self.session():
            try:
                proc.send_signal(signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(30)


class Burst:
    """Concurrent writers against one server: each thread writes memories of its own
    ids, sometimes a new text of one, sometimes deletes one (each id's writes in order,
    so the ledger knows which one is last)."""

    def __init__(self, url: str, key: str, ledger: Ledger, rng: random.Random, threads: int = 4):
        self.url, self.key, self.ledger = url, key, ledger
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.seeds = [rng.randrange(10**6) for _ in range(threads)]
        self.errors: dict[str, int] = {}
        self.said: dict[str, list[str]] = {}
        self.threads = [threading.Thread(target=self.worker, args=(n,), daemon=True) for n in range(threads)]

    def start(self) -> "Burst":
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(70)

    def note(self, what: str, body: str | None = None) -> None:
        """Count an error; keep the first few bodies of each 5xx status (what the server said)."""
        with self.lock:
            self.errors[what] = self.errors.get(what, 0) + 1
            if body is not None and what.startswith("5") and len(self.said.setdefault(what, [])) < 3:
                self.said[what].append(body[:300])

    def worker(self, n: int) -> None:
        import httpx

        rng = random.Random(self.seeds[n])
        mine: list[str] = []
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60) as client:
            for k in range(10**6):
                if self.halt.is_set():
                    return
                roll = rng.random()
                try:
                    if mine and roll < 0.15:
                        memory_id = mine.pop(rng.randrange(len(mine)))
                        with self.lock:
                            self.ledger.attempt(memory_id, None)
                        answer = client.delete(f"/v1/memories/{memory_id}")
                        status = answer.status_code
                        if status == 200:
                            with self.lock:
                                self.ledger.delete(memory_id)
                        else:
                            mine.append(memory_id)  # its delete may be retried later
                    else:
                        memory_id = rng.choice(mine) if mine and roll < 0.3 else f"t{self.seeds[n]}-{n}-{k}"
                        word = tag()
                        with self.lock:
                            self.ledger.attempt(memory_id, word)
                        body = record(memory_id, word, rng)
                        del body["user"]  # the key's user
                        answer = client.post("/v1/memories", json=body)
                        status = answer.status_code
                        if status == 201:
                            with self.lock:
                                self.ledger.put(memory_id, word)
                            if memory_id not in mine:
                                mine.append(memory_id)
                    if status >= 400:
                        self.note(str(status), answer.text)
                        time.sleep(0.2)
                except httpx.HTTPError as exc:
                    self.note(type(exc).__name__)
                    time.sleep(0.2)


def http_check(url: str, key: str, ledger: Ledger) -> Outcome:
    """Recall each acknowledged memory by its word through the server, then one write."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        def found(word: str) -> dict[str, str]:
            response = client.post("/v1/recall", json={"query": word, "k": 5, "budget_tokens": 400})
            response.raise_for_status()
            return {item["id"]: item["text"] for item in response.json()["items"]}

        outcome = check(ledger, found, True)
        after = client.post("/v1/memories", json={"id": f"after-{uuid.uuid4().hex[:8]}", "text": "Written after "
                                                  f"the restart {tag()}: {sentence(random.Random())}."})
        if after.status_code != 201:
            outcome.opened, outcome.why = False, f"a write after the restart got {after.status_code}: {after.text[:200]}"
    return outcome


def doctor_problems(store: Path) -> str:
    from helix_ray.store.doctor import check_store

    return "; ".join(f"{c.name}: {c.found}" for c in check_store(store) if not c.ok)


def new_serve_store(store: Path) -> tuple[str, str]:
    """A store with an empty generation and two API keys: (user key, admin key)."""
    from helix_ray.ingest.run import initialise
    from helix_ray.store.keys import KeyStore

    shutil.rmtree(store, ignore_errors=True)
    initialise(store)
    keys = KeyStore(store)
    return keys.create(USER)[0], keys.create("drill-admin", admin=True)[0]


#: ``helix serve``'s refusal of a port whose last server's connections are closing.
PORT_CLOSING = "connections of the server that last used it are still closing"


def restart(store: Path, log: Path, port: int) -> Server:
    """``helix serve`` on ``port`` again; while the killed server's connections are still
    closing (TIME_WAIT, up to a minute) it refuses the port and says so: start it again
    then, as its message asks."""
    deadline = time.monotonic() + 120
    while True:
        server = Server(store, log, port=port)
        ready = server.wait_ready()
        if ready or time.monotonic() > deadline or PORT_CLOSING not in server.log.read_text(errors="replace"):
            return server
        server.stop()
        time.sleep(5)


def serve_round(store: Path, keys: tuple[str, str], ledger: Ledger, target: str, compaction: bool,
                rng: random.Random, log: Path) -> tuple[Outcome, bool]:
    """One round: serve, write in a burst (and compact), kill ``target``, start again
    (or, for the Writer, wait for Serve's new one) and check. Returns the outcome and
    whether the kill came (a server that did not start is a failed round)."""
    import httpx

    key, admin = keys
    server = Server(store, log)
    try:
        if not server.wait_ready():
            return Outcome(0, [], [], False, f"helix serve did not start within {START_TIMEOUT_S:.0f} s"), False
        burst = Burst(server.url, key, ledger, rng).start()
        if compaction:
            time.sleep(rng.uniform(2.0, 5.0))  # writes for the compaction to fold
            threading.Thread(target=lambda: httpx.post(server.url + "/v1/admin/compact", timeout=300,
                                                       headers={"Authorization": f"Bearer {admin}"}),
                             daemon=True).start()
            time.sleep(rng.uniform(0.2, 4.0))
        else:
            time.sleep(rng.uniform(1.0, 8.0))
        killed = server.kill(target)
        if target == "writer":
            time.sleep(rng.uniform(2.0, 5.0))  # the burst meets the Writer's absence, then its successor
        burst.stop()
        print(f"    round: killed {killed}; errors seen {burst.errors}; 5xx bodies {burst.said}", file=sys.stderr,
              flush=True)
        if target == "writer":
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:  # the first write Serve's new Writer answers
                try:
                    outcome = http_check(server.url, key, ledger)
                    return outcome, True
                except httpx.HTTPError:
                    time.sleep(1.0)
            return Outcome(0, [], [], False, "no new Writer within the start timeout"), True
        left = server.outliving(grace_s=15.0)
        problems = doctor_problems(store) if not left else ""
        # Started again on the same port, as an operator would, with whatever outlived the kill.
        restarted = restart(store, log, server.port)
        if not restarted.wait_ready():
            restarted.stop()
            server.reap()
            why = f"helix serve did not start again while {len(left)} processes outlived the kill ({left[:3]})"
            restarted = restart(store, log, server.port)
            if not restarted.wait_ready():
                restarted.stop()
                return Outcome(0, [], [], False, why + "; nor after they were killed"), True
            problems = "; ".join(w for w in (why, problems) if w)
        try:
            outcome = http_check(restarted.url, key, ledger)
        finally:
            restarted.stop()
    finally:
        server.stop()
    if problems:
        outcome.opened = False
        outcome.why = "; ".join(w for w in (problems, outcome.why) if w)
    return outcome, True


def drill_serve(work: Path, targets: list[str], rounds: int, rng: random.Random, *, compaction: bool) -> list[Row]:
    rows = []
    name = "serve-compaction" if compaction else "serve-writes"
    for target in targets:
        store = work / f"{name}-{target}"
        keys = new_serve_store(store)
        ledger, row = Ledger(), Row(f"{name}@{target}")
        for _ in range(rounds):
            outcome, killed = serve_round(store, keys, ledger, target, compaction, rng, work / f"{name}.log")
            row.add(ledger, outcome, killed=killed)
        rows.append(row)
        print_row(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="all",
                    choices=("memory-add", "ingest", "ingest-worker", "serve-writes", "serve-compaction", "all"))
    ap.add_argument("--rounds", type=int, default=None, help="kills per kill point (default: 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/helix-crash-drill")
    ap.add_argument("--targets", default=",".join(SERVE_TARGETS),
                    help=f"comma-separated kill targets of the serve scenarios (default: {','.join(SERVE_TARGETS)})")
    ap.add_argument("--steps", default=None, help="comma-separated kill points of memory-add / ingest (default: all)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or 3
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER), flush=True)
    rows: list[Row] = []
    chosen = args.steps.split(",") if args.steps else [*STEPS, "random"]
    unknown = set(chosen) - {*STEPS, "random"}
    if unknown:
        ap.error(f"unknown kill points {sorted(unknown)}; choose from {', '.join(STEPS)}, random")
    if args.scenario in ("memory-add", "all"):
        rows += drill_memory_add(work, chosen, rounds, rng)
    if args.scenario in ("ingest", "all"):
        rows += drill_ingest(work, [s for s in chosen if s in (*PUBLISH_STEPS, "random")], rounds, rng)
    if args.scenario in ("ingest-worker", "all"):
        rows.append(drill_ingest_worker(work, rounds, rng))
    targets = args.targets.split(",")
    if args.scenario in ("serve-writes", "all"):
        rows += drill_serve(work, targets, rounds, rng, compaction=False)
    if args.scenario in ("serve-compaction", "all"):
        rows += drill_serve(work, targets, rounds, rng, compaction=True)
    bad = [r for r in rows if r.lost or r.resurrected or not r.opened]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
