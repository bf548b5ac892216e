"""The stage shells (Embedder, BM25, DenseANN, Ranker, the one-replica pipeline) composed
in this process, no Ray: they answer as the in-process pipeline does, rank what the legs
send (a failed leg, a plan without a vector, a generation swapped mid-request), and the
query encoder sizes its threads to the cores it may use."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import STRONG_ERROR, STRONG_ID, local_recall


def test_query_encoder_widens_only_when_the_replica_is_alone(monkeypatch):
    """plan(alone=True) encodes with the two-thread encoder (built then), plan(alone=False)
    with the one-thread one; both give the same vector (the same model). When the plan
    encodes the query's tokens on the second core, the sentence encoder stays narrow."""
    from helix_ray.config import RetrievalConfig, load_config
    from helix_ray.runtime import usable_cores
    from helix_ray.serve.shells import EmbedderShell

    monkeypatch.delenv("HELIX_QUERY_THREADS_ALONE", raising=False)
    assert not EmbedderShell().widens  # the default: one encoder, however idle the host
    monkeypatch.setenv("HELIX_QUERY_THREADS", "1")
    monkeypatch.setenv("HELIX_QUERY_THREADS_ALONE", "2")
    shell = EmbedderShell()
    assert True not in shell._encoders  # the split graph never asks for it: never loaded there
    config = load_config(RetrievalConfig, overrides={"late": {"enabled": False}})  # a store without tokens
    query = "why did we pin uvicorn after the keep-alive bug"
    wide = shell.plan(query, user="alice", config=config, budget_tokens=300, alone=True)
    assert shell.recaller.embedder is shell._encoders[True] is not shell._encoders[False]
    narrow = shell.plan(query, user="alice", config=config, budget_tokens=300)
    assert shell.recaller.embedder is shell._encoders[False]
    np.testing.assert_allclose(wide.query_vector, narrow.query_vector, atol=1e-5)
    if usable_cores() > 1:
        with_tokens = shell.plan(query, user="alice", config=RetrievalConfig(), budget_tokens=300, alone=True,
                                 resolve=False)  # as the inline graph calls it
        assert shell.recaller.embedder is shell._encoders[False]
        assert with_tokens.pending_tokens is not None and with_tokens.tokens() is not None
        # The Embedder deployment's plans cross a hop: they carry their tokens, resolved here.
        sent = shell.plan(query, user="alice", config=RetrievalConfig(), budget_tokens=300)
        assert sent.pending_tokens is None and "embed_tokens" in sent.timings_ms
        # The same model on other threads: onnxruntime's sums may differ in the last
        # bit, a float16 step (6e-5 seen) in a few of the 2,048 values.
        np.testing.assert_allclose(sent.query_tokens, with_tokens.query_tokens, atol=1e-3)


def test_cpu_quota_is_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    """cgroup v2 and v1 layouts as the kernel writes them: a quota on a parent group
    binds a child without one; a group path from another namespace falls back to the
    mount's root; no quota anywhere is None."""
    from helix_ray.runtime import cgroup_cpu_quota

    def tree(name: str, files: dict[str, str], membership: str) -> tuple[Path, Path]:
        root = tmp_path / name
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        (tmp_path / f"{name}.cgroup").write_text(membership)
        return root, tmp_path / f"{name}.cgroup"

    v2 = tree("v2", {"a/cpu.max": "150000 100000\n", "a/b/cpu.max": "max 100000\n"}, "0::/a/b\n")
    assert cgroup_cpu_quota(*v2) == 1.5
    tighter = tree("v2t", {"a/cpu.max": "300000 100000\n", "a/b/cpu.max": "100000 100000\n"}, "0::/a/b\n")
    assert cgroup_cpu_quota(*tighter) == 1.0
    hidden = tree("ns", {"cpu.max": "50000 100000\n"}, "0::/docker/abc\n")
    assert cgroup_cpu_quota(*hidden) == 0.5
    hybrid = tree("hy", {"unified/g/cpu.max": "250000 100000\n", "memory/g/x": ""}, "4:memory:/g\n0::/g\n")
    assert cgroup_cpu_quota(*hybrid) == 2.5
    v1 = tree("v1", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                     "cpu,cpuacct/g/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/g/cpu.cfs_period_us": "100000\n"},
              "5:cpu,cpuacct:/g\n1:name=systemd:/\n")
    assert cgroup_cpu_quota(*v1) == 1.5
    unlimited = tree("none", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "3:cpu:/\n")
    assert cgroup_cpu_quota(*unlimited) is None
    assert cgroup_cpu_quota(tmp_path / "v2", tmp_path / "missing") is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and two cores")
def test_query_encoder_never_widens_past_the_cores_it_may_use(monkeypatch):
    """Pinned to one core (a container's cpuset, `taskset -c 0`), a second spinning
    encoder thread could only wait for the first: no wide encoder."""
    from helix_ray.runtime import usable_cores
    from helix_ray.serve.shells import EmbedderShell

    monkeypatch.setenv("HELIX_QUERY_THREADS", "1")
    monkeypatch.setenv("HELIX_QUERY_THREADS_ALONE", "2")
    cores = os.sched_getaffinity(0)
    assert EmbedderShell().widens
    os.sched_setaffinity(0, {min(cores)})
    try:
        assert usable_cores() == 1
        assert not EmbedderShell().widens
        monkeypatch.setenv("HELIX_QUERY_THREADS", "2")  # the busy-time encoder is capped too
        narrow = EmbedderShell()
        assert not narrow.widens and narrow.recaller._threads == 1
    finally:
        os.sched_setaffinity(0, cores)


def test_host_idle_sees_another_busy_process():
    """/proc/loadavg counts runnable threads: a process spinning on a core makes the
    host not idle for the second encoder thread."""
    import subprocess
    import sys

    from helix_ray.serve.shells import host_idle

    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        busy = [host_idle() for _ in range(200)]
    finally:
        spinner.kill()
        spinner.wait()
    assert sum(busy) < 20, f"host_idle() said idle {sum(busy)} times of 200 while another process spun"


def test_shells_compose_to_recall_and_serve_the_delta(shells):
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.store.generation import Generation

    query = "how do I rotate the API keys?"
    local = Recaller(Generation.open_current(shells["store"]), get_embedder())
    *_, out = local_recall(shells, query)
    assert [i["id"] for i in out["items"]] == [i.id for i in local.recall(query, user="alice", budget_tokens=400,
                                                                            k=8).items]
    shells["writer"].add([{"id": "alice-new", "text": "To rotate the API keys now run keyctl rotate --all."}],
                         "alice")
    *_, out = local_recall(shells, query)
    assert "alice-new" in [i["id"] for i in out["items"]]
    assert {i["origin"] for i in out["items"] if i["id"] == "alice-new"} == {"delta"}
    shells["writer"].delete("alice-new", "alice")
    *_, out = local_recall(shells, query)
    assert "alice-new" not in [i["id"] for i in out["items"]]


def test_the_compact_pipeline_shell_answers_like_the_split_graph(shells):
    """graph="compact" runs the same shells in one replica: same answers, delta included,
    and a lexically decisive query does not run the dense leg."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve.shells import PipelineShell

    pipeline = PipelineShell(shells["store"])
    for query in ("how do I rotate the API keys?", "which database did billing move to?"):
        *_, split = local_recall(shells, query)
        compact = asyncio.run(pipeline.recall(query, user="alice", config=RetrievalConfig(), budget_tokens=400, k=8))
        assert [i["id"] for i in compact["items"]] == [i["id"] for i in split["items"]]
    strong = asyncio.run(pipeline.recall(STRONG_ERROR, user="alice", config=RetrievalConfig(), budget_tokens=400, k=8))
    assert strong["items"][0]["id"] == STRONG_ID and "dense" not in strong["timings_ms"]
    shells["writer"].add([{"id": "alice-compact", "text": "To rotate the API keys now run keyctl rotate --all."}],
                         "alice")
    fresh = asyncio.run(pipeline.recall("how do I rotate the API keys?", user="alice", config=RetrievalConfig(),
                                        budget_tokens=400, k=8))
    assert "alice-compact" in [i["id"] for i in fresh["items"]]


def test_ranker_drops_a_delete_that_the_legs_missed(shells):
    """The legs ran before the delete; the Ranker, after it, must still not return it."""
    plan, lexical, dense, out = local_recall(shells, STRONG_ERROR)
    assert [i["id"] for i in out["items"]][0] == STRONG_ID
    shells["writer"].delete(STRONG_ID, "alice")
    after = asyncio.run(shells["ranker"].finish(plan, lexical, dense))
    assert STRONG_ID not in [i["id"] for i in after["items"]]


def test_ranker_flags_a_failed_leg_and_refuses_mixed_generations(shells):
    from dataclasses import replace

    from helix_ray.serve.errors import ReplicaError, kind_of, status_of

    plan, lexical, dense, _ = local_recall(shells, "how do I rotate the API keys?")
    out = asyncio.run(shells["ranker"].finish(plan, replace(lexical, hits=None, error="RuntimeError: boom"), dense))
    assert out["items"] and any("bm25 leg failed" in d for d in out["flags"]["degraded"])
    with pytest.raises(ReplicaError) as caught:  # the ingress answers it by re-running the legs
        asyncio.run(shells["ranker"].finish(plan, replace(lexical, generation=lexical.generation + 1), dense))
    assert kind_of(caught.value) == "StaleLegs" and status_of(caught.value) == 503


def test_a_plan_without_a_vector_is_ranked_on_bm25_alone(shells):
    """What the ingress sends while the Embedder is down: the Ranker ranks the BM25 leg
    (generation and delta) by its rank alone (no cosine)."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.recall.pipeline import Recaller

    shells["writer"].add([{"id": "alice-vectorless", "text": "The vectorless drill password is quartz-otter."}],
                         "alice")
    plan = Recaller(None, None).plan_without_vector("quartz-otter drill password", user="alice",
                                                    config=RetrievalConfig(), budget_tokens=400, k=8)
    lexical = asyncio.run(shells["bm25"].search(plan))
    out = asyncio.run(shells["ranker"].finish(plan, lexical, None))
    top = min(out["items"], key=lambda item: item["rank"])
    assert top["id"] == "alice-vectorless" and top["origin"] == "delta"
    assert "match" not in out["flags"]  # no query vector, no cosine: never called a weak match
    *_, full = local_recall(shells, STRONG_ERROR)  # a generation memory, found by its words
    plan = Recaller(None, None).plan_without_vector(STRONG_ERROR, user="alice", config=RetrievalConfig(),
                                                    budget_tokens=400, k=8, explain=True)
    out = asyncio.run(shells["ranker"].finish(plan, asyncio.run(shells["bm25"].search(plan)), None))
    top = min(out["items"], key=lambda item: item["rank"])
    assert top["id"] == full["items"][0]["id"] == STRONG_ID and len(out["items"]) > 1
    assert top["signals"]["similarity"] == 1.0  # the fused rank's best (with a cosine blend it would be less)


def test_a_swap_keeps_the_old_generation_for_requests_in_flight(shells):
    """After compaction publishes generation N+1, a request pinned to N (its legs ran
    there) is still finished on N; new requests move to N+1."""
    plan, lexical, dense, _ = local_recall(shells, "how do I rotate the API keys?")
    old = lexical.generation
    shells["writer"].add([{"id": "alice-swap", "text": "Rotating keys also needs the vault token refresh."}], "alice")
    report = shells["writer"].compact()
    assert report["published"] and report["generation"] == old + 1 and report["folded"] == 1
    ranker = shells["ranker"]
    assert asyncio.run(ranker.views.refresh()) and ranker.views.latest == old + 1
    finished = asyncio.run(ranker.finish(plan, lexical, dense))
    assert finished["generation"] == old and finished["items"]
    for leg in ("bm25", "dense"):
        asyncio.run(shells[leg].views.refresh())
    *_, fresh = local_recall(shells, "vault token refresh when rotating keys")
    assert fresh["generation"] == old + 1
    assert {i["origin"] for i in fresh["items"] if i["id"] == "alice-swap"} == {"generation"}


def test_a_replica_is_warm_before_it_answers(tenant_store, tmp_path):
    """Construction (what Serve waits for before a replica is healthy) loads both query
    encoders when the generation has passage tokens, and reads each role's files."""
    from helix_ray.recall.warm import ROLE_FILES, read_through
    from helix_ray.serve.shells import EmbedderShell
    from helix_ray.store.generation import Generation

    store, _ = tenant_store
    assert Generation.open_current(store).manifest.get("late"), "the tenant store has passage tokens"
    assert EmbedderShell(store=store).recaller._token_encoder is not None
    assert EmbedderShell().recaller._token_encoder is None  # no store: whether tokens are needed is unknown

    folder = Generation.open_current(store).path
    sizes = {role: read_through(folder, names) for role, names in ROLE_FILES.items()}
    assert sizes["bm25"] == sum(p.stat().st_size for p in (folder / "bm25").rglob("*") if p.is_file()) > 0
    assert 0 < sizes["dense"] < sizes["all"] and sizes["ranker"] < sizes["all"]
    everything = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert sizes["all"] < everything == read_through(folder)  # knn/ and mentions are the next ingest's


def test_read_through_leaves_no_buffer_on_the_heap(tmp_path):
    """Its read buffer is a mapping of its own, returned to the OS at the end: a 16 MiB
    block freed on the heap stays in the arena of the thread that read (a replica opens
    each new generation in an executor thread), so every swap left one there."""
    import tracemalloc

    from helix_ray.recall.warm import read_through

    (tmp_path / "rows.bin").write_bytes(b"x" * 3_000_000)
    tracemalloc.start()
    try:
        assert read_through(tmp_path) == 3_000_000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"read_through allocated {peak:,} bytes on the heap"


def test_dropping_a_generation_trims_the_heap_once(shells, monkeypatch):
    """A replica holds two generations: the swap that drops the oldest asks for one trim
    of the C heap (what that generation held goes back to the OS), the one before does not."""
    from helix_ray.live import views as views_mod

    trims: list[float] = []
    monkeypatch.setattr(views_mod, "trim_heap_later", lambda *a: trims.append(1.0))
    views = shells["ranker"].views
    first = views.latest
    for n in (1, 2):
        shells["writer"].add([{"id": f"alice-trim-{n}", "text": f"Trim drill number {n}."}], "alice")
        assert shells["writer"].compact()["published"]
        assert asyncio.run(views.refresh()) and views.latest == first + n
        assert len(trims) == n - 1, f"{len(trims)} trims after {n} swaps"
    assert list(views.generations) == [first + 1, first + 2]


def test_a_trim_runs_later_off_the_event_loop(monkeypatch):
    import threading

    from helix_ray import heap

    ran: list[str] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: ran.append(threading.current_thread().name))

    async def drop() -> str:
        heap.trim_heap_later(0.05)
        assert not ran  # not at once: requests in flight still hold the generation
        await asyncio.sleep(0.3)
        return threading.current_thread().name

    loop_thread = asyncio.run(drop())
    assert len(ran) == 1 and ran[0] != loop_thread


def test_trimming_the_heap_never_fails_without_glibc(monkeypatch):
    """macOS and musl have no ``malloc_trim``; Windows has no ``CDLL(None)``."""
    import ctypes

    from helix_ray import heap

    assert isinstance(heap.trim_heap(), bool)  # this host's libc, whatever it is
    def no_libc(*args, **kwargs):
        raise OSError("no C library")

    def windows(name, *args, **kwargs):
        raise TypeError(f"expected str, got {name!r}")

    for cdll in (lambda *a, **k: object(), no_libc, windows):  # musl/macOS: a libc without malloc_trim
        monkeypatch.setattr(ctypes, "CDLL", cdll)
        heap._malloc_trim.cache_clear()
        assert heap.trim_heap() is False
    heap._malloc_trim.cache_clear()
