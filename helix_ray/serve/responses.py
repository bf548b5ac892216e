"""How answers and errors become HTTP responses.

Every error is ``{"detail": sentence}`` with the status :func:`helix_ray.serve.errors.status_of`
gives it (a request the models reject: 422 with the fields' ``errors`` too; a call whose
replica is gone: 503, :func:`helix_ray.serve.errors.lost_replica`); a 503 carries
``Retry-After``. A recall answer is sent as the pipeline built it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException

from helix_ray.errors import HelixError, fault
from helix_ray.live.inputs import request_error_sentence
from helix_ray.serve.api import RecallResponse, undecodable_body
from helix_ray.serve.errors import lost_replica, message_of, status_of

log = logging.getLogger(__name__)


class ErrorOut(BaseModel):
    detail: str = Field(description="What was received, what is allowed, how to fix it.")
    errors: list[dict[str, Any]] | None = Field(None, description="A 422 for a request the models reject: each "
                                                "field's location, message and type.")


#: What a 503 tells a client to wait before it retries (``Retry-After``, seconds): the
#: store is swapping generations or Serve is replacing replicas.
RETRY_AFTER_S = 2

_RETRY_AFTER = {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 1}}

#: Every error answer a route can give, as FastAPI's ``responses=`` takes it; a route
#: picks its own with :func:`errors`.
ERROR_RESPONSES: dict[int, dict[str, Any]] = {
    401: {"description": "No API key, or one this store does not know (when the server runs with keys)."},
    403: {"description": "The key belongs to another user than the request names, or a user's key asked for "
                         "what only an admin key may change."},
    404: {"description": "No such memory for this user; for DELETE /v1/users, no such user in the store."},
    409: {"description": "The request conflicts with the store's state (an id another user's memory holds; "
                         "no feedback to fit an adapter on)."},
    411: {"description": "A chunked body without Content-Length."},
    413: {"description": "A body over the size limit (32 MiB)."},
    422: {"description": "A field is unknown, missing or out of range, or the body is not UTF-8 JSON."},
    429: {"description": "The key sent more requests than its rate limit (when the server sets one); "
                         "`Retry-After` says when to send again.", "headers": {"Retry-After": _RETRY_AFTER}},
    503: {"description": "The store cannot be read or searched right now (a generation swap, replicas being "
                         "replaced); `Retry-After` says when to try again.", "headers": {"Retry-After": _RETRY_AFTER}},
}

#: The gate's answers to any request to a ``/v1/`` route (:mod:`helix_ray.serve.gate`).
KEYED = (401, 429)

#: The gate's answers (:mod:`helix_ray.serve.gate`) to any request with a body.
BODY = (411, 413, 422)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route, each a ``{"detail": sentence}`` (:class:`ErrorOut`),
    for its ``responses=``: the OpenAPI schema lists every status it can return."""
    return {status: {"model": ErrorOut, **ERROR_RESPONSES[status]} for status in sorted(set(statuses))}


def recall_response(out: dict[str, Any]) -> Response:
    """A recall answer as HTTP. Sent as built: the pipeline's dict already has
    :class:`RecallResponse`'s shape (the HTTP tests validate every answer against it
    strictly), and FastAPI's response-model pass would only add time (docs/benchmarks.md).
    An answer that is not plain JSON (a NaN score, a numpy scalar) goes through the model,
    which writes NaN as null, instead of failing with a 500."""
    try:
        return JSONResponse(out)
    except (TypeError, ValueError):
        log.warning("recall answer not plain JSON; sent through the response model", exc_info=True)
        return Response(RecallResponse.model_validate(out).model_dump_json(), media_type="application/json")


def error_response(status: int, message: str, *, retry_after: int | None = None) -> JSONResponse:
    """``{"detail": message}`` with ``status``; a 503 says when to retry (``Retry-After``:
    ``retry_after`` seconds, :data:`RETRY_AFTER_S` by default), a 429 too."""
    if status == 503:
        retry_after = retry_after or RETRY_AFTER_S
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(status_code=status, content={"detail": message}, headers=headers)


async def request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": request_error_sentence(exc.errors()), "errors": errors})


async def helix_error(request: Request, exc: HelixError) -> JSONResponse:
    return error_response(status_of(exc) or 400, message_of(exc))


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc)
    if status is not None:  # a Helix error raised in another replica, wrapped by Ray
        return error_response(status, message_of(exc))
    # The message can quote the request's data: the log says where, the traceback is DEBUG's.
    log.error("unexpected error on %s: %s", request.url.path, fault(exc))
    log.debug("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"Internal error ({type(exc).__name__}) while serving {request.url.path}; "
                       "the server log says where it was raised.")


async def replica_error(request: Request, exc: Exception) -> JSONResponse:
    """Ray's error for a call to another deployment: a 503 saying whether the request was
    carried out when the replica is gone (a client retries it), else as :func:`unexpected`.
    Registered for Ray's error classes, so that it answers through Starlette's exception
    middleware: the handler of ``Exception`` answers from the outermost one, which raises
    the error again into the replica after the answer."""
    sentence = lost_replica(exc, request.method, request.url.path)
    if sentence is None:
        return await unexpected(request, exc)
    log.warning("%s %s: a replica it called is gone (%s)", request.method, request.url.path, type(exc).__name__)
    return error_response(503, sentence)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own answers in Helix's words: no such path (404), a method the path
    does not take (405, its ``Allow`` naming every method the path takes, not only those
    of the first route that matched), a body it could not read (422, as for the other
    bodies the models reject)."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        allowed = allowed_methods(request.app, path) \
            or [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",")]
        return JSONResponse(status_code=405, headers={"Allow": ", ".join(allowed)}, content={
            "detail": f"Got {method} {path}; this path takes {' or '.join(allowed)}. The methods of each path are "
                      "in the OpenAPI schema at /docs."})
    if exc.status_code == 404:
        return error_response(404, f"Got {method} {path}; there is no such path. The paths are in the OpenAPI schema "
                                   "at /docs.")
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return error_response(422, str(undecodable_body(cause)))
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return error_response(422, "Got a request body of JSON nested too deep to read (about 1,000 levels); nest "
                                   "it less (metadata may nest at most 32 levels).")
    return JSONResponse(status_code=exc.status_code, content={"detail": str(exc.detail)}, headers=exc.headers)


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the OpenAPI schema of ``app`` lists for ``path`` (its templates'
    parameters match any text, '/' too: the memory ids of ``{memory_id:path}``)."""
    table = getattr(app.state, "helix_methods", None)
    if table is None:
        table = app.state.helix_methods = [
            (re.compile("".join(".+" if part.startswith("{") else re.escape(part)
                                for part in re.split(r"(\{[^}]*\})", template))), [m.upper() for m in operations])
            for template, operations in app.openapi()["paths"].items()]
    return sorted({m for pattern, methods in table if pattern.fullmatch(path) for m in methods})


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.exception_handler(RequestValidationError)(request_invalid)
    app.exception_handler(HTTPException)(http_error)
    app.exception_handler(HelixError)(helix_error)
    for ray_error in (RayError, RayServeException):
        app.exception_handler(ray_error)(replica_error)
    app.exception_handler(Exception)(unexpected)
