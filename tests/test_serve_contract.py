"""The HTTP contract, checked by a schema-driven fuzzer: schemathesis generates requests
from the OpenAPI schema (valid ones, invalid ones, methods a path does not take) and
checks every answer against it — no 5xx, no status the route does not declare, no body
off its schema, no valid request refused, no invalid one accepted, a 405's ``Allow``
naming the path's methods.

The application runs in this process without Ray (:func:`tests.helpers.ingress_app`:
the ingress over the inline graph, a real store and DuckDB file), with a user's key and
an admin's. The run is bounded and seeded: the same requests every time.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import TENANT_USERS, ingress_app

schemathesis = pytest.importorskip("schemathesis")

#: Generated cases per operation and phase, and the seed they are drawn from.
EXAMPLES = 25
SEED = 20260326


@pytest.fixture(scope="module")
def contract_app(tenant_store, tmp_path_factory):
    """(app, {role: key}, store) over a private copy of the tenant store."""
    from helix_ray.store.keys import KeyStore

    store = tmp_path_factory.mktemp("contract") / "store"
    shutil.copytree(tenant_store[0], store)
    keys = {"user": KeyStore(store).create("bob")[0], "admin": KeyStore(store).create("alice", admin=True)[0]}
    with ingress_app(store) as app:
        yield app, keys, store


def fuzz(app, key: str, store, *, examples: int = EXAMPLES, seed: int = SEED) -> tuple[int, list[str]]:
    """Run schemathesis's phases (examples, coverage, fuzzing; not the stateful one)
    against ``app`` with ``key``: (requests sent, one line per failed check or error).

    Two bounds keep the run to seconds: the coverage phase sends ``POST /v1/memories``
    its invalid bodies only (its valid ones include batches of 1,000 memories to embed;
    the fuzzing phase sends valid ones), and each accepted ``PATCH /v1/settings`` is
    undone after its answer, so that every patch is judged on the deployment's own
    settings, as the schema states its rules, and the recalls after it run on them too.
    ``DELETE /v1/users/{user}`` is never sent for a user of the store (:func:`foreign`)."""
    from schemathesis.engine import Status, events, from_schema

    from helix_ray.live.settings import settings_path

    config = schemathesis.Config.from_dict({
        "seed": seed,
        "headers": {"Authorization": f"Bearer {key}"},
        "generation": {"max-examples": examples, "deterministic": True, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
        "operations": [{"include-path": "/v1/memories", "include-method": "POST",
                        "phases": {"coverage": {"generation": {"mode": "negative"}}}}],
        "max-failures": 100,
    })
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    schema.hook("filter_body")(drawable)
    schema.hook("filter_path_parameters")(foreign)

    @schema.hook
    def after_call(context, case, response):
        if case.method.upper() == "PATCH" and case.path == "/v1/settings":
            settings_path(store).unlink(missing_ok=True)

    sent, failures = 0, []
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"{getattr(event, 'label', '')}: error {getattr(event, 'value', event)!r}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        sent += len(event.recorder.interactions)
        for case_id, checks in event.recorder.checks.items():
            for check in checks:
                if check.status != Status.FAILURE:
                    continue
                interaction = event.recorder.interactions.get(case_id)
                request = interaction.request if interaction else None
                response = interaction.response if interaction else None
                title = check.failure_info.failure.title if check.failure_info else ""
                failures.append(f"{event.recorder.label} [{check.name}: {title}] "
                                f"{request.method if request else ''} {request.uri if request else ''} "
                                f"{(request.body or b'')[:200]!r} -> {response.status_code if response else ''} "
                                f"{(response.content or b'')[:300]!r}" if response else "")
    return sent, failures


def drawable(context, body) -> bool:
    """Whether to send ``body``: one the server refuses by a rule between fields, which
    JSON Schema cannot state (the schema says it in words), is not drawn:

    - a recall whose ``since`` is later than its ``until``;
    - a batch in which two memories have one id (given, or derived from the same text)."""
    if context.operation is None or not isinstance(body, (dict, list)):
        return True
    where = (context.operation.method.upper(), context.operation.path)
    if where == ("POST", "/v1/recall") and isinstance(body, dict):
        return _window_in_order(body)
    if where == ("POST", "/v1/memories"):
        batch = body if isinstance(body, list) else body.get("memories") if isinstance(body, dict) else None
        if isinstance(batch, list):
            ids = [m.get("id") or ("text", str(m.get("text", "")).strip()) for m in batch if isinstance(m, dict)]
            return len(ids) == len(set(map(repr, ids)))
    return True


def foreign(context, parameters) -> bool:
    """Whether to send these path parameters: not a ``DELETE /v1/users/{user}`` of a user
    the store holds (the fuzzer reuses the users its answers name), which would erase the
    admin's key for the rest of the run (tests/test_serve_forget.py erases users)."""
    if context.operation is None or context.operation.path != "/v1/users/{user}":
        return True
    return parameters.get("user") not in TENANT_USERS


def _window_in_order(body: dict) -> bool:
    from helix_ray.errors import InvalidArgument
    from helix_ray.recall.scope import as_time

    try:
        since, until = as_time("since", body.get("since")), as_time("until", body.get("until"), end_of_day=True)
    except (InvalidArgument, TypeError):
        return True
    return since is None or until is None or since <= until


@pytest.mark.parametrize("role", ["user", "admin"])
def test_every_answer_keeps_the_openapi_contract(contract_app, role):
    from helix_ray.store.keys import KeyStore

    app, keys, store = contract_app
    sent, failures = fuzz(app, keys[role], store)
    assert sent > 100, sent  # the run reached the routes
    assert KeyStore(store).user_for(keys[role])  # and its key worked to the end
    assert not failures, f"{len(failures)} contract failures in {sent} requests:\n" + "\n".join(sorted(set(failures)))


# --------------------------------------------------------------------------- what the fuzzer does not send


@pytest.fixture(scope="module")
def user_client(contract_app):
    from starlette.testclient import TestClient

    app, keys, _ = contract_app
    with TestClient(app, headers={"Authorization": f"Bearer {keys['user']}"}) as client:
        yield client


LIMITS = [
    ("/v1/recall", {"query": "q" * 8001}, 422, "it must be at most 8000 characters"),
    ("/v1/recall", {"query": "q", "k": 201}, 422, "Got k=201; it must be a whole number from 1 to 200"),
    ("/v1/recall", {"query": "q", "budget_tokens": 10_000_001}, 422, "at most 10,000,000"),
    ("/v1/recall", {"query": "q", "context": ["turn"] * 65}, 422, "it holds at most 64 turns"),
    ("/v1/memories", [{"text": f"m{i}"} for i in range(1001)], 422, "a batch holds at most 1000"),
    ("/v1/memories", {"text": "x", "id": "i" * 513}, 422, "at most 512"),
    ("/v1/feedback", {"query": "q", "memory_ids": ["m"] * 101}, 422, "memory_ids"),
    ("/v1/feedback", {"query": "q" * 4001, "memory_ids": ["m"]}, 422, "query"),
]


@pytest.mark.parametrize("path, body, status, says", LIMITS)
def test_limits_are_enforced_with_a_sentence(user_client, path, body, status, says):
    """Protects: the limits docs/http-api.md lists are the server's, each refused with
    a sentence naming it."""
    response = user_client.post(path, json=body)
    assert response.status_code == status and says in response.json()["detail"], response.text[:300]


def test_limits_are_declared_in_the_schema(contract_app):
    """Protects: the OpenAPI schema states the limits the server enforces."""
    app, _, _ = contract_app
    spec = app.openapi()
    recall = spec["components"]["schemas"]["RecallRequest"]["properties"]
    assert recall["query"]["maxLength"] == 8000 and recall["query"]["minLength"] == 1
    assert [b.get("maximum") for b in recall["k"]["anyOf"]][0] == 200
    assert [b.get("maximum") for b in recall["budget_tokens"]["anyOf"]][0] == 10_000_000
    assert [b.get("minItems") for b in recall["types"]["anyOf"]][0] == 1
    batch = spec["paths"]["/v1/memories"]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"][2]
    assert (batch["minItems"], batch["maxItems"], batch["uniqueItems"]) == (1, 1000, True)
    assert spec["components"]["schemas"]["MemoryPatch"]["minProperties"] == 1
    assert sorted(spec["paths"]["/v1/feedback"]["post"]["responses"]) == ["201", "401", "403", "404", "411", "413",
                                                                           "422", "429", "503"]


def test_an_oversized_body_is_refused_before_it_is_read(user_client):
    response = user_client.post("/v1/memories", content=b" " * (32 * 1024 * 1024 + 1),
                                headers={"content-type": "application/json"})
    assert response.status_code == 413 and "the limit is 33,554,432" in response.json()["detail"]


@pytest.mark.parametrize("path", ["/v1/recall", "/v1/memories", "/v1/feedback"])
def test_a_body_that_is_not_utf8_gets_a_422_naming_the_byte(user_client, path):
    response = user_client.post(path, content=b'{"query": "caf\xe9"}', headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "a request body must be JSON encoded in UTF-8, and byte 0xe9 at position 14 is not UTF-8" \
        in response.json()["detail"] and "Encode the body as UTF-8" in response.json()["detail"]


def test_a_method_a_path_does_not_take_gets_405_naming_all_it_takes(user_client):
    for method, path, allowed in [("GET", "/v1/memories/some/id", "DELETE, PATCH"), ("PUT", "/v1/settings",
                                  "DELETE, GET, PATCH"), ("TRACE", "/v1/admin/compact", "POST"),
                                  ("OPTIONS", "/v1/recall", "POST")]:
        response = user_client.request(method, path)
        assert response.status_code == 405 and response.headers["allow"] == allowed, (method, path, response.text)
        assert f"Got {method} {path}; this path takes" in response.json()["detail"]
    missing = user_client.get("/v1/nothing")
    assert missing.status_code == 404 and "there is no such path" in missing.json()["detail"]


def test_no_cors_headers_by_default(contract_app, user_client):
    """Protects: no CORS middleware: a browser page of another origin cannot call the API."""
    app, _, _ = contract_app
    assert [m.cls.__name__ for m in app.user_middleware] == ["Gate"]
    origin = {"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"}
    for response in (user_client.options("/v1/recall", headers=origin),
                     user_client.get("/v1/settings", headers={"Origin": "https://elsewhere.example"})):
        assert not any(h.lower().startswith("access-control-") for h in response.headers), response.headers


def test_a_key_over_its_rate_limit_gets_429_with_retry_after(tenant_store, tmp_path):
    """Protects: with ``rate_limit`` set, each key has its own token bucket; the one over
    it waits (429, Retry-After), the others do not; unset, nothing is limited."""
    from starlette.testclient import TestClient

    from helix_ray.store.keys import KeyStore

    store = tmp_path / "store"
    shutil.copytree(tenant_store[0], store)
    busy, calm = KeyStore(store).create("alice")[0], KeyStore(store).create("bob")[0]
    with ingress_app(store, rate_limit=0.5, rate_burst=3) as app, TestClient(app) as client:
        answers = [client.get("/v1/settings", headers={"Authorization": f"Bearer {busy}"}) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert answers[-1].headers["retry-after"] == "2" and "more than 0.5 requests per second" \
            in answers[-1].json()["detail"]
        assert client.get("/v1/settings", headers={"Authorization": f"Bearer {calm}"}).status_code == 200
        assert client.get("/healthz").status_code == 200  # no key, no bucket
    with ingress_app(store) as app, TestClient(app) as client:
        assert {client.get("/v1/settings", headers={"Authorization": f"Bearer {busy}"}).status_code
                for _ in range(30)} == {200}


def test_the_rate_limiter_refills_at_its_rate():
    from helix_ray.serve.ratelimit import RateLimiter

    limiter = RateLimiter(rate=2.0, burst=2)
    assert [limiter.wait("k", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert limiter.wait("k", now=0.25) == 0.25  # half a token back
    assert limiter.wait("k", now=0.5) == 0.0 and limiter.wait("other", now=0.5) == 0.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        RateLimiter(rate=0, burst=1)
