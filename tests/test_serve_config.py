"""The Serve application's configuration and construction, no Ray: the shipped Serve
configs against the graphs they deploy, ``build_app`` and ``initialise`` on new and
broken stores, and the API keys that map a request to its user."""

from __future__ import annotations

import json

import pytest

from tests.helpers import tenant_records


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


@pytest.mark.parametrize("graph", ["split", "compact", "inline"])
def test_every_deployment_bounds_its_callers_queue(graph, tenant_store):
    """Protects the overload contract: no deployment of any graph keeps Serve's unbounded
    default queue (``max_queued_requests=-1``), and the proxy's refusal of the ingress
    says when to retry (a 503 with Retry-After, as Helix's own 503s)."""
    from ray.serve._private.build_app import build_app as serve_build

    from helix_ray.serve.app import ServeArgs, build_app
    from helix_ray.serve.responses import RETRY_AFTER_S

    built = serve_build(build_app(ServeArgs(store=str(tenant_store[0]), graph=graph, max_queued_requests=7)),
                        name="helix").deployments
    assert {d.name: d.max_queued_requests for d in built} == {d.name: 7 for d in built}
    (ingress,) = (d for d in built if d.name == "HelixAPI")
    assert (ingress.backpressure_config.status_code, ingress.backpressure_config.retry_after_s) == \
        (503, RETRY_AFTER_S)
    assert ServeArgs(store="x").max_queued_requests > 0


def test_a_full_queue_behind_the_ingress_is_refused_in_helix_words():
    """Protects the ingress's half of the overload contract (the flood test in
    test_serve_http.py may see only the proxy's half on a busy host): a handle call Serve
    refuses because the callee's queue is full answers Helix's 503 with Retry-After,
    saying that nothing was changed, not Serve's plain text."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from ray.serve.exceptions import BackPressureError

    from helix_ray.serve.app import RefusalsInHelixWords
    from helix_ray.serve.responses import RETRY_AFTER_S

    app = FastAPI()
    app.router.route_class = RefusalsInHelixWords

    @app.post("/v1/memories")
    async def add() -> dict[str, str]:
        raise BackPressureError(num_queued_requests=5, max_queued_requests=4)

    answer = TestClient(app).post("/v1/memories", json={})
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == str(RETRY_AFTER_S)
    detail = answer.json()["detail"]
    assert "POST /v1/memories" in detail and "has more calls queued than it takes" in detail
    assert "nothing was changed" in detail and "Retry-After" in detail


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
    from helix_ray.ingest.run import ingest, initialise

    source = tmp_path / "two.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()[:2]))
    store = tmp_path / "store"
    assert ingest([source], store, runner="local", show_progress=False).published
    (store / "CURRENT").unlink()
    shutil.rmtree(store / "generations")
    with pytest.raises(StoreError, match="generation files are missing"):
        initialise(store)
    assert not (store / "CURRENT").exists()


def test_keys_store_only_hashes_and_map_to_users(tmp_path):
    import stat

    from helix_ray.errors import Unauthorized
    from helix_ray.store.keys import KeyStore

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

    from helix_ray.errors import Forbidden, InvalidArgument
    from helix_ray.serve.app import HelixAPI
    from helix_ray.store.keys import KeyStore

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
