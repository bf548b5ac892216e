"""`helix serve` on a store nothing was ingested into: the application starts on an empty
first generation, a key created after the start works at once, and online writes fill
the store (the delta, then compaction). A real local Ray and the inline graph over HTTP
on 127.0.0.1; one application start for the module."""

from __future__ import annotations

import time

import pytest

from helix_ray.runtime import spare_port
from tests.helpers import ids, recall

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def new_server(tmp_path_factory):
    import ray
    from ray import serve

    from helix_ray.serve import server

    store = tmp_path_factory.mktemp("serve-new") / "does-not-exist-yet"
    started = not ray.is_initialized()
    server.start_ray(num_cpus=4)
    port = spare_port()
    server.run(store, port=port, compact_interval_s=3600, watch_interval_s=0.25, graph="inline", create=True)
    yield f"http://127.0.0.1:{port}", store
    serve.shutdown()
    if started:
        ray.shutdown()


def test_a_new_store_is_served_and_filled_online(new_server):
    from helix_ray.store.keys import KeyStore

    url, store = new_server
    with httpx.Client(base_url=url, timeout=60) as anonymous:
        health = anonymous.get("/healthz")
        assert health.status_code == 200 and health.json()["generation"] == 1, health.text
        refused = anonymous.post("/v1/recall", json={"query": "anything", "budget_tokens": 100})
        assert refused.status_code == 401, refused.text

    key = KeyStore(store).create("dana")[0]  # after the start: the ingress reads the key file per request
    admin = KeyStore(store).create("dana", admin=True)[0]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as dana:
        query = "why did we pin uvicorn?"
        empty = recall(dana, query)
        assert empty["items"] == [] and empty["generation"] == 1
        start = time.perf_counter()
        written = dana.post("/v1/memories", json={"id": "dana-uvicorn",
                                                  "text": "We pinned uvicorn to 0.30 after the keep-alive bug."})
        assert written.status_code == 201, written.text
        found = []
        while not found and time.perf_counter() - start < 1.0:
            found = ids(recall(dana, query))
        assert found == ["dana-uvicorn"], "a write into a new store was not recalled within 1 s"

        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=120) as ops:
            compacted = ops.post("/v1/admin/compact")
        assert compacted.status_code == 200, compacted.text
        assert compacted.json()["generation"] == 2 and compacted.json()["folded"] == 1
        deadline = time.monotonic() + 10
        answer = recall(dana, query)
        while answer["generation"] != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = recall(dana, query)
        assert [(i["id"], i["origin"]) for i in answer["items"]] == [("dana-uvicorn", "generation")]
