"""API keys mapped to users, kept in ``keys.json`` in the store folder.

A key is ``hx_<key id>_<secret>``: 8 hex characters naming the key (safe to log and to
revoke by) and 32 random bytes. Only ``sha256(key)`` is stored; the key itself is
printed once by ``helix keys create`` and never again. A random 256-bit secret needs no
slow password hash: nobody can guess it from its SHA-256 faster than guessing it.

Why a JSON file rather than a DuckDB table: while ``helix serve`` runs, its Writer
deployment holds the store's DuckDB file open read-write, and DuckDB then refuses every
other process, even read-only (see docs/operations.md). With a plain file,
``helix keys create`` works while the server runs, and every ingress replica picks a
new or revoked key up on its next request (one ``stat`` per request; the file is
replaced by rename, under an advisory lock so two concurrent creates do not lose one).
The file is created with mode 0600.

A key with ``admin`` set may also change what every user shares: the live retrieval
settings and compaction (``helix keys create --admin``). It still reads and writes only
its own user's memories.

A key may expire (``helix keys create --expires 90d``): from ``expires_at`` on it is
refused like a revoked one, with a sentence that says so. Rotation needs no restart:
create the new key, move clients to it, revoke (or let expire) the old one.

Every key made or revoked through :class:`KeyStore` is recorded in the store's audit log
(:mod:`helix_ray.store.audit`): its id, user, rights and expiry, never the key.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from helix_ray.errors import InvalidArgument, Unauthorized
from helix_ray.store import audit
from helix_ray.store.pointer import file_identity

KEYS_FILE = "keys.json"
_KEY = re.compile(r"^hx_([0-9a-f]{8})_[A-Za-z0-9_-]{20,}$")


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    user: str
    sha256: str
    created_at: str
    revoked: bool = False
    admin: bool = False
    expires_at: str | None = None  # ISO 8601 UTC; None: never


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


_DURATION = re.compile(r"^\s*(\d+)\s*([dhm])\s*$")


def parse_duration(text: str) -> dt.timedelta:
    """``90d``, ``12h`` or ``30m`` as a timedelta; :class:`InvalidArgument` otherwise."""
    match = _DURATION.match(text or "")
    if not match or int(match.group(1)) <= 0:
        raise InvalidArgument("--expires", text, "give a positive number of days, hours or minutes: 90d, 12h, 30m")
    unit = {"d": "days", "h": "hours", "m": "minutes"}[match.group(2)]
    return dt.timedelta(**{unit: int(match.group(1))})


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyStore:
    """The keys of one store folder."""

    def __init__(self, store: str | Path):
        self.store = Path(store)
        self.path = self.store / KEYS_FILE
        self._stat: tuple[int, int, int, int] | None = None
        self._by_id: dict[str, KeyRecord] = {}

    # ---------------------------------------------------------------- reading
    def _load(self) -> None:
        try:
            key = file_identity(self.path)
        except FileNotFoundError:
            self._stat, self._by_id = None, {}
            return
        if key == self._stat:
            return
        data = json.loads(self.path.read_text())
        self._by_id = {k["key_id"]: KeyRecord(**k) for k in data.get("keys", [])}
        self._stat = key

    def records(self) -> list[KeyRecord]:
        self._load()
        return list(self._by_id.values())

    def user_for(self, key: str | None) -> str:
        """The user ``key`` belongs to; :class:`Unauthorized` with the reason otherwise."""
        return self.record_for(key).user

    def record_for(self, key: str | None) -> KeyRecord:
        """The record of a valid ``key``; :class:`Unauthorized` with the reason otherwise."""
        if not key:
            raise Unauthorized(
                "No API key: send 'Authorization: Bearer <key>'. Create a key with "
                "`helix keys create --store DIR --user USER` (or start the server with --no-auth)."
            )
        match = _KEY.match(key)
        self._load()
        record = self._by_id.get(match.group(1)) if match else None
        if record is None or record.revoked or not hmac.compare_digest(record.sha256, _digest(key)):
            raise Unauthorized(
                "The API key is not valid for this store (unknown, revoked or mistyped). "
                "Create one with `helix keys create --store DIR --user USER`."
            )
        if record.expires_at is not None and dt.datetime.fromisoformat(record.expires_at) <= _now():
            raise Unauthorized(
                f"The API key {record.key_id} expired at {record.expires_at}. Create a new one with "
                "`helix keys create --store DIR --user USER [--expires 90d]`."
            )
        return record

    # ---------------------------------------------------------------- writing
    @contextmanager
    def _locked(self) -> Iterator[dict]:
        self.store.mkdir(parents=True, exist_ok=True)
        with open(self.store / ".keys.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(self.path.read_text()) if self.path.exists() else {"version": 1, "keys": []}
                yield data
                tmp = self.store / f".keys.{uuid.uuid4().hex[:8]}.json"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(json.dumps(data, indent=1))
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def create(self, user: str, *, admin: bool = False, expires_in: dt.timedelta | None = None,
               actor: str | None = None) -> tuple[str, KeyRecord]:
        """A new key for ``user``: (the key, to show once; its stored record).
        ``expires_in``: how long it is valid (None: until revoked). Recorded in the
        store's audit log as done by ``actor`` (default: ``cli:<os user>``)."""
        params = {"user": user, "admin": bool(admin), "expires_in_s": None if expires_in is None
                  else expires_in.total_seconds()}
        try:
            key, record = self._create(user, admin=admin, expires_in=expires_in)
        except InvalidArgument as exc:
            self._audit("key.create", actor, None, params, exc)
            raise
        self._audit("key.create", actor, record.key_id, {**params, "expires_at": record.expires_at}, None)
        return key, record

    def _create(self, user: str, *, admin: bool, expires_in: dt.timedelta | None) -> tuple[str, KeyRecord]:
        if not isinstance(user, str) or not user.strip():
            raise InvalidArgument("user", user, "it must be a non-empty user id")
        if expires_in is not None and expires_in <= dt.timedelta(0):
            raise InvalidArgument("expires_in", expires_in, "a key must be valid for some time; give a positive "
                                  "duration such as 90d or 12h")
        now = _now()
        expires_at = (now + expires_in).isoformat() if expires_in is not None else None
        with self._locked() as data:
            taken = {k["key_id"] for k in data["keys"]}
            key_id = secrets.token_hex(4)
            while key_id in taken:
                key_id = secrets.token_hex(4)
            key = f"hx_{key_id}_{secrets.token_urlsafe(32)}"
            record = KeyRecord(key_id, user, _digest(key), now.isoformat(), admin=bool(admin), expires_at=expires_at)
            data["keys"].append(record.__dict__)
        self._stat = None
        return key, record

    def forget(self, user: str) -> int:
        """Remove every key of ``user`` from the file (revoked ones too: a record names
        its user); return how many went. Without one, the file is left as it is."""
        if not any(record.user == user for record in self.records()):
            return 0
        with self._locked() as data:
            before = len(data["keys"])
            data["keys"] = [k for k in data["keys"] if k["user"] != user]
            removed = before - len(data["keys"])
        self._stat = None
        return removed

    def revoke(self, key_id: str, *, actor: str | None = None) -> KeyRecord:
        """Revoke the key ``key_id`` (its record stays, marked revoked); recorded in the
        store's audit log as done by ``actor`` (default: ``cli:<os user>``)."""
        with self._locked() as data:
            for k in data["keys"]:
                if k["key_id"] == key_id:
                    k["revoked"] = True
                    self._stat = None
                    record = KeyRecord(**k)
                    break
            else:
                record = None
        if record is None:
            refusal = InvalidArgument("key_id", key_id, "no key of this store has that id",
                                      "See `helix keys list --store DIR`.")
            self._audit("key.revoke", actor, key_id, {}, refusal)
            raise refusal
        self._audit("key.revoke", actor, key_id, {"user": record.user}, None)
        return record

    def _audit(self, action: str, actor: str | None, key_id: str | None, params: dict,
               refusal: InvalidArgument | None) -> None:
        """A key made or revoked (or refused) in the store's audit log."""
        audit.append(self.store, actor=actor or audit.local_actor(), action=action,
                     target=f"key:{key_id}" if key_id else None, params=params,
                     outcome="ok" if refusal is None else "refused", status=None if refusal is None else 2,
                     detail=None if refusal is None else str(refusal))
