"""Errors a caller can act on: each says what was received, what is allowed, how to fix it."""

from __future__ import annotations

import traceback
from pathlib import Path


class HelixError(Exception):
    """Base class for every error Helix raises on purpose."""


#: Longest echo of a received value in an error message (a huge text is not sent back).
MAX_ECHO_CHARS = 200


def short_repr(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_ECHO_CHARS` with the full length said."""
    text = repr(value)
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}… ({len(text)} characters in all)"


class InvalidArgument(HelixError, ValueError):
    """A caller passed a value outside what is allowed."""

    def __init__(self, name: str, received: object, allowed: str, fix: str | None = None):
        self.name, self.received, self.allowed, self.fix = name, received, allowed, fix
        message = f"Got {name}={short_repr(received)}; {allowed}."
        if fix:
            message += f" {fix}"
        super().__init__(message)

    def __reduce__(self):
        # Rebuild from the constructor's arguments: Ray pickles errors across processes.
        return (type(self), (self.name, self.received, self.allowed, self.fix))


class Unauthorized(HelixError):
    """No API key, or one this store does not know (HTTP 401)."""


class Forbidden(HelixError):
    """A caller asked for another user's memories (HTTP 403)."""


class NotFound(HelixError):
    """No such memory, or nothing of such a user, in this store (HTTP 404)."""


class Conflict(HelixError):
    """The id is taken by another user's memory (HTTP 409)."""


class StoreError(HelixError):
    """A store folder is missing, locked, or holds something this version cannot read."""


class ManifestMismatch(StoreError):
    """A generation's manifest is unknown or does not match what the reader expects."""


class GenerationDamaged(StoreError):
    """A generation's files or manifest differ from what was published (missing,
    truncated, altered): the message names each file, what was expected and what was
    found; ``problems`` holds those sentences alone, one per file."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()):
        super().__init__(message)
        self.problems = tuple(problems)

    def __reduce__(self):
        return (type(self), (str(self), self.problems))


class ClusterUnreachable(HelixError):
    """``RAY_ADDRESS`` names a Ray cluster this process could not join."""


class RayLost(HelixError):
    """The Ray under a running command went away: its GCS (on the head node) stopped
    accepting connections, and Ray cannot go on without it."""


class DiskFull(StoreError):
    """The filesystem a store is on has no space left (ENOSPC) for a write; nothing
    half-written became current. Serve answers it with HTTP 507."""

    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self),))


#: errno of a full filesystem (ENOSPC) and of a user's exhausted disk quota (EDQUOT).
DISK_FULL_ERRNOS = (28, 122)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, says the disk
    is full: an ``OSError`` with errno ENOSPC or EDQUOT, numpy's short write ("1152
    requested and 992 written", an ``OSError`` without an errno), or a DuckDB error
    that says "No space left on device"."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, OSError) and (current.errno in DISK_FULL_ERRNOS or
                                             (" requested and " in text and text.endswith(" written"))):
            return True
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def fault(exc: BaseException, frames: int = 3) -> str:
    """An unexpected exception as a log line that holds none of the caller's data: its
    type and the innermost ``frames`` places of its traceback (file, line, function).
    Its message is left out, since it can quote what was sent (a database error quotes
    the row it could not write); log the whole traceback at DEBUG for that."""
    kind = type(exc).__qualname__ if type(exc).__module__ == "builtins" else \
        f"{type(exc).__module__}.{type(exc).__qualname__}"
    where = [f"{Path(f.filename).name}:{f.lineno} in {f.name}"
             for f in reversed(traceback.extract_tb(exc.__traceback__)[-frames:])]
    return kind + (" at " + " < ".join(where) if where else "")
