"""``Memory.add`` killed (SIGKILL) at each step of a write and of the compaction that
folds it: nothing acknowledged is lost, no replaced text comes back, the store opens
without repair.

One round of ``scripts/drill_crash.py --scenario memory-add`` per kill point (a child
process each, so a few minutes in all): the child adds memories, a new text of the first
among them, and compacts after every second add; it kills itself at that step of its
fourth add (a write's step) or of the compaction after it; a fresh
:class:`helix_ray.Memory` then recalls every acknowledged memory by a word only its last
acknowledged text holds, finds no replaced text, and ``helix doctor``'s checks pass.

One round of ``--scenario ingest-worker``: an embedding actor of ``helix ingest --runner
ray`` SIGKILLed mid-batch, and the ingest still publishes every record once.

One round of each of ``scripts/drill_cluster.py``'s scenarios: ``helix serve`` losing its
Ray's GCS (its own Ray's ``gcs_server``, or a cluster's head node) exits non-zero saying
so, leaves no process behind and loses no acknowledged write; a worker node lost
mid-ingest on a two-node cluster, and every record is published once.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers import load_script


def _drill(name: str = "drill_crash"):
    return load_script(name)


@pytest.mark.slow
def test_memory_add_killed_at_each_write_and_compaction_step_loses_nothing(tmp_path):
    drill = _drill()
    rows = drill.drill_memory_add(tmp_path, list(drill.STEPS), 1, random.Random(0), kill_on=4, show=False)
    table = "\n".join(" | ".join(row.cells()) + "".join(f"\n  ! {n}" for n in row.notes) for row in rows)
    assert [row.kills for row in rows] == [1] * len(drill.STEPS), f"a kill point was not reached:\n{table}"
    assert all(row.acknowledged >= 2 for row in rows), table
    assert sum(len(row.lost) for row in rows) == 0, table
    assert sum(len(row.resurrected) for row in rows) == 0, table
    assert all(row.opened for row in rows), table


@pytest.mark.slow
@pytest.mark.ray
def test_ingest_with_an_embedding_actor_killed_mid_batch_completes_with_every_record_once(tmp_path):
    """Issue 32: a Ray worker lost mid-ingest. ``helix ingest --runner ray`` of 1,500
    synthetic records, one embedding actor SIGKILLed while it runs a batch: Ray Data
    restarts it and retries the batch, so the ingest exits 0 and its generation holds
    every input id once, each with a vector (with ``max_restarts=0`` the ingest exits
    non-zero and ``opened`` is False)."""
    drill = _drill()
    row = drill.drill_ingest_worker(tmp_path, 1, random.Random(0), records=1500, show=False)
    table = " | ".join(row.cells()) + "".join(f"\n  ! {n}" for n in row.notes)
    assert row.kills == 1, f"no embedding actor was caught running a batch:\n{table}"
    assert row.acknowledged == row.recovered == 1500, table
    assert not row.lost and not row.resurrected, table
    assert row.opened, table


def _table(rows) -> str:
    return "\n".join(" | ".join(row.cells()) + "".join(f"\n  ! {n}" for n in row.notes) for row in rows)


@pytest.mark.ray
@pytest.mark.parametrize("where", ["own", pytest.param("cluster", marks=pytest.mark.slow)])
def test_helix_serve_that_loses_its_rays_gcs_exits_saying_so_and_loses_nothing(tmp_path, where):
    """Issue 32: under a burst of writes, the GCS of the Ray `helix serve` started is
    SIGKILLed (``own``), or the head node of the two-node cluster it joined with
    RAY_ADDRESS (``cluster``). Ray alone lets the driver answer on for 60 s, then ends it
    (exit 1, a line of Ray's) and leaves the node's agents running: `helix serve` exits
    2 within seconds instead, with a sentence saying what to run, nothing of its session
    (or of the cluster's, once stopped) is left, and a restart on the same store
    recalls every acknowledged write."""
    drill = _drill("drill_cluster")
    (row,) = drill.drill_ray_head(tmp_path, [where], 1, random.Random(0), show=False)
    table = _table([row])
    assert row.kills == 1, table
    ((code, took),) = row.exits
    assert code == 2 and took < drill.EXIT_WITHIN_S, table
    assert row.acknowledged > 0 and row.recovered == row.acknowledged, table
    assert not row.lost and not row.resurrected and row.opened, table
    assert row.orphans == 0, table


@pytest.mark.slow
@pytest.mark.ray
def test_ingest_that_loses_a_worker_node_mid_embedding_publishes_every_record_once(tmp_path):
    """Issue 32: node 1 of a two-node cluster SIGKILLed while an embedding actor there
    runs a batch of `helix ingest --runner ray`: every record of the store's previous
    generation and of the ingest is published exactly once (or the ingest fails with a
    sentence, the previous generation current, and a second run completes), and no
    process of the ingest or the cluster is left."""
    drill = _drill("drill_cluster")
    row = drill.drill_ingest_node(tmp_path, 1, random.Random(0), records=1500, show=False)
    table = _table([row])
    assert row.kills == 1, f"no embedding actor ran a batch on node 1:\n{table}"
    assert row.acknowledged == row.recovered > drill.PREVIOUS_RECORDS + 1400, table  # less near-duplicates
    assert not row.lost and not row.resurrected and row.opened, table
    assert row.orphans == 0, table
