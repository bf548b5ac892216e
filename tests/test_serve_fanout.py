"""The ingress's fan-out over the stage deployments, no Ray: stand-in stages with set
delays check its timeouts, the answers it gives without a leg or an Embedder, the calls
it cancels and the ones it keeps as probes; then the errors that cross a replica
boundary, the answer's encoding and the recall hits it batches to the Writer."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest


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


def test_an_unexpected_error_is_a_500_whose_log_line_quotes_nothing_the_caller_sent(caplog):
    """A fault's message can quote the request (a database error quotes the row): the
    500 and the log line at ERROR name its kind and where it was raised, and only DEBUG
    holds the message."""
    import logging
    from types import SimpleNamespace

    from helix_ray.serve.responses import unexpected as _unexpected

    def write(text: str) -> None:
        raise RuntimeError(f"could not convert {text!r}")

    try:
        write("SECRET-MEMORY-TEXT")
    except RuntimeError as exc:
        fault = exc
    request = SimpleNamespace(url=SimpleNamespace(path="/v1/memories"))
    with caplog.at_level(logging.DEBUG, logger="helix_ray.serve.responses"):
        answer = asyncio.run(_unexpected(request, fault))
    assert answer.status_code == 500 and b"RuntimeError" in answer.body and b"SECRET" not in answer.body
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "RuntimeError at " in errors[0] and "in write" in errors[0], errors
    assert not any("SECRET" in r.getMessage() or (r.exc_info and r.levelno >= logging.INFO)
                   for r in caplog.records if r.levelno >= logging.INFO)
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records), "DEBUG keeps the traceback"


def test_a_write_whose_writer_replica_died_gets_503_saying_what_is_known(tenant_store, tmp_path):
    """Protects: Ray's errors for a Writer replica that is gone become a 503 with
    Retry-After — never a 500 — saying whether the write may have been made (the replica
    died holding it) or was not (no replica took it); a recall's reads say nothing was
    changed. (With Ray: the killed-replica test of tests/test_serve_http.py.)"""
    import shutil

    import ray.serve
    from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError
    from starlette.testclient import TestClient

    from helix_ray.store.keys import KeyStore
    from tests.helpers import ingress_app

    store = tmp_path / "store"
    shutil.copytree(tenant_store[0], store)
    key = KeyStore(store).create("alice")[0]

    class Gone:
        def __init__(self, error):
            self.error = error

        def __getattr__(self, name):
            async def remote(*args, **kwargs):
                raise self.error
            return type("Method", (), {"remote": staticmethod(remote)})()

    died = ActorDiedError()
    died.error_msg = ("The actor died unexpectedly before finishing this task.\n\tclass_name: "
                      "ServeReplica:helix:Writer\n\tname: SERVE_REPLICA::helix#Writer#abc")
    with ingress_app(store) as app, TestClient(app, raise_server_exceptions=False) as client:
        ingress = ray.serve.get_replica_context().servable_object
        headers = {"Authorization": f"Bearer {key}"}
        ingress.writer = Gone(died)
        written = client.post("/v1/memories", json={"text": "A note.", "id": "alice-note"}, headers=headers)
        assert written.status_code == 503 and written.headers["retry-after"] == "2", written.text
        said = written.json()["detail"]
        assert said.startswith("The replica of the Writer deployment serving POST /v1/memories stopped before it "
                               "answered (ActorDiedError)") and "may or may not have been made" in said, said
        assert "the same ids get the same memories" in said
        stats = client.get("/v1/stats", headers=headers)
        assert stats.status_code == 503 and "Nothing was changed" in stats.json()["detail"]
        ingress.writer = Gone(DeploymentUnavailableError(DeploymentID(name="Writer", app_name="helix")))
        deleted = client.delete("/v1/memories/alice-00", headers=headers)
        assert deleted.status_code == 503 and deleted.headers["retry-after"] == "2"
        assert "no replica took it and nothing was changed" in deleted.json()["detail"], deleted.text
        # Ray failing to carry the call otherwise (here the node under the Writer lost): may have run.
        ingress.writer = Gone(NodeDiedError("node 1 died"))
        written = client.post("/v1/memories", json={"text": "A note.", "id": "alice-note"}, headers=headers)
        assert written.status_code == 503 and written.headers["retry-after"] == "2", written.text
        assert "(NodeDiedError)" in written.json()["detail"] and "may or may not" in written.json()["detail"]
        # An error the replica's own code raised is a 500, wrapped by Ray or not.
        for bug in (RuntimeError("a bug"), RayTaskError("create", "Traceback: ...", RuntimeError("a bug"))):
            ingress.writer = Gone(bug)
            assert client.post("/v1/memories", json={"text": "x"}, headers=headers).status_code == 500, bug


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


#: How late a timed step may finish on a loaded host (the event loop, the threads of the
#: fake stages). Each assertion's alternative (the full bound, no bound) lies further out.
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
    not take, are sent in the next rounds of the same flush task: they do not wait for
    the next recall (lost if none came before the replica stopped)."""
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


def _copy_with_newer_generation(source: Path, store: Path) -> Path:
    """``source`` copied to ``store`` with its current generation copied as the next
    number (not yet current)."""
    import shutil

    from helix_ray.store.generation import current_generation_number
    from helix_ray.store.integrity import seal

    shutil.copytree(source, store)
    first = current_generation_number(store)
    newer = store / "generations" / f"{first + 1:06d}"
    shutil.copytree(store / "generations" / f"{first:06d}", newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps(seal({**manifest, "generation": first + 1})))
    return store


def test_a_cancelled_request_does_not_cancel_the_generation_load_others_wait_for(tenant_store, tmp_path,
                                                                                  monkeypatch):
    """Two requests wait for a replica to open a new generation; one is cancelled (its
    client left, or the ingress gave up on a leg). The other still gets the generation,
    installed once, opened once: the cancellation must not cancel the shared load, which
    would fail every request of the swap that waits for it."""
    from helix_ray.live.views import StoreViews

    store = _copy_with_newer_generation(tenant_store[0], tmp_path / "store")
    views = StoreViews(store, role="ranker")
    first = views.latest
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


def test_a_replica_makes_the_first_requests_recaller_while_it_loads(tenant_store, tmp_path):
    """What the first request over a new generation, or a new delta snapshot, would make
    on the event loop (the snapshot read and joined, the role's recaller) is made by the
    replica's loader off the loop: that request finds it made, and uses it."""
    from helix_ray.live.views import StoreViews
    from helix_ray.memory import Memory

    store = _copy_with_newer_generation(tenant_store[0], tmp_path / "store")
    views = StoreViews(store, role="ranker")
    first = views.latest
    (store / "CURRENT").write_text(str(first + 1))

    assert _run(views.refresh())
    version = views.delta_version()
    assert set(views.recallers) == {(first + 1, version, True)} and version in views.deltas
    view = views.generations[first + 1]
    made = views.recallers[(first + 1, version, True)]
    assert views.recaller(view, views.delta_for(view), joined=True) is made

    with Memory(store, record_access=False, warm=False) as mem:
        mem.add([{"id": "fresh", "user": "alice", "text": "The canary rollout waits for the p99 alarm."}])
    assert views.delta_version() > version and views.delta_version() not in views.deltas
    _run(views._follow_delta())
    key = (first + 1, views.delta_version(), True)
    assert key in views.recallers and views.delta_version() in views.deltas
    delta = views.delta_for(view)
    assert "fresh" in set(delta.ids.tolist())
    assert views.recaller(view, delta, joined=True) is views.recallers[key]


def test_a_delta_snapshot_the_watcher_cannot_read_ahead_is_left_to_requests(tenant_store, tmp_path, monkeypatch,
                                                                             caplog):
    """The watcher tries a new snapshot once: failing, it warns once and leaves it to the
    next request, instead of trying (and logging) every half second."""
    import logging

    from helix_ray.live.views import StoreViews
    from helix_ray.memory import Memory

    store = _copy_with_newer_generation(tenant_store[0], tmp_path / "store")
    views = StoreViews(store, role="ranker")
    with Memory(store, record_access=False, warm=False) as mem:
        mem.add([{"id": "fresh", "user": "alice", "text": "The canary rollout waits for the p99 alarm."}])
    tried = []

    def unreadable(view):
        tried.append(view.number)
        raise OSError("segment unreadable")

    monkeypatch.setattr(views, "ready", unreadable)
    with caplog.at_level(logging.WARNING, logger="helix_ray.live.views"):
        for _ in range(3):
            _run(views._follow_delta())
    assert tried == [views.latest]
    assert len([r for r in caplog.records if "ahead of requests" in r.message]) == 1
    assert views.delta_version() not in views.deltas
    view = views.generations[views.latest]
    assert "fresh" in set(views.delta_for(view).ids.tolist())  # a request reads it itself
