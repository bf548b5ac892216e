"""Helix errors as HTTP status codes. Each message is one sentence a caller can act on,
raised from :mod:`helix_ray.errors` (``Unauthorized`` 401, ``Forbidden`` 403, ``NotFound``
404, ``Conflict`` 409, ``InvalidArgument`` 422, ``StoreError`` 503, ``DiskFull`` 507), and
Ray's errors for a replica that is gone (a 503 saying whether the request was carried
out: :func:`lost_replica`)."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable

from helix_ray.errors import HelixError


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

    def __str__(self) -> str:
        # Serve logs every exception a replica's method raises ("Request failed." at
        # ERROR, with the traceback, which shows str(exc)) in the replica's log and its
        # worker's stderr, at any log level. A caller's mistake quotes the request (a
        # memory's text, a query), which no log may hold: its sentence goes to the caller
        # only (message_of reads it from args), the log names the kind and status.
        status = STATUS.get(self.kind)
        if status is not None and status < 500:
            return (f"{self.kind} (HTTP {status}): the request's own fault, answered to the caller; its sentence "
                    "is not logged, as it may quote the request")
        return str(self.args[0])


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


#: Ray's and Serve's errors, by class name, for a call whose replica is gone or that no
#: replica took, and whether the replica may have carried the call out. ``ActorDiedError``:
#: the replica died after it took the call (Serve sends a call again on its own while no
#: replica has taken it, and holds it while none is running); ``ActorUnavailableError``:
#: the replica could not be reached, and Ray cannot tell whether the call ran. Both may
#: have done their work: the Writer makes a write durable before it answers, and dying
#: between the two loses the answer, not the write. ``DeploymentUnavailableError`` (the
#: deployment failed to deploy) and ``BackPressureError`` (the handle's queue is full)
#: refuse a call before any replica has it. Any other failure of Ray's own (a ``RayError``
#: that is not the replica's code raising: a node or the GCS lost, a timeout) counts as
#: one that may have run.
REPLICA_LOST = {"ActorDiedError": True, "ActorUnavailableError": True,
                "DeploymentUnavailableError": False, "BackPressureError": False}

#: Ray's name of a replica actor's class: ``ServeReplica:<application>:<deployment>``.
_REPLICA_CLASS = re.compile(r"ServeReplica:[^:\s]+:([A-Za-z0-9_.-]+)")

#: What sending a change again does, by path (the first that starts the path).
_RETRY = (("/v1/memories", "sending it again is safe: the same ids get the same memories, and a DELETE that was "
                           "carried out answers 404"),
          ("/v1/users/", "sending it again finishes the erasure, or answers 404 when it was complete"),
          ("/v1/feedback", "sending it again may record the feedback twice"),
          ("/v1/", "sending it again is safe: it gives the same result"))


def lost_replica(exc: BaseException, method: str, path: str) -> str | None:
    """The 503 sentence for ``exc`` when it is Ray's word that the replica serving the
    call is gone (:data:`REPLICA_LOST`), else None: which deployment, whether the change
    may have been made, and what sending it again does. ``method``/``path``: the
    request's (a GET or a recall changes nothing)."""
    kinds = [cls.__name__ for cls in type(exc).__mro__ if cls.__name__ in REPLICA_LOST]
    if not kinds:
        cause = getattr(exc, "cause", None) or exc.__cause__
        if cause is not None and cause is not exc:
            return lost_replica(cause, method, path)
        if not _ray_failure(exc):
            return None
    kind = kinds[0] if kinds else type(exc).__name__  # Ray could not finish the call: it may have run
    named = _REPLICA_CLASS.search(str(getattr(exc, "error_msg", "") or exc))
    deployment = getattr(getattr(exc, "_deployment_id", None), "name", None) or (named and named.group(1))
    who = f"the {deployment} deployment" if deployment else "a deployment of the server"
    changes = method.upper() not in ("GET", "HEAD") and path.rstrip("/") != "/v1/recall"
    if not REPLICA_LOST.get(kind, True):
        why = "failed to deploy (the server log says why)" if kind == "DeploymentUnavailableError" else \
            "has more calls queued than it takes"
        return (f"{method} {path} was not carried out: {who} {why}, so no replica took it and nothing was "
                "changed. Send it again after Retry-After seconds.")
    retry = next(note for prefix, note in _RETRY if path.startswith(prefix))
    if not changes:
        return (f"The replica of {who} serving {method} {path} stopped before it answered ({kind}); Serve is "
                "starting a new one. Nothing was changed; send the request again after Retry-After seconds.")
    return (f"The replica of {who} serving {method} {path} stopped before it answered ({kind}); Serve is "
            "starting a new one. The change may or may not have been made: what the replica had made durable "
            "before it stopped is kept (the new replica serves it), what it had not was not made. Send the same "
            f"request again after Retry-After seconds (it waits for the new replica); {retry}.")


def _ray_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's own failure to carry a call (a node, the GCS or an object
    lost, a timeout: a ``RayError``), not an error the replica's code raised
    (``RayTaskError``, which stays what it is)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "RayError" in names and "RayTaskError" not in names


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
