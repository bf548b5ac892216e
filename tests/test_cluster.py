"""Helix on a multi-node Ray made with ``ray start``, as on real hosts: two nodes of this
machine (:class:`helix_ray.local_cluster.LocalCluster`, with token auth), the batch
ingest on Ray Data, ``serve deploy configs/serve.yaml`` and ``helix serve`` joining with
``RAY_ADDRESS`` — each a separate process, as a user runs them. This process never joins
the cluster.

Helix's processes get ``RAY_ADDRESS`` and the cluster's token file but not
``RAY_AUTH_MODE``: Ray sends no token to an explicit address unless told, and Helix must
(``runtime.send_auth_token``). One cluster for the module, shared by its tests.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from helix_ray.runtime import spare_port
from tests.helpers import REPO, SAMPLE, ids, recall

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.ray

QUERY = "which message broker did we choose for the ingest queue, and why?"
BROKER = "atlas-0020"  # "We chose NATS JetStream over Kafka for the ingest queue..." (dana's)


@pytest.fixture(scope="module")
def cluster():
    from helix_ray.local_cluster import LocalCluster

    with LocalCluster(nodes=2, cpus=2) as running:
        yield running


def _probe(cluster, code: str) -> str:
    """The last line ``code`` prints, run by a separate driver that joins as Helix does."""
    probe = subprocess.run([sys.executable, "-c", "import ray\nfrom helix_ray.runtime import ensure_ray\n"
                            "ensure_ray()\n" + textwrap.dedent(code)],
                           env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return probe.stdout.strip().splitlines()[-1]


def _cluster_nodes(cluster) -> int:
    """Alive nodes."""
    return int(_probe(cluster, "print(sum(n['Alive'] for n in ray.nodes()))"))


def _placement(cluster) -> dict[str, list[int]]:
    """Per deployment, its replicas on the head and on the worker node
    (``serve.server.replicas_per_node``, asked by a driver that joins). Printed: which
    replicas a node loss takes varies from run to run."""
    placed = json.loads(_probe(cluster, "import json\nfrom helix_ray.serve.server import replicas_per_node\n"
                                        "print(json.dumps(replicas_per_node()))"))
    print("replicas per node (head, worker):", placed)
    return placed


def _serve_cli(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Ray's own `serve` CLI: unlike Helix's commands it sends the cluster's token only
    with RAY_AUTH_MODE=token (what docs/operations.md tells users to set)."""
    serve = str(Path(sys.executable).with_name("serve"))
    return subprocess.run([serve, *args, "-a", cluster.dashboard_url], env=cluster.env(RAY_AUTH_MODE="token"),
                          capture_output=True, text=True, timeout=timeout)


def _applications(cluster) -> dict:
    shown = _serve_cli(cluster, "status")
    assert shown.returncode == 0, shown.stderr[-2000:]
    return (yaml.safe_load(shown.stdout) or {}).get("applications") or {}


@pytest.fixture(scope="module")
def ingested(cluster, tmp_path_factory):
    """`helix ingest` of the sample's memories with RAY_ADDRESS (Ray Data on the
    cluster); dana's key."""
    from helix_ray.store.keys import KeyStore

    store = tmp_path_factory.mktemp("cluster-store") / "store"
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "ingest", str(SAMPLE / "memories.jsonl"),
                           "--store", str(store), "--no-progress"],
                          env=cluster.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    keys = KeyStore(store)
    return store, keys.create("dana")[0], keys.create("dana", admin=True)[0]


@pytest.fixture(scope="module")
def deployed(cluster, ingested, tmp_path_factory) -> int:
    """The shipped configs/serve.yaml, only the store's path and the port changed, sent
    with `serve deploy`; the port it answers on."""
    config = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    port = spare_port()
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"]["store"] = str(ingested[0])
    path = tmp_path_factory.mktemp("cluster-config") / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    sent = _serve_cli(cluster, "deploy", str(path))
    assert sent.returncode == 0, sent.stderr[-3000:]
    deadline, status = time.monotonic() + 240, {}
    while time.monotonic() < deadline:
        status = _applications(cluster).get("helix", {})
        if status.get("status") in ("RUNNING", "DEPLOY_FAILED"):
            break
        time.sleep(2)
    assert status.get("status") == "RUNNING", status
    assert set(status["deployments"]) == {"HelixAPI", "Embedder", "DenseANN", "BM25", "Ranker", "Writer"}
    return port


def test_the_batch_ingest_runs_on_the_cluster(cluster, ingested, tmp_path):
    """Ray Data on two nodes publishes the memories the one-process runner publishes
    (the sample's near-duplicates removed: 203 of 220)."""
    from helix_ray.store.generation import Generation
    from helix_ray.ingest.run import ingest

    assert _cluster_nodes(cluster) == 2
    generation = Generation.open_current(ingested[0])
    assert generation.number == 1
    alone = tmp_path / "alone"
    ingest([SAMPLE / "memories.jsonl"], alone, runner="local", show_progress=False)
    expected = Generation.open_current(alone).memories
    assert sorted(generation.memories.column("id").to_pylist()) == sorted(expected.column("id").to_pylist())
    assert len(expected) == 203


def test_the_knn_searches_run_on_both_nodes(cluster, tmp_path):
    """With HNSW indexes to search (tenants of 10 memories or more here; 20,000 by
    default), the ingest's kNN searches are given their rows' vectors and the index's
    bytes, and spread over the two nodes; the neighbours they find are the ones the
    one-process runner finds."""
    import numpy as np

    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest
    from helix_ray.store.generation import Generation

    config = tmp_path / "ingest.yaml"
    config.write_text("hnsw_min_rows: 10\n")
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "ingest", str(SAMPLE / "memories.jsonl"),
                           "--store", str(store), "--config", str(config), "--json"],
                          env=cluster.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    units = json.loads(done.stdout)["work_units"]
    print("HNSW units per node:", units)
    assert len(units) == 2, units
    alone = tmp_path / "alone"
    ingest([SAMPLE / "memories.jsonl"], alone, runner="local", config=IngestConfig(hnsw_min_rows=10),
           show_progress=False)
    spread, local = Generation.open_current(store), Generation.open_current(alone)
    assert [p for p in spread.manifest["partitions"] if p["dense"]]
    for x, y in zip(spread.knn, local.knn):
        np.testing.assert_array_equal(x, y)


def test_configs_serve_yaml_deploys_onto_the_cluster(cluster, ingested, deployed):
    """The split graph from the config file (its replicas wherever Serve placed them on the
    two nodes) recalls; a write through it is recalled; a compaction by the Writer
    publishes generation 2, and every replica the request crosses then serves from it."""
    url = f"http://127.0.0.1:{deployed}"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ingested[1]}"}, timeout=60) as dana, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ingested[2]}"}, timeout=120) as ops:
        assert BROKER in ids(recall(dana, QUERY))[:3]
        written = dana.post("/v1/memories", json={"id": "dana-cluster", "text": "The cluster drill moved to Fridays."})
        assert written.status_code == 201, written.text
        deadline, found = time.monotonic() + 10, []
        while "dana-cluster" not in found and time.monotonic() < deadline:
            found = ids(recall(dana, "when is the cluster drill?"))
            time.sleep(0.05)
        assert "dana-cluster" in found

        compacted = ops.post("/v1/admin/compact")
        assert compacted.status_code == 200, compacted.text
        assert compacted.json()["generation"] == 2 and compacted.json()["folded"] == 1
        deadline, answer = time.monotonic() + 20, recall(dana, "when is the cluster drill?")
        while answer["generation"] != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = recall(dana, "when is the cluster drill?")
        drill = next(i for i in answer["items"] if i["id"] == "dana-cluster")
        assert answer["generation"] == 2 and drill["origin"] == "generation"
        assert BROKER in ids(recall(dana, QUERY))[:3]


def test_a_lost_node_loses_no_acknowledged_write(cluster, ingested, deployed):
    """The worker node fails (SIGKILL of its raylet, agents and every replica on it; the
    GCS notices by its health checks): Serve starts the lost replicas again on the head,
    recall answers again, a write acknowledged before the loss is still pending in the
    Writer and recalled, and writes go on. Then the node rejoins, for the tests below."""
    url = f"http://127.0.0.1:{deployed}"
    query = "what is the node-loss drill word?"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ingested[1]}"}, timeout=120) as dana:
        pending = dana.get("/v1/stats").json()["pending_writes"]
        written = dana.post("/v1/memories", json={"id": "dana-node-loss", "text": "The node-loss drill word is "
                                                  "copper-finch."})
        assert written.status_code == 201, written.text
        placed = _placement(cluster)
        assert cluster.kill_node(1) >= 3  # ray start, its raylet, its agents (and the replicas placed there)
        # Until Serve has replaced what ran there, a request may wait (a stage with no
        # replica), be answered without a leg (flags.degraded) or fail; then it must not.
        lost = time.monotonic()
        deadline, answers = lost + 180, []
        while time.monotonic() < deadline:
            sent = time.monotonic()
            response = dana.post("/v1/recall", json={"query": query, "budget_tokens": 400, "k": 8})
            degraded = response.json()["flags"].get("degraded") if response.status_code == 200 else None
            # (seconds after the loss it was sent, seconds it took, status, what it was made without)
            answers.append((round(sent - lost, 2), round(time.monotonic() - sent, 2), response.status_code,
                            [flag.split(" (")[0] for flag in degraded or ()]))
            if response.status_code == 200 and not degraded:
                break
            time.sleep(0.5)
        print("placement before the loss:", placed, "answers after it:", answers)
        try:
            out = recall(dana, query)
            assert not out["flags"].get("degraded") and ids(out)[0] == "dana-node-loss", (answers, out["flags"])
            assert dana.post("/v1/memories", json={"id": "dana-node-loss-2", "text": "After the node loss the "
                                                   "word is silver-owl."}).status_code == 201
            assert dana.get("/v1/stats").json()["pending_writes"] == pending + 2, placed
            deadline = time.monotonic() + 60  # the GCS marks the node dead after its health checks fail
            while _cluster_nodes(cluster) != 1 and time.monotonic() < deadline:
                time.sleep(2)
            assert _cluster_nodes(cluster) == 1
        finally:
            cluster.restart_node(1)  # the tests below run on two nodes
    assert _cluster_nodes(cluster) == 2


def _read_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> tuple[str, queue.Queue]:
    """What ``proc`` printed up to the line starting with ``marker`` (or its exit, or the
    deadline), and the queue a thread keeps filling with the rest (None at the end), so
    the pipe never fills."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.startswith(marker):
            break
    return "".join(seen), lines


def _rest(lines: queue.Queue) -> str:
    out = []
    while (line := lines.get(timeout=30)) is not None:
        out.append(line)
    return "".join(out)


def test_helix_serve_joins_the_cluster_and_leaves_it_running(cluster, ingested, deployed):
    """`helix serve` with RAY_ADDRESS replaces the application of the same name, says
    where it answers (Serve keeps the HTTP port it was started with, not --port), and on
    SIGTERM removes its application: the cluster and its Serve stay up."""
    store, key, _ = ingested
    asked = spare_port()
    served = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(store),
                               "--port", str(asked)], env=cluster.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        printed, lines = _read_until(served, "Helix is serving", timeout_s=300)
        assert f"Helix is serving {store} on http://127.0.0.1:{deployed} (split graph" in printed, printed[-3000:]
        assert f"not on 127.0.0.1:{asked}" in printed
        with httpx.Client(base_url=f"http://127.0.0.1:{deployed}", headers={"Authorization": f"Bearer {key}"},
                          timeout=60) as dana:
            assert "dana-cluster" in ids(recall(dana, "when is the cluster drill?"))  # replayed by the new Writer
            assert BROKER in ids(recall(dana, QUERY))[:3]
    finally:
        served.send_signal(signal.SIGTERM)
        served.wait(timeout=120)
    rest = _rest(lines)
    assert served.returncode == 0, rest[-3000:]
    assert "stopping Helix" in rest

    assert _cluster_nodes(cluster) == 2
    assert _applications(cluster) == {}
    # Serve's proxy still answers, for no application: 404, not a refused connection.
    assert httpx.get(f"http://127.0.0.1:{deployed}/healthz", timeout=10).status_code == 404


def test_joining_with_the_wrong_token_says_what_to_check(cluster, tmp_path):
    """A token that is not the cluster's: a sentence naming RAY_ADDRESS and the token, no
    traceback (Ray itself retries for a while, then raises a bare ConnectionError)."""
    env = cluster.env(RAY_AUTH_TOKEN="0" * 64)  # takes precedence over the cluster's token file
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(tmp_path / "s")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"helix serve: Could not join the Ray cluster at RAY_ADDRESS='{cluster.address}'"), last
    assert "auth token found on this machine, which must be the cluster's own" in last
    assert "Traceback" not in done.stderr
