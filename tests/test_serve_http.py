"""The Serve application end to end: a real local Ray and Serve, over HTTP on 127.0.0.1.

One store (the four-tenant set of ``tests.helpers.tenant_records``, real model, real
DuckDB) is served once per graph shape (split, inline); the tests run in file order
against each, each writing memories with its own ids, and the last one kills replicas.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from helix_ray.runtime import spare_port
from tests.helpers import STRONG_ERROR, STRONG_ID, ids, recall, tenant_records

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.ray


#: The served app's ``max_queued_requests``: low, so that a flood of a hundred writes
#: overflows the Writer's queue (its 16 ongoing requests and this many waiting).
FLOOD_QUEUE = 4


@pytest.fixture(scope="module", params=["split", "inline"])
def served(request, tmp_path_factory):
    """(base URL, {user: key}, store) for the app serving a fresh tenant store, once per
    graph shape: the split graph (a deployment per stage) and the inline one (the ingress
    runs every stage); every HTTP test below runs against both."""
    import ray
    from ray import serve

    from helix_ray.serve import server
    from helix_ray.store.keys import KeyStore
    from helix_ray.ingest.run import ingest

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
    port = spare_port()
    server.run(store, port=port, compact_interval_s=3600, watch_interval_s=0.25, graph=request.param,
               max_queued_requests=FLOOD_QUEUE)
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


# --------------------------------------------------------------------------- read path


def test_health_and_openapi(served):
    url, _, _ = served
    health = httpx.get(url + "/healthz").json()
    assert health["status"] == "ok" and health["generation"] >= 1
    spec = httpx.get(url + "/openapi.json").json()
    for path in ("/v1/recall", "/v1/memories", "/v1/memories/{memory_id}", "/v1/settings", "/v1/stats", "/healthz"):
        assert path in spec["paths"], path
    assert spec["components"]["schemas"]["RecallRequest"]["additionalProperties"] is False


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


def test_two_users_never_cross(alice, bob):
    shared = "How are the database migrations run before the gateway pods roll?"
    assert all(i.startswith("alice") for i in ids(recall(alice, shared)))
    assert all(i.startswith("bob") for i in ids(recall(bob, shared)))
    secret = "The bob-only vault passphrase hint is purple giraffe umbrella."
    written = bob.post("/v1/memories", json={"text": secret, "id": "bob-secret"})
    assert written.status_code == 201 and written.json()["replaced"] == [], written.text
    again = bob.post("/v1/memories", json={"text": secret, "id": "bob-secret"})
    assert (again.status_code, again.json()["replaced"]) == (201, ["bob-secret"]), again.text
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


def test_a_long_write_is_chunked_and_recalled_with_context_and_a_date(alice):
    """A long text is stored as chunks (each named by its parent), found through the
    conversation's context turns, and a question's time words are read against `now`."""
    steps = [f"## Stage {n}\n" + " ".join(f"Stage {n} drains queue {m} of the osprey broker." for m in range(30))
             for n in range(1, 6)]
    doc = "\n\n".join(["# Osprey broker upgrade", *steps, "## Canary\nThe osprey canary runs in zone b for a day."])
    written = alice.post("/v1/memories", json={"id": "alice-osprey", "text": doc, "created_at": "2025-03-04T10:00:00Z"})
    assert written.status_code == 201 and written.json()["ids"] == ["alice-osprey"], written.text
    result = recall(alice, "and where does its canary run?", context=["we are upgrading the osprey broker"],
                    now="2025-03-10T09:00:00Z")
    chunks = [i for i in result["items"] if i["parent"] == "alice-osprey"]
    assert chunks and chunks[0]["id"].startswith("alice-osprey#chunk"), result["items"]
    dated = recall(alice, "what did we upgrade last week?", now="2025-03-10T09:00:00Z", explain=True)
    assert dated["flags"]["time"]["window"]["expression"] == "last week", dated["flags"]
    assert alice.delete("/v1/memories/alice-osprey").status_code == 200
    assert not [i for i in recall(alice, "osprey canary zone")["items"] if i["parent"] == "alice-osprey"]


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


def test_a_batch_over_a_megabyte_is_written_and_checked_off_the_loop(alice):
    """A write body over PARSE_ON_LOOP_BYTES is parsed and validated in a thread (the
    replica's loop serves everything else): the same 201, the same 422 with the bad
    record's place."""
    import random

    from helix_ray.serve.bodies import PARSE_ON_LOOP_BYTES

    rng = random.Random(7)
    words = [f"{rng.choice('bdfgklmnprstvz')}{rng.choice('aeiou')}{rng.choice('bdfgklmnprstvz')}{rng.choice('aeiou')}"
             f"{rng.choice('bdfgklmnprstvz')}" for _ in range(5000)]
    # The bulk is in metadata: the body is over a megabyte, the texts to embed are short.
    batch = [{"id": f"alice-big-{i:02d}", "text": f"Runbook {i} names the beacon-{i}-marker.",
              "metadata": {"notes": " ".join(rng.choice(words) for _ in range(2800))}} for i in range(64)]
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
                      # an encoding that cannot load would make a 500 of every recall that cuts an item
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


@pytest.mark.parametrize("body, status, says", [
    ({"query": "x", "budget_tokens": 10, "colour": "red"}, 422, "unknown field 'colour'"),
    ({"query": "", "budget_tokens": 10}, 422, "Got query=''; it must be a non-empty string"),
    ({"query": "x", "budget_tokens": 0}, 422, "Got budget_tokens=0; it must be a whole number of tokens > 0"),
    ({"query": "x", "budget_tokens": 10, "types": ["gossip"]}, 422, "each must be one of episodic"),
    ({"query": "x", "budget_tokens": 10, "k": 0}, 422, "Got k=0; it must be a whole number from 1 to 200"),
    ({"query": "x", "budget_tokens": 10, "since": "last tuesday"}, 422, "ISO-8601"),
    ({"query": "x", "budget_tokens": 10, "now": "tomorrow"}, 422, "Got now='tomorrow'"),
    ({"query": "x", "budget_tokens": 10, "context": ["ok", 3]}, 422, "context"),
    ({"query": "x", "budget_tokens": "many"}, 422, "budget_tokens"),
    ({"budget_tokens": 10}, 422, "'query' is required"),
    # It would match nothing, silently: a memory without a project has none, not "".
    ({"query": "x", "budget_tokens": 10, "project": ""}, 422, "Got project=''; it must be a non-empty project name"),
    # A lone surrogate, shown escaped once.
    ({"query": "why \ud800 nats", "budget_tokens": 10}, 422, "Got query='why \\ud800 nats'; it must be valid Unicode"),
])
def test_malformed_recall_requests_get_4xx_sentences(alice, body, status, says):
    # As ASCII JSON: httpx's own encoding cannot carry a lone surrogate.
    response = alice.post("/v1/recall", content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status and says in response.json()["detail"], response.text


def test_a_recall_without_a_budget_packs_into_the_settings_default(alice):
    """Protects: POST /v1/recall without budget_tokens and `helix recall` without --budget
    pack into the same default, the settings' default_budget_tokens."""
    from helix_ray.config import DEFAULT_BUDGET_TOKENS

    response = alice.post("/v1/recall", json={"query": "how do I rotate the API keys?"})
    assert response.status_code == 200, response.text
    assert response.json()["budget_tokens"] == DEFAULT_BUDGET_TOKENS


def _nested(levels: int) -> dict:
    out: dict = {"leaf": 1}
    for _ in range(levels - 1):
        out = {"a": out}
    return out


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
        # A turn that orders nothing would fail every compaction after it.
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
        # JSON nested deeper than Python's reader goes: a 422, not a 500 (RecursionError).
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
    # A rejected text (over validation.max_text_chars) is not echoed back whole.
    long = alice.post("/v1/memories", json={"text": "x" * 2_000_001})
    assert long.status_code == 422 and "characters in all" in long.json()["detail"] and len(long.content) < 2_000


def test_an_id_with_a_slash_can_be_patched_and_deleted(alice):
    """Markdown notes in subfolders get ids like md:alice/notes/ops.md#rotate."""
    memory_id = "md:alice/notes/ops.md#rotate"
    assert alice.post("/v1/memories", json={"id": memory_id, "text": "Rotate the ops keys monthly."}).status_code == 201
    path = "/v1/memories/" + memory_id.replace("#", "%23")
    patched = alice.patch(path, json={"pinned": True})
    assert patched.status_code == 200 and patched.json()["id"] == memory_id, patched.text
    deleted = alice.delete(path)
    assert deleted.status_code == 200 and deleted.json()["deleted"] and deleted.json()["generation"] >= 1
    assert alice.delete(path).status_code == 404


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
    assert none.status_code == 409 and "records no feedback of user 'bob'" in none.json()["detail"], none.text
    try:
        fitted = ops.post("/v1/admin/adapt", json={"users": ["alice"], "force": True})
        assert fitted.status_code == 200, fitted.text
        report = fitted.json()
        assert report["queries"] >= 20 and report["saved"] and (store / ADAPTER_FILE).is_file()
        assert recall(alice, "what did we decide about topic 3")["flags"].get("query_adapter")
    finally:
        (store / ADAPTER_FILE).unlink(missing_ok=True)
    assert not recall(alice, "what did we decide about topic 3")["flags"].get("query_adapter")


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


def test_an_admin_forgets_a_user_through_the_writer_deployment(served, alice, ops):
    """Protects: ``DELETE /v1/users/{user}`` reaches the Writer deployment in both
    graphs, and once its compaction has deleted the generations before the new one, the
    replicas recall on (the erasure's own checks: tests/test_serve_forget.py)."""
    from helix_ray.store.keys import KeyStore

    url, _, store = served
    erin = KeyStore(store).create("erin")[0]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {erin}"}, timeout=60) as client:
        assert client.post("/v1/memories", json={"text": "Erin keeps the VOLE-3390 runbook."}).status_code == 201
    kept = alice.post("/v1/memories", json={"text": "Alice pinned the KESTREL-7741 migration to Tuesdays.",
                                         "id": "alice-kestrel"})
    assert kept.status_code == 201, kept.text
    assert ops.post("/v1/admin/compact").json()["published"]  # into a generation, which the replicas open
    assert alice.delete("/v1/users/erin").status_code == 403
    unknown = ops.delete("/v1/users/nobody-here")
    assert unknown.status_code == 404 and "holds nothing of that user" in unknown.json()["detail"], unknown.text
    generation = ops.get("/v1/stats").json()["generation"]
    gone = ops.delete("/v1/users/erin", timeout=300)
    assert gone.status_code == 200, gone.text
    assert (gone.json()["memories"], gone.json()["keys"], gone.json()["compacted"]) == (1, 1, True), gone.text
    assert gone.json()["generation"] > generation
    assert not [p for p in store.rglob("*") if p.is_file() and b"VOLE-3390" in p.read_bytes()]
    assert [p.name for p in (store / "generations").iterdir() if p.name.isdigit()] == [f"{gone.json()['generation']:06d}"]
    for _ in range(5):  # another user's write, made before the erasure, is still recalled first
        assert ids(recall(alice, "which migration did Alice pin to Tuesdays? KESTREL-7741"))[0] == "alice-kestrel"


def test_a_flood_beyond_the_queue_bound_is_refused_at_once_with_503s(served, alice):
    """Protects the overload contract (``max_queued_requests``): a hundred writes at once,
    more than the Writer runs and queues, are not all kept waiting: those over the bound
    get a 503 with Retry-After, sooner than the writes that went through, and never a
    500; the writes answered 201 are stored, the refused ones not, and the server
    answers normally afterwards."""
    import asyncio

    url, _, _ = served
    flood = 100
    pending = alice.get("/v1/stats").json()["pending_writes"]

    async def send(client: "httpx.AsyncClient", n: int) -> tuple[int, float, httpx.Response]:
        clock = time.perf_counter()
        answer = await client.post("/v1/memories", json={"id": f"alice-flood-{n:03d}",
                                                         "text": f"Flood write {n}: relay {n} of the otter ring."})
        return answer.status_code, time.perf_counter() - clock, answer

    async def burst() -> list[tuple[int, float, httpx.Response]]:
        async with httpx.AsyncClient(base_url=url, headers=alice.headers, timeout=120,
                                     limits=httpx.Limits(max_connections=flood)) as client:
            return await asyncio.gather(*(send(client, n) for n in range(flood)))

    answers = asyncio.run(burst())
    statuses = sorted({status for status, _, _ in answers})
    refused = [(took, answer) for status, took, answer in answers if status == 503]
    written = [took for status, took, _ in answers if status == 201]
    assert set(statuses) <= {201, 503}, [a.text[:200] for s, _, a in answers if s not in (201, 503)][:3]
    assert refused, f"no write of {flood} at once was refused: the Writer's queue is not bounded"
    assert written, "every write was refused"
    assert all(a.headers.get("retry-after") == "2" for _, a in refused), [a.headers for _, a in refused][:3]
    # The proxy refuses what its queue to the ingress cannot take (Serve's plain text); the
    # ingress refuses what its queue to the Writer cannot, in Helix's words. Which of the two
    # refuses depends on how fast the proxy hands requests to the ingress on a busy host
    # (either may take them all), so both are allowed; the ingress's words are pinned by
    # test_serve_config.py::test_a_full_queue_behind_the_ingress_is_refused_in_helix_words.
    by_ingress = [a.json()["detail"] for _, a in refused if a.headers["content-type"] == "application/json"]
    assert len(by_ingress) + sum("dropped due to backpressure" in a.text for _, a in refused) == len(refused)
    assert all("has more calls queued than it takes" in d and "nothing was changed" in d
               for d in by_ingress), by_ingress[:2]
    assert max(took for took, _ in refused) < max(written), "a refused write waited as long as the slowest written"
    # Every 201 is stored and no refused write is: "nothing was changed", as the 503 says.
    assert alice.get("/v1/stats").json()["pending_writes"] == pending + len(written)
    assert alice.post("/v1/memories", json={"id": "alice-after-flood", "text": "After the flood the otter ring "
                                            "relays were renumbered."}).status_code == 201
    assert "alice-after-flood" in ids(recall(alice, "what happened to the otter ring relays after the flood?"))


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
    replayed by the new one from DuckDB; a write the Writer held when it died gets a 503
    with Retry-After (never a 500), and sent again it is written; a write sent while it
    is down waits for it;
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
    # A batch the Writer is embedding when it dies: its answer is lost, and the client told so.
    batch = [{"id": f"alice-held-{n:04d}", "text": f"Held write {n}: the drill batch names relay {n} of the "
              "marmot cluster."} for n in range(1000)]
    held: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: held.setdefault("answer", alice.post("/v1/memories", json=batch)))
    sender.start()
    time.sleep(0.5)  # in the Writer by now, and embedding for seconds more
    assert _kill_replicas("Writer")
    sender.join()
    lost = held["answer"]
    assert lost.status_code == 503 and lost.headers["retry-after"] == "2", lost.text
    assert "Writer deployment serving POST /v1/memories stopped before it answered" in lost.json()["detail"]

    if killed:  # a leg with no live replica: answered without it, not once Serve has replaced it
        clock = time.perf_counter()
        out = recall(alice, "tangerine-walrus crash drill code word")
        # leg_timeout_s and the grace: well before Serve has started a successor
        assert time.perf_counter() - clock < 5.0, "recall waited for the DenseANN replica's successor"
        # Serve notices a dead replica at its next health check and then starts one:
        # unless a successor exists already, the leg was left out.
        successors = set(replica_names("DenseANN")) - set(killed)
        if not successors:
            assert any(flag.startswith("dense leg failed") for flag in out["flags"]["degraded"]), out["flags"]
        assert ids(out)[0] == "alice-crash-1"  # BM25 alone finds it
    assert alice.post("/v1/memories", json={"id": "alice-crash-2", "text": "After the crash the drill code word "
                                            "is lemon-heron."}).status_code == 201
    # The new Writer holds both: the first from its log, the second as written.
    assert alice.get("/v1/stats").json()["pending_writes"] == pending + 2
    again = alice.post("/v1/memories", json=batch)  # the lost batch, sent again as its 503 says
    assert again.status_code == 201 and len(again.json()["ids"]) == len(batch), again.text[:300]
    assert "alice-held-0417" in ids(recall(alice, "which relay of the marmot cluster is named in held write 417?"))
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
        # twice leg_timeout_s: well before Serve has started a successor
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


# --------------------------------------------------------------------------- benchmark


def test_bench_serve_times_recall_idle_and_around_a_compaction(served):
    """``scripts/bench_serve.py --compact-rounds``'s phase against the running app: the
    writes land, the compaction publishes, and recall is timed on both sides of it. Last
    in the module: the writes are this store's for good."""
    import argparse
    import asyncio

    from tests.helpers import load_script

    url, keys, store = served
    bench = load_script("bench_serve")
    before = json.loads((store / "CURRENT").read_text())
    alice_key = {"Authorization": f"Bearer {keys['alice']}"}
    bodies = [({"query": q, "budget_tokens": 256}, alice_key) for q in ("gateway port", "billing cache")]
    args = argparse.Namespace(seed=0, compact_rounds=1, compact_writes=3, compact_idle=4, compact_settle_s=0.3)
    out = asyncio.run(bench.during_compactions(url, bodies, alice_key, {"Authorization": f"Bearer {keys['ops']}"},
                                               args))
    assert out["idle"]["n"] == 4 and out["during"]["n"] >= 2 and out["p95_ratio"] > 0
    (report,) = out["compactions"]
    assert report["folded"] >= args.compact_writes, report  # and whatever earlier tests left pending
    assert report["generation"] == json.loads((store / "CURRENT").read_text()) > before
    assert report["seconds_with_settle"] >= args.compact_settle_s
