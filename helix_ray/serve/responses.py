"""How answers and errors become HTTP responses.

Every error is ``{"detail": sentence}`` with the status :func:`helix_ray.serve.errors.status_of`
gives it (a request the models reject: 422 with the fields' ``errors`` too); a 503 carries
``Retry-After``. A recall answer is sent as the pipeline built it.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from helix_ray.errors import HelixError
from helix_ray.serve.api import RecallResponse, request_error_sentence
from helix_ray.serve.errors import message_of, status_of

log = logging.getLogger(__name__)


class ErrorOut(BaseModel):
    detail: str = Field(description="What was received, what is allowed, how to fix it.")


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "No API key, or an unknown one."},
    403: {"model": ErrorOut, "description": "The key belongs to another user."},
    422: {"model": ErrorOut, "description": "A field is unknown, missing or out of range."},
    503: {"model": ErrorOut, "description": "The store cannot be read or searched right now (a generation swap, "
                                           "replicas being replaced); `Retry-After` says when to try again."},
}


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


#: What a 503 tells a client to wait before it retries (``Retry-After``, seconds): the
#: store is swapping generations or Serve is replacing replicas.
RETRY_AFTER_S = 2


def error_response(status: int, message: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
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
    log.exception("unexpected error on %s", request.url.path)
    return error_response(500, f"Internal error ({type(exc).__name__}) while serving {request.url.path}; "
                       "the server log has the details.")


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.exception_handler(RequestValidationError)(request_invalid)
    app.exception_handler(HelixError)(helix_error)
    app.exception_handler(Exception)(unexpected)
