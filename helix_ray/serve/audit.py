"""Admin requests over HTTP as records of the store's audit log (:mod:`helix_ray.store.audit`).

The gate (:mod:`helix_ray.serve.gate`) hands every request to an admin route —
``PATCH``/``DELETE /v1/settings``, ``POST /v1/admin/compact`` and ``/v1/admin/adapt``,
``DELETE /v1/users/{user}``, ``GET /v1/admin/audit`` — to :func:`recorded`, which runs
it and, before its answer leaves the ingress, appends what it was and how it ended: the
key's id and user, the action, its target (the user forgotten), its parameters (the
settings patch, the adapter's users and ``force``, ``compact``), ``ok``, ``refused``
with the status and sentence (a user's key: 403, a bad patch: 422) or ``failed`` (5xx),
and the counts the action reported. A request without a valid key (401) or over its
rate limit (429) is not recorded: anyone can send those, and each record is a disk flush.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import parse_qs

from helix_ray.errors import HelixError
from helix_ray.store import audit

log = logging.getLogger(__name__)

#: The store of the ingress replica running in this process (None: not serving), set by
#: :class:`helix_ray.serve.app.HelixAPI` as ``gate.SERVING`` is.
SERVING: dict[str, Optional[Path]] = {"store": None}

#: Most bytes of an admin request's body read into its record's ``params``.
MAX_BODY_BYTES = 64 * 1024
#: The actions whose answer's counts (its top-level numbers and flags) go into ``result``.
COUNTED = {"compact", "adapt", "forget-user"}

Message = dict[str, Any]
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


def action_of(method: str, path: str) -> Optional[tuple[str, Optional[str]]]:
    """``(action, target)`` of an admin route, or None for any other request."""
    route = path.rstrip("/")
    if route == "/v1/settings" and method in ("PATCH", "DELETE"):
        return ("settings.patch" if method == "PATCH" else "settings.reset"), None
    if method == "POST" and route in ("/v1/admin/compact", "/v1/admin/adapt"):
        return route.rsplit("/", 1)[1], None
    if method == "GET" and route == "/v1/admin/audit":
        return "audit.read", None
    if method == "DELETE" and path.startswith("/v1/users/") and len(path) > len("/v1/users/"):
        return "forget-user", path[len("/v1/users/"):]
    return None


def actor_of(authorization: Optional[str]) -> tuple[str, Optional[str]]:
    """``("key:<id>", user)`` for a valid key, ``("no-auth", None)`` on a server without
    keys, ``("unknown", None)`` otherwise (such a request is refused, 401, unrecorded)."""
    from helix_ray.serve.gate import SERVING as KEYS, bearer

    keys = KEYS["store"]
    if keys is None:
        return "no-auth", None
    try:
        record = keys.record_for(bearer(authorization))
    except HelixError:
        return "unknown", None
    return f"key:{record.key_id}", record.user


async def recorded(app: ASGIApp, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                   send: Callable[[Message], Awaitable[None]], action: str, target: Optional[str],
                   store: Path) -> None:
    """Run ``app`` on an admin request and append its record to ``store``'s audit log
    before the answer is sent (the answer is held until then: admin answers are small).
    An answer that could not be recorded is still sent, and the failure logged."""
    from starlette.datastructures import Headers

    # Before the request runs: forgetting the key's own user removes the key.
    actor = actor_of(Headers(scope=scope).get("authorization"))
    body = bytearray()
    held: list[Message] = []
    status: list[int] = []

    async def reading() -> Message:
        message = await receive()
        if message["type"] == "http.request" and len(body) < MAX_BODY_BYTES:
            body.extend(message.get("body", b"")[:MAX_BODY_BYTES - len(body)])
        return message

    async def holding(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(int(message["status"]))
        held.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await _record(scope, actor, action, target, store, bytes(body), status[0] if status else 500, held)
            for part in held:
                await send(part)
            held.clear()

    try:
        await app(scope, reading, holding)
    except Exception:
        if not status:  # an error no handler answered: Starlette's outermost layer answers it, 500
            await _record(scope, actor, action, target, store, bytes(body), 500, [])
        raise


async def _record(scope: dict[str, Any], who: tuple[str, Optional[str]], action: str, target: Optional[str],
                  store: Path, body: bytes, status: int, answer: list[Message]) -> None:
    if status in (401, 429):
        return
    actor, user = who
    reply = _json(b"".join(m.get("body", b"") for m in answer if m["type"] == "http.response.body"))
    outcome: audit.Outcome = "ok" if status < 400 else "refused" if status < 500 else "failed"
    detail = reply.get("detail") if isinstance(reply, dict) and outcome != "ok" else None
    result = {k: v for k, v in reply.items() if isinstance(v, (bool, int, float)) or v is None} \
        if isinstance(reply, dict) and outcome == "ok" and action in COUNTED else None
    try:
        await asyncio.to_thread(audit.append, store, actor=actor, actor_user=user, action=action, target=target,
                                params=_params(scope, body), outcome=outcome, status=status,
                                detail=detail if isinstance(detail, str) else None, result=result)
    except Exception:  # noqa: BLE001 - the action is done; its answer is still given
        log.exception("could not append %s by %s (status %d) to the audit log of %s", action, actor, status, store)


def _params(scope: dict[str, Any], body: bytes) -> dict[str, Any]:
    """What the request asked for: its query parameters and its JSON body (an object),
    or the body's size when it is not one."""
    query = {k: v[0] if len(v) == 1 else v
             for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
    if not body:
        return query
    parsed = _json(body)
    if isinstance(parsed, dict):
        return {**query, **parsed}
    return {**query, "body_bytes": len(body)}


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
