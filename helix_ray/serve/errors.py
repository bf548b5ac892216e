"""Errors the HTTP API maps to a status code. Each message is one sentence a caller can
act on, like :mod:`helix_ray.errors` (whose ``InvalidArgument`` becomes a 422 and whose
``StoreError`` becomes a 503)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from helix_ray.errors import HelixError


class Unauthorized(HelixError):
    """No API key, or one this store does not know (401)."""


class Forbidden(HelixError):
    """A key asked for another user's memories (403)."""


class NotFound(HelixError):
    """No such memory for this user (404)."""


class Conflict(HelixError):
    """The id is taken by another user's memory (409)."""


STATUS = {"Unauthorized": 401, "Forbidden": 403, "NotFound": 404, "Conflict": 409,
          "InvalidArgument": 422, "StoreError": 503, "ManifestMismatch": 503, "StaleLegs": 503,
          "DiskFull": 507}  # the message says what to free; the current generation keeps serving


class ReplicaError(HelixError):
    """A Helix error on its way out of a replica: the original class's name and sentence.

    Ray pickles an exception by calling its class with ``exc.args``;
    :class:`helix_ray.errors.InvalidArgument` takes four arguments but keeps one in
    ``args``, so it arrives as Ray's ``UnserializableException`` (a 500). The shells
    send this instead (see :func:`boundary`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplicaError, (self.kind, str(self.args[0])))


def boundary(fn: Callable) -> Callable:
    """Wrap a shell method so the Helix errors it raises cross the replica boundary."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except ReplicaError:
                raise
            except HelixError as exc:
                raise ReplicaError(type(exc).__name__, str(exc)) from None
        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ReplicaError:
            raise
        except HelixError as exc:
            raise ReplicaError(type(exc).__name__, str(exc)) from None
    return wrapped


def kind_of(exc: BaseException | None) -> str | None:
    """The class name of the Helix error behind ``exc`` (through Ray's wrapping)."""
    seen = 0
    while exc is not None and seen < 5:
        kind = getattr(exc, "kind", None)
        if kind is not None:
            return kind
        if isinstance(exc, HelixError):
            return type(exc).__name__
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None


def status_of(exc: BaseException) -> int | None:
    """The HTTP status for a Helix error (also when it crossed a replica boundary and
    arrives wrapped by Ray), or None for an unexpected error."""
    kind = getattr(exc, "kind", None)
    if kind in STATUS:
        return STATUS[kind]
    for cls in type(exc).__mro__:
        if cls.__name__ in STATUS:
            return STATUS[cls.__name__]
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is not None and cause is not exc:
        return status_of(cause)
    return None


def callers_mistake(exc: BaseException) -> bool:
    """A 4xx Helix error (the request's own fault, said by whichever replica found it):
    passed on to the caller, never answered around."""
    status = status_of(exc)
    return status is not None and status < 500


def message_of(exc: BaseException) -> str:
    """The error's own sentence, without Ray's wrapping and traceback."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc and status_of(cause) is not None:
        return message_of(cause)
    text = str(exc.args[0]) if getattr(exc, "args", None) else str(exc)
    return text.strip()
