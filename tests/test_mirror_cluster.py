"""Serving a store from its mirror on a two-node ``ray start`` cluster whose worker node
does not see the store folder (the worker starts in a mount namespace with an empty
tmpfs over the folder holding the store: :class:`helix_ray.local_cluster.LocalCluster`
``hidden``). A local folder both nodes see stands in for object storage.

A separate driver joins the cluster and deploys the Writer on the head (the store's
node) and the compact graph's recall replica (Pipeline) on the worker, as ``helix serve
--mirror`` places them; the replica reads a cache of the mirror on its node. It answers
as recall in process over the store does, then a write made after it started once its
cache synced, then from the compaction's new generation.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO, SAMPLE

pytestmark = [pytest.mark.ray, pytest.mark.slow]

QUERY = "which message broker did we choose for the ingest queue, and why?"
ASKS_WRITTEN = "when does the ingest queue move to Redpanda?"
WRITTEN = {"id": "m960", "user": "dana", "created_at": "2025-03-05T10:00:00Z",
           "text": "We will move the ingest queue from NATS JetStream to Redpanda next quarter."}

DRIVER = textwrap.dedent('''
    import asyncio, json, os, sys, time
    import ray
    from ray import serve
    from helix_ray.config import RetrievalConfig
    from helix_ray.runtime import ensure_ray, spare_port
    from helix_ray.serve.app import store_node
    from helix_ray.serve.deployments import Pipeline, Writer
    from helix_ray.serve.server import replicas_per_node
    from helix_ray.serve.shells import PipelineShell
    from helix_ray.store.mirror import open_mirror, push

    store, uri, cache, query, asks = sys.argv[1:6]
    written = json.loads(sys.argv[6])
    config = RetrievalConfig()
    request = dict(user="dana", config=config, budget_tokens=400, k=8)
    out = {"in_process": [i["id"] for i in asyncio.run(PipelineShell(store).recall(query, **request))["items"]]}

    ensure_ray()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
    worker = next(n["NodeID"] for n in nodes if n["NodeID"] != head)
    on = lambda node: {"ray.io/node-id": node}

    @ray.remote(num_cpus=0.01)
    def sees(path):
        return os.path.exists(path)

    out["head_sees_store"] = ray.get(sees.options(label_selector=on(head)).remote(store))
    out["worker_sees_store"] = ray.get(sees.options(label_selector=on(worker)).remote(store))
    out["store_node_is_head"] = store_node(store) == head  # what `helix serve --mirror` pins the Writer to

    push(store, open_mirror(uri))  # what build_app does before any replica starts
    serve.start(http_options={"host": "127.0.0.1", "port": spare_port()})
    writer = serve.run(Writer.options(ray_actor_options={"num_cpus": 0.1, "label_selector": on(head)}).bind(
        store, None, mirror=uri), name="helix-writer", route_prefix=None)
    pipeline = serve.run(Pipeline.options(autoscaling_config=None, num_replicas=1, ray_actor_options={
        "num_cpus": 0.2, "label_selector": on(worker)}).bind(store, None, 0.2, mirror=uri, mirror_cache=cache),
        name="helix", route_prefix=None)
    out["placed"] = replicas_per_node("helix")

    def answer(text):
        got = pipeline.recall.remote(text, **request).result(timeout_s=120)
        return got["generation"], [(i["id"], i["origin"]) for i in got["items"]]

    def until(generation, wanted):
        """Seconds until the replica answers from ``generation`` with ``wanted``; None: 120 s passed."""
        started = time.monotonic()
        while time.monotonic() - started < 120:
            number, items = answer(asks)
            if number == generation and wanted in items:
                return round(time.monotonic() - started, 2)
            time.sleep(0.2)
        return None

    out["served"] = [i for i, _ in answer(query)[1]]
    writer.add.remote([written], None).result(timeout_s=120)
    out["write_after_s"] = until(1, (written["id"], "delta"))
    out["compacted"] = writer.compact.remote().result(timeout_s=300)["generation"]
    out["generation_after_s"] = until(2, (written["id"], "generation"))
    serve.shutdown()
    print(json.dumps(out))
''')


def _unshare_allowed() -> str | None:
    """Why the worker cannot be given a mount namespace here, or None."""
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available ({exc})"
    return None if done.returncode == 0 else f"unshare --mount is not permitted here: {done.stderr.strip()}"


@contextlib.contextmanager
def _started(cluster):
    """``cluster`` started, a second time if a node's registration timed out the first
    (the GCS of a loaded 2-core host sometimes answers a joining node too late)."""
    try:
        cluster.start()
    except RuntimeError as exc:
        print(f"starting the cluster again: {str(exc).splitlines()[0]}")
        cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_replica_on_a_node_without_the_store_serves_it_from_the_mirror(tmp_path):
    reason = _unshare_allowed()
    if reason:
        pytest.skip(f"the worker node needs its own mount namespace to hide the store folder: {reason}")
    from helix_ray.ingest.run import ingest
    from helix_ray.local_cluster import LocalCluster

    hidden = tmp_path / "hidden"
    store = hidden / "store"
    ingest([SAMPLE / "memories.jsonl"], store, runner="local", show_progress=False)
    uri, cache = f"file://{tmp_path / 'mirror'}", tmp_path / "cache"
    with _started(LocalCluster(nodes=2, cpus=2, hidden=(hidden,))) as cluster:
        done = subprocess.run([sys.executable, "-c", DRIVER, str(store), uri, str(cache), QUERY, ASKS_WRITTEN,
                               json.dumps(WRITTEN)],
                              env=cluster.env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(out)
    assert (out["head_sees_store"], out["worker_sees_store"], out["store_node_is_head"]) == (True, False, True)
    assert out["placed"]["Pipeline"] == [0, 1]  # head, worker
    assert out["served"] and out["served"] == out["in_process"]
    assert out["write_after_s"] is not None and out["compacted"] == 2 and out["generation_after_s"] is not None
