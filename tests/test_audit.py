"""The audit log of admin actions (helix_ray/store/audit.py, helix_ray/serve/audit.py):
what the HTTP admin routes, the key store and the ``helix`` commands append, what they
never write, and how ``helix audit`` and ``GET /v1/admin/audit`` read it back.

The HTTP application runs in this process (:func:`tests.helpers.ingress_app`) over a
private copy of the tenant store, a real DuckDB file.
"""

from __future__ import annotations

import getpass
import json
import shutil

import pytest

from tests.helpers import ingress_app

CLI_ACTOR = f"cli:{getpass.getuser()}"


@pytest.fixture()
def store(tenant_store, tmp_path):
    folder = tmp_path / "store"
    shutil.copytree(tenant_store[0], folder)
    return folder


def records(store) -> list[dict]:
    from helix_ray.store import audit

    return audit.read(store)


def test_admin_requests_are_recorded_with_actor_params_and_outcome(store, tenant_store):
    """Protects: every admin route appends one record before its answer — ok, refused
    (403 at the gate, 422 from the route) — naming the key and its user; reading the log
    is admin only; no key and no memory text reaches the file."""
    from starlette.testclient import TestClient

    from helix_ray.store.keys import KeyStore

    user_key, user_record = KeyStore(store).create("bob")
    admin_key, admin_record = KeyStore(store).create("alice", admin=True)
    dave_key, dave_record = KeyStore(store).create("dave", admin=True)  # forgets dave, and with them this key
    made = records(store)
    assert [(r["action"], r["actor"], r["target"], r["params"]["admin"], r["outcome"]) for r in made] == [
        ("key.create", CLI_ACTOR, f"key:{user_record.key_id}", False, "ok"),
        ("key.create", CLI_ACTOR, f"key:{admin_record.key_id}", True, "ok"),
        ("key.create", CLI_ACTOR, f"key:{dave_record.key_id}", True, "ok")]
    with ingress_app(store) as app, TestClient(app) as client:
        user = {"Authorization": f"Bearer {user_key}"}
        admin = {"Authorization": f"Bearer {admin_key}"}
        assert client.patch("/v1/settings", json={"fusion": {"k": 30}}, headers=user).status_code == 403
        assert client.patch("/v1/settings", json={"fusion": {"k": 30}}, headers=admin).status_code == 200
        assert client.patch("/v1/settings", json={"fusion": {"k": 0}}, headers=admin).status_code == 422
        assert client.delete("/v1/settings", headers=admin).status_code == 200
        assert client.post("/v1/recall", json={"query": "billing database", "budget_tokens": 100},
                           headers=user).status_code == 200  # not an admin action: not recorded
        assert client.post("/v1/admin/compact", headers=admin).status_code == 200
        dave = {"Authorization": f"Bearer {dave_key}"}
        gone = client.delete("/v1/users/dave", params={"compact": "false"}, headers=dave)
        assert gone.status_code == 200, gone.text
        assert client.get("/v1/admin/audit", headers=user).status_code == 403
        read = client.get("/v1/admin/audit", params={"limit": 3}, headers=admin)
        assert read.status_code == 200, read.text
        assert client.get("/v1/admin/audit", params={"limit": 0}, headers=admin).status_code == 422
        assert client.get("/v1/admin/audit", headers={"Authorization": "Bearer hx_00000000_wrongwrongwrongwrong"}
                          ).status_code == 401  # no valid key: not recorded

    log = records(store)[len(made):]
    seen = [(r["action"], r["actor"], r["actor_user"], r["outcome"], r["status"]) for r in log]
    bob, ops = f"key:{user_record.key_id}", f"key:{admin_record.key_id}"
    assert seen == [("settings.patch", bob, "bob", "refused", 403), ("settings.patch", ops, "alice", "ok", 200),
                    ("settings.patch", ops, "alice", "refused", 422), ("settings.reset", ops, "alice", "ok", 200),
                    ("compact", ops, "alice", "ok", 200),
                    ("forget-user", f"key:{dave_record.key_id}", "dave", "ok", 200),  # named as it was
                    ("audit.read", bob, "bob", "refused", 403), ("audit.read", ops, "alice", "ok", 200),
                    ("audit.read", ops, "alice", "refused", 422)]
    assert log[0]["detail"].startswith("This API key (user 'bob') cannot change") and log[0]["params"] == {}
    assert log[1]["params"] == {"fusion": {"k": 30}} and log[1]["detail"] is None
    assert "Got settings={'fusion': {'k': 0}}" in log[2]["detail"]
    assert log[4]["result"]["published"] is False  # nothing pending: its answer's flags and counts
    forgot = log[5]
    assert (forgot["target"], forgot["params"], forgot["result"]["memories"]) == ("dave", {"compact": "false"}, 11)
    # What GET /v1/admin/audit answered: the newest three records of the log as it was.
    assert [r["action"] for r in read.json()["records"]] == ["compact", "forget-user", "audit.read"]

    raw = (store / "audit" / "audit.jsonl").read_bytes()
    for key in (user_key, admin_key, dave_key):
        assert key.split("_", 2)[2].encode() not in raw  # hx_<id>_<secret>: not the secret
    texts = [r["text"] for r in tenant_store[1].values() if r["user"] == "dave"]
    assert not [text for text in texts if text.encode() in raw]
    assert oct((store / "audit" / "audit.jsonl").stat().st_mode & 0o777) == "0o600"


def test_helix_audit_prints_the_log_and_records_the_commands(store, capsys):
    """Protects: ``helix forget-user`` and ``helix keys revoke`` are recorded as done by
    ``cli:<os user>`` (a refusal too, with its exit code and sentence); ``helix audit``
    prints the newest records, filters by time and prints JSON lines."""
    from helix_ray.cli import main
    from helix_ray.store.keys import KeyStore

    _, record = KeyStore(store).create("carol")
    assert main(["keys", "revoke", "--store", str(store), record.key_id]) == 0
    assert main(["keys", "revoke", "--store", str(store), "ffffffff"]) == 2
    assert main(["forget-user", "--store", str(store), "carol"]) == 0
    assert main(["forget-user", "--store", str(store), "nobody-here"]) == 1
    capsys.readouterr()

    assert main(["audit", "--store", str(store), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["action"], r["target"], r["outcome"], r["status"]) for r in lines] == [
        ("key.create", f"key:{record.key_id}", "ok", None), ("key.revoke", f"key:{record.key_id}", "ok", None),
        ("key.revoke", "key:ffffffff", "refused", 2), ("forget-user", "carol", "ok", 0),
        ("forget-user", "nobody-here", "refused", 1)]
    assert {r["actor"] for r in lines} == {CLI_ACTOR} and "no key of this store has that id" in lines[2]["detail"]

    assert main(["audit", "--store", str(store), "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "forget-user carol  ok 0" in out[0] and f"  {CLI_ACTOR}  " in out[0] and '"compact": true' in out[0]
    assert "forget-user nobody-here  refused 1" in out[1] and out[-1].startswith("-- 2 records (log: ")
    assert main(["audit", "--store", str(store), "--since", lines[-1]["time"]]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("-- 1 record ")
    assert main(["audit", "--store", str(store / "missing")]) == 2
    assert "holds no Helix store" in capsys.readouterr().err


def test_the_log_rotates_and_reads_across_files(store, monkeypatch):
    """Protects: a full log is renamed aside, never deleted, and read with the new one in
    order; a line cut short by a crash is skipped; a folder that is not a store gets
    nothing; anything shaped like a key is cut to its id."""
    from helix_ray.store import audit

    monkeypatch.setattr(audit, "ROTATE_BYTES", 600)
    for n in range(8):
        audit.append(store, actor="cli:test", action="compact", params={"n": n, "note": "hx_0123abcd_" + "s" * 30})
    assert len(audit.files(store)) > 2 and audit.files(store)[-1].name == "audit.jsonl"
    with open(store / "audit" / "audit.jsonl", "a") as fh:
        fh.write('{"time": "2026-')  # a crash in the middle of a record
    assert [r["params"]["n"] for r in audit.read(store)] == list(range(8))
    assert [r["params"]["n"] for r in audit.read(store, limit=3)] == [5, 6, 7]
    assert audit.read(store)[0]["params"]["note"] == "hx_0123abcd_…"
    assert audit.append(store / "elsewhere", actor="cli:test", action="compact") is None
    assert not (store / "elsewhere").exists()
