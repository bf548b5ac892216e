"""The gate every request passes before its body is read: API keys and body size.

One plain ASGI middleware (:class:`Gate`) answers, before any endpoint runs, a request
without a valid key (401), a user's key on an admin route (403: changing the settings,
``/v1/admin/``, ``DELETE /v1/users/``), a key over its rate limit (429,
:mod:`helix_ray.serve.ratelimit`), a body over :data:`MAX_BODY_BYTES` (413) and a chunked
body without a length (411). The endpoints read the key's user and rights with
:func:`bearer`. A request to an admin route, refused or not, is recorded in the store's
audit log (:mod:`helix_ray.serve.audit`).
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi.responses import JSONResponse

from helix_ray.errors import HelixError, Unauthorized, short_repr
from helix_ray.serve import audit
from helix_ray.serve import ratelimit
from helix_ray.serve.errors import message_of, status_of
from helix_ray.serve.responses import error_response
from helix_ray.store.keys import KeyStore

#: Largest request body the ingress reads (a batch of 1,000 memories of 20k characters is
#: ~20 MB); larger ones get a 413 before they are parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024

#: The key store of the ingress replica running in this process (None: no keys), set by
#: :class:`helix_ray.serve.app.HelixAPI` and read by the gate, which checks keys before bodies.
SERVING: dict[str, Optional[KeyStore]] = {"store": None}


class Gate:
    """What every request passes before its body is read, as one plain ASGI middleware
    (each of Starlette's ``@app.middleware("http")`` layers costs a task group and a
    response stream per request):

    - first, a request without a valid key gets its 401 (a 422, 413 or 411 about its body
      would answer an unknown caller), a user's key on an admin route its 403, and a key
      over its rate limit its 429;
    - then a body over :data:`MAX_BODY_BYTES` gets its 413, a chunked one without a length 411.

    The handlers still read the key's user and rights. The key store is the one this
    replica's :class:`helix_ray.serve.app.HelixAPI` registered in :data:`SERVING` (Serve
    ships the ingress class by value, so it cannot share a global of its own module with
    the middleware)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            admin = audit.action_of(scope["method"], scope["path"])
            store = audit.SERVING["store"]
            if admin is not None and store is not None:  # recorded in the audit log, refused or not
                await audit.recorded(self._gated, scope, receive, send, *admin, store)
                return
            await self._gated(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _gated(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        refusal = _refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _refusal(scope: dict[str, Any]) -> Optional[JSONResponse]:
    from starlette.datastructures import Headers

    headers = Headers(scope=scope)
    keys = SERVING["store"]
    path = scope["path"]
    if keys is not None and path.startswith("/v1/"):
        try:
            record = keys.record_for(bearer(headers.get("authorization")))
        except HelixError as exc:
            return error_response(status_of(exc) or 401, message_of(exc))
        if not record.admin and _admin_only(scope["method"], path):
            return error_response(403, not_admin(record.user))
        limiter = ratelimit.SERVING["limiter"]
        wait = limiter.wait(record.key_id) if limiter is not None else 0.0
        if limiter is not None and wait > 0:
            return error_response(429, f"This API key (id {record.key_id}) sent more than {limiter.rate:g} requests "
                                  f"per second (bursts of {limiter.burst}); wait {ratelimit.retry_after(wait)} s "
                                  "(Retry-After) and send fewer, or ask for a higher rate_limit.",
                                  retry_after=ratelimit.retry_after(wait))
    size = headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        return error_response(413, f"Got a request body of {int(size):,} bytes; the limit is {MAX_BODY_BYTES:,}. Send "
                           "large imports in batches of fewer memories, or ingest files with `helix ingest`.")
    if size is None and "chunked" in headers.get("transfer-encoding", "").lower():
        # Its size is unknown until read: ask for a length rather than read an unbounded body.
        return error_response(411, "Got a chunked request body without Content-Length; send the body with a "
                           f"Content-Length header (at most {MAX_BODY_BYTES:,} bytes).")
    return None


def _admin_only(method: str, path: str) -> bool:
    """What changes the server for every user (live settings, compaction, the adapter),
    erases one, or reads who did (the audit log). A method these paths do not take is
    not refused here: the router answers it, 405."""
    if path.startswith("/v1/admin/"):
        return method == ("GET" if path.rstrip("/") == "/v1/admin/audit" else "POST")
    if path.startswith("/v1/users/"):
        return method == "DELETE"
    return path.rstrip("/") == "/v1/settings" and method in ("PATCH", "DELETE")


def not_admin(user: str) -> str:
    return (f"This API key (user {user!r}) cannot change what every user shares (live settings, compaction, the "
            "query adapter), read the audit log or forget a user. Use an admin key: `helix keys create --store DIR "
            "--user USER --admin`.")


def bearer(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer TOKEN`` header; None without the header;
    :class:`Unauthorized` saying so for a header of another scheme (not "No API key",
    which would send a caller that did send one looking in the wrong place)."""
    if not authorization or not authorization.strip():
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.startswith("hx_"):  # the key itself: not echoed
        raise Unauthorized("Got an Authorization header holding the key alone; put 'Bearer ' before it: "
                           "'Authorization: Bearer <key>'.")
    raise Unauthorized(f"Got an Authorization header of the scheme {short_repr(scheme[:24])}; this server takes "
                       "its API keys as 'Authorization: Bearer <key>' (create one with `helix keys create --store "
                       "DIR --user USER`).")
