"""The audit log of a store: one JSON line per admin action, appended, never rewritten.

An admin action is what changes a store for every user or erases one — API keys made and
revoked, compaction, the query adapter, the live settings, forgetting a user, a backup
and a restore — whether the server did it (an admin key over HTTP:
:mod:`helix_ray.serve.audit`) or a command on the host (``helix keys``, ``helix
forget-user`` …). A record says when (UTC), who (``key:<key id>`` and the key's user, or
``cli:<os user>``), what (``action``, ``target``, ``params``) and how it ended: ``ok``,
``refused`` (the caller's mistake or a lack of rights, with its status and sentence) or
``failed``. It never holds a key, a memory's text or a query: the callers pass names,
ids, counts and settings, and anything shaped like an API key is cut to its id before
the line is written.

The log is ``<store>/audit/audit.jsonl``. Each record is one ``write`` of one line under
an advisory lock (``audit/.audit.lock``: the ingress replicas and the ``helix`` commands
append to the same file), flushed to disk (``fsync``) before the action's answer is
given. At :data:`ROTATE_BYTES` the file is renamed ``audit-<UTC time>.jsonl`` and a new
one begun; Helix deletes none of them, and :func:`read` reads them all in order. Forgetting
a user leaves the log alone: its records name the user, never their memories.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import getpass
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Literal

AUDIT_DIR = "audit"
AUDIT_FILE = "audit.jsonl"
#: Size at which the log is rotated (bytes): tens of thousands of records.
ROTATE_BYTES = 16 * 1024 * 1024
#: Longest ``params`` (JSON characters) and ``detail`` (characters) a record keeps.
MAX_PARAMS_CHARS = 4096
MAX_DETAIL_CHARS = 600

Outcome = Literal["ok", "refused", "failed"]

#: An API key (``hx_<key id>_<secret>``): only its id is written.
_KEY = re.compile(r"hx_([0-9a-f]{8})_[A-Za-z0-9_-]{8,}")


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    """One admin action. ``status``: the HTTP status of the answer, or a command's exit
    code (``actor`` says which); ``detail``: the sentence of a refusal or failure;
    ``result``: counts the action reported (memories erased, the generation published)."""

    time: str
    actor: str
    actor_user: str | None
    action: str
    target: str | None
    params: dict[str, Any]
    outcome: Outcome
    status: int | None
    detail: str | None = None
    result: dict[str, Any] | None = None


def local_actor() -> str:
    """The actor of a command run on the host: ``cli:<os user>``."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's bare uid)
        name = f"uid{os.getuid()}"
    return f"cli:{name}"


def is_store(folder: str | Path) -> bool:
    """Whether ``folder`` holds a Helix store (a database or a published generation):
    the only folders an audit record is written into (a refused command never creates
    one)."""
    from helix_ray.store.db import DB_FILE

    folder = Path(folder)
    return (folder / DB_FILE).is_file() or (folder / "CURRENT").is_file()


def append(store: str | Path, *, actor: str, action: str, outcome: Outcome = "ok", actor_user: str | None = None,
           target: str | None = None, params: dict[str, Any] | None = None, status: int | None = None,
           detail: str | None = None, result: dict[str, Any] | None = None) -> AuditRecord | None:
    """Append one record to ``store``'s audit log, on disk when this returns; None (and
    nothing written) when ``store`` is not a store folder."""
    store = Path(store)
    if not is_store(store):
        return None
    record = AuditRecord(time=dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds"), actor=actor,
                         actor_user=actor_user, action=action, target=target, params=_bounded(params or {}),
                         outcome=outcome, status=status, detail=_cut(detail), result=result)
    line = _KEY.sub(r"hx_\1_…", json.dumps(dataclasses.asdict(record), ensure_ascii=False, default=str)) + "\n"
    folder = store / AUDIT_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    with open(folder / ".audit.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            path = folder / AUDIT_FILE
            new = _rotate(path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            if new:  # the file's name in its folder survives a crash too
                from helix_ray.store.publish import fsync_path

                fsync_path(folder)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return record


def read(store: str | Path, *, since: dt.datetime | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The newest ``limit`` records (all: None) at or after ``since``, oldest first. A
    line cut short by a crash while it was written (only the last one can be) is
    skipped."""
    out: list[dict[str, Any]] = []
    for record in _records(files(store)):
        if since is not None and dt.datetime.fromisoformat(record["time"]) < since:
            continue
        out.append(record)
        if limit is not None and len(out) > 2 * limit:
            del out[:-limit]
    return out[-limit:] if limit is not None else out


def files(store: str | Path) -> list[Path]:
    """The log's files, oldest first: the rotated ones, then the current one."""
    folder = Path(store) / AUDIT_DIR
    rotated = sorted(folder.glob("audit-*.jsonl"))
    current = folder / AUDIT_FILE
    return rotated + ([current] if current.is_file() else [])


def _records(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def _rotate(path: Path) -> bool:
    """Rename a full log aside (under the lock); whether a new file begins."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return True
    if size < ROTATE_BYTES:
        return False
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    os.replace(path, path.with_name(f"audit-{stamp}.jsonl"))
    return True


def _bounded(params: dict[str, Any]) -> dict[str, Any]:
    """``params``, or a note of their size when they would make a long line."""
    size = len(json.dumps(params, default=str))
    return params if size <= MAX_PARAMS_CHARS else {"truncated": True, "json_chars": size}


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_DETAIL_CHARS:
        return text
    return text[:MAX_DETAIL_CHARS - 1] + "…"
