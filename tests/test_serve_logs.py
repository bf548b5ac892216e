"""No API key, memory text or recall query reaches a log at the default log level.

One `helix serve` (a subprocess, as a user runs it, its stdout and stderr in files) on a
Ray whose session folder this test chooses (``RAY_TMPDIR``), fed requests whose keys,
texts and queries carry unique markers: writes (one and a batch), recalls, a PATCH, a
DELETE, feedback, a wrong key, bodies that fail validation, bodies that are not UTF-8
JSON, admin calls and a forced compaction. Once it stopped, every byte of its output,
of every log file of that Ray session (driver, GCS, raylet, workers, Serve's controller,
proxy and replicas) and of the store's audit log is searched for them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from helix_ray.runtime import spare_port
from helix_ray.store import audit
from tests.helpers import leaks, wait_healthy

httpx = pytest.importorskip("httpx")


def _helix(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helix_ray.cli", *args], capture_output=True, text=True,
                          timeout=300, check=True)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM, as a supervisor stops `helix serve`; its exit code (killed after 120 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _exercise(url: str, user_key: str, admin_key: str, marks: dict[str, str]) -> None:
    """Every kind of request the server answers, each carrying markers, with the
    answers they must get (so the markers went where they were meant to)."""
    user = {"Authorization": f"Bearer {user_key}"}
    admin = {"Authorization": f"Bearer {admin_key}"}
    text, batch, query, patch = marks["memory"], marks["batch"], marks["query"], marks["patch"]
    with httpx.Client(base_url=url, timeout=120) as client:
        def call(method: str, path: str, status: int, headers: dict[str, str] = user, **kw):
            answer = client.request(method, path, headers=headers, **kw)
            assert answer.status_code == status, (method, path, answer.status_code, answer.text)
            return answer

        one = call("POST", "/v1/memories", 201, json={"text": f"{text} the gateway rotates its keys nightly"})
        mid = one.json()["ids"][0]
        call("POST", "/v1/memories", 201, json={"memories": [
            {"text": f"{batch} the billing database moved to Postgres", "type": "semantic"},
            {"text": f"{batch} deploys run the migrations first", "project": "atlas"}]})
        call("POST", "/v1/recall", 200, json={"query": f"{query} when does the gateway rotate keys",
                                              "budget_tokens": 300, "explain": True})
        call("POST", "/v1/feedback", 201, json={"query": f"{query} feedback", "memory_ids": [mid]})
        call("PATCH", f"/v1/memories/{mid}", 200, json={"text": f"{patch} the gateway rotates its keys weekly"})
        # Refused: a wrong key (key-shaped, and not), bodies the models reject, bodies
        # that are not UTF-8 JSON, a user's key on an admin route, an unknown memory.
        for wrong in (f"hx_0badc0de_{marks['wrong_key']}", marks["wrong_key"]):
            call("POST", "/v1/recall", 401, headers={"Authorization": f"Bearer {wrong}"},
                 json={"query": f"{query} with a wrong key", "budget_tokens": 300})
        call("POST", "/v1/recall", 422, json={"query": f"{query} invalid", "budget_tokens": f"{query} tokens",
                                              f"{query}_field": text})
        call("POST", "/v1/recall", 422, json={"query": f"{query} too long " + "x" * 9000, "budget_tokens": 300})
        call("POST", "/v1/memories", 422, json={"text": f"{text} invalid", "salience": f"{text}"})
        call("POST", "/v1/memories", 422, json=[{"text": f"{batch} fine"}, {"text": f"{batch} bad", "bogus": 1}])
        call("PATCH", f"/v1/memories/{mid}", 422, json={"text": f"{patch} invalid", "salience": f"{patch}"})
        for path in ("/v1/memories", "/v1/recall"):
            call("POST", path, 422, content=f'{{"text": "{text}", "query": "{query}" \xff}}'.encode("latin-1"),
                 headers={**user, "Content-Type": "application/json"})
            call("POST", path, 422, content=f'{{"text": "{text}", "query": "{query}"'.encode(),
                 headers={**user, "Content-Type": "application/json"})
        call("PATCH", f"/v1/memories/{mid}-none", 404, json={"text": f"{patch} for no memory"})
        # Refused by the Writer (another replica), whose refusal quotes the record.
        call("POST", "/v1/memories", 422, json={"text": f"{text} of no known type", "type": "no-such-type"})
        call("POST", "/v1/memories", 422, json={"memories": [{"text": f"{batch} undated", "created_at": "someday"}]})
        call("PATCH", f"/v1/memories/{mid}", 422, json={"text": f"{patch} of no known type", "type": "no-such-type"})
        call("POST", "/v1/admin/compact", 403)
        # Admin calls, and a compaction that folds every write into a generation, so the
        # Writer's and the ingest's code paths log what they log.
        call("GET", "/v1/stats", 200, headers=admin)
        call("GET", "/v1/settings", 200, headers=admin)
        call("GET", "/v1/admin/audit", 200, headers=admin)
        call("POST", "/v1/admin/compact", 200, headers=admin)
        call("POST", "/v1/recall", 200, json={"query": f"{query} after compaction", "budget_tokens": 300})
        call("DELETE", f"/v1/memories/{mid}", 200)
        call("POST", "/v1/recall", 200, json={"query": f"{query} after the delete", "budget_tokens": 300})


def test_a_callers_mistake_leaves_a_replica_without_its_sentence_in_str():
    """Serve logs what a replica raises with ``str(exc)``: a 4xx sentence, which may quote
    the request, reaches the caller (``message_of``) and not that string; a 5xx keeps it."""
    from helix_ray.errors import InvalidArgument, StoreError
    from helix_ray.serve.errors import ReplicaError, boundary, message_of, status_of

    @boundary
    def refuse(error: Exception) -> None:
        raise error

    for error, status, logged in ((InvalidArgument("text", "zq7 a memory", "it is too long"), 422, False),
                                  (StoreError("zq7 the store is being swapped"), 503, True)):
        with pytest.raises(ReplicaError) as caught:
            refuse(error)
        assert status_of(caught.value) == status and message_of(caught.value) == str(error)
        assert ("zq7" in str(caught.value)) is logged, str(caught.value)


@pytest.mark.ray
@pytest.mark.slow
def test_no_key_text_or_query_in_any_log(tmp_path):
    # Ray's session folder, short: its unix sockets' paths have a length limit.
    ray_tmp = Path(tempfile.mkdtemp(prefix="hxlog", dir="/tmp"))
    store = tmp_path / "store"
    port = spare_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(ray_tmp)
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    marks = {kind: f"zq7{kind}{uuid.uuid4().hex[:16]}" for kind in ("memory", "batch", "query", "patch")}
    marks["wrong_key"] = f"zq7wrongkey{uuid.uuid4().hex}"
    try:
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(store),
                                     "--port", str(port)], stdout=stdout, stderr=stderr, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            healthy = wait_healthy(url, proc)
            if healthy:
                user_key = _helix("keys", "create", "--store", str(store), "--user", "alice").stdout.split()[-1]
                admin_key = _helix("keys", "create", "--store", str(store), "--user", "ops",
                                   "--admin").stdout.split()[-1]
                _exercise(url, user_key, admin_key, marks)
        finally:
            code = _stop(proc)
        assert healthy, f"helix serve never became healthy:\n{out.read_text()}\n{err.read_text()}"
        assert code == 0, f"helix serve exited {code}:\n{err.read_text()}"
        needles = dict(marks)
        for name, key in (("user key", user_key), ("admin key", admin_key)):
            needles[name] = key
            needles[f"{name}'s secret"] = key.split("_", 2)[2]
        sessions = [p for p in (ray_tmp / "ray").glob("session_*") if not p.is_symlink()]
        assert len(sessions) == 1, sessions
        logs = [p for p in (sessions[0] / "logs").rglob("*") if p.is_file() and not p.is_symlink()]
        for part in ("replica_helix_HelixAPI", "replica_helix_Writer", "controller", "proxy", "python-core-driver"):
            assert any(part in p.name for p in logs), (part, logs)
        files = [out, err, *logs, *audit.files(store)]
        assert leaks([out], {"address": f"127.0.0.1:{port}"}), "the search missed what helix serve printed"
        found = leaks(files, needles)
        read = sum(p.stat().st_size for p in files)
        print(f"{len(files)} files, {read / 2**20:.2f} MiB read: {len(found)} hits")
        assert not found, "secrets in the logs:\n" + "\n".join(found)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
