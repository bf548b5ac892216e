"""Helix on a multi-node Ray made with ``ray start``, as on real hosts: two nodes of this
machine (:class:`helix_ray.local_cluster.LocalCluster`), the batch ingest on Ray Data,
``serve deploy configs/serve.yaml`` and ``helix serve`` joining with ``RAY_ADDRESS`` —
each a separate process, as a user runs them. This process never joins the cluster.

Nothing here sets ``RAY_AUTH_MODE``: a local cluster checks Ray's auth token since Ray
2.59, and Helix must send it on its own (``runtime.send_auth_token``). One cluster for
the module (~10 s to start); the tests run in file order and build on each other.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, SAMPLE
from tests.test_serve import _free_port, ids, recall

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.ray

QUERY = "which message broker did we choose for the ingest queue, and why?"
BROKER = "atlas-0020"  # "We chose NATS JetStream over Kafka for the ingest queue..." (dana's)


@pytest.fixture(scope="module")
def cluster():
    from helix_ray.local_cluster import LocalCluster

    with LocalCluster(nodes=2, cpus=2) as running:
        yield running


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """What the tests pass on: the store, dana's key, the port Serve answers on."""
    return {"store": tmp_path_factory.mktemp("cluster-store") / "store"}


def _env(cluster) -> dict[str, str]:
    env = cluster.env()
    env.pop("RAY_AUTH_MODE", None)
    return env


def _cluster_nodes(cluster) -> int:
    """Alive nodes, asked by a separate driver."""
    probe = subprocess.run([sys.executable, "-c", "import ray\nfrom helix_ray.runtime import ensure_ray\nensure_ray()\n"
                            "print(sum(n['Alive'] for n in ray.nodes()))"],
                           env=_env(cluster), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return int(probe.stdout.strip().splitlines()[-1])


def _serve_cli(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Ray's own `serve` CLI: unlike Helix's commands it sends the cluster's token only
    with RAY_AUTH_MODE=token (what docs/serve.md tells users to set)."""
    serve = str(Path(sys.executable).with_name("serve"))
    return subprocess.run([serve, *args, "-a", cluster.dashboard_url], env={**_env(cluster), "RAY_AUTH_MODE": "token"},
                          capture_output=True, text=True, timeout=timeout)


def test_the_batch_ingest_runs_on_the_cluster(cluster, shared, tmp_path):
    """`helix ingest` with RAY_ADDRESS: Ray Data on the two nodes, one generation published."""
    from helix_ray.serve.keys import KeyStore
    from helix_ray.store.generation import Generation

    assert _cluster_nodes(cluster) == 2
    store = shared["store"]
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "ingest", str(SAMPLE / "memories.jsonl"),
                           "--store", str(store), "--no-progress"],
                          env=_env(cluster), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    generation = Generation.open_current(store)
    assert generation.number == 1
    # The same memories as the one-process runner publishes (the sample's near-duplicates
    # removed: 203 of 220).
    from pipelines.ingest import ingest

    alone = tmp_path / "alone"
    ingest([SAMPLE / "memories.jsonl"], alone, runner="local", show_progress=False)
    expected = Generation.open_current(alone).memories
    assert sorted(generation.memories.column("id").to_pylist()) == sorted(expected.column("id").to_pylist())
    assert len(expected) == 203
    shared["key"] = KeyStore(store).create("dana")[0]


def test_configs_serve_yaml_deploys_onto_the_cluster(cluster, shared, tmp_path):
    """The shipped config with only the store's path and the port changed: `serve deploy`
    runs the split graph on the cluster; it recalls, and a write through it is recalled."""
    config = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    port = _free_port()
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"]["store"] = str(shared["store"])
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))

    deployed = _serve_cli(cluster, "deploy", str(path))
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    deadline, status = time.monotonic() + 240, {}
    while time.monotonic() < deadline:
        shown = _serve_cli(cluster, "status")
        status = (yaml.safe_load(shown.stdout) or {}).get("applications", {}).get("helix", {}) if shown.returncode == 0 else {}
        if status.get("status") in ("RUNNING", "DEPLOY_FAILED"):
            break
        time.sleep(2)
    assert status.get("status") == "RUNNING", status
    assert set(status["deployments"]) == {"HelixAPI", "Embedder", "DenseANN", "BM25", "Ranker", "Writer"}

    shared["port"] = port
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {shared['key']}"},
                      timeout=60) as dana:
        assert BROKER in ids(recall(dana, QUERY))[:3]
        written = dana.post("/v1/memories", json={"id": "dana-cluster", "text": "The cluster drill moved to Fridays."})
        assert written.status_code == 201, written.text
        deadline, found = time.monotonic() + 5, []
        while "dana-cluster" not in found and time.monotonic() < deadline:
            found = ids(recall(dana, "when is the cluster drill?"))
        assert "dana-cluster" in found


def test_helix_serve_joins_the_cluster_and_leaves_it_running(cluster, shared):
    """`helix serve` with RAY_ADDRESS replaces the application, says where it answers
    (Serve keeps the HTTP port it was started with, not --port), and on SIGTERM removes
    only its application: the cluster and its Serve stay up."""
    asked = _free_port()
    served = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(shared["store"]),
                               "--port", str(asked)], env=_env(cluster), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert served.stdout is not None
        for line in served.stdout:
            lines.append(line)
            if line.startswith("Helix is serving") or served.poll() is not None:
                break
        printed = "".join(lines)
        assert f"Helix is serving {shared['store']} on http://127.0.0.1:{shared['port']} (split graph" in printed, printed[-3000:]
        assert f"not on 127.0.0.1:{asked}" in printed
        with httpx.Client(base_url=f"http://127.0.0.1:{shared['port']}",
                          headers={"Authorization": f"Bearer {shared['key']}"}, timeout=60) as dana:
            found = ids(recall(dana, "when is the cluster drill?"))
            assert "dana-cluster" in found  # the write the last test made, replayed by the new Writer
            assert BROKER in ids(recall(dana, QUERY))[:3]
    finally:
        served.send_signal(signal.SIGTERM)
        rest, _ = served.communicate(timeout=120)
    assert served.returncode == 0, "".join(lines)[-2000:] + rest[-3000:]
    assert "stopping Helix" in rest

    assert _cluster_nodes(cluster) == 2
    shown = _serve_cli(cluster, "status")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert not (yaml.safe_load(shown.stdout) or {}).get("applications"), shown.stdout
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{shared['port']}/healthz", timeout=5).raise_for_status()


def test_joining_with_the_wrong_token_says_what_to_check(cluster, tmp_path):
    """A token that is not the cluster's: a sentence naming RAY_ADDRESS and the token, no
    traceback (Ray itself retries for ~20 s, then raises a bare ConnectionError)."""
    env = _env(cluster)
    env["RAY_AUTH_TOKEN"] = "not-this-clusters-token-" + "0" * 40
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(tmp_path / "s")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"helix serve: Could not join the Ray cluster at RAY_ADDRESS='{cluster.address}'"), last
    assert "auth token" in last and "Traceback" not in done.stderr
