"""The Serve layer: its pieces in one process, then the application on a real local Ray,
over HTTP on 127.0.0.1.

The first part (no Ray) checks the shells, the delta and the keys directly. The second
(marked ``ray``) starts one store (the four-tenant set of ``conftest.tenant_records``,
real model, real DuckDB) and one application per graph shape (split, inline) — starting
Ray and Serve costs ~30 s here — and its tests run in file order against each; each
writes memories with its own ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest

from tests.conftest import STRONG_ERROR, STRONG_ID, tenant_records

httpx = pytest.importorskip("httpx")
ray_test = pytest.mark.ray


def _free_port() -> int:
    """A port for a server that binds it after Ray has started (below the ephemeral range,
    where Ray's processes binding port 0 could take it first)."""
    from helix_ray.runtime import spare_port

    return spare_port()


@pytest.fixture(scope="module", params=["split", "inline"])
def served(request, tmp_path_factory):
    """(base URL, {user: key}, store) for the app serving a fresh tenant store, once per
    graph shape: the split graph (a deployment per stage) and the inline one (the ingress
    runs every stage); every HTTP test below runs against both."""
    import ray
    from ray import serve

    from helix_ray.serve import server
    from helix_ray.serve.keys import KeyStore
    from pipelines.ingest import ingest

    folder = tmp_path_factory.mktemp("serve")
    source = folder / "tenants.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()))
    store = folder / "store"
    report = ingest([source], store, runner="local", show_progress=False)
    assert report.published
    keys = {user: KeyStore(store).create(user)[0] for user in ("alice", "bob")}
    keys["ops"] = KeyStore(store).create("alice", admin=True)[0]  # settings and compaction
    started = not ray.is_initialized()
    server.start_ray(num_cpus=4)  # a new local Ray (address="local"), never someone else's cluster
    port = _free_port()
    server.run(store, port=port, compact_interval_s=3600, watch_interval_s=0.25, graph=request.param)
    yield f"http://127.0.0.1:{port}", keys, store
    serve.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def alice(served):
    url, keys, _ = served
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def ops(served):
    """An admin key (of user alice): may change the shared settings and compact."""
    url, keys, _ = served
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['ops']}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def bob(served):
    url, keys, _ = served
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=60) as client:
        yield client


def recall(client, query: str, **extra) -> dict:
    response = client.post("/v1/recall", json={"query": query, "budget_tokens": 400, "k": 8, **extra})
    assert response.status_code == 200, response.text
    from helix_ray.serve.api import RecallResponse

    # The ingress sends the pipeline's dict without FastAPI's response validation: every
    # answer is held to the documented schema here instead: its types, and no key the
    # schema does not name (the response model used to drop those silently).
    answer = response.json()
    assert RecallResponse.model_validate(answer, strict=True).model_dump(exclude_unset=True) == answer
    return answer


def ids(result: dict) -> list[str]:
    return [item["id"] for item in result["items"]]


# --------------------------------------------------------------------------- pieces, no Ray


@pytest.mark.parametrize("name, graph", [("serve", "split"), ("serve-inline", "inline")])
def test_shipped_serve_configs_name_only_their_graphs_deployments(name, graph, tenant_store):
    """Serve refuses a whole config whose `deployments` names one its graph lacks
    ("Deployment 'Embedder' does not exist"): each shipped config builds, with its own
    graph, into deployments that include every name it lists (no Ray needed to build)."""
    import yaml
    from ray.serve._private.build_app import build_app as serve_build

    from helix_ray.serve.app import ServeArgs, build_app
    from tests.helpers import REPO

    config = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    (app,) = config["applications"]
    args = ServeArgs(**{**app["args"], "store": str(tenant_store[0])})
    assert args.graph == graph and config["http_options"]["host"] == "127.0.0.1"
    built = {d.name for d in serve_build(build_app(args), name=app["name"]).deployments}
    listed = {d["name"] for d in app["deployments"]}
    assert listed <= built, f"{name}.yaml names {sorted(listed - built)}, not in the {graph} graph {sorted(built)}"
    assert {"HelixAPI", "Writer"} <= listed


def test_merge_dense_orders_by_cosine_and_keeps_top_k():
    from helix_ray.recall.dense import DenseHits
    from helix_ray.serve.delta import DELTA_BASE, merge_dense

    base = DenseHits(np.array([4, 9, 2]), np.array([0.9, 0.7, 0.5], np.float32), "binary")
    extra = DenseHits(np.array([DELTA_BASE + 1, DELTA_BASE + 3]), np.array([0.8, 0.1], np.float32), "delta")
    merged = merge_dense(base, extra, top_k=3)
    assert merged.rows.tolist() == [4, DELTA_BASE + 1, 9] and merged.first_pass == "binary+delta"
    assert merge_dense(base, None, top_k=3) is base


def test_merge_lexical_normalises_by_the_shared_ceiling():
    """Hand-computed: base raw [6, 3], delta raw [4.5]; ceiling over both 8 → normalised
    [.75, .5625, .375]; the strong signal (≥ .85) no longer holds."""
    from helix_ray.recall.lexical import LexicalHits
    from helix_ray.serve.delta import DELTA_BASE, DeltaLexical, merge_lexical

    base = LexicalHits(np.array([7, 1]), np.array([6.0, 3.0], np.float32), np.array([1.0, 0.5], np.float32), True)
    extra = DeltaLexical(np.array([DELTA_BASE + 5]), np.array([4.5], np.float32), ceiling=8.0)
    merged = merge_lexical(base, extra, top_k=10, strong_score=0.85, strong_gap=0.15)
    assert merged.rows.tolist() == [7, DELTA_BASE + 5, 1]
    np.testing.assert_allclose(merged.normalised, [0.75, 0.5625, 0.375])
    assert merged.strong_signal is False
    assert merge_lexical(base, None, top_k=10, strong_score=0.85, strong_gap=0.15) is base


def test_a_recall_answer_that_is_not_plain_json_is_still_sent():
    """A NaN score or a numpy scalar would make JSONResponse raise (a 500): the answer goes
    through the response model instead, NaN written as null."""
    from helix_ray.serve.responses import recall_response

    item = {"id": "a", "text": "t", "type": "fact", "rank": 1, "score": float("nan"), "n_tokens": 3,
            "truncated": False, "created_at": "2026-01-01T00:00:00+00:00", "session_id": None, "project": None,
            "signals": {"similarity": float("nan")}, "origin": "generation"}
    out = {"query": "q", "user": "u", "items": [item], "total_tokens": 3, "budget_tokens": 5, "timings_ms": {},
           "flags": {}, "generation": np.int64(3), "delta_version": 0}
    sent = json.loads(recall_response(out).body)
    assert sent["items"][0]["score"] is None and sent["items"][0]["signals"] == {"similarity": None}
    assert sent["generation"] == 3
    plain = json.loads(recall_response({**out, "items": [], "generation": 3}).body)
    assert plain["generation"] == 3 and plain["items"] == []


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
        np.testing.assert_array_equal(sent.query_tokens, with_tokens.query_tokens)


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


def test_replica_errors_survive_pickling():
    """InvalidArgument cannot be rebuilt from its args; what leaves a replica can (a 422,
    not Ray's UnserializableException and a 500)."""
    import pickle

    from helix_ray.errors import InvalidArgument
    from helix_ray.serve.errors import ReplicaError, boundary, message_of, status_of

    @boundary
    def reject() -> None:
        raise InvalidArgument("k", 0, "it must be a whole number from 1 to 200")

    with pytest.raises(ReplicaError) as caught:
        reject()
    again = pickle.loads(pickle.dumps(caught.value))
    assert status_of(again) == 422 and message_of(again) == "Got k=0; it must be a whole number from 1 to 200."


def test_keys_store_only_hashes_and_map_to_users(tmp_path):
    import stat

    from helix_ray.serve.errors import Unauthorized
    from helix_ray.serve.keys import KeyStore

    keys = KeyStore(tmp_path)
    key, record = keys.create("alice")
    assert keys.user_for(key) == "alice" and record.user == "alice"
    stored = (tmp_path / "keys.json").read_text()
    assert key not in stored and record.sha256 in stored
    assert stat.S_IMODE((tmp_path / "keys.json").stat().st_mode) == 0o600
    for wrong in (None, "", key + "x", key[:-1] + ("A" if key[-1] != "A" else "B")):
        with pytest.raises(Unauthorized):
            keys.user_for(wrong)
    assert not keys.record_for(key).admin
    admin_key, admin = keys.create("alice", admin=True)
    assert admin.admin and KeyStore(tmp_path).record_for(admin_key).admin
    keys.revoke(record.key_id)
    with pytest.raises(Unauthorized):
        KeyStore(tmp_path).user_for(key)
    assert KeyStore(tmp_path).user_for(admin_key) == "alice"  # revoking one key leaves the others


def test_without_keys_each_request_names_its_user(tmp_path):
    """--no-auth: no key is asked for, and the user must be in the request."""
    import types

    from helix_ray.errors import InvalidArgument
    from helix_ray.serve.app import HelixAPI
    from helix_ray.serve.errors import Forbidden
    from helix_ray.serve.keys import KeyStore

    cls = HelixAPI.func_or_class
    open_server = types.SimpleNamespace(keys=None)
    open_server.authenticate = lambda header: cls.authenticate(open_server, header)
    assert cls.user_for(open_server, None, "bob") == "bob"
    with pytest.raises(InvalidArgument, match="--no-auth"):
        cls.user_for(open_server, None, None)
    keyed = types.SimpleNamespace(keys=KeyStore(tmp_path))
    keyed.authenticate = lambda header: cls.authenticate(keyed, header)
    key, _ = keyed.keys.create("alice")
    assert cls.user_for(keyed, f"Bearer {key}", None) == "alice"
    assert cls.user_for(keyed, f"bearer {key}", "alice") == "alice"
    with pytest.raises(Forbidden):
        cls.user_for(keyed, f"Bearer {key}", "bob")


class _Call:
    """Stands in for a DeploymentResponse: started at once, awaitable more than once,
    cancellable; a call given other calls as arguments waits for them first, as Serve
    resolves a DeploymentResponse passed to another handle call. As in Serve, a wait on a
    call that is cancelled (say by a timeout) cancels the call: a later await of it raises
    CancelledError (Serve's ``asyncio.wrap_future`` over a call's routing future, Ray 2.60).
    A call answers ``delay`` seconds after its arguments did, the stage's delay as it is
    then (a test may shorten it for calls already out: a new replica answers them)."""

    def __init__(self, stage: "_Stage", args: tuple):
        async def run():
            # Serve resolves arguments in tasks of their own: cancelling this call does not cancel them.
            values = [await asyncio.shield(a.task) if isinstance(a, _Call) else a for a in args]
            sent = asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - sent < stage.delay:  # read again: a test may change it
                await asyncio.sleep(0.01)
            return stage.result(*values)

        self.task = asyncio.ensure_future(run())
        self.task.add_done_callback(lambda task: task.cancelled() or task.exception())  # Serve logs none unawaited
        self._cancel_called = False

    @property
    def cancelled(self) -> bool:
        return self._cancel_called or self.task.cancelled()

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self._cancel_called = True
        self.task.cancel()


class _Stage:
    """One method of a stand-in DeploymentHandle: answers after ``delay`` seconds (never,
    for ``float('inf')``), counting its calls."""

    def __init__(self, delay: float, result):
        self.delay, self.result, self.calls = delay, result, []

    def remote(self, *args, **kwargs):
        call = _Call(self, args[:3])
        self.calls.append(call)
        return call


def _split_ingress(plan_s=0.0, bm25_s=0.0, dense_s=0.0, rank_s=0.0, timeout_s=0.2):
    """The split graph's ingress logic over stand-in stages with the given delays."""
    import types

    from helix_ray.serve.app import HelixAPI, ServeArgs

    leg = types.SimpleNamespace(generation=1)
    from helix_ray.recall.pipeline import Recaller

    server = types.SimpleNamespace(args=ServeArgs(store="unused", graph="split", leg_timeout_s=timeout_s),
                                   _legs_missing=set(), _vectorless=Recaller(None, None), _probes={})
    for name in ("_recall_split", "_recall_late", "_recall_stepwise", "_recall_unplanned", "_finish_legs", "_stage",
                 "_bound", "_probe", "_probed"):
        setattr(server, name, types.MethodType(getattr(HelixAPI.func_or_class, name), server))
    server.embedder = types.SimpleNamespace(plan=_Stage(plan_s, lambda *a: types.SimpleNamespace(skip=False)))
    server.bm25 = types.SimpleNamespace(search=_Stage(bm25_s, lambda *a: leg))
    server.dense = types.SimpleNamespace(search=_Stage(dense_s, lambda *a: leg))
    server.ranker = types.SimpleNamespace(finish=_Stage(rank_s, lambda plan, lexical, dense: {
        "flags": {}, "legs": [lexical is not None, dense is not None], "plan": plan}))
    return server


async def _timed_recall(server) -> tuple[dict, float]:
    clock = time.perf_counter()
    out = await server._recall_split("q", "alice", None, {})
    return out, time.perf_counter() - clock


#: How late a timed step may finish on a loaded 2-core host (the event loop, the threads
#: of the fake stages): a 0.15 s slack failed once under .ci/run, 3.25 s for a 3 s bound.
#: Each assertion's alternative (the full bound, no bound) lies further out.
SLACK_S = 0.3


def _run(scenario):
    return asyncio.run(asyncio.wait_for(scenario, 30))  # a recall that waits for ever fails, not hangs


def _recall_split(server) -> tuple[dict, float]:
    return _run(_timed_recall(server))


def test_a_leg_that_never_answers_is_left_out_after_the_timeout():
    """A leg deployment with no live replica never answers (Serve's router holds the call):
    the answer comes after ``leg_timeout_s`` and a grace, ranked on the other leg, flagged;
    the held Ranker call is cancelled, the plan and the live leg are not sent again."""
    server = _split_ingress(dense_s=float("inf"))
    out, took = _recall_split(server)
    assert 0.2 <= took < 0.2 + 0.2 + SLACK_S
    assert out["legs"] == [True, False]
    assert out["flags"]["degraded"] == ["dense leg failed (no answer within 0.4 s); answered without it"]
    first, last = server.ranker.finish.calls
    assert first.cancelled and not last.cancelled
    assert [len(server.embedder.plan.calls), len(server.bm25.search.calls)] == [1, 1]


def test_while_a_leg_is_missing_recall_waits_less_for_it():
    """After a leg ran out of time, the next recalls give the graph 0.25 s, not the whole
    ``leg_timeout_s``, until the leg answers again; then the full bound is back."""
    server = _split_ingress(dense_s=float("inf"), timeout_s=2.0)
    out, took = _recall_split(server)
    assert took >= 2.0 and out["flags"]["degraded"] and server._legs_missing == {"dense"}
    out, took = _recall_split(server)
    assert took < 0.25 + 0.2 + SLACK_S
    assert out["flags"]["degraded"] == ["dense leg failed (no answer within 0.45 s); answered without it"]
    server.dense.search.delay = 0.0  # Serve has replaced the replica
    out, _ = _recall_split(server)
    assert not out["flags"].get("degraded") and server._legs_missing == set()
    server.dense.search.delay = 0.3  # slow, not gone: no longer cut short at 0.25 s
    out, took = _recall_split(server)
    assert took >= 0.3 and not out["flags"].get("degraded")


def test_without_an_embedder_bm25_answers_on_a_plan_made_without_a_vector():
    """An Embedder with no live replica never gives its plan: after twice the bound the
    held calls are cancelled and BM25 alone answers, on a plan the ingress made without a
    query vector (dense, late interaction and router off, similarity from the fused rank
    alone), flagged. The plan call is kept as a probe (one at a time); while the Embedder
    is missing the next recalls wait 0.25 s twice. When a new, slow Embedder answers the
    probe, recalls wait for plans in full again and are not flagged."""
    server = _split_ingress(plan_s=float("inf"), timeout_s=1.0)

    async def scenario():
        out, took = await _timed_recall(server)
        assert 2.0 <= took < 2.0 + SLACK_S
        assert out["legs"] == [True, False]
        assert out["flags"]["degraded"] == ["embedder failed (no answer within 2 s); answered by BM25 alone, "
                                            "without the query vector"]
        plan = out["plan"]
        assert {"dense", "late", "router"} <= plan.disabled and plan.weights["dense"] == 0
        assert plan.config.rank.similarity_blend == 0  # the fused rank alone: there is no cosine
        assert plan.weights["bm25"] > 0 and not plan.query_vector.any() and plan.query == "q" and plan.user == "alice"
        assert [call.cancelled for call in server.embedder.plan.calls] == [False]  # the probe
        assert [call.cancelled for call in server.dense.search.calls] == [True]
        assert [call.cancelled for call in server.bm25.search.calls] == [True, False]  # the held one, then a new one
        assert [call.cancelled for call in server.ranker.finish.calls] == [True, False]
        assert server._legs_missing == {"embedder"}

        out, took = await _timed_recall(server)
        assert 0.5 <= took < 0.5 + SLACK_S
        assert out["flags"]["degraded"][0].startswith("embedder failed (no answer within 0.5 s)")
        assert [call.cancelled for call in server.embedder.plan.calls] == [False, True]  # one probe at a time

        server.embedder.plan.delay = 1.5  # a new replica, slow: it answers the probe (sent 2.5 s ago) now
        await asyncio.sleep(0.05)
        assert server._legs_missing == set()
        out, took = await _timed_recall(server)  # 1 s bound, then 1 s for the plan: it comes at 1.5 s
        assert 1.5 <= took < 1.5 + SLACK_S
        assert out["legs"] == [True, True] and not out["flags"].get("degraded") and server._legs_missing == set()

    _run(scenario())


def test_without_an_embedder_or_bm25_recall_fails_fast_and_says_why():
    """A node holding both the Embedder and BM25 lost: nothing can search (DenseANN needs
    the vector). Each recall fails with a 503 sentence naming both, the first after three
    bounds, the next ones after three of 0.25 s, until a stage answers again — also one
    back but slower than the short bound (its kept call, the probe, answers)."""
    from helix_ray.errors import StoreError

    server = _split_ingress(plan_s=float("inf"), bm25_s=float("inf"), timeout_s=1.0)

    async def scenario():
        for expected_s in (3.0, 0.75):
            clock = time.perf_counter()
            with pytest.raises(StoreError) as caught:
                await server._recall_split("q", "alice", None, {})
            assert expected_s <= time.perf_counter() - clock < expected_s + SLACK_S
            assert str(caught.value).startswith("The store cannot be searched right now: the embedder failed (no "
                                                "answer within ")
            said = str(caught.value)
            assert "the bm25 leg (no answer within" in said and "Retry in a few seconds" in said
            assert server._legs_missing == {"embedder", "bm25"}
        # BM25 back but slower than the short bound, the Embedder not yet: the BM25 call
        # kept from the first recall (its probe) answers, and BM25 gets its full time again.
        server.bm25.search.delay = 0.3
        await asyncio.sleep(0.05)
        assert server._legs_missing == {"embedder"}
        out, took = await _timed_recall(server)
        assert out["legs"] == [True, False] and 0.5 + 0.3 <= took < 0.5 + 0.3 + SLACK_S

    _run(scenario())


def test_a_503_tells_the_client_when_to_retry():
    """Refusals for the store's state (503) carry Retry-After, as raised here or in another
    replica (wrapped by Ray); a caller's mistake does not."""
    from helix_ray.errors import InvalidArgument, StoreError
    from helix_ray.serve.responses import RETRY_AFTER_S
    from helix_ray.serve.responses import helix_error as _helix_error
    from helix_ray.serve.responses import unexpected as _unexpected
    from helix_ray.serve.errors import ReplicaError

    down = asyncio.run(_helix_error(None, StoreError("The store cannot be searched right now: ...")))
    assert down.status_code == 503 and down.headers["retry-after"] == str(RETRY_AFTER_S)
    wrapped = asyncio.run(_unexpected(None, ReplicaError("StaleLegs", "The legs searched different generations")))
    assert wrapped.status_code == 503 and wrapped.headers["retry-after"] == str(RETRY_AFTER_S)
    wrong = asyncio.run(_helix_error(None, InvalidArgument("k", 0, "it must be at least 1", "Ask for k ≥ 1.")))
    assert wrong.status_code == 422 and "retry-after" not in wrong.headers


def test_a_leg_back_but_slower_than_the_short_bound_is_waited_for_again():
    """The late call of a missing leg is kept running as its probe (one at a time): a new
    replica slower than the short bound (0.25 s and the grace) answers it, and the next
    recalls wait for the leg in full again instead of leaving it out for good."""
    server = _split_ingress(dense_s=float("inf"), timeout_s=1.0)

    async def scenario():
        await _timed_recall(server)
        assert server._legs_missing == {"dense"}
        assert [call.cancelled for call in server.dense.search.calls] == [False]  # the probe
        out, took = await _timed_recall(server)
        assert out["flags"]["degraded"] and took < 0.45 + SLACK_S
        assert [call.cancelled for call in server.dense.search.calls] == [False, True]  # one probe at a time
        server.dense.search.delay = 0.6
        await asyncio.sleep(0.05)
        assert server._legs_missing == set()
        out, took = await _timed_recall(server)
        assert out["legs"] == [True, True] and not out["flags"].get("degraded") and 0.6 <= took < 0.6 + SLACK_S

    _run(scenario())


def test_a_missing_leg_does_not_cut_a_slow_plan_short():
    """While a leg is missing the graph's bound is 0.25 s, but the plan still gets the full
    ``leg_timeout_s`` after it: a slow Embedder is not taken for gone because DenseANN is."""
    server = _split_ingress(dense_s=float("inf"), timeout_s=1.0)

    async def scenario():
        await _timed_recall(server)
        assert server._legs_missing == {"dense"}
        server.embedder.plan.delay = 0.6
        out, took = await _timed_recall(server)
        assert out["legs"] == [True, False] and 0.6 + 1.0 <= took < 0.6 + 1.0 + SLACK_S  # the legs' full time again
        assert out["flags"]["degraded"] == ["dense leg failed (no answer within 1.2 s); answered without it"]
        assert server._legs_missing == {"dense"}

    _run(scenario())


@pytest.mark.parametrize("after_s", [0.05, 0.3])
def test_a_recall_whose_client_went_away_cancels_its_calls(after_s):
    """The request's task cancelled (Serve does so when the client disconnects) while it
    waits for the graph (0.05 s) or, late, for the plan (0.3 s): the calls it holds are
    cancelled, none is left waiting."""
    server = _split_ingress(plan_s=float("inf"), timeout_s=0.2)

    async def scenario():
        recall = asyncio.ensure_future(server._recall_split("q", "alice", None, {}))
        await asyncio.sleep(after_s)
        recall.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recall
        await asyncio.sleep(0.02)

    _run(scenario())
    assert server.ranker.finish.calls[0].cancelled
    if after_s > 0.2:  # in _recall_late: every call of the graph
        held = [server.embedder.plan, server.bm25.search, server.dense.search]
        assert all(stage.calls[0].cancelled for stage in held)


def test_an_embedder_that_fails_is_answered_by_bm25_too():
    """An Embedder that raises (a server error, not the caller's) is not waited for again:
    the graph is sent once step by step, then BM25 answers on a plan made without a vector."""
    def broken(*args):
        raise RuntimeError("onnxruntime: out of memory")

    server = _split_ingress()
    server.embedder.plan.result = broken
    out, took = _recall_split(server)
    assert out["legs"] == [True, False] and took < SLACK_S
    assert out["flags"]["degraded"] == ["embedder failed (RuntimeError); answered by BM25 alone, "
                                        "without the query vector"]
    assert len(server.embedder.plan.calls) == 2 and server._legs_missing == set()


@pytest.mark.parametrize("slow", ["plan", "rank", "legs"])
def test_a_slow_but_live_graph_is_waited_for_not_degraded_or_sent_twice(slow):
    """Past ``leg_timeout_s`` because the plan, the Ranker or both legs are slow, not gone:
    the same calls are awaited to the end (a late plan gives the legs their full time
    again), nothing is cancelled or sent twice, and the answer is not flagged."""
    delays = {"plan": dict(plan_s=0.3), "rank": dict(rank_s=0.4), "legs": dict(bm25_s=0.25, dense_s=0.25)}[slow]
    server = _split_ingress(**delays)
    out, _ = _recall_split(server)
    assert out["legs"] == [True, True] and not out["flags"].get("degraded")
    for stage in (server.embedder.plan, server.bm25.search, server.dense.search, server.ranker.finish):
        assert len(stage.calls) == 1 and not stage.calls[0].cancelled


def test_recall_hits_reach_the_writer_without_another_recall(monkeypatch):
    """Hits buffered while a batch is on its way to the Writer, and a batch the Writer did
    not take, are sent in the next rounds of the same flush task: they used to wait for
    the next recall (and were lost if none came before the replica stopped)."""
    import types

    from helix_ray.serve import app as app_module

    flush = app_module.HelixAPI.func_or_class._flush_access
    # Serve's ingress decorator gives the class's methods a copy of the module's globals.
    monkeypatch.setitem(flush.__globals__, "ACCESS_FLUSH_S", 0.05)
    received: list[list[tuple]] = []
    attempts = []

    async def accessed(hits):
        attempts.append(list(hits))
        await asyncio.sleep(0.1)  # on its way: the next recall's hits arrive meanwhile
        if len(attempts) == 2:
            raise ConnectionError("Writer replica restarting")
        received.append(list(hits))
        return {"recorded": len(hits)}

    server = types.SimpleNamespace(_accessed=[], _access_flush=None,
                                   writer=types.SimpleNamespace(accessed=types.SimpleNamespace(remote=accessed)))
    for name in ("_note_access", "_flush_access"):
        setattr(server, name, types.MethodType(getattr(app_module.HelixAPI.func_or_class, name), server))

    async def scenario():
        server._note_access([{"id": "a"}, {"id": "b"}], "alice")
        await asyncio.sleep(0.08)  # the first batch is on its way
        server._note_access([{"id": "c"}], "alice")  # no task started: one is running
        await asyncio.wait_for(server._access_flush, 5)

    _run(scenario())
    assert [[h[0] for h in batch] for batch in attempts] == [["a", "b"], ["c"], ["c"]]
    assert [[h[0] for h in batch] for batch in received] == [["a", "b"], ["c"]] and server._accessed == []


def test_a_cancelled_request_does_not_cancel_the_generation_load_others_wait_for(tenant_store, tmp_path,
                                                                                  monkeypatch):
    """Two requests wait for a replica to open a new generation; one is cancelled (its
    client left, or the ingress gave up on a leg). The other still gets the generation,
    installed once, opened once: the cancellation used to cancel the shared load, failing
    every request of the swap that waited for it."""
    import json
    import shutil

    from helix_ray.serve.views import StoreViews

    store = tmp_path / "store"
    shutil.copytree(tenant_store[0], store)
    views = StoreViews(store, role="ranker")
    first = views.latest
    newer = store / "generations" / f"{first + 1:06d}"
    shutil.copytree(store / "generations" / f"{first:06d}", newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "generation": first + 1}))
    opened = []
    real_open = views._open

    def slow_open(number):
        opened.append(number)
        time.sleep(0.3)  # a large generation warming
        return real_open(number)

    monkeypatch.setattr(views, "_open", slow_open)

    async def scenario():
        cancelled = asyncio.ensure_future(views.generation(first + 1))
        waiting = asyncio.ensure_future(views.generation(first + 1))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        view = await waiting
        assert cancelled.cancelled()
        return view

    view = _run(scenario())
    assert view.number == first + 1 and views.generations[first + 1] is view and views.latest == first + 1
    assert opened == [first + 1] and not views._loading
    assert _run(views.generation(first + 1)) is view  # installed: no second open


@pytest.fixture()
def shells(tenant_store, tmp_path):
    """The five shells over a private copy of the tenant store, in this process."""
    import shutil

    from helix_ray.serve import shells as sh

    store = tmp_path / "store"
    shutil.copytree(tenant_store[0], store)
    writer = sh.WriterShell(store, compact_interval_s=3600)
    parts = {"embedder": sh.EmbedderShell(), "bm25": sh.BM25Shell(store), "dense": sh.DenseShell(store),
             "ranker": sh.RankerShell(store), "writer": writer, "store": store}
    yield parts
    writer._stop.set()
    writer.core.close()


from helix_ray.serve.delta import DELTA_BASE as DELTA_BASE_ROWS  # noqa: E402 - the delta's row ids start here


def _local_recall(parts, query: str, user: str = "alice", **config):
    from helix_ray.config import RetrievalConfig

    plan = parts["embedder"].plan(query, user=user, config=RetrievalConfig(**config), budget_tokens=400, k=8)
    lexical = asyncio.run(parts["bm25"].search(plan))
    dense = asyncio.run(parts["dense"].search(plan))
    return plan, lexical, dense, asyncio.run(parts["ranker"].finish(plan, lexical, dense))


def test_shells_compose_to_recall_and_serve_the_delta(shells):
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.store.generation import Generation

    query = "how do I rotate the API keys?"
    local = Recaller(Generation.open_current(shells["store"]), get_embedder())
    *_, out = _local_recall(shells, query)
    assert [i["id"] for i in out["items"]] == [i.id for i in local.recall(query, user="alice", budget_tokens=400,
                                                                            k=8).items]
    shells["writer"].add([{"id": "alice-new", "text": "To rotate the API keys now run keyctl rotate --all."}],
                         "alice")
    *_, out = _local_recall(shells, query)
    assert "alice-new" in [i["id"] for i in out["items"]]
    assert {i["origin"] for i in out["items"] if i["id"] == "alice-new"} == {"delta"}
    shells["writer"].delete("alice-new", "alice")
    *_, out = _local_recall(shells, query)
    assert "alice-new" not in [i["id"] for i in out["items"]]


def test_the_compact_pipeline_shell_answers_like_the_split_graph(shells):
    """graph="compact" runs the same shells in one replica: same answers, delta included,
    and a lexically decisive query does not run the dense leg."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve.shells import PipelineShell

    pipeline = PipelineShell(shells["store"])
    for query in ("how do I rotate the API keys?", "which database did billing move to?"):
        *_, split = _local_recall(shells, query)
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
    plan, lexical, dense, out = _local_recall(shells, STRONG_ERROR)
    assert [i["id"] for i in out["items"]][0] == STRONG_ID
    shells["writer"].delete(STRONG_ID, "alice")
    after = asyncio.run(shells["ranker"].finish(plan, lexical, dense))
    assert STRONG_ID not in [i["id"] for i in after["items"]]


def test_ranker_flags_a_failed_leg_and_refuses_mixed_generations(shells):
    from dataclasses import replace

    from helix_ray.serve.errors import ReplicaError, kind_of, status_of

    plan, lexical, dense, _ = _local_recall(shells, "how do I rotate the API keys?")
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
    *_, full = _local_recall(shells, STRONG_ERROR)  # a generation memory, found by its words
    plan = Recaller(None, None).plan_without_vector(STRONG_ERROR, user="alice", config=RetrievalConfig(),
                                                    budget_tokens=400, k=8, explain=True)
    out = asyncio.run(shells["ranker"].finish(plan, asyncio.run(shells["bm25"].search(plan)), None))
    top = min(out["items"], key=lambda item: item["rank"])
    assert top["id"] == full["items"][0]["id"] == STRONG_ID and len(out["items"]) > 1
    assert top["signals"]["similarity"] == 1.0  # the fused rank's best (with a cosine blend it would be less)


def test_writer_rebuilds_the_delta_from_its_log_after_a_restart(shells):
    from helix_ray.serve.writer import WriterCore

    writer = shells["writer"]
    writer.add([{"id": "alice-durable", "text": "The restart drill runs every second Thursday."}], "alice")
    writer.delete("alice-03", "alice")
    version = writer.core.version
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # what a restarted Writer replica does
    assert "alice-durable" in writer.core.entries and "alice-03" in writer.core.tombstones
    assert writer.core.version == version + 1
    *_, out = _local_recall(shells, "when does the restart drill run?")
    ids_ = [i["id"] for i in out["items"]]
    assert "alice-durable" in ids_ and "alice-03" not in ids_
    assert list((shells["store"] / "inbox").glob("*.jsonl"))  # the ingest-ready copy, fsynced


def test_a_delete_and_a_patch_survive_two_compactions_and_a_restart(shells):
    """A memory written and deleted between two compactions, and the text a PATCH
    replaced, stay gone after a restart: the log's older put of each used to outlive the
    row that replaced it (pruned once a generation held it), and the replay made it live
    again — and the next compaction published it."""
    from helix_ray.serve.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-okapi", "text": "The okapi vault password rotates on Fridays."}], "alice")
    writer.delete("alice-okapi", "alice")
    writer.add([{"id": "alice-heron", "text": "The heron queue drains at midnight."}], "alice")
    writer.patch("alice-heron", {"text": "The heron queue drains at noon."}, "alice")
    inbox = shells["store"] / "inbox"
    (inbox / "20260101T000000-deadbeef.jsonl").write_text("{}\n")  # as an ingest that failed leaves Memory.add's
    assert writer.compact()["published"]
    # A served write's copy was kept for ever (a file per write); now deleted once a
    # generation holds it. The compaction's input, and any other file, go to folded/.
    assert not list(inbox.glob("*.jsonl"))
    assert sorted(p.name[:8] for p in (inbox / "folded").glob("*.jsonl")) == ["20260101", "compact-"]
    writer.add([{"id": "alice-later", "text": "A later note, so that a second compaction has work."}], "alice")
    assert writer.compact()["published"]  # prunes the rows the first one folded
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # a restarted Writer replica
    assert "alice-okapi" not in writer.core.entries and "alice-heron" not in writer.core.entries
    for shell in ("bm25", "dense", "ranker"):
        asyncio.run(shells[shell].views.refresh())
    *_, out = _local_recall(shells, "okapi vault password")
    assert "alice-okapi" not in [i["id"] for i in out["items"]]
    *_, out = _local_recall(shells, "when does the heron queue drain?")
    heron = [i for i in out["items"] if i["id"] == "alice-heron"]
    assert heron and "noon" in heron[0]["text"], out["items"]
    writer.add([{"id": "alice-third", "text": "A third note, for a third generation."}], "alice")
    assert writer.compact()["published"]
    ids = set(Generation.open_current(shells["store"]).memories.column("id").to_pylist())
    assert "alice-okapi" not in ids and {"alice-heron", "alice-later", "alice-third"} <= ids


def test_compaction_takes_what_the_writes_computed_instead_of_embedding_again(shells):
    """A write is expanded, embedded and token-encoded when it is made (it is served from
    the delta at once); compaction used to do it all again (1,017 writes: 17.8 s). It
    now takes the writes' own outputs, also after a restart, and computes again only
    what another ingest config made."""
    from helix_ray.config import IngestConfig
    from helix_ray.serve.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    notes = {"alice-gecko": "The gecko cache warms up before the nightly batch.",
             "alice-newt": "Newt builds are pinned to the LTS toolchain."}
    writer.add([{"id": i, "text": t} for i, t in notes.items()], "alice")
    made = {i: writer.core.entries[i] for i in notes}
    out = writer.compact()
    assert out["published"] and out["folded"] == 2, out
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (2, 0), out["ingest"]
    gen = Generation.open_current(shells["store"])
    rows = {i: r for r, i in enumerate(gen.memories.column("id").to_pylist())}
    for memory_id, entry in made.items():
        row = rows[memory_id]
        np.testing.assert_array_equal(gen.vectors[row], entry["vector"])
        tokens = gen.late.tokens[gen.late.offsets[row]:gen.late.offsets[row + 1]]
        assert tokens.tobytes() == entry["late_codes"]
        assert gen.memories.column("n_tokens")[row].as_py() == entry["n_tokens"]
    *_, found = _local_recall(shells, "when does the gecko cache warm up?")
    assert found["items"][0]["id"] == "alice-gecko", found["items"]

    # After a restart the log row says which config computed it.
    writer.add([{"id": "alice-skink", "text": "Skink dashboards refresh every five minutes."}], "alice")
    writer.core.close()
    writer.core = WriterCore(shells["store"])
    out = writer.compact()
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (1, 0), out["ingest"]
    # Another config (fewer doc2query expansions) computes its own.
    writer.add([{"id": "alice-tuatara", "text": "Tuatara logs are kept for ninety days."}], "alice")
    writer.core.close()
    writer.core = WriterCore(shells["store"], ingest=IngestConfig(doc2query={"max_queries": 2}))
    out = writer.compact()
    assert (out["ingest"]["reused"], out["ingest"]["embedded"]) == (0, 1), out["ingest"]


def test_a_failed_compaction_leaves_no_input_behind_and_backs_off(shells, monkeypatch):
    """A compaction whose ingest fails (a full disk here) leaves no input file behind (it
    is a copy of serve_log's pending rows, which go on serving), and the background
    compactor waits longer after each failure — also with the pending writes past
    ``compact_max_pending``, where it used to try every second, writing one more copy of
    every pending write each time. Once the fault is gone, the next try folds them."""
    import pipelines.ingest as ingest_module
    from helix_ray.serve import shells as sh

    writer = shells["writer"]
    writer.add([{"id": "alice-wren", "text": "The wren backup job runs nightly at two."}], "alice")
    inbox = shells["store"] / "inbox"
    real = ingest_module.ingest
    tries: list[float] = []

    def full_disk(*args, **kwargs):
        tries.append(time.monotonic())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ingest_module, "ingest", full_disk)
    with pytest.raises(Exception, match="No space left"):
        writer.compact()
    assert not list(inbox.glob("compact-*.jsonl")) and writer.core.compactable() == 1
    *_, out = _local_recall(shells, "when does the wren backup job run?")
    assert "alice-wren" in [i["id"] for i in out["items"]]

    monkeypatch.setattr(sh, "COMPACT_TICK_S", 0.02)
    monkeypatch.setattr(sh, "COMPACT_RETRY_S", 0.1)
    tries.clear()
    writer.compact_max_pending = 1  # past it: the compactor's thread tries at its next tick
    deadline = time.monotonic() + 10
    while not tries and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2.0)
    gaps = np.diff(tries)
    # Waits of 0.2, 0.4, 0.8, 1.6 s: four or five tries in 2 s (every 20 ms before: ~100).
    assert 2 <= len(tries) <= 6 and (gaps >= 0.18).all() and gaps[-1] > gaps[0], tries
    assert not list(inbox.glob("compact-*.jsonl"))
    monkeypatch.setattr(ingest_module, "ingest", real)
    while writer.core.compactable() and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    writer.compact_max_pending = 2000
    assert writer.core.compactable() == 0 and writer.core.last_compaction["published"]


def test_served_files_of_compactions_that_publish_nothing_are_pruned(shells, monkeypatch):
    """A compaction that publishes nothing (every pending write is already in the
    generation as it is) moves the writes' inbox files to ``folded/``; those were kept
    for ever, each with the text of its memory. The newest KEEP_FOLDED stay, as for the
    compactions' inputs. And the count of writes compaction could not fold is of those
    still in the delta (it counted every one ever tried)."""
    from helix_ray.serve import compaction as writer_module

    monkeypatch.setattr(writer_module, "KEEP_FOLDED", 1)
    writer = shells["writer"]
    record = {"id": "alice-lark", "text": "The lark report goes out on Mondays."}
    writer.add([record], "alice")
    assert writer.compact()["published"]
    folded = shells["store"] / "inbox" / "folded"
    for _ in range(3):
        writer.add([record], "alice")  # the same memory again: nothing new to publish
        assert not writer.compact()["published"]
    assert len(list(folded.glob("serve-*.jsonl"))) == 1 and len(list(folded.glob("compact-*.jsonl"))) == 1
    # Each write replaced the one before: one entry is left that compaction could not fold.
    assert writer.stats()["delta"]["unfoldable"] == 1


def test_writes_go_on_while_a_compaction_runs_and_what_they_changed_stays(shells, monkeypatch):
    """The compaction's pipeline runs outside the writer's lock (it rebuilds every index:
    minutes at 10^5 memories, and every write used to wait). Paused mid-way here, the
    writer takes a write, a PATCH and a DELETE of memories it is folding, a DELETE of a
    generation memory and its stats; after it publishes, each of those still holds —
    through a second compaction and a restart."""
    import threading

    import pipelines.ingest as ingest_module
    from helix_ray.serve.delta_format import NOT_FOLDED
    from helix_ray.serve.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-kite", "text": "The kite service retries three times."},
                {"id": "alice-moth", "text": "The moth cache expires hourly."}], "alice")
    running, resume = threading.Event(), threading.Event()
    real = ingest_module.ingest

    def paused(*args, **kwargs):
        running.set()
        assert resume.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(ingest_module, "ingest", paused)
    outcome: dict = {}
    compaction = threading.Thread(target=lambda: outcome.update(writer.compact()))
    compaction.start()
    try:
        assert running.wait(60)
        clock = time.perf_counter()
        writer.add([{"id": "alice-wren", "text": "The wren queue was added during the compaction."}], "alice")
        writer.patch("alice-kite", {"text": "The kite service retries five times."}, "alice")
        writer.delete("alice-moth", "alice")
        writer.delete(STRONG_ID, "alice")  # a generation memory
        assert writer.core.stats()["delta"]["tombstones"] >= 2
        assert time.perf_counter() - clock < 30  # answered while the pipeline waits, not after it
        assert compaction.is_alive()
    finally:
        resume.set()
        compaction.join(120)
    monkeypatch.setattr(ingest_module, "ingest", real)
    assert outcome["published"], outcome
    core = writer.core
    assert core.entries["alice-wren"]["folded_into"] == NOT_FOLDED  # came after the snapshot: next time
    assert core.entries["alice-kite"]["folded_into"] == NOT_FOLDED and "five" in core.entries["alice-kite"]["text"]
    assert "alice-moth" in core.tombstones and "alice-moth" not in core.entries

    def check() -> None:
        for shell in ("bm25", "dense", "ranker"):
            asyncio.run(shells[shell].views.refresh())
        *_, out = _local_recall(shells, "how often does the kite service retry?")
        kite = [i for i in out["items"] if i["id"] == "alice-kite"]
        assert kite and "five" in kite[0]["text"], out["items"]
        *_, out = _local_recall(shells, "when does the moth cache expire?")
        assert "alice-moth" not in [i["id"] for i in out["items"]]
        *_, out = _local_recall(shells, STRONG_ERROR)
        assert STRONG_ID not in [i["id"] for i in out["items"]]
        *_, out = _local_recall(shells, "the wren queue")
        assert "alice-wren" in [i["id"] for i in out["items"]]

    check()
    assert writer.compact()["published"]
    writer.core.close()
    writer.core = WriterCore(shells["store"])
    check()
    ids = Generation.open_current(shells["store"]).memories.column("id").to_pylist()
    assert "alice-moth" not in ids and STRONG_ID not in ids and {"alice-wren", "alice-kite"} <= set(ids)


def test_a_delete_made_while_a_compaction_ran_holds_if_the_writer_stops_before_it_ends(shells, monkeypatch):
    """A DELETE answered while the pipeline ran, of a memory it was folding: the pipeline
    writes the row as live, and the writer marks it deleted again once the pipeline is
    done. If the Writer stops in between (here: the pipeline raises after its commit), the
    restart must mark it: the next compaction would carry the row over, past its
    tombstone, and serve the memory again."""
    import threading

    import pipelines.ingest as ingest_module
    from helix_ray.serve.writer import WriterCore
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.add([{"id": "alice-lynx", "text": "The lynx token leaked; rotate it."}], "alice")
    running, resume = threading.Event(), threading.Event()
    real = ingest_module.ingest

    def stops_after_its_commit(*args, **kwargs):
        running.set()
        assert resume.wait(60)
        real(*args, **kwargs)
        raise RuntimeError("the Writer stopped here")

    monkeypatch.setattr(ingest_module, "ingest", stops_after_its_commit)
    failed: list[BaseException] = []

    def compact() -> None:
        try:
            writer.core.compact()
        except RuntimeError as exc:
            failed.append(exc)

    compaction = threading.Thread(target=compact)
    compaction.start()
    assert running.wait(60)
    writer.delete("alice-lynx", "alice")
    resume.set()
    compaction.join(120)
    assert failed and "stopped here" in str(failed[0])
    monkeypatch.setattr(ingest_module, "ingest", real)
    writer.core.close()
    writer.core = WriterCore(shells["store"])  # the restart
    writer.add([{"id": "alice-next", "text": "Another note, so the next compaction has work."}], "alice")
    assert writer.compact()["published"]
    assert "alice-lynx" not in Generation.open_current(shells["store"]).memories.column("id").to_pylist()
    for shell in ("bm25", "dense", "ranker"):
        asyncio.run(shells[shell].views.refresh())
    *_, out = _local_recall(shells, "the lynx token leaked")
    assert "alice-lynx" not in [i["id"] for i in out["items"]]


def test_a_new_store_is_served_empty_filled_online_and_compacted(tmp_path):
    """A store nothing was ingested into starts with an empty generation (what
    ``build_app`` publishes): recall answers nothing, a write is recalled from the delta,
    compaction folds it into generation 2, and deleting the only memory compacts into an
    empty generation 3 (bm25s cannot index zero documents; the store writes an empty index)."""
    from helix_ray.serve import shells as sh
    from helix_ray.store.generation import Generation
    from pipelines.ingest import initialise

    store = tmp_path / "new-store"
    assert initialise(store) == 1 and initialise(store) == 1  # the second call finds it
    assert Generation.open_current(store).size == 0
    writer = sh.WriterShell(store, compact_interval_s=3600)
    try:
        parts = {"embedder": sh.EmbedderShell(), "bm25": sh.BM25Shell(store), "dense": sh.DenseShell(store),
                 "ranker": sh.RankerShell(store), "writer": writer}
        query = "why did we pin uvicorn?"
        *_, out = _local_recall(parts, query)
        assert out["items"] == [] and out["generation"] == 1
        writer.add([{"id": "alice-uvicorn", "text": "We pinned uvicorn to 0.30 after the keep-alive bug."}], "alice")
        *_, out = _local_recall(parts, query)
        assert [(i["id"], i["origin"]) for i in out["items"]] == [("alice-uvicorn", "delta")]
        assert not out["flags"]["degraded"]
        report = writer.compact()
        assert report["published"] and report["generation"] == 2 and report["folded"] == 1, report
        for shell in ("bm25", "dense", "ranker"):  # what each replica's CURRENT watcher does
            assert asyncio.run(parts[shell].views.refresh())
        *_, out = _local_recall(parts, query)
        assert [(i["id"], i["origin"]) for i in out["items"]] == [("alice-uvicorn", "generation")]
        assert out["generation"] == 2
        writer.delete("alice-uvicorn", "alice")
        report = writer.compact()
        assert report["published"] and report["generation"] == 3, report
        assert Generation.open_current(store).size == 0
        for shell in ("bm25", "dense", "ranker"):
            assert asyncio.run(parts[shell].views.refresh())
        *_, out = _local_recall(parts, query)
        assert out["items"] == [] and out["generation"] == 3
    finally:
        writer._stop.set()
        writer.core.close()


def test_build_app_starts_a_new_store_only_when_asked(tmp_path):
    """``create`` (what `helix serve` sets) starts a new or empty folder as a store; without
    it, or on a folder holding other files, build_app refuses and writes nothing."""
    from helix_ray.errors import StoreError
    from helix_ray.serve.app import ServeArgs, build_app

    new = tmp_path / "new"
    with pytest.raises(StoreError, match="helix ingest"):
        build_app(ServeArgs(store=str(new)))
    assert not new.exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("not a store")
    with pytest.raises(StoreError, match="no Helix store in it"):
        build_app(ServeArgs(store=str(other), create=True))
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
    build_app(ServeArgs(store=str(new), create=True))
    assert (new / "CURRENT").read_text().strip() == "1"


def test_initialise_refuses_a_store_whose_generations_are_missing(tmp_path):
    """A database that records memories, with the generation files gone: an empty
    generation would hide them (and pruning would delete what is left)."""
    import shutil

    from helix_ray.errors import StoreError
    from pipelines.ingest import ingest, initialise

    source = tmp_path / "two.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()[:2]))
    store = tmp_path / "store"
    assert ingest([source], store, runner="local", show_progress=False).published
    (store / "CURRENT").unlink()
    shutil.rmtree(store / "generations")
    with pytest.raises(StoreError, match="generation files are missing"):
        initialise(store)
    assert not (store / "CURRENT").exists()


def test_a_writer_says_at_start_when_its_first_compaction_would_encode_every_memorys_tokens(tmp_path, caplog):
    """A store built without token vectors, served with late interaction on (the
    default): the first compaction encodes every memory's tokens, minutes on a large
    store. The Writer says so at start, with the fix; served as built, it says nothing."""
    import logging

    from helix_ray.config import IngestConfig
    from helix_ray.serve.writer import WriterCore
    from pipelines.ingest import ingest

    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()[:12]))
    built = IngestConfig(late_interaction={"enabled": False})
    ingest([source], tmp_path / "store", config=built, runner="local", show_progress=False)
    for config, warned in ((built, False), (IngestConfig(), True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="helix_ray.serve.writer"):
            core = WriterCore(tmp_path / "store", ingest=config)
            core.close()
        said = [r.getMessage() for r in caplog.records if "token vectors" in r.getMessage()]
        assert bool(said) == warned, said
    assert "encode the tokens of all 12 memories" in said[0] and "late_interaction: {enabled: false}" in said[0]


def test_online_writes_carry_late_interaction_tokens_through_a_restart(shells):
    """A write is scored by MaxSim like a stored memory: its tokens are encoded by the
    Writer, logged durably, published in the delta snapshot and read by the Ranker."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.recall import late
    from helix_ray.serve.delta import DeltaSegment
    from helix_ray.serve.delta_format import current_delta_version
    from helix_ray.serve.writer import WriterCore
    from helix_ray.token_encoder import from_blobs, get_token_encoder, to_blobs

    text = "The staging Kafka cluster was renamed to heron-7 after the quota incident."
    query = "what is the staging Kafka cluster called now?"
    writer, store = shells["writer"], shells["store"]
    writer.add([{"id": "alice-heron", "text": text}], "alice")
    delta = DeltaSegment.load(store, current_delta_version(store))
    pos = list(delta.ids).index("alice-heron")
    encoder = get_token_encoder()
    q = encoder.encode_query(query)
    direct = late.maxsim(q, from_blobs(*to_blobs(encoder.encode_passages([text]))), np.array([0]))
    np.testing.assert_allclose(late.maxsim(q, delta.late, np.array([pos])), direct, atol=0.02)

    writer.core.close()
    writer.core = WriterCore(store)  # a restarted Writer replica replays its log, tokens included
    assert writer.core.entries["alice-heron"]["late_codes"] == delta.late_codes[pos]
    plan = shells["embedder"].plan(query, user="alice", config=RetrievalConfig(), budget_tokens=400, k=8,
                                   explain=True)
    lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
    out = asyncio.run(shells["ranker"].finish(plan, lexical, dense))
    row = next(r for r in out["explain"] if r["id"] == "alice-heron")
    assert row["late_maxsim"] == pytest.approx(float(direct[0]), abs=0.02)
    assert out["items"][0]["id"] == "alice-heron"


def _segment_files(store) -> dict[str, tuple[int, int]]:
    return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (store / "delta").glob("seg-*.arrow")}


def test_a_write_publishes_only_its_own_entries_and_replicas_parse_only_those(shells):
    """The delta is a manifest over immutable segment files: a write adds one file of its
    own entries and leaves every earlier file as it was; a replica parses only the new
    file and joins it with what it holds, to the same snapshot a fresh read gives."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from helix_ray.serve.delta import DeltaSegment
    from helix_ray.serve.delta_format import current_delta_version

    writer, store, views = shells["writer"], shells["store"], shells["bm25"].views
    texts = ["The canary fleet runs in eu-west-3.", "Billing exports land in the ledger bucket.",
             "Rotate the signing keys every ninety days."]
    reads = views.segments.reads
    before: dict[str, tuple[int, int]] = {}
    for n, text in enumerate(texts):
        writer.add([{"id": f"alice-seg{n}", "text": text}], "alice")
        files = _segment_files(store)
        new = sorted(set(files) - set(before))
        assert len(new) == 1, new
        assert {name: files[name] for name in before} == before  # nothing written earlier was rewritten
        with pa.memory_map(str(store / "delta" / new[0])) as source:
            assert ipc.open_file(source).read_all().column("id").to_pylist() == [f"alice-seg{n}"]
        before = files
        held = views.delta()
        assert views.segments.reads == reads + n + 1  # the new file only
        fresh = DeltaSegment.load(store, current_delta_version(store))
        assert held.version == fresh.version and list(held.ids) == list(fresh.ids) == [
            f"alice-seg{i}" for i in range(n + 1)]
        np.testing.assert_array_equal(held.vectors, fresh.vectors)
        assert held.late_codes == fresh.late_codes and held.lexical_texts == fresh.lexical_texts
    *_, out = _local_recall(shells, "where does the canary fleet run?")
    assert out["items"][0]["id"] == "alice-seg0" and out["items"][0]["origin"] == "delta"
    # BM25 over the joined segments' postings scores as one table of the same entries does.
    from helix_ray.recall import lexical
    from helix_ray.recall.scope import make_scope

    tables = []
    for name in held.segments:
        with pa.memory_map(str(store / "delta" / name)) as source:
            tables.append(ipc.open_file(source).read_all())
    whole = DeltaSegment.from_table(held.version, pa.concat_tables(tables), held.tombstones.values())
    base = views.generations[views.latest].generation.bm25
    for query in ("the canary fleet and the signing keys", "ledger bucket exports", "keys keys every"):
        scope = make_scope(query=query, user="alice", budget_tokens=400, k=8)
        a = held.lexical_search(query, scope, views.latest, base, top_k=10, span=None)
        b = whole.lexical_search(query, scope, views.latest, base, top_k=10, span=None)
        assert a is not None and b is not None and len(a.rows) >= 1
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)
        assert (a.ceiling, a.coverage) == pytest.approx((b.ceiling, b.coverage))
    assert isinstance(base, lexical.BM25Index)


def test_small_segments_merge_and_dead_entries_leave_the_files(shells, monkeypatch):
    """Small segments are merged once enough pile up; an entry replaced by a PATCH or
    deleted is dead in the manifest at once and gone from the files at the next rewrite;
    a store whose files hold more dead entries than live ones is rewritten whole."""
    from helix_ray.serve import writer as writer_module
    from helix_ray.serve.delta import DeltaSegment
    from helix_ray.serve.delta_format import current_delta_version

    monkeypatch.setattr(writer_module, "MERGE_SMALL_AT", 3)
    monkeypatch.setattr(writer_module, "SMALL_SEGMENT", 2)
    writer, store = shells["writer"], shells["store"]
    for n in range(3):
        writer.add([{"id": f"alice-m{n}", "text": f"Merge drill {n}: the on-call rota moves to team {n}."}], "alice")
    core = writer.core
    assert len(core.segments) == 1 and sorted(core.segments[0][1].tolist()) == sorted(
        core.entries[f"alice-m{n}"]["seq"] for n in range(3))
    # On disk: the files some kept snapshot lists (a lagging replica may still read one), no more.
    kept = [json.loads(f.read_text()) for f in (store / "delta").glob("*.json") if f.stem.isdigit()]
    assert len(kept) == 4 and set(_segment_files(store)) == {n for m in kept for n in m["segments"]}
    dead = {core.entries["alice-m0"]["seq"], core.entries["alice-m1"]["seq"]}
    writer.patch("alice-m0", {"text": "Merge drill 0: the on-call rota moved to the platform team."}, "alice")
    writer.delete("alice-m1", "alice")
    manifest = json.loads((store / "delta" / f"{current_delta_version(store):010d}.json").read_text())
    assert set(manifest["dead"]) == dead
    snapshot = DeltaSegment.load(store, current_delta_version(store))
    assert sorted(snapshot.ids.tolist()) == ["alice-m0", "alice-m2"] and "alice-m1" in snapshot.tombstones
    assert snapshot.texts[snapshot.ids.tolist().index("alice-m0")].endswith("the platform team.")
    # Two dead rows against two live ones: one more delete tips it, and the files are rewritten.
    writer.delete("alice-m2", "alice")
    assert len(core.segments) == 1 and core.segments[0][1].tolist() == [core.entries["alice-m0"]["seq"]]
    manifest = json.loads((store / "delta" / f"{current_delta_version(store):010d}.json").read_text())
    assert manifest["dead"] == [] and manifest["segments"] == [core.segments[0][0]]


def test_a_write_whose_publish_failed_is_in_the_next_snapshot(shells, monkeypatch):
    """A write is committed to DuckDB before its snapshot is published; when publishing
    fails (a full disk), the caller gets the error, and the next publish carries the
    write all the same: no later snapshot leaves a live entry out."""
    from helix_ray.serve import writer as writer_module
    from helix_ray.serve.delta import DeltaSegment
    from helix_ray.serve.delta_format import current_delta_version

    real, calls = writer_module.publish_manifest, []

    def full_disk_once(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "publish_manifest", full_disk_once)
    writer, store = shells["writer"], shells["store"]
    with pytest.raises(OSError):
        writer.add([{"id": "alice-unpublished", "text": "The disk filled up while this note was published."}],
                   "alice")
    writer.add([{"id": "alice-after", "text": "The next write published fine."}], "alice")
    snapshot = DeltaSegment.load(store, current_delta_version(store))
    assert sorted(snapshot.ids.tolist()) == ["alice-after", "alice-unpublished"] and len(calls) == 2
    *_, out = _local_recall(shells, "what happened when the disk filled up?")
    assert "alice-unpublished" in [i["id"] for i in out["items"]]


def test_a_format_1_delta_snapshot_is_still_read(shells):
    """A store written before segments (one whole table per snapshot) still serves."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from helix_ray.serve.delta import DeltaSegment
    from helix_ray.serve.delta_format import delta_dir

    writer, store = shells["writer"], shells["store"]
    writer.add([{"id": "alice-v1", "text": "The old snapshot format held every entry in one file."}], "alice")
    name = writer.core.segments[0][0]
    with pa.memory_map(str(delta_dir(store) / name)) as source:
        table = ipc.open_file(source).read_all()
    meta = {"format": "helix-delta", "format_version": 1, "version": 99, "tombstones": [["alice-03", "alice", None]]}
    table = table.replace_schema_metadata({"helix_delta": json.dumps(meta)})
    with pa.OSFile(str(delta_dir(store) / "0000000099.arrow"), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    old = DeltaSegment.load(store, 99)
    assert old.ids.tolist() == ["alice-v1"] and set(old.tombstones) == {"alice-03"}
    assert old.late.take(np.array([0])).tokens.shape[0] > 0


def test_the_delta_analyses_text_as_its_generation_does(shells):
    """BM25 over online writes uses the analyzer the generation's manifest records: a
    question in words meets a compound identifier before compaction, as after it."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.recall import lexical
    from helix_ray.store.generation import Generation

    recorded = Generation.open_current(shells["store"]).manifest["bm25"]
    assert lexical.Analyzer.from_dict(recorded).split_identifiers
    shells["writer"].add([{"id": "alice-ident", "text": "Call refreshVaultTokenCache() after rotating signing keys."}],
                         "alice")
    plan = shells["embedder"].plan("refresh the vault token cache", user="alice", config=RetrievalConfig(),
                                   budget_tokens=400, k=8, explain=True)
    hits = asyncio.run(shells["bm25"].search(plan))
    out = asyncio.run(shells["ranker"].finish(plan, hits, asyncio.run(shells["dense"].search(plan))))
    assert next(r for r in out["explain"] if r["id"] == "alice-ident")["bm25_rank"] == 1
    assert next(i for i in out["items"] if i["id"] == "alice-ident")["origin"] == "delta"


def test_writer_records_feedback_and_a_delete_takes_it_away(shells):
    from helix_ray.errors import InvalidArgument
    from helix_ray.serve.errors import NotFound

    writer = shells["writer"]
    assert writer.core.feedback("how do we rotate keys", ["alice-01", "alice-02"], user="alice") == {"recorded": 2}
    assert writer.core.db.feedback_pairs() == [
        {"user": "alice", "query": "how do we rotate keys", "memory_ids": ["alice-01", "alice-02"]}]
    assert writer.core.db.feedback_pairs(["bob"]) == []
    with pytest.raises(NotFound, match="no memories with those ids"):
        writer.core.feedback("q", ["alice-01"], user="bob")  # not bob's
    with pytest.raises(InvalidArgument, match="at most 100"):
        writer.core.feedback("q", [f"alice-{i}" for i in range(101)], user="alice")
    writer.core.delete("alice-01", user="alice")
    assert writer.core.db.feedback_pairs() == [
        {"user": "alice", "query": "how do we rotate keys", "memory_ids": ["alice-02"]}]


def test_a_swap_keeps_the_old_generation_for_requests_in_flight(shells):
    """After compaction publishes generation N+1, a request pinned to N (its legs ran
    there) is still finished on N; new requests move to N+1."""
    plan, lexical, dense, _ = _local_recall(shells, "how do I rotate the API keys?")
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
    *_, fresh = _local_recall(shells, "vault token refresh when rotating keys")
    assert fresh["generation"] == old + 1
    assert {i["origin"] for i in fresh["items"] if i["id"] == "alice-swap"} == {"generation"}


def test_a_patch_of_fields_only_is_folded_by_compaction(shells):
    """PATCH pinned/salience (text unchanged): compaction folds it into the generation
    without re-embedding, and the delta is left empty."""
    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    writer.patch("alice-00", {"pinned": True, "salience": 0.9}, "alice")
    report = writer.compact()
    assert report["published"] and (report["folded"], report["kept_in_delta"]) == (1, 0)
    assert (report["ingest"]["retagged"], report["ingest"]["embedded"]) == (1, 0)
    assert writer.core.compactable() == 0
    gen = Generation.open_current(shells["store"])
    row = gen.columns.id_to_row["alice-00"]
    assert gen.memories.column("pinned")[row].as_py() is True
    assert gen.memories.column("salience")[row].as_py() == pytest.approx(0.9)


def test_the_delta_strong_signal_weighs_the_query_terms_the_user_holds(shells):
    """A write only in the delta: the query naming it exactly is a strong signal; the same
    query with a word no memory holds is not (the delta merge uses the same coverage rule
    as the generation's BM25 leg)."""
    shells["writer"].add([{"id": "alice-zq", "text": "zqxv flux capacitor calibration"}], "alice")
    _, exact, _, _ = _local_recall(shells, "zqxv flux capacitor calibration")
    assert exact.hits.rows[0] >= DELTA_BASE_ROWS and exact.hits.strong_signal
    _, unknown, _, _ = _local_recall(shells, "zqxv flux capacitor calibration wombat")
    assert unknown.hits.rows[0] == exact.hits.rows[0] and not unknown.hits.strong_signal


def test_replicas_read_only_the_hits_appended_since_they_last_looked(tmp_path, monkeypatch):
    """Recall hits are appended a batch per line; a replica's AccessTail parses only the
    new complete lines (a line still being written waits), starts over when the Writer
    rewrote the file (a new file by rename), and agrees with a whole read throughout."""
    from helix_ray.serve import writer as writer_module
    from helix_ray.serve.access_log import AccessTail, accesses_path, read_accesses
    from pipelines.ingest import initialise

    store = tmp_path / "store"
    initialise(store)
    core = writer_module.WriterCore(store)
    try:
        tail = AccessTail(accesses_path(store))
        assert tail.read() == {}
        core.accessed([("a", "alice", 10), ("b", "alice", 20)])
        assert tail.read() == {"a": 10, "b": 20}
        offset = tail._offset
        core.accessed([("a", "alice", 30), ("b", "alice", 5)])  # b's older hit changes nothing
        assert accesses_path(store).stat().st_size > offset  # appended, not rewritten
        assert tail.read() == {"a": 30, "b": 20} == read_accesses(store)
        with open(accesses_path(store), "a") as fh:  # a line the Writer is still writing
            fh.write('{"c": 4')
        assert "c" not in tail.read()
        with open(accesses_path(store), "a") as fh:
            fh.write('0}\n')
        assert tail.read()["c"] == 40
        held = tail.read()
        monkeypatch.setattr(writer_module, "ACCESSES_REWRITE_BYTES", 1)  # the next batch rewrites the file
        core.accessed([("d", "alice", 50)])
        assert accesses_path(store).read_text().count("\n") == 1
        # The rewrite is the Writer's own record (c came from the hand-written lines above).
        assert tail.read() == {"a": 30, "b": 20, "d": 50} == read_accesses(store)
        assert held == {"a": 30, "b": 20, "c": 40}  # a request holding the dict of before still sees it whole
    finally:
        core.close()


def test_served_recency_moves_with_the_writers_recent_hits(shells):
    """The Writer publishes the hits not yet folded (delta/ACCESSES.jsonl); the Ranker
    reads them, so a memory just recalled ranks with fresh recency before compaction, and
    a Writer restarted on the same store publishes them again."""
    from helix_ray.config import RetrievalConfig
    from helix_ray.serve import shells as sh

    def recency_of(memory_id: str) -> float:
        plan = shells["embedder"].plan("deploy the gateway", user="alice", config=RetrievalConfig(),
                                       budget_tokens=2000, k=20, explain=True)
        lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
        explain = asyncio.run(shells["ranker"].finish(plan, lexical, dense))["explain"]
        return {row["id"]: row["recency"] for row in explain}[memory_id]

    plan = shells["embedder"].plan("deploy the gateway", user="alice", config=RetrievalConfig(), budget_tokens=2000,
                                   k=20, explain=True)
    lexical, dense = asyncio.run(shells["bm25"].search(plan)), asyncio.run(shells["dense"].search(plan))
    candidate = asyncio.run(shells["ranker"].finish(plan, lexical, dense))["explain"][-1]["id"]
    before = recency_of(candidate)
    shells["writer"].accessed([(candidate, "alice", int(time.time() * 1_000_000))])
    assert recency_of(candidate) > max(before, 0.99)
    # Bounded: past MAX_RECENT_ACCESSES ids, the newest stay (the log keeps every hit).
    from helix_ray.serve import writer as writer_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer_module, "MAX_RECENT_ACCESSES", 2)
        shells["writer"].accessed([("old-hit", "alice", 1), ("newer-hit", "alice", 2)])
    assert set(writer_module.read_accesses(shells["store"])) == {candidate, "newer-hit"}
    shells["writer"]._stop.set()
    shells["writer"].core.close()
    writer_module.accesses_path(shells["store"]).unlink()
    restarted = sh.WriterShell(shells["store"], compact_interval_s=3600)
    try:
        assert writer_module.read_accesses(shells["store"])[candidate] > 0
    finally:
        restarted._stop.set()
        restarted.core.close()


def test_a_write_compaction_drops_as_a_near_duplicate_leaves_the_delta(shells):
    """Two online writes, the later a near-copy of the earlier: compaction keeps the newer
    in the generation, and the older must not stay live in the delta beside it."""
    writer = shells["writer"]
    text = ("The nightly export job writes parquet files to the analytics bucket under exports slash "
            "year month day and keeps thirty days of history before deleting the oldest folder")
    writer.add([{"id": "w-old", "text": text}], "alice")
    writer.add([{"id": "w-new", "text": text + " automatically"}], "alice")
    report = writer.compact()
    assert report["published"] and report["ingest"]["duplicates"] == 1
    assert (report["folded"], report["kept_in_delta"]) == (2, 0) and writer.core.compactable() == 0
    for leg in ("bm25", "dense", "ranker"):  # what each replica's watcher does within a second
        assert asyncio.run(shells[leg].views.refresh())
    *_, out = _local_recall(shells, "nightly export job parquet analytics bucket")
    assert "w-new" in [i["id"] for i in out["items"]] and "w-old" not in [i["id"] for i in out["items"]]


def test_the_writer_records_accesses_after_any_read_of_its_database(shells):
    """DuckDB 2.0 refuses to register a table on a connection whose last result was left
    unfinished (``fetchone()`` leaves one): a user's GET /v1/stats, or a PATCH, then made
    every access-log flush fail until the next write."""
    writer = shells["writer"]
    assert writer.user_stats("alice")["user_memories"]["alice"] > 0
    assert writer.accessed([("alice-00", "alice", 1_750_000_000_000_000)]) == {"recorded": 1}
    writer.patch("alice-01", {"salience": 0.9}, "alice")  # reads the record from the database first
    assert writer.accessed([("alice-01", "alice", 1_750_000_000_000_001)]) == {"recorded": 1}
    assert writer.core.db.row("SELECT count(*) FROM access_log WHERE id IN ('alice-00', 'alice-01')") == (2,)


def test_server_recall_hits_reach_the_access_log_and_the_next_generation(shells):
    """What the ingress sends after each answer: the Writer logs it, and compaction
    folds it into last_accessed_at / access_count (recency's input), once."""
    import datetime as dt

    from helix_ray.store.generation import Generation

    writer = shells["writer"]
    first = Generation.open_current(shells["store"])
    base = first.memories.to_pylist()[first.columns.id_to_row["alice-00"]]["access_count"]
    when = dt.datetime(2025, 6, 1, 12, tzinfo=dt.timezone.utc)
    micros = int(when.timestamp() * 1_000_000)
    assert writer.accessed([("alice-00", "alice", micros), ("alice-00", "alice", micros - 10)]) == {"recorded": 2}
    assert writer.stats()["db"]["accesses"] == 2
    writer.patch("alice-01", {"salience": 0.8}, "alice")  # something to compact
    assert writer.compact()["published"]
    gen = Generation.open_current(shells["store"])
    row = gen.memories.to_pylist()[gen.columns.id_to_row["alice-00"]]
    assert row["access_count"] == base + 2 and row["last_accessed_at"] == when
    writer.patch("alice-01", {"salience": 0.7}, "alice")
    assert writer.compact()["published"]
    gen = Generation.open_current(shells["store"])
    assert gen.memories.to_pylist()[gen.columns.id_to_row["alice-00"]]["access_count"] == base + 2  # not twice


# --------------------------------------------------------------------------- read path


@ray_test
def test_health_and_openapi(served):
    url, _, _ = served
    health = httpx.get(url + "/healthz").json()
    assert health["status"] == "ok" and health["generation"] >= 1
    spec = httpx.get(url + "/openapi.json").json()
    for path in ("/v1/recall", "/v1/memories", "/v1/memories/{memory_id}", "/v1/settings", "/v1/stats", "/healthz"):
        assert path in spec["paths"], path
    assert spec["components"]["schemas"]["RecallRequest"]["additionalProperties"] is False


@ray_test
def test_recall_answers_like_the_in_process_pipeline(served, alice):
    """The graph of deployments is a distribution of Recaller.recall, not a variant.
    (The in-process side reads the generation only: the server's Writer holds DuckDB.)"""
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller
    from helix_ray.store.generation import Generation

    _, _, store = served
    queries = ["why did we move the billing database to Postgres?", "how do I rotate the API keys?", STRONG_ERROR]
    local = Recaller(Generation.open_current(store), get_embedder())
    expected = [[i.id for i in local.recall(q, user="alice", budget_tokens=400, k=8).items] for q in queries]
    got = [ids(recall(alice, q)) for q in queries]
    assert got == expected


@ray_test
def test_recall_returns_order_tokens_timings_and_flags(alice, request):
    result = recall(alice, STRONG_ERROR, explain=True)
    assert result["user"] == "alice" and ids(result)[0] == STRONG_ID
    assert result["flags"]["strong_signal_skip"] is True
    assert 0 < result["total_tokens"] <= result["budget_tokens"] == 400
    for stage in ("embed", "route", "bm25", "fuse", "rank", "pack", "total", "call_graph", "ingress"):
        assert stage in result["timings_ms"], stage
    # The split graph runs both legs at once; the inline one, like Recaller.recall, does
    # not start the dense leg once BM25 is decisive.
    graph = request.node.callspec.params["served"]
    assert ("dense" in result["timings_ms"]) == (graph == "split"), (graph, result["timings_ms"])
    assert result["explain"] and {"id", "score", "dropped_by"} <= set(result["explain"][0])
    assert all(item["origin"] == "generation" for item in result["items"])


# --------------------------------------------------------------------------- tenants


@ray_test
def test_two_users_never_cross(alice, bob):
    shared = "How are the database migrations run before the gateway pods roll?"
    assert all(i.startswith("alice") for i in ids(recall(alice, shared)))
    assert all(i.startswith("bob") for i in ids(recall(bob, shared)))
    secret = "The bob-only vault passphrase hint is purple giraffe umbrella."
    written = bob.post("/v1/memories", json={"text": secret, "id": "bob-secret"})
    assert written.status_code == 201, written.text
    assert "bob-secret" in ids(recall(bob, "purple giraffe umbrella passphrase"))
    assert "bob-secret" not in ids(recall(alice, "purple giraffe umbrella passphrase"))
    # A key reads and writes only its own user's memories.
    other = alice.post("/v1/recall", json={"query": "anything", "budget_tokens": 100, "user": "bob"})
    assert other.status_code == 403 and "belongs to user 'alice'" in other.json()["detail"]
    assert alice.post("/v1/memories", json={"text": "x", "user": "bob"}).status_code == 403
    assert alice.delete("/v1/memories/bob-secret").status_code == 404
    assert alice.patch("/v1/memories/bob-secret", json={"text": "mine now"}).status_code == 404
    taken = alice.post("/v1/memories", json={"text": "an id collision", "id": "bob-secret"})
    assert taken.status_code == 409 and "another user" in taken.json()["detail"]
    # An id of the derived shape must be the memory's own: neither a 409 telling alice
    # that bob holds exactly some text, nor a way to take the id bob's write of it gets.
    from helix_ray.schema import content_hash

    held = "The bob-only standup moved to 9:40."
    assert bob.post("/v1/memories", json={"text": held}).json()["ids"] == [content_hash(held, "bob")]
    for text in (held, "A text bob never wrote."):
        probe = alice.post("/v1/memories", json={"text": "anything", "id": content_hash(text, "bob")})
        assert probe.status_code == 422 and "derives from the memory's user and text" in probe.json()["detail"]
    own = "alice's own note, sent twice with its derived id"
    assert alice.post("/v1/memories", json={"text": own, "id": content_hash(own, "alice")}).status_code == 201


# --------------------------------------------------------------------------- writes


@ray_test
def test_write_is_recalled_within_one_second(alice):
    text = "The staging Kafka cluster was renamed to heron-7 after the quota incident."
    start = time.perf_counter()
    written = alice.post("/v1/memories", json={"text": text, "id": "alice-heron", "type": "episodic"})
    assert written.status_code == 201, written.text
    assert written.json()["ids"] == ["alice-heron"]
    found = None
    while time.perf_counter() - start < 1.0:
        result = recall(alice, "what is the staging Kafka cluster called now?")
        if "alice-heron" in ids(result):
            found = result
            break
    assert found is not None, "a written memory was not recalled within 1 s of the request"
    item = next(i for i in found["items"] if i["id"] == "alice-heron")
    assert item["origin"] == "delta" and item["text"] == text


@ray_test
def test_batch_write_and_patch(alice):
    batch = {"memories": [
        {"id": "alice-b1", "text": "The nightly export job writes Parquet files to the cold bucket."},
        {"id": "alice-b2", "text": "Feature flags live in the flagd service, not in environment variables."},
    ]}
    assert alice.post("/v1/memories", json=batch).status_code == 201
    assert "alice-b2" in ids(recall(alice, "where do feature flags live?"))
    changed = alice.patch("/v1/memories/alice-b2", json={"text": "Feature flags moved to the Unleash server in May."})
    assert changed.status_code == 200, changed.text
    result = recall(alice, "where do feature flags live?")
    texts = {i["id"]: i["text"] for i in result["items"]}
    assert texts.get("alice-b2") == "Feature flags moved to the Unleash server in May."
    # A PATCH of a generation memory replaces it at once, too.
    assert alice.patch("/v1/memories/alice-00", json={"pinned": True}).status_code == 200


@ray_test
def test_a_batch_over_a_megabyte_is_written_and_checked_off_the_loop(alice):
    """A write body over PARSE_ON_LOOP_BYTES is parsed and validated in a thread (the
    replica's loop serves everything else): the same 201, the same 422 with the bad
    record's place."""
    import random

    from helix_ray.serve.bodies import PARSE_ON_LOOP_BYTES

    rng = random.Random(7)
    words = [f"{rng.choice('bdfgklmnprstvz')}{rng.choice('aeiou')}{rng.choice('bdfgklmnprstvz')}{rng.choice('aeiou')}"
             f"{rng.choice('bdfgklmnprstvz')}" for _ in range(5000)]
    batch = [{"id": f"alice-big-{i:02d}", "text": f"Runbook {i} names the beacon-{i}-marker. "
              + " ".join(rng.choice(words) for _ in range(2800))} for i in range(64)]
    body = json.dumps(batch).encode()
    assert len(body) > PARSE_ON_LOOP_BYTES
    written = alice.post("/v1/memories", content=body, headers={"content-type": "application/json"})
    assert written.status_code == 201, written.text[:500]
    assert written.json()["ids"] == [r["id"] for r in batch]
    assert "alice-big-41" in ids(recall(alice, "beacon-41-marker runbook"))
    batch[40]["salience"] = "very"
    refused = alice.post("/v1/memories", content=json.dumps(batch).encode(),
                         headers={"content-type": "application/json"})
    assert refused.status_code == 422, refused.text[:500]
    assert "memories[40].salience='very'" in refused.json()["detail"], refused.text[:800]
    assert [e["loc"] for e in refused.json()["errors"]] == [[40, "salience"]], refused.text[:800]


@ray_test
def test_deleted_memory_never_comes_back(alice, bob):
    doomed = {"id": "alice-doomed", "text": "The doomed memory mentions the zebra-quokka protocol."}
    assert alice.post("/v1/memories", json=doomed).status_code == 201
    assert "alice-doomed" in ids(recall(alice, "zebra-quokka protocol"))
    assert alice.delete("/v1/memories/alice-doomed").status_code == 200
    assert alice.delete(f"/v1/memories/{STRONG_ID}").status_code == 200  # a generation memory
    for _ in range(3):
        assert "alice-doomed" not in ids(recall(alice, "zebra-quokka protocol"))
        assert STRONG_ID not in ids(recall(alice, STRONG_ERROR))
    again = alice.delete("/v1/memories/alice-doomed")
    assert again.status_code == 404 and "that memory was deleted" in again.json()["detail"], again.text
    theirs = bob.delete("/v1/memories/alice-doomed")  # another user learns nothing of it
    assert theirs.status_code == 404 and "no such memory for user 'bob'" in theirs.json()["detail"], theirs.text


# --------------------------------------------------------------------------- settings


@ray_test
def test_settings_patch_changes_results_live(alice, ops):
    query = "rotate the API keys and restart the gateway pods"
    before = recall(alice, query, explain=True)
    settings = alice.get("/v1/settings").json()
    assert settings["effective"]["fusion"]["k"] >= 1 and settings["overrides"] == {}

    refused = alice.patch("/v1/settings", json={"fusion": {"weights": {"bm25": 0.0}}})
    assert refused.status_code == 403 and "--admin" in refused.json()["detail"], refused.text
    # Rights before the body: a user's key gets 403, not a 422 about a patch it may not send.
    assert alice.patch("/v1/settings", content=b"[not json", headers={"content-type": "application/json"}
                       ).status_code == 403
    assert alice.post("/v1/admin/adapt", content=b"[not json", headers={"content-type": "application/json"}
                      ).status_code == 403
    assert alice.post("/v1/admin/compact").status_code == 403
    patched = ops.patch("/v1/settings", json={"fusion": {"weights": {"bm25": 0.0}}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["effective"]["fusion"]["weights"] == {"dense": 1.0, "bm25": 0.0}
    dense_only = recall(alice, query, explain=True)
    assert all(row["bm25_rank"] is None for row in dense_only["explain"])

    lexical_only = ops.patch("/v1/settings", json={"fusion": {"weights": {"dense": 0.0, "bm25": 1.0}}})
    assert lexical_only.status_code == 200
    bm25_only = recall(alice, query, explain=True)
    assert all(row["dense_rank"] is None for row in bm25_only["explain"])
    assert ids(bm25_only) != ids(dense_only)

    for bad, says in (({"fusion": {"k": 0}}, "greater than or equal to 1"),
                      ({"diversity": {"mmr_lambda": 2}}, "less than or equal to 1"),
                      ({"fusion": {"weights": {"dense": 0, "bm25": 0}}}, "at least one must be > 0"),
                      ({"fusion": {"kay": 3}}, "allowed here: k, weights"),
                      # accepted before, and every recall that cut an item to its budget was a 500
                      ({"pack": {"encoding": "bogus"}}, "cannot load here"),
                      ({"fusion": {"k": True}}, "valid integer"),  # not 1: JSON types, strictly
                      ({"lexical": {"strong_signal_skip": "yes"}}, "valid boolean"),
                      ({"rank": {"type_weights": {"bogus": {"similarity": 1}}}}, "bogus is not a memory type")):
        response = ops.patch("/v1/settings", json=bad)
        assert response.status_code == 422 and says in response.json()["detail"], response.text
        # It quotes the request's patch, not the live overrides merged into it.
        assert response.json()["detail"].startswith(f"Got settings={bad!r}"), response.text
    assert recall(alice, query, budget_tokens=20)["items"]  # an item cut to fit: the encoding still loads
    # Python's JSON parser (the server's) reads NaN and Infinity; no setting takes them.
    for raw in (b'{"fusion": {"weights": {"bm25": NaN}}}', b'{"diversity": {"mmr_lambda": Infinity}}'):
        response = ops.patch("/v1/settings", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422 and "finite number" in response.json()["detail"], response.text
    # One weight of one type's row: the rest of the table keeps its values.
    defaults = ops.get("/v1/settings").json()["effective"]["rank"]["type_weights"]["decision"]
    one = ops.patch("/v1/settings", json={"rank": {"type_weights": {"decision": {"graph": 0.3}}}})
    assert one.status_code == 200, one.text
    assert one.json()["effective"]["rank"]["type_weights"]["decision"] == {**defaults, "graph": 0.3}
    reset = ops.delete("/v1/settings")
    assert reset.status_code == 200 and reset.json()["overrides"] == {}
    assert reset.json()["effective"] == settings["effective"]
    # Fused as before the patches. (Not the final order: the recalls in between counted
    # as accesses, and recency from last access moves what they returned up.)
    assert fused(recall(alice, query, explain=True)) == fused(before)


def fused(answer: dict) -> dict[str, tuple]:
    """Each fused candidate's ranks in the two legs and its RRF score (explain rows)."""
    return {row["id"]: (row["dense_rank"], row["bm25_rank"], row["rrf_score"])
            for row in answer["explain"] if row["rrf_score"]}


# --------------------------------------------------------------------------- hot swap


@ray_test
def test_generation_swap_during_requests_loses_none(served, alice, ops):
    """Compaction publishes a new generation (the ingest pipeline) while a loop of
    requests runs; every request answers 200, and the replicas end on the new one."""
    url, keys, _ = served
    first = alice.get("/healthz").json()["generation"]
    statuses: list[int] = []
    generations: list[int] = []
    resurrected: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=60) as c:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                r = c.post("/v1/recall", json={"query": "what is the staging Kafka cluster called now?",
                                               "budget_tokens": 300})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    generations.append(r.json()["generation"])
                    resurrected.extend(i for i in ids(r.json()) if i in ("alice-doomed", STRONG_ID))

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        time.sleep(0.5)
        compacted = ops.post("/v1/admin/compact")
        assert compacted.status_code == 200, compacted.text
        report = compacted.json()
        assert report["published"] and report["generation"] == first + 1 and report["folded"] >= 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not generations or generations[-1] != first + 1):
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        worker.join()
    assert statuses and set(statuses) == {200}, statuses
    assert not resurrected
    assert generations[0] == first and generations[-1] == first + 1
    # What was written online is now served from the generation; the delete still holds.
    result = recall(alice, "what is the staging Kafka cluster called now?")
    heron = next(i for i in result["items"] if i["id"] == "alice-heron")
    assert heron["origin"] == "generation"
    assert STRONG_ID not in ids(recall(alice, STRONG_ERROR))
    assert "alice-doomed" not in ids(recall(alice, "zebra-quokka protocol"))


# --------------------------------------------------------------------------- errors, stats


@ray_test
@pytest.mark.parametrize("body, status, says", [
    ({"query": "x", "budget_tokens": 10, "colour": "red"}, 422, "unknown field 'colour'"),
    ({"query": "", "budget_tokens": 10}, 422, "Got query=''; it must be a non-empty string"),
    ({"query": "x", "budget_tokens": 0}, 422, "Got budget_tokens=0; it must be a whole number of tokens > 0"),
    ({"query": "x", "budget_tokens": 10, "types": ["gossip"]}, 422, "each must be one of episodic"),
    ({"query": "x", "budget_tokens": 10, "k": 0}, 422, "Got k=0; it must be a whole number from 1 to 200"),
    ({"query": "x", "budget_tokens": 10, "since": "last tuesday"}, 422, "ISO-8601"),
    ({"query": "x", "budget_tokens": "many"}, 422, "budget_tokens"),
    ({"budget_tokens": 10}, 422, "'query' is required"),
    # Matched nothing, silently: a memory without a project has none, not "".
    ({"query": "x", "budget_tokens": 10, "project": ""}, 422, "Got project=''; it must be a non-empty project name"),
    # A lone surrogate, shown escaped once (it was escaped twice).
    ({"query": "why \ud800 nats", "budget_tokens": 10}, 422, "Got query='why \\ud800 nats'; it must be valid Unicode"),
])
def test_malformed_recall_requests_get_4xx_sentences(alice, body, status, says):
    # As ASCII JSON: httpx's own encoding cannot carry a lone surrogate.
    response = alice.post("/v1/recall", content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status and says in response.json()["detail"], response.text


def _nested(levels: int) -> dict:
    out: dict = {"leaf": 1}
    for _ in range(levels - 1):
        out = {"a": out}
    return out


@ray_test
def test_malformed_writes_and_keys_get_4xx_sentences(served, alice):
    url, _, _ = served
    cases = [
        (alice.post("/v1/memories", json={"text": "x", "type": "gossip"}), 422, "type='gossip' is unknown"),
        (alice.post("/v1/memories", json={"text": "   "}), 422, "empty"),
        (alice.post("/v1/memories", json={"text": "x", "mood": "happy"}), 422, "unknown field 'mood'"),
        (alice.post("/v1/memories", json={"memories": []}), 422, "at least one memory"),
        (alice.post("/v1/memories", content=b"{not json", headers={"content-type": "application/json"}), 422,
         "not valid JSON at character 1 (Expecting property name enclosed in double quotes); check its quotes"),
        (alice.patch("/v1/memories/alice-01", json={"colour": "red"}), 422, "unknown field 'colour'"),
        (alice.patch("/v1/memories/alice-01", json={}), 422, "at least one field"),
        (alice.patch("/v1/memories/alice-01", json={"pinned": "yes"}), 422, "Got pinned='yes'"),
        # A turn that orders nothing failed every compaction after it.
        (alice.post("/v1/memories", json={"text": "x", "metadata": {"turn": "first"}}), 422,
         "metadata.turn must be a whole number"),
        (alice.delete("/v1/memories/no-such-id"), 404, "no such memory"),
        (httpx.post(url + "/v1/recall", json={"query": "x", "budget_tokens": 10}), 401, "No API key"),
        (httpx.post(url + "/v1/recall", json={"query": "x", "budget_tokens": 10},
                    headers={"Authorization": "Bearer hx_00000000_wrongwrongwrongwrongwrong"}), 401, "not valid"),
        (httpx.get(url + "/v1/stats", headers={"Authorization": "Basic abc"}), 401, "of the scheme 'Basic'"),
        (httpx.get(url + "/v1/stats", headers={"Authorization": "hx_0000_secret"}), 401, "put 'Bearer ' before it"),
        # Ids the API could not name again in a PATCH or DELETE are refused.
        (alice.post("/v1/memories", json={"text": "x", "id": "mid\nline"}), 422, "control character U+000A"),
        (alice.post("/v1/memories", json={"text": "x", "id": "a" * 600}), 422, "at most 512"),
        # JSON nested deeper than Python's reader goes was a 500 (RecursionError).
        (alice.post("/v1/memories", content=b'{"text": "x", "metadata": ' + b'{"a": ' * 1500 + b'1' + b'}' * 1501,
                    headers={"content-type": "application/json"}), 422, "nested too deep"),
        (alice.post("/v1/memories", json={"text": "x", "metadata": _nested(40)}), 422, "more than 32 levels"),
        # One object is "memory" in a sentence, not memories[0].
        (alice.post("/v1/memories", content=json.dumps({"text": "x", "metadata": {"v": "\ud800"}}),
                    headers={"content-type": "application/json"}), 422,
         "Got memory={'text': 'x', 'user': 'alice'}; it was rejected (invalid_utf8)"),
        (alice.post("/v1/memories", content=json.dumps([{"text": "x", "metadata": {"v": "\ud800"}}]),
                    headers={"content-type": "application/json"}), 422,
         "Got memories[0]={'text': 'x', 'user': 'alice'}; it was rejected (invalid_utf8)"),
        (alice.post("/v1/memories", json=[{"text": "a", "id": "dup-1"}, {"text": "b", "id": "dup-1"}]), 422,
         "memories[0] of this batch has that id already"),
        # The key is checked before the body: an unknown caller learns nothing from a 422.
        (httpx.post(url + "/v1/recall", json={"colour": 1}), 401, "No API key"),
        (httpx.post(url + "/v1/memories", content=b"{not json", headers={"content-type": "application/json"}), 401,
         "No API key"),
        (alice.post("/v1/memories", json={"text": "x", "id": "   "}), 422, "Got id='   '"),
        # A plain list names the bad record by its index, as {"memories": [...]} does.
        (alice.post("/v1/memories", json=[{"text": "a"}, {"text": "b", "colour": "red"}]), 422,
         "unknown field 'memories[1].colour'"),
        (alice.post("/v1/recall", content=b'{"query": "x", "budget_tokens": 10}',
                    headers={"content-type": "text/plain"}), 422, "Content-Type: application/json"),
        (alice.post("/v1/memories", content=b" " * (33 * 1024 * 1024), headers={"content-type": "application/json"}),
         413, "the limit is 33,554,432"),
        (alice.post("/v1/memories", content=iter([b'{"text": ', b'"streamed"}']),
                    headers={"content-type": "application/json"}), 411, "without Content-Length"),
        # No key and an oversized body: the 401 comes first, as for any other body.
        (httpx.post(url + "/v1/memories", content=b" " * (33 * 1024 * 1024),
                    headers={"content-type": "application/json"}), 401, "No API key"),
    ]
    for response, status, says in cases:
        assert response.status_code == status and says in response.json()["detail"], response.text
    # A rejected 50,000-character text is not echoed back whole.
    long = alice.post("/v1/memories", json={"text": "x" * 50_000})
    assert long.status_code == 422 and "characters in all" in long.json()["detail"] and len(long.content) < 2_000


@ray_test
def test_an_id_with_a_slash_can_be_patched_and_deleted(alice):
    """Markdown notes in subfolders get ids like md:notes/ops.md#rotate."""
    memory_id = "md:notes/ops.md#rotate"
    assert alice.post("/v1/memories", json={"id": memory_id, "text": "Rotate the ops keys monthly."}).status_code == 201
    path = "/v1/memories/" + memory_id.replace("#", "%23")
    patched = alice.patch(path, json={"pinned": True})
    assert patched.status_code == 200 and patched.json()["id"] == memory_id, patched.text
    deleted = alice.delete(path)
    assert deleted.status_code == 200 and deleted.json()["deleted"] and deleted.json()["generation"] >= 1
    assert alice.delete(path).status_code == 404


@ray_test
def test_feedback_is_recorded_for_the_callers_own_memories_only(alice, bob):
    answer = ids(recall(alice, "how do we rotate database credentials"))[0]
    given = alice.post("/v1/feedback", json={"query": "how do we rotate database credentials",
                                              "memory_ids": [answer]})
    assert given.status_code == 201 and given.json() == {"recorded": 1}, given.text
    cases = [
        (bob.post("/v1/feedback", json={"query": "q", "memory_ids": [answer]}), 404, "has no memories with those ids"),
        (alice.post("/v1/feedback", json={"query": "q", "memory_ids": []}), 422, "memory_ids"),
        (alice.post("/v1/feedback", json={"query": "   ", "memory_ids": [answer]}), 422, "non-empty string"),
        (alice.post("/v1/feedback", json={"query": "q", "memory_ids": [answer], "user": "bob"}), 403, "belongs to"),
    ]
    for response, status, says in cases:
        assert response.status_code == status and says in response.json()["detail"], response.text


@ray_test
def test_admin_fits_the_query_adapter_from_feedback_and_replicas_use_it(served, alice, ops):
    from helix_ray.recall.adapter import ADAPTER_FILE

    _, _, store = served
    for n in range(20):
        given = alice.post("/v1/feedback", json={"query": f"what did we decide about topic {n}",
                                                  "memory_ids": [f"alice-{n % 11:02d}"]})
        assert given.status_code == 201, given.text
    refused = alice.post("/v1/admin/adapt", json={"force": True})
    assert refused.status_code == 403 and "admin key" in refused.json()["detail"]
    none = ops.post("/v1/admin/adapt", json={"users": ["bob"]})
    assert none.status_code == 422 and "records no feedback of user 'bob'" in none.json()["detail"], none.text
    try:
        fitted = ops.post("/v1/admin/adapt", json={"users": ["alice"], "force": True})
        assert fitted.status_code == 200, fitted.text
        report = fitted.json()
        assert report["queries"] >= 20 and report["saved"] and (store / ADAPTER_FILE).is_file()
        assert recall(alice, "what did we decide about topic 3")["flags"].get("query_adapter")
    finally:
        (store / ADAPTER_FILE).unlink(missing_ok=True)
    assert not recall(alice, "what did we decide about topic 3")["flags"].get("query_adapter")


@ray_test
def test_recall_counts_its_answers_as_accessed(alice, ops):
    """As in-process recall does: the answer's memories reach the access log (batched
    by the ingress, about a second later)."""
    before = ops.get("/v1/stats").json()["db"]["accesses"]
    answer = ids(recall(alice, "why did we move billing to Postgres?"))
    assert answer
    deadline, now = time.monotonic() + 15, before
    while time.monotonic() < deadline and now < before + len(answer):
        time.sleep(0.25)
        now = ops.get("/v1/stats").json()["db"]["accesses"]
    assert now >= before + len(answer)


@ray_test
def test_stats_report_generation_delta_and_latency(alice, bob, ops):
    stats = ops.get("/v1/stats").json()  # an admin key: the whole store
    assert stats["generation"] >= 1 and stats["generation_counts"]["memories"] > 0
    assert {"version", "entries", "pending", "tombstones"} <= set(stats["delta"])
    assert {"alice", "bob"} <= set(stats["db"]["user_memories"])
    # A user's key sees its own counts, and writes not yet compacted, and nothing of others.
    mine = alice.get("/v1/stats").json()
    assert set(mine["user_memories"]) == {"alice"} and "db" not in mine and "generation_counts" not in mine
    before = bob.get("/v1/stats").json()["pending_writes"]
    assert bob.post("/v1/memories", json={"text": "Bob keeps the staging VPN config in vault."}).status_code == 201
    assert bob.get("/v1/stats").json()["pending_writes"] == before + 1
    stats = mine
    for stage in ("embed", "bm25", "dense", "fuse", "rank", "pack", "ingress"):
        assert stats["latency_ms"][stage]["p95"] >= stats["latency_ms"][stage]["p50"] >= 0


def _kill_replicas(deployment: str) -> list[str]:
    """Kill every live replica of one of the app's deployments, as a crash would (Serve's
    controller notices and starts new ones); returns the killed actors' names."""
    import ray

    from helix_ray.serve.server import replica_names

    names = replica_names(deployment)
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return names


def test_killed_replicas_come_back_and_lose_no_acknowledged_write(served, alice, request):
    """Last in the file: it kills replicas. A write acknowledged before the Writer died is
    replayed by the new one from DuckDB; a write sent while it is down waits for it;
    recall never waits for a dead retriever leg longer than ``leg_timeout_s`` (it answers
    without the leg, flagged), nor for a dead Embedder longer than twice that (BM25 alone
    answers, flagged); a request sent while the ingress is down is answered by its
    successor."""
    from helix_ray.serve.server import replica_names

    pending = alice.get("/v1/stats").json()["pending_writes"]
    assert alice.post("/v1/memories", json={"id": "alice-crash-1", "text": "The crash drill code word is "
                                            "tangerine-walrus."}).status_code == 201
    split = request.node.callspec.params["served"] == "split"
    killed = _kill_replicas("DenseANN")  # only the split graph has retriever deployments
    assert bool(killed) == split
    assert _kill_replicas("Writer")

    if killed:  # a leg with no live replica: answered without it, not once Serve has replaced it
        clock = time.perf_counter()
        out = recall(alice, "tangerine-walrus crash drill code word")
        # 2.2 s nominal (leg_timeout_s and the grace); the successor takes ~9 s here
        assert time.perf_counter() - clock < 5.0, "recall waited for the DenseANN replica's successor"
        # Serve notices a dead replica at its next health check (every ~10 s, jittered)
        # and then starts one: unless a successor exists already, the leg was left out.
        successors = set(replica_names("DenseANN")) - set(killed)
        if not successors:
            assert any(flag.startswith("dense leg failed") for flag in out["flags"]["degraded"]), out["flags"]
        assert ids(out)[0] == "alice-crash-1"  # BM25 alone finds it
    assert alice.post("/v1/memories", json={"id": "alice-crash-2", "text": "After the crash the drill code word "
                                            "is lemon-heron."}).status_code == 201
    # The new Writer holds both: the first from its log, the second as written.
    assert alice.get("/v1/stats").json()["pending_writes"] == pending + 2
    deadline = time.time() + 60
    while True:  # until the new DenseANN replica answers
        out = recall(alice, "what is the crash drill code word?")
        if not out["flags"].get("degraded") or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not out["flags"].get("degraded") and {"alice-crash-1", "alice-crash-2"} <= set(ids(out)), out

    killed = _kill_replicas("Embedder")  # the split graph's: without its plan, BM25 alone on one made by the ingress
    assert bool(killed) == split
    if killed:
        clock = time.perf_counter()
        out = recall(alice, "lemon-heron drill code word")
        # 4 s nominal (twice leg_timeout_s)
        assert time.perf_counter() - clock < 7.0, "recall waited for the Embedder replica's successor"
        if not set(replica_names("Embedder")) - set(killed):
            assert any(flag.startswith("embedder failed") for flag in out["flags"]["degraded"]), out["flags"]
        assert ids(out)[0] == "alice-crash-2"
        deadline = time.time() + 60
        while out["flags"].get("degraded") and time.time() < deadline:  # until the new Embedder answers
            time.sleep(0.5)
            out = recall(alice, "what is the crash drill code word after the crash?")
        assert not out["flags"].get("degraded") and ids(out)[0] == "alice-crash-2", out

    assert _kill_replicas("HelixAPI")
    out = recall(alice, "the code word after the crash")  # held by Serve until the new ingress is up
    assert ids(out)[0] == "alice-crash-2" and not out["flags"].get("degraded")
