"""Ray drills: the Ray under Helix goes away; count what survived and what was left running.

    .venv/bin/python scripts/drill_cluster.py [--scenario ray-head|ingest-node|all]
        [--where own,cluster] [--rounds 1] [--seed 0] [--records 3000] [--work DIR]

- ``ray-head``: ``helix serve`` (in a session of its own) takes a burst of concurrent
  writes (``scripts/drill_crash.py``'s serve burst), then loses its Ray's GCS: ``own``
  (the default ``helix serve``, which starts a Ray of its own) has that Ray's
  ``gcs_server`` SIGKILLed; ``cluster`` (``helix serve`` joined with ``RAY_ADDRESS`` to a
  two-node :class:`helix_ray.local_cluster.LocalCluster`) has the head node SIGKILLed
  with everything it started (GCS, raylet, Serve's controller and proxy, the replicas
  there). ``helix serve`` must exit non-zero within :data:`EXIT_WITHIN_S`, its last line
  saying that it lost its Ray and what to run, and leave no process of its session
  behind. Then ``helix serve`` starts again on the same store, on a Ray of its own (a
  cluster that lost its head is gone) and a new port, and recalls every acknowledged
  memory.
- ``ingest-node``: on a two-node LocalCluster, a store whose current generation holds
  :data:`PREVIOUS_RECORDS` synthetic records (``scripts/synthetic.py``) takes
  ``helix ingest --runner ray`` of ``--records`` more; once an embedding actor on node 1
  runs a batch, node 1 is SIGKILLed (``LocalCluster.kill_node(1)``). The ingest must
  either exit 0 with every record of both files in the new generation exactly once,
  each with a vector, or fail with a sentence and the previous generation still current
  and openable; node 1 then rejoins and a second ingest of the same file must complete.

Columns as in ``drill_crash.py``, plus how ``helix`` exited after the loss (exit code,
and seconds from the kill: the largest over the rounds) and ``orphans``: processes of
the drilled command's session (and, on a cluster, of the nodes' sessions once the
cluster is stopped) still alive after a grace period. Every round starts Ray two or
three times (~1–2 minutes a round).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from drill_crash import (  # noqa: E402
    HEADER, INGEST_TIMEOUT_S, WORKER_TITLE, Burst, Ledger, Outcome, Row, Server, finish, generation_check,
    http_check, new_serve_store, restart, session_processes, title,
)
from helix_ray.local_cluster import LocalCluster  # noqa: E402
from helix_ray.runtime import spare_port  # noqa: E402
from helix_ray.store.generation import current_generation_number  # noqa: E402

#: How soon ``helix serve`` must have exited after its GCS is lost: its watch's
#: patience (``helix_ray.runtime.GCS_LOST_AFTER_S``) and its own Ray stopped, with room.
EXIT_WITHIN_S = 45.0
#: Seconds the drill gives a command's processes to end after it exited.
GRACE_S = 5.0
#: What ``helix serve``'s last line starts with when it lost its Ray.
LOST_SAYS = "helix serve: Lost the"
#: Records of the generation current before ``ingest-node``'s ingest.
PREVIOUS_RECORDS = 100
WHERE = ("own", "cluster")


@dataclass
class RayRow(Row):
    """A drill_crash row, with how the command exited after each loss and the orphans."""

    exits: list[tuple[int | None, float]] = field(default_factory=list)
    orphans: int = 0

    def cells(self) -> list[str]:
        codes = ",".join(sorted({str(code) for code, _ in self.exits})) or "-"
        slowest = max((s for _, s in self.exits), default=0.0)
        return [*super().cells(), f"{codes} in ≤{slowest:.0f} s" if self.exits else "-", str(self.orphans)]


COLUMNS = [*HEADER, "exit after the loss", "orphans"]


def print_row(row: RayRow) -> None:
    print("| " + " | ".join(row.cells()) + " |", flush=True)
    for note in row.notes[:6]:
        print(f"|   ! {note}", flush=True)


def left_running(sids: list[int], grace_s: float = GRACE_S) -> list[str]:
    """The titles of the processes of sessions ``sids`` still alive after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while any(session_processes(s) for s in sids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [title(p)[:60] for s in sids for p in session_processes(s)]


def reap(sids: list[int]) -> None:
    for sid in sids:
        for proc in session_processes(sid):
            try:
                proc.kill()
            except OSError:
                pass


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ----------------------------------------------------------------------------- ray-head


def kill_gcs(server: Server) -> str:
    """SIGKILL the ``gcs_server`` of the Ray ``server`` started."""
    victims = [p for p in server.session() if "gcs_server" in title(p).split(" ")[0]]
    for proc in victims:
        proc.kill()
    return f"gcs_server (pid {', '.join(str(p.pid) for p in victims)})" if victims else ""


def ray_head_round(work: Path, where: str, row: RayRow, rng: random.Random) -> None:
    """One ``ray-head`` round (see the module's docstring), added to ``row``."""
    store, log = work / f"ray-head-{where}", work / f"ray-head-{where}.log"
    key, _ = new_serve_store(store)
    ledger = Ledger()
    cluster = LocalCluster(nodes=2, cpus=2).start() if where == "cluster" else None
    sids: list[int] = []
    try:
        server = Server(store, log, env=cluster.env() if cluster else None)
        sids.append(server.proc.pid)
        if not server.wait_ready():
            row.add(ledger, Outcome(0, [], [], False, f"helix serve did not start; see {server.log}"), killed=False)
            return
        burst = Burst(server.url, key, ledger, rng).start()
        time.sleep(rng.uniform(2.0, 5.0))
        lost = time.monotonic()
        killed = kill_gcs(server) if cluster is None else f"head node ({cluster.kill_node(0)} processes)"
        try:
            code: int | None = server.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - lost
        burst.stop()
        said = last_line(server.log)
        left = left_running(sids)
        if cluster is not None:
            sids += cluster.node_pids
            cluster.stop()
            cluster = None
            left += left_running(sids[1:])
        print(f"    round: killed {killed}; helix serve exited {code} after {took:.1f} s; errors seen "
              f"{burst.errors}; 5xx bodies {burst.said}; said: {said[:160]}", file=sys.stderr, flush=True)
        server.stop()  # SIGKILL of whatever is left, a server that did not exit included
        reap(sids)
        # A new port: the lost server's connections to its own stay in TIME_WAIT for up to
        # a minute, past which the proxy of a Ray of one node does not bind.
        restarted = restart(store, log, spare_port())
        sids.append(restarted.proc.pid)
        try:
            outcome = (http_check(restarted.url, key, ledger) if restarted.wait_ready() else
                       Outcome(0, list(ledger.live), [], False, f"helix serve did not start again; see {restarted.log}"))
        finally:
            restarted.stop()
        left += left_running(sids[-1:])
        row.add(ledger, outcome, killed=bool(killed))
        row.exits.append((code, took))
        row.orphans += len(left)
        if code in (0, None) or not said.startswith(LOST_SAYS):
            row.opened = False
            row.notes.append(f"helix serve exited {code} after {took:.0f} s; its last line: {said[:200]}")
        row.notes += [f"left running: {t}" for t in left[:3]]
    finally:
        if cluster is not None:
            cluster.stop()
        reap(sids)


# ----------------------------------------------------------------------------- ingest-node


def cluster_ingest(store: Path, source: Path, log: Path, cluster: LocalCluster) -> subprocess.Popen:
    """``helix ingest SOURCE --store STORE --runner ray --json`` joined to ``cluster``, in a
    session of its own, its report written to ``log`` with ``.json`` after it and the
    rest appended to ``log`` (``embed_actor_restarts`` left to its default: 3 with
    RAY_ADDRESS)."""
    with open(log, "a") as err, open(f"{log}.json", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "ingest", str(source), "--store", str(store),
                                 "--runner", "ray", "--no-progress", "--json"], start_new_session=True,
                                env=cluster.env(PYTHONPATH=str(ROOT)), stdout=out, stderr=err)


def duplicates(log: Path) -> int:
    """The near-duplicates the last ingest's report (:func:`cluster_ingest`) says it
    removed: records of the input it acknowledged and did not keep."""
    text = Path(f"{log}.json").read_text(errors="replace")
    return int(json.loads(text[text.index("{"):])["duplicates"])


def kill_node_mid_batch(ingest: subprocess.Popen, cluster: LocalCluster, rng: random.Random) -> str:
    """Once an embedding actor on node 1 runs a batch, wait a random few seconds, then
    SIGKILL node 1; "" when none did before the ingest ended or the timeout."""
    deadline = time.monotonic() + INGEST_TIMEOUT_S
    while ingest.poll() is None and time.monotonic() < deadline:
        if any(title(p).startswith(WORKER_TITLE + ".submit") for p in session_processes(cluster.node_pids[1])):
            break
        time.sleep(0.2)
    else:
        return ""
    time.sleep(rng.uniform(0.0, 5.0))
    if ingest.poll() is not None:
        return ""
    return f"node 1 ({cluster.kill_node(1)} processes)"


def ingest_node_round(work: Path, r: int, records: int, row: RayRow, rng: random.Random) -> None:
    """One ``ingest-node`` round (see the module's docstring), added to ``row``."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from synthetic import write_jsonl

    from helix_ray.ingest.run import ingest
    from helix_ray.schema import parent_of
    from helix_ray.store.generation import Generation

    store = work / f"ingest-node-round{r}"
    previous, source, log = (work / f"ingest-node-round{r}-{name}" for name in ("previous.jsonl", "new.jsonl",
                                                                                  "log.txt"))
    shutil.rmtree(store, ignore_errors=True)
    log.unlink(missing_ok=True)
    write_jsonl(PREVIOUS_RECORDS, str(previous), seed=rng.randrange(10**6))
    write_jsonl(records, str(source), seed=rng.randrange(10**6))
    new_ids = [json.loads(line)["id"] for line in source.read_text().splitlines()]
    ingest([previous], store, runner="local", show_progress=False)
    before = current_generation_number(store)
    old_ids = sorted({parent_of(i) or i for i in Generation.open_current(store).memories.column("id").to_pylist()})
    sids: list[int] = []
    with LocalCluster(nodes=2, cpus=2, dashboard=False) as cluster:
        sids += cluster.node_pids
        running = cluster_ingest(store, source, log, cluster)
        sids.append(running.pid)
        killed = kill_node_mid_batch(running, cluster, rng)
        lost = time.monotonic()
        code = finish(running, INGEST_TIMEOUT_S)
        took = time.monotonic() - lost
        said = last_line(log)
        notes, unclear = [], False
        if code != 0:
            # Failed: the previous generation must still be current, and open.
            now = current_generation_number(store)
            try:
                Generation.open_current(store)
                opens = True
            except Exception as exc:  # noqa: BLE001 - said in the row
                opens, said = False, f"{said} (the current generation does not open: {exc})"
            if now != before or not opens:
                unclear = True
                notes.append(f"after the failed ingest generation {now} is current (was {before}), opens: {opens}")
            if not said.startswith("helix ingest:"):
                unclear = True
                notes.append(f"the failed ingest's last line is not a sentence of helix's: {said[:200]}")
            cluster.restart_node(1)
            again = cluster_ingest(store, source, log, cluster)
            sids.append(again.pid)
            second = finish(again, INGEST_TIMEOUT_S)
            notes.append(f"ingested again with node 1 back: exit {second}")
            if second != 0:
                unclear = True
                notes.append(f"the second ingest failed too; see {log}")
        print(f"    round {r}: killed {killed or 'nothing (no batch ran on node 1)'}; ingest exited {code} "
              f"after {took:.1f} s; said: {said[:160]}", file=sys.stderr, flush=True)
        left = left_running(sids[2:])  # the ingests' own sessions, before the cluster stops
    left += left_running(sids[:2])
    reap(sids)
    ids = old_ids + new_ids
    outcome = (generation_check(store, ids) if current_generation_number(store) != before else
               Outcome(len(old_ids), new_ids, [], False, "no new generation was published"))
    # A record near-duplicate removal dropped (synthetic data has a few) is not lost: a
    # run without a kill drops the same ones, and the report counts them.
    dropped = duplicates(log) if outcome.lost and current_generation_number(store) != before else 0
    if 0 < len(outcome.lost) <= dropped:
        notes.append(f"{len(outcome.lost)} near-duplicates removed, as the report says")
        ids, outcome.lost = [i for i in ids if i not in set(outcome.lost)], []
    outcome.opened = outcome.opened and not unclear
    row.notes += notes
    row.add_ingest(r, ids, outcome, killed=bool(killed))
    row.exits.append((code, took))
    row.orphans += len(left)
    row.notes += [f"left running: {t}" for t in left[:3]]


# ----------------------------------------------------------------------------- main


def drill_ray_head(work: Path, where: list[str], rounds: int, rng: random.Random, *, show: bool = True) -> list[RayRow]:
    rows = []
    for place in where:
        row = RayRow(f"ray-head@{place}")
        for _ in range(rounds):
            ray_head_round(work, place, row, rng)
        rows.append(row)
        if show:
            print_row(row)
    return rows


def drill_ingest_node(work: Path, rounds: int, rng: random.Random, *, records: int = 3000,
                      show: bool = True) -> RayRow:
    row = RayRow("ingest-node")
    for r in range(rounds):
        ingest_node_round(work, r, records, row, rng)
    if show:
        print_row(row)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="all", choices=("ray-head", "ingest-node", "all"))
    ap.add_argument("--where", default=",".join(WHERE),
                    help="ray-head: own (helix serve's own Ray), cluster (joined with RAY_ADDRESS), or both")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--records", type=int, default=3000, help="ingest-node: records of the ingest that loses a node")
    ap.add_argument("--work", default="/tmp/helix-cluster-drill")
    args = ap.parse_args(argv)
    where = args.where.split(",")
    if set(where) - set(WHERE):
        ap.error(f"unknown --where {sorted(set(where) - set(WHERE))}; choose from {', '.join(WHERE)}")
    rng = random.Random(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    rows: list[RayRow] = []
    if args.scenario in ("ray-head", "all"):
        rows += drill_ray_head(work, where, args.rounds, rng)
    if args.scenario in ("ingest-node", "all"):
        rows.append(drill_ingest_node(work, args.rounds, rng, records=args.records))
    bad = [r for r in rows if r.lost or r.resurrected or not r.opened or r.orphans]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
