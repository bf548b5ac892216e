"""``DELETE /v1/users/{user}`` on the HTTP application (the ingress over the inline graph
and the Writer, in this process without Ray; a real store and DuckDB file): the user's
memories, online writes, deletions, feedback, recall hits and key are gone from every
file of the store, the other user's memories are still recalled, and only an admin key
may ask.

One store (two users with six memories each, every text tagged with a string found
nowhere else) is built once with the real ingest; each test serves a copy."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import TENANT_TOPICS, audit_without, files_holding, ingress_app, write_jsonl

#: The user forgotten and a tag in each of their texts; the user kept and theirs.
GONE, GONE_TAG, KEPT, KEPT_TAG = "wombat-7", "XYLEM-5082", "kit", "kept-note"
QUERY = "database migrations and backups"


def _records(user: str, tag: str) -> list[dict]:
    return [{"id": f"{user}-{i}", "user": user, "text": f"{TENANT_TOPICS[i]} ({tag} {i})",
             "created_at": f"2025-03-{1 + i:02d}T10:00:00Z"} for i in range(6)]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    from helix_ray.ingest.run import ingest

    folder = tmp_path_factory.mktemp("forget")
    source = write_jsonl(folder / "records.jsonl", _records(GONE, GONE_TAG) + _records(KEPT, KEPT_TAG))
    report = ingest([source], folder / "store", runner="local", show_progress=False)
    assert report.published and report.accepted == 12, report
    return folder / "store"


@pytest.fixture()
def served(built, tmp_path):
    """(client, {role: key}, store): the application over a copy of the store, with an
    admin key (of a third user) and a key for each user."""
    from starlette.testclient import TestClient

    from helix_ray.store.keys import KeyStore

    store = tmp_path / "store"
    shutil.copytree(built, store)
    keys = {"admin": KeyStore(store).create("root", admin=True)[0],
            GONE: KeyStore(store).create(GONE)[0], KEPT: KeyStore(store).create(KEPT)[0]}
    with ingress_app(store) as app, TestClient(app) as client:
        yield client, keys, store


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _recall(client, key: str) -> dict:
    answer = client.post("/v1/recall", json={"query": QUERY, "k": 8}, headers=_as(key))
    assert answer.status_code == 200, answer.text
    return answer.json()


def _use(client, keys: dict[str, str]) -> None:
    """Each user writes online (the delta), deletes a memory (a tombstone), gives
    feedback and recalls (the hits reach the access log)."""
    from helix_ray.serve.app import ACCESS_FLUSH_S

    for user, tag in ((GONE, GONE_TAG), (KEPT, KEPT_TAG)):
        written = client.post("/v1/memories", headers=_as(keys[user]),
                              json={"id": f"{user}-online", "text": f"The gateway rejects large uploads ({tag} online)."})
        assert written.status_code == 201, written.text
        assert client.delete(f"/v1/memories/{user}-5", headers=_as(keys[user])).status_code == 200
        given = client.post("/v1/feedback", headers=_as(keys[user]), json={"query": QUERY, "memory_ids": [f"{user}-1"]})
        assert given.status_code == 201, given.text
        assert f"{user}-online" in [item["id"] for item in _recall(client, keys[user])["items"]]
    time.sleep(ACCESS_FLUSH_S + 0.5)  # the ingress sends recall hits to the Writer in batches


def test_an_admin_forgets_a_user_and_no_file_holds_a_byte_of_theirs(served):
    from helix_ray.serve.app import ACCESS_FLUSH_S
    from helix_ray.store.keys import KeyStore

    client, keys, store = served
    _use(client, keys)
    kept_before = {item["id"] for item in _recall(client, keys[KEPT])["items"]}
    assert files_holding(store, GONE_TAG) and files_holding(store, GONE)

    refused = client.delete(f"/v1/users/{GONE}", headers=_as(keys[KEPT]))
    assert refused.status_code == 403 and "or forget a user" in refused.json()["detail"]
    assert client.delete(f"/v1/users/{GONE}").status_code == 401
    _recall(client, keys[GONE])  # hits the ingress still holds when the user is forgotten
    answer = client.delete(f"/v1/users/{GONE}", headers=_as(keys["admin"]))
    assert answer.status_code == 200, answer.text
    gone = answer.json()
    assert (gone["memories"], gone["chunks"], gone["feedback"], gone["keys"]) == (6, 0, 1, 1), gone
    assert gone["online_writes"] == 2 and gone["inbox_lines"] >= 1 and gone["access_rows"] >= 1, gone
    assert gone["compacted"] and gone["generation"] == 2, gone

    time.sleep(ACCESS_FLUSH_S + 0.5)  # the Writer gets those hits, and does not log them
    assert files_holding(store, GONE_TAG) == [] and files_holding(store, GONE) == []
    done = [(r["outcome"], r["status"]) for r in audit_without(store, GONE_TAG)
            if (r["action"], r["target"]) == ("forget-user", GONE)]
    assert done == [("refused", 403), ("ok", 200)]  # the 401 has no key to name
    assert client.post("/v1/recall", json={"query": QUERY}, headers=_as(keys[GONE])).status_code == 401
    assert kept_before <= {item["id"] for item in _recall(client, keys[KEPT])["items"]}
    assert client.delete(f"/v1/users/{GONE}", headers=_as(keys["admin"])).status_code == 404

    # The user comes back with a new key: the served generation and delta hold nothing of theirs.
    again = KeyStore(store).create(GONE)[0]
    deadline = time.monotonic() + 20
    while (result := _recall(client, again))["generation"] != gone["generation"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert result["generation"] == gone["generation"] and result["items"] == [], result


def test_without_compact_the_generation_serves_them_until_asked_again(served):
    """``compact=false`` erases the database, delta and keys at once and leaves the
    generation as it is; a second DELETE finds the user there and compacts."""
    client, keys, store = served
    _use(client, keys)
    first = client.delete(f"/v1/users/{GONE}", params={"compact": "false"}, headers=_as(keys["admin"]))
    assert first.status_code == 200 and first.json()["memories"] == 6 and not first.json()["compacted"], first.text
    assert first.json()["generation"] == 1
    assert GONE_TAG.encode() not in (store / "helix.duckdb").read_bytes()
    assert [p for p in files_holding(store, GONE_TAG) if not p.startswith("generations/")] == []
    second = client.delete(f"/v1/users/{GONE}", headers=_as(keys["admin"]))
    assert second.status_code == 200, second.text
    assert second.json()["memories"] == 0 and second.json()["compacted"] and second.json()["generation"] == 2
    assert files_holding(store, GONE_TAG) == []


@pytest.mark.parametrize("path, status, says", [
    ("/v1/users/nobody-here", 404, "Got user 'nobody-here'; this store holds nothing of that user"),
    ("/v1/users/%20", 422, "it must be a non-empty user id"),
])
def test_an_unknown_or_blank_user_changes_nothing(served, path, status, says):
    client, keys, store = served
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file() and p.parent.name != "audit"}
    answer = client.delete(path, headers=_as(keys["admin"]))
    assert answer.status_code == status and says in answer.json()["detail"], answer.text
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file() and p.parent.name != "audit"} == before
    last = audit_without(store, GONE_TAG)[-1]
    assert (last["action"], last["outcome"], last["status"]) == ("forget-user", "refused", status)
