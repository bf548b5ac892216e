"""The Helix Serve application: a FastAPI ingress over the recall graph.

::

    HTTP ─▶ HelixAPI (FastAPI ingress: auth, checks, settings, stats)
              │ plan ─▶ Embedder            Recaller.plan: check, embed, route
              │ ┌─▶ BM25                    Recaller.lexical_leg  + delta BM25     ┐ awaited
              │ └─▶ DenseANN                Recaller.dense_leg    + delta cosine   ┘ together
              │ finish ─▶ Ranker            Recaller.finish over generation + delta
              │ writes ─▶ Writer (1)        DuckDB + inbox + delta snapshot; compaction
              ▼
            JSON

``build_app(args)`` is a typed application builder: ``serve run
helix_ray.serve.app:build_app store=DIR`` or ``serve deploy configs/serve.yaml``.
(No ``from __future__ import annotations`` here: Serve reads ``build_app``'s annotation
to validate its arguments, and FastAPI reads the endpoints'.)
"""

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, cast

from fastapi import Body, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.handle import DeploymentHandle

from helix_ray import __version__
from helix_ray.config import IngestConfig, RetrievalConfig, deep_merge, load_config
from helix_ray.errors import HelixError, InvalidArgument, StoreError, short_repr
from helix_ray.recall.pipeline import Recaller
from helix_ray.recall.scope import make_scope
from helix_ray.serve.api import (
    AdaptIn,
    FeedbackIn,
    FeedbackOut,
    LatencyWindow,
    MemoryBatch,
    MemoryChanged,
    MemoryIn,
    MemoryPatch,
    RecallRequest,
    RecallResponse,
    SettingsResponse,
    WriteResponse,
    check_settings,
    request_error_sentence,
)
from helix_ray.serve.deployments import BM25, CPUS, RETRIEVER_AUTOSCALING, DenseANN, Embedder, Pipeline, Ranker, Writer
from helix_ray.serve.errors import Forbidden, Unauthorized, callers_mistake, kind_of, message_of, status_of
from helix_ray.serve.keys import KeyStore
from helix_ray.serve.shells import PipelineShell
from helix_ray.store.pointer import Pointer
from helix_ray.serve.writer import settings_path

log = logging.getLogger(__name__)


class ServeArgs(BaseModel):
    """Arguments of :func:`build_app` (``args:`` in ``configs/serve.yaml``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    store: str = Field(description="The store folder (with a published generation, unless `create`).")
    create: bool = Field(False, description="A store folder that does not exist yet (or is empty) starts with an "
                                            "empty generation that online writes fill; `helix serve` sets it. Off, "
                                            "a store must have been ingested into first.")
    auth: bool = Field(True, description="Require 'Authorization: Bearer <key>' (keys: `helix keys create`).")
    retrieval: dict[str, Any] = Field(default_factory=dict,
                                      description="RetrievalConfig overrides used until PATCH /v1/settings changes "
                                                  "them (the ingress user_config also sets them).")
    ingest_config: Optional[str] = Field(None, description="Ingest YAML for writes and compaction (default: the "
                                                           "typed defaults, as `helix ingest`).")
    compact_interval_s: float = Field(600.0, gt=0, description="Compact pending writes at least this often.")
    compact_max_pending: int = Field(2000, ge=1, description="...or as soon as this many are pending.")
    compact_runner: Literal["local", "ray"] = Field("local", description="Ingest runner for compaction.")
    watch_interval_s: float = Field(0.5, ge=0.05, le=10.0, description="How often replicas look for a new generation.")
    retriever_replicas: tuple[int, int] = Field((1, 3), description="(min, max) replicas of DenseANN and BM25 "
                                                                     "(autoscaling; the Ranker's max is 2).")
    graph: Literal["split", "compact", "inline"] = Field(
        "split", description="'split': Embedder → BM25 ∥ DenseANN → Ranker, each its own deployment (scales each "
                             "stage); 'compact': all of them in one Pipeline deployment, one hop per request; "
                             "'inline': the ingress replicas run every stage themselves, no hop (the fastest on "
                             "one small host: docs/benchmarks.md).")
    leg_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Split graph: how long a recall waits for its graph before answering "
                                      "with the retriever legs (BM25, DenseANN) that have answered, a missing one "
                                      "flagged in `flags.degraded` — e.g. while Serve replaces a failed replica "
                                      "(seconds), instead of waiting for it. An Embedder with no answer after twice "
                                      "this: BM25 alone answers, on a plan made without the query vector, flagged.")

    @model_validator(mode="after")
    def _check_replicas(self) -> "ServeArgs":
        low, high = self.retriever_replicas
        if not 1 <= low <= high <= 16:
            raise ValueError(f"Got retriever_replicas={self.retriever_replicas}; it must be (min, max) with "
                             "1 <= min <= max <= 16.")
        return self


class ErrorOut(BaseModel):
    detail: str = Field(description="What was received, what is allowed, how to fix it.")


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "No API key, or an unknown one."},
    403: {"model": ErrorOut, "description": "The key belongs to another user."},
    422: {"model": ErrorOut, "description": "A field is unknown, missing or out of range."},
    503: {"model": ErrorOut, "description": "The store cannot be read or searched right now (a generation swap, "
                                           "replicas being replaced); `Retry-After` says when to try again."},
}

api = FastAPI(
    title="Helix",
    version=__version__,
    description="Memory recall for coding agents. Every endpoint but /healthz needs "
                "'Authorization: Bearer <key>' unless the server runs with --no-auth.",
)


#: Recall hits are sent to the Writer's access log in batches, this often (seconds), and
#: at most this many are kept waiting when it cannot be reached.
ACCESS_FLUSH_S = 1.0
ACCESS_BUFFER = 100_000


#: Largest request body the ingress reads (a batch of 1,000 memories of 20k characters is
#: ~20 MB); larger ones get a 413 before they are parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024


class _Gate:
    """What every request passes before its body is read, as one plain ASGI middleware
    (each of Starlette's ``@app.middleware("http")`` layers costs a task group and a
    response stream per request):

    - first, a request without a valid key gets its 401 (a 422, 413 or 411 about its body
      would answer an unknown caller), and a user's key on an admin route its 403;
    - then a body over :data:`MAX_BODY_BYTES` gets its 413, a chunked one without a length 411.

    The handlers still read the key's user and rights. The key store is the one this
    replica's :class:`HelixAPI` registered (Serve ships the ingress class by value, so it
    cannot share a global of this module with us)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = _refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(scope: dict[str, Any]) -> Optional[JSONResponse]:
    from starlette.datastructures import Headers

    from helix_ray.serve import keys as keys_module

    headers = Headers(scope=scope)
    keys = keys_module.SERVING["store"]
    path = scope["path"]
    if keys is not None and path.startswith("/v1/"):
        try:
            record = keys.record_for(_bearer(headers.get("authorization")))
        except HelixError as exc:
            return _error(status_of(exc) or 401, message_of(exc))
        if not record.admin and _admin_only(scope["method"], path):
            return _error(403, _not_admin(record.user))
    size = headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        return _error(413, f"Got a request body of {int(size):,} bytes; the limit is {MAX_BODY_BYTES:,}. Send "
                           "large imports in batches of fewer memories, or ingest files with `helix ingest`.")
    if size is None and "chunked" in headers.get("transfer-encoding", "").lower():
        # Its size is unknown until read: ask for a length rather than read an unbounded body.
        return _error(411, "Got a chunked request body without Content-Length; send the body with a "
                           f"Content-Length header (at most {MAX_BODY_BYTES:,} bytes).")
    return None


api.add_middleware(_Gate)


def _admin_only(method: str, path: str) -> bool:
    """What changes the server for every user: live settings, compaction, the adapter."""
    return path.startswith("/v1/admin/") or (path.rstrip("/") == "/v1/settings" and method in ("PATCH", "DELETE"))


def _not_admin(user: str) -> str:
    return (f"This API key (user {user!r}) cannot change what every user shares (live settings, compaction, the "
            "query adapter). Use an admin key: `helix keys create --store DIR --user USER --admin`.")


def recall_response(out: dict[str, Any]) -> Response:
    """A recall answer as HTTP. Sent as built: the pipeline's dict already has
    :class:`RecallResponse`'s shape (the HTTP tests validate every answer against it
    strictly), and FastAPI's response-model pass took 0.055 ms against 0.029 (docs/benchmarks.md).
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


def _error(status: int, message: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(status_code=status, content={"detail": message}, headers=headers)


@api.exception_handler(RequestValidationError)
async def _request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": request_error_sentence(exc.errors()), "errors": errors})


@api.exception_handler(HelixError)
async def _helix_error(request: Request, exc: HelixError) -> JSONResponse:
    return _error(status_of(exc) or 400, message_of(exc))


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc)
    if status is not None:  # a Helix error raised in another replica, wrapped by Ray
        return _error(status, message_of(exc))
    log.exception("unexpected error on %s", request.url.path)
    return _error(500, f"Internal error ({type(exc).__name__}) while serving {request.url.path}; "
                       "the server log has the details.")


def _bearer(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer TOKEN`` header; None without the header;
    :class:`Unauthorized` saying so for a header of another scheme (it was answered "No
    API key", which sends a caller that did send one looking in the wrong place)."""
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


#: After the graph's ``leg_timeout_s``: the legs' grace when the plan was in by then
#: (seconds), and how long the plan may take to come back for that to hold.
LEG_GRACE_S = 0.2
LATE_PLAN_S = 0.05
#: The graph's bound (seconds) while a leg that ran out of time has not answered since.
MISSING_LEG_TIMEOUT_S = 0.25


class LegTimedOut(Exception):
    """A stage of the split graph (a retriever leg, the Embedder) that did not answer in time."""


def _drop(call: "asyncio.Future[Any]") -> None:
    """Cancel a task over a handle call no one will await; if it has ended, its error
    counts as read (asyncio would log one never retrieved)."""
    if call.done():
        if not call.cancelled():
            call.exception()
    else:
        call.cancel()


class CallCancelled(Exception):
    """A handle call cancelled under this request, not by it: a failure like any other."""


async def _settle(call: "asyncio.Future[Any]", wait_s: Optional[float]) -> Any:
    """The result of ``call`` (a task over a handle call) within ``wait_s`` seconds
    (None: no bound), else :class:`LegTimedOut` with the call left running, to be waited
    for again. Never cancels it, unless this request itself is cancelled: a
    ``DeploymentResponse`` awaited under a timeout that expires while Serve is still
    routing it (no live replica) is cancelled for good, and a later await raises
    ``CancelledError`` (Ray 2.60 wraps its routing future with ``asyncio.wrap_future``)."""
    try:
        done, _ = await asyncio.wait({call}, timeout=wait_s)
    except asyncio.CancelledError:
        call.cancel()
        raise
    if not done:
        raise LegTimedOut()
    if call.cancelled():
        raise CallCancelled("the call was cancelled")
    return call.result()


def _unsearchable(why: str) -> StoreError:
    """The 503 of a split graph with no stage left that can search (``why``)."""
    return StoreError(f"The store cannot be searched right now: {why}, as while Serve replaces lost replicas. "
                      "Retry in a few seconds.")


def _failure(exc: BaseException, timeout_s: float) -> str:
    """How a stage failed, for ``flags.degraded``."""
    return f"no answer within {timeout_s:.2g} s" if isinstance(exc, LegTimedOut) else type(exc).__name__


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


_MEMORY_SCHEMA = MemoryIn.model_json_schema()
_MEMORY_LIST = TypeAdapter(list[MemoryIn])

#: A write body larger than this is parsed and validated in a thread, not on the
#: replica's event loop (which answers every other request and Serve's own calls): a
#: 32 MB batch took ~0.9 s to read, validate and dump.
PARSE_ON_LOOP_BYTES = 1 << 20


def write_records(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """A ``POST /v1/memories`` body as records (each a memory object, None fields left
    out) and whether it was one memory rather than a batch; a body that is not JSON or
    not memories raises the 422's :class:`RequestValidationError`."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # JSONDecodeError says where; a UnicodeDecodeError does not
        pos = getattr(exc, "pos", None)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", *([] if pos is None else [pos])),
                                       "msg": "invalid JSON",
                                       "ctx": {"error": getattr(exc, "msg", None)}}]) from None
    except RecursionError:  # was a 500
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "JSON nested too deep to read (about 1,000 levels); metadata may "
                                              "nest at most 32"}]) from None
    single = not isinstance(payload, list) and not (isinstance(payload, dict) and "memories" in payload)
    try:
        if isinstance(payload, list):  # each bad record located by its index, as in {"memories": [...]}
            items = _MEMORY_LIST.validate_python(payload)
        elif not single:
            items = MemoryBatch.model_validate(payload).memories
        else:
            items = [MemoryIn.model_validate(payload)]
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    return [m.model_dump(exclude_none=True) for m in items], single


_WRITE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    _MEMORY_SCHEMA,
    {"type": "object", "title": "MemoryBatch", "required": ["memories"], "additionalProperties": False,
     "properties": {"memories": {"type": "array", "items": _MEMORY_SCHEMA, "minItems": 1, "maxItems": 1000}}},
    {"type": "array", "items": _MEMORY_SCHEMA, "minItems": 1, "maxItems": 1000},
]}}}}}


@serve.deployment(name="HelixAPI", ray_actor_options={"num_cpus": CPUS["ingress"]}, max_ongoing_requests=128)
@serve.ingress(api)
class HelixAPI:
    """The ingress: authenticates, checks requests, and calls the graph's handles."""

    def __init__(self, embedder: Optional[DeploymentHandle], dense: Optional[DeploymentHandle],
                 bm25: Optional[DeploymentHandle], ranker: Optional[DeploymentHandle], writer: DeploymentHandle,
                 args: dict[str, Any], pipeline: Optional[DeploymentHandle] = None,
                 ingest: Optional[IngestConfig] = None):
        self.embedder, self.dense, self.bm25, self.ranker, self.writer = embedder, dense, bm25, ranker, writer
        self.pipeline = pipeline  # the compact graph: one handle for every recall stage
        self.args = ServeArgs.model_validate(args)
        self.store = Path(self.args.store)
        # The inline graph: this replica runs the stages itself (the compact graph's shell).
        self.local = PipelineShell(self.store, ingest, self.args.watch_interval_s) \
            if self.args.graph == "inline" else None
        self.keys = KeyStore(self.store) if self.args.auth else None
        from helix_ray.serve import keys as keys_module

        keys_module.SERVING["store"] = self.keys  # for the key-first middleware
        self.latency = LatencyWindow()
        self._generation = Pointer(self.store / "CURRENT", _read_int)
        self._delta = Pointer(self.store / "delta" / "CURRENT", _read_int)
        self._overrides = Pointer(settings_path(self.store), _read_json)
        self.base: dict[str, Any] = dict(self.args.retrieval)
        self._base_version = 0
        self._config_key: Any = None
        self._config = check_settings(self.base, {})
        self._accessed: list[tuple[str, str, int]] = []  # recall hits not yet sent to the Writer
        self._access_flush: asyncio.Task | None = None
        # The split graph: stages that ran out of time and have not answered since (the
        # legs, or "embedder"); what makes a plan here while the Embedder is missing.
        self._legs_missing: set[str] = set()
        self._vectorless = Recaller(None, None)
        self._probes: dict[str, asyncio.Future[Any]] = {}  # a late call kept per missing stage: see _probe

    # ---------------------------------------------------------------- settings
    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook: ``{"retrieval": {...RetrievalConfig overrides}}``.
        Applied without restarting the replica (``serve deploy`` with a changed
        ``user_config``); an invalid one fails the deploy with the sentence saying why."""
        unknown = sorted(set(user_config or {}) - {"retrieval"})
        if unknown:
            raise InvalidArgument("user_config", user_config, f"its only key is 'retrieval' (got {unknown})")
        base = dict((user_config or {}).get("retrieval") or {})
        check_settings(base, {})
        self.base = base
        self._base_version += 1

    def config(self) -> RetrievalConfig:
        """The effective config: defaults ← ``user_config`` ← live overrides (one
        ``stat`` of ``serve-settings.json`` per request)."""
        overrides = self._overrides.read()
        key = (self._overrides.version, self._base_version)
        if key != self._config_key:
            try:
                self._config = check_settings(self.base, overrides)
            except InvalidArgument:
                log.exception("ignoring invalid live settings in %s", settings_path(self.store))
                self._config = check_settings(self.base, {})
            self._config_key = key
        return self._config

    # ---------------------------------------------------------------- auth
    def authenticate(self, authorization: Optional[str]) -> Optional[str]:
        """The key's user, or None when the server runs without keys."""
        if self.keys is None:
            return None
        return self.keys.user_for(_bearer(authorization))

    def require_admin(self, authorization: Optional[str]) -> None:
        """Settings and compaction change the server for every user: admin keys only
        (any caller when the server runs without keys, bound to 127.0.0.1)."""
        if self.keys is None:
            return
        record = self.keys.record_for(_bearer(authorization))
        if not record.admin:
            raise Forbidden(_not_admin(record.user))

    def user_for(self, authorization: Optional[str], claimed: Optional[str]) -> str:
        user = self.authenticate(authorization)
        if user is None:
            if not claimed:
                raise InvalidArgument("user", claimed, "it must be given when the server runs without API keys "
                                      "(--no-auth)")
            return claimed
        if claimed not in (None, "") and claimed != user:
            raise Forbidden(f"Got user={claimed!r}; this API key belongs to user {user!r} and reads and writes only "
                            "that user's memories. Leave user out or use that user's key.")
        return user

    # ---------------------------------------------------------------- recall
    @api.post("/v1/recall", response_model=RecallResponse, responses=ERRORS, tags=["recall"],
              summary="Recall a user's memories for a query, packed into a token budget")
    async def recall(self, body: RecallRequest, authorization: Optional[str] = Header(None)) -> Response:
        clock = time.perf_counter()
        user = self.user_for(authorization, body.user)
        config = self.config()
        k = config.default_k if body.k is None else body.k
        # The library's own checks, before any hop: the same sentences as in Python.
        make_scope(query=body.query, user=user, budget_tokens=body.budget_tokens, k=k, project=body.project,
                   types=body.types, since=body.since, until=body.until)
        request = dict(budget_tokens=body.budget_tokens, k=k, project=body.project, types=body.types,
                       since=body.since, until=body.until, explain=body.explain)
        hop = time.perf_counter()
        if self.local is not None:  # the inline graph: no hop
            out = await self.local.recall(body.query, user=user, config=config, **request)
        elif self.pipeline is not None:  # the compact graph: one hop does every stage
            out = await self.pipeline.recall.remote(body.query, user=user, config=config, **request)
        else:
            out = await self._recall_split(body.query, user, config, request)
        out["timings_ms"]["call_graph"] = _ms(hop)
        out["timings_ms"]["ingress"] = _ms(clock)
        self.latency.add(out["timings_ms"])
        self._note_access(out["items"], user)
        return recall_response(out)

    def _note_access(self, items: list[dict[str, Any]], user: str) -> None:
        """Count the answer's memories as accessed, as in-process recall does: buffered
        here and sent to the Writer at most once per :data:`ACCESS_FLUSH_S` (a hop per
        recall would cost more than some stages)."""
        if not items:
            return
        now_us = int(time.time() * 1_000_000)
        self._accessed.extend((item["id"], user, now_us) for item in items)
        del self._accessed[:-ACCESS_BUFFER]  # the Writer unreachable for long: keep the newest
        if self._access_flush is None or self._access_flush.done():
            self._access_flush = asyncio.get_running_loop().create_task(self._flush_access())

    async def _flush_access(self) -> None:
        """Send the buffered hits every :data:`ACCESS_FLUSH_S` until none are left: hits
        buffered while a batch is on its way, or a batch the Writer did not take, go with
        the next round, also when no recall comes after them."""
        while True:
            await asyncio.sleep(ACCESS_FLUSH_S)
            hits, self._accessed = self._accessed, []
            if not hits:
                return
            try:
                await self.writer.accessed.remote(hits)
            except Exception:  # noqa: BLE001 - recency only: keep them for the next round
                log.warning("could not record %d recall hits in the access log; retrying in %.0f s",
                            len(hits), ACCESS_FLUSH_S, exc_info=True)
                self._accessed[:0] = hits
                del self._accessed[:-ACCESS_BUFFER]

    async def _recall_split(self, query: str, user: str, config: RetrievalConfig,
                            request: dict[str, Any]) -> dict[str, Any]:
        """One await for the whole split graph: the plan's DeploymentResponse goes straight
        into both legs (Serve resolves it; the ingress never unpickles the plan), and the
        legs' responses straight into the Ranker."""
        # Only the split graph comes here, and build_app binds all four of its handles.
        assert self.embedder is not None and self.bm25 is not None
        assert self.dense is not None and self.ranker is not None
        plan = self.embedder.plan.remote(query, user=user, config=config, **request)
        lexical, dense = self.bm25.search.remote(plan), self.dense.search.remote(plan)
        finish = self.ranker.finish.remote(plan, lexical, dense)
        # A leg with no live replica (it died; Serve is starting another) does not fail:
        # its call waits in Serve's router, and the Ranker's call on it. Bounded here;
        # while a leg is missing, more tightly (each recall of an agent's turn would
        # otherwise wait the whole bound until Serve has replaced the replica).
        bound = self._bound(bool(self._legs_missing))
        finishing = asyncio.ensure_future(finish)
        try:
            out = await _settle(finishing, bound)
            self._legs_missing.clear()
            return out
        except LegTimedOut:
            return await self._recall_late(query, user, config, request, (plan, lexical, dense, finish), finishing,
                                           bound)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake, said by the replica that found it
            # A swap between the two legs' replicas, or a leg replica that failed: run the
            # legs again one by one, so one failing leg degrades the answer instead of failing it.
            log.warning("recall graph failed (%s); answering step by step", kind_of(exc) or type(exc).__name__)
            return await self._recall_stepwise(query, user, config, request)

    async def _recall_late(self, query: str, user: str, config: RetrievalConfig, request: dict[str, Any],
                           calls: tuple[Any, Any, Any, Any], finishing: "asyncio.Future[Any]",
                           bound: float) -> dict[str, Any]:
        """The graph did not answer within ``bound`` seconds (``leg_timeout_s``, or less
        while a stage is missing): its calls are reused, not sent again. The plan gets
        ``leg_timeout_s`` more (``bound`` more while the Embedder is known missing); past
        that the Embedder is taken for gone: BM25 alone answers, on a plan made here, and
        the plan call is left running as the Embedder's probe (:meth:`_probe`).
        The legs get a moment's grace (the full ``leg_timeout_s`` if the plan itself was
        late); if both then answer, the Ranker is slow, not gone, and its call is awaited;
        otherwise it is cancelled and the legs that answered are ranked. ``calls``: the
        graph's plan, lexical, dense and finish calls; ``finishing``: the task awaiting
        the last."""
        plan, lexical, dense, finish = calls
        planning = asyncio.ensure_future(plan)
        kept: list[Any] = []  # calls left running as a stage's probe

        def give_up() -> None:
            _drop(finishing)
            for call in calls:
                if call not in kept:
                    call.cancel()  # best effort: a call Serve has sent on runs to its end
            if plan not in kept:
                _drop(planning)

        try:
            clock = time.perf_counter()
            plan_wait = self._bound("embedder" in self._legs_missing)
            try:
                planned = await _settle(planning, plan_wait)
            except LegTimedOut as exc:
                if self._probe("embedder", planning):
                    kept.append(plan)
                give_up()
                return await self._recall_unplanned(query, user, config, request, _failure(exc, bound + plan_wait))
            except Exception as exc:  # noqa: BLE001
                if callers_mistake(exc):
                    raise
                give_up()
                return await self._recall_stepwise(query, user, config, request)
            self._legs_missing.discard("embedder")
            late_plan = time.perf_counter() - clock > LATE_PLAN_S
            wait_s = self.args.leg_timeout_s if late_plan else min(LEG_GRACE_S, self.args.leg_timeout_s)
            legs = await asyncio.gather(self._stage("bm25", lexical, wait_s, kept),
                                        self._stage("dense", dense, wait_s, kept), return_exceptions=True)
            if not any(isinstance(leg, BaseException) for leg in legs):
                try:
                    return await _settle(finishing, None)
                except Exception as exc:  # noqa: BLE001 - e.g. the legs straddled a swap: ranked here
                    if callers_mistake(exc):
                        raise
            give_up()
            log.warning("recall graph took over %g s; answering with the legs that answered", self.args.leg_timeout_s)
            return await self._finish_legs(planned, legs, bound + wait_s)
        except BaseException:  # this request cancelled (its client went away), or refused: its calls are not needed
            give_up()
            raise

    def _bound(self, short: bool) -> float:
        """How long to wait for a stage: ``leg_timeout_s``, or less (``short``) while it,
        or for the whole graph any stage, is missing."""
        return min(self.args.leg_timeout_s, MISSING_LEG_TIMEOUT_S) if short else self.args.leg_timeout_s

    def _probe(self, name: str, call: "asyncio.Future[Any]") -> bool:
        """Keep a late call to stage ``name`` running (one per stage) while the stage is
        taken for missing: when it answers, however late — Serve routes it to the new
        replica — the stage is back and recalls get their full bound again (a stage back
        but slower than the short bound would otherwise never be waited for). False:
        another probe is out; this call is not needed."""
        probe = self._probes.get(name)
        if probe is not None and not probe.done():
            return False
        self._probes[name] = call
        call.add_done_callback(lambda done: self._probed(name, done))
        return True

    def _probed(self, name: str, call: "asyncio.Future[Any]") -> None:
        if not call.cancelled() and call.exception() is None:
            self._legs_missing.discard(name)

    async def _recall_stepwise(self, query: str, user: str, config: RetrievalConfig,
                               request: dict[str, Any]) -> dict[str, Any]:
        """The graph with every hop awaited here: legs realigned on one generation when a
        swap put them on different ones, and a failed leg, or one that does not answer
        within ``leg_timeout_s``, left out (flagged)."""
        # Only the split graph comes here, and build_app binds all four of its handles.
        assert self.embedder is not None and self.bm25 is not None and self.dense is not None
        try:
            plan = await self._stage("embedder", self.embedder.plan.remote(query, user=user, config=config, **request),
                                     self.args.leg_timeout_s)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake
            return await self._recall_unplanned(query, user, config, request, _failure(exc, self.args.leg_timeout_s))
        legs = await asyncio.gather(self._stage("bm25", self.bm25.search.remote(plan), self.args.leg_timeout_s),
                                    self._stage("dense", self.dense.search.remote(plan), self.args.leg_timeout_s),
                                    return_exceptions=True)
        return await self._finish_legs(plan, legs, self.args.leg_timeout_s)

    async def _recall_unplanned(self, query: str, user: str, config: RetrievalConfig, request: dict[str, Any],
                                failure: str) -> dict[str, Any]:
        """The Embedder gave no plan (``failure``: no answer in time — no live replica,
        Serve is replacing it — or a server error): BM25 alone, on a plan made here
        without a query vector (:meth:`Recaller.plan_without_vector`), flagged. Nothing is
        searched by meaning, but a memory is still found by its words."""
        assert self.bm25 is not None
        if failure.startswith("no answer"):
            self._legs_missing.add("embedder")
        plan = self._vectorless.plan_without_vector(query, user=user, config=config, **request)
        wait_s = self._bound("bm25" in self._legs_missing)
        try:
            lexical = await self._stage("bm25", self.bm25.search.remote(plan), wait_s)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake, said by the replica that found it
            raise _unsearchable(f"the embedder failed ({failure}) and the bm25 leg ({_failure(exc, wait_s)})") \
                from None
        note = f"embedder failed ({failure}); answered by BM25 alone, without the query vector"
        return await self._finish_legs(plan, [lexical, None], wait_s, [note])

    async def _finish_legs(self, plan: Any, legs: Sequence[Any], waited_s: float,
                           degraded: Sequence[str] = ()) -> dict[str, Any]:
        """The Ranker over the legs that answered (a failed one is flagged and left out;
        ``None``: not searched)."""
        assert self.bm25 is not None and self.dense is not None and self.ranker is not None
        degraded = [*degraded, *(f"{name} leg failed ({_failure(r, waited_s)}); answered without it"
                                 for name, r in zip(("bm25", "dense"), legs) if isinstance(r, BaseException))]
        lexical, dense = (None if isinstance(r, BaseException) else r for r in legs)
        if lexical is None and dense is None and not plan.skip:
            failed = ", ".join(f"{name} {_failure(r, waited_s)}" for name, r in zip(("bm25", "dense"), legs)
                               if isinstance(r, BaseException))
            raise _unsearchable(f"both retriever legs failed ({failed})")
        if lexical is not None and dense is not None and lexical.generation != dense.generation:
            newer = max(lexical.generation, dense.generation)
            if lexical.generation != newer:
                lexical = await self.bm25.search.remote(plan, newer)
            else:
                dense = await self.dense.search.remote(plan, newer)
            degraded.append(f"legs realigned on generation {newer} during a swap")
        out = await self.ranker.finish.remote(plan, lexical, dense)
        out["flags"].setdefault("degraded", []).extend(degraded)
        return out

    async def _stage(self, name: str, response: Any, wait_s: float, kept: Optional[list[Any]] = None) -> Any:
        """A stage's handle call (its DeploymentResponse) awaited for at most ``wait_s``:
        answered, the stage is not missing; past that it is (:class:`LegTimedOut`), and
        the call is kept as the stage's probe (listed in ``kept``) or cancelled."""
        call = asyncio.ensure_future(response)
        try:
            out = await _settle(call, wait_s)
        except LegTimedOut:
            self._legs_missing.add(name)
            if self._probe(name, call):
                if kept is not None:
                    kept.append(response)
            else:
                call.cancel()
                response.cancel()
            raise
        except Exception:
            self._legs_missing.discard(name)  # it answers, if with an error: not missing
            raise
        self._legs_missing.discard(name)
        return out

    # ---------------------------------------------------------------- writes
    @api.post("/v1/memories", status_code=201, response_model=WriteResponse, responses=ERRORS, tags=["memories"],
              summary="Write one memory or a batch; durable before the answer, recallable at once",
              openapi_extra=_WRITE_BODY)
    async def write(self, request: Request, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        user = self.authenticate(authorization)
        body = await request.body()
        if len(body) > PARSE_ON_LOOP_BYTES:  # off the replica's event loop, which serves every other request
            records, single = await asyncio.get_running_loop().run_in_executor(None, write_records, body)
        else:
            records, single = write_records(body)
        if user is None and any(not r.get("user") for r in records):
            raise InvalidArgument("user", None, "every memory must name its user when the server runs without "
                                  "API keys (--no-auth)")
        return await self.writer.add.remote(records, user, single)

    @api.patch("/v1/memories/{memory_id:path}", response_model=MemoryChanged, responses={**ERRORS, 404: {
        "model": ErrorOut, "description": "No such memory for this user."}}, tags=["memories"],
               summary="Change fields of a memory (a new version replaces it at once)")
    async def patch_memory(self, memory_id: str, body: MemoryPatch,
                           authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        user = self.authenticate(authorization)
        fields = body.model_dump(exclude_unset=True)
        if not fields:
            raise InvalidArgument("body", {}, "give at least one field to change: "
                                  + ", ".join(MemoryPatch.model_fields))
        return await self.writer.patch.remote(memory_id, fields, user)

    @api.delete("/v1/memories/{memory_id:path}", response_model=MemoryChanged, responses={**ERRORS, 404: {
        "model": ErrorOut, "description": "No such memory for this user."}}, tags=["memories"],
                summary="Delete a memory: never returned again, also before compaction")
    async def delete_memory(self, memory_id: str, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        return await self.writer.delete.remote(memory_id, self.authenticate(authorization))

    @api.post("/v1/feedback", status_code=201, response_model=FeedbackOut, responses=ERRORS, tags=["recall"],
              summary="Say which recalled memories answered a query (labelled queries for the query adapter)")
    async def feedback(self, body: FeedbackIn, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        user = self.user_for(authorization, body.user)
        return await self.writer.feedback.remote(body.query, body.memory_ids, user)

    @api.post("/v1/admin/adapt", responses=ERRORS, tags=["admin"],
              summary="Fit the query adapter on the recorded feedback; the replicas use it from their next request")
    async def adapt(self, body: AdaptIn = Body(AdaptIn()), authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return await self.writer.adapt.remote(body.users, body.force)

    @api.post("/v1/admin/compact", responses=ERRORS, tags=["admin"],
              summary="Fold the delta into the next generation now (ingest pipeline)")
    async def compact(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return await self.writer.compact.remote()

    # ---------------------------------------------------------------- settings
    def _settings(self) -> dict[str, Any]:
        config = self.config()
        return {"effective": config.model_dump(), "overrides": self._overrides.read(), "base": self.base}

    @api.get("/v1/settings", response_model=SettingsResponse, responses=ERRORS, tags=["settings"],
             summary="The retrieval settings every recall uses now")
    async def get_settings(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.authenticate(authorization)
        return self._settings()

    @api.patch("/v1/settings", response_model=SettingsResponse, responses=ERRORS, tags=["settings"],
               summary="Change retrieval settings live (no restart); persisted in the store")
    async def patch_settings(self, authorization: Optional[str] = Header(None), patch: dict[str, Any] = Body(
            ..., examples=[{"fusion": {"k": 30, "weights": {"bm25": 0.5}}, "diversity": {"mmr_lambda": 0.7}}],
            description="A partial RetrievalConfig, deep-merged into the live overrides. Typical knobs: "
                        "fusion.weights, fusion.k, fusion.top_rank_bonus, diversity.mmr_lambda, rank.type_weights, "
                        "lexical.strong_signal_score / _gap / _skip.")) -> dict[str, Any]:
        self.require_admin(authorization)
        check_settings(self.base, deep_merge(self._overrides.read(), patch), patch)  # 422 before the hop
        await self.writer.patch_settings.remote(patch, self.base)
        return self._settings()

    @api.delete("/v1/settings", response_model=SettingsResponse, responses=ERRORS, tags=["settings"],
                summary="Drop the live overrides (back to the deployment's user_config)")
    async def reset_settings(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        await self.writer.reset_settings.remote()
        return self._settings()

    # ---------------------------------------------------------------- health, stats
    @api.get("/healthz", tags=["admin"], summary="Liveness: the ingress answers and the store has a generation")
    async def healthz(self) -> dict[str, Any]:
        generation = self._generation.read()
        if generation is None:
            raise StoreError(f"Store {self.store} has no published generation.")
        return {"status": "ok", "generation": generation, "delta_version": self._delta.read() or 0}

    @api.get("/v1/stats", responses=ERRORS, tags=["admin"],
             summary="Generation, counts, delta size, p50/p95 per stage over recent requests")
    async def stats(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        record = self.keys.record_for(_bearer(authorization)) if self.keys is not None else None
        generation = self._generation.read()
        if record is not None and not record.admin:
            # A user's key sees its own counts only: nothing about the other tenants.
            mine = await self.writer.user_stats.remote(record.user)
            return {"generation": generation, "user": record.user, **mine, "latency_ms": self.latency.summary(),
                    "requests_seen_by_this_ingress": self.latency.requests}
        manifest = _read_json(self.store / "generations" / f"{generation:06d}" / "manifest.json") \
            if generation is not None else {}
        writer = await self.writer.stats.remote()
        db = dict(writer["db"])
        db["user_memories"] = db.pop("by_user", {})
        return {
            "generation": generation,
            "generation_counts": manifest.get("counts", {}),
            "delta": writer["delta"],
            "last_compaction": writer["last_compaction"],
            "db": db,
            "latency_ms": self.latency.summary(),
            "requests_seen_by_this_ingress": self.latency.requests,
        }


def build_app(args: ServeArgs) -> Application:
    """The Helix application for ``serve.run`` / ``serve run`` / ``serve deploy``."""
    if not isinstance(args, ServeArgs):
        args = ServeArgs.model_validate(args)
    store = Path(args.store).expanduser().resolve()
    check_settings(args.retrieval, {})
    ingest = load_config(IngestConfig, args.ingest_config) if args.ingest_config else IngestConfig()
    if not (store / "CURRENT").is_file():
        if not args.create:
            raise StoreError(f"Store {store} has no published generation yet (no CURRENT file). Run `helix ingest "
                             "SOURCE --store DIR` first, or set `create: true` to start a new store empty.")
        if store.exists() and any(store.iterdir()):
            raise StoreError(f"{store} is a folder with files but no Helix store in it (no CURRENT file); give "
                             "a new or empty folder to start a store in, or the folder of an existing store.")
        # A new store: an empty first generation, so the server starts and online
        # writes fill it (the delta, then compaction).
        from pipelines.ingest import initialise

        log.warning("Starting a new, empty Helix store in %s", store)
        initialise(store, config=ingest)
    args = args.model_copy(update={"store": str(store)})
    low, high = args.retriever_replicas
    scaling = {**RETRIEVER_AUTOSCALING, "min_replicas": low, "initial_replicas": low, "max_replicas": high}
    writer = Writer.bind(str(store), ingest, compact_interval_s=args.compact_interval_s,
                         compact_max_pending=args.compact_max_pending, compact_runner=args.compact_runner)
    pipelines = {**scaling, "max_replicas": min(high, 2)}  # each holds the models and every stage
    ingress = cast(Deployment, HelixAPI)  # what @serve.deployment made it; mypy keeps the class type
    if args.graph == "compact":
        pipeline = Pipeline.options(autoscaling_config=pipelines).bind(str(store), ingest, args.watch_interval_s)
        return ingress.options(user_config={"retrieval": args.retrieval}).bind(
            None, None, None, None, writer, args.model_dump(), pipeline)
    if args.graph == "inline":
        return ingress.options(user_config={"retrieval": args.retrieval}, autoscaling_config=pipelines,
                               ray_actor_options={"num_cpus": CPUS["pipeline"]}).bind(
            None, None, None, None, writer, args.model_dump(), None, ingest)
    return ingress.options(user_config={"retrieval": args.retrieval}).bind(
        Embedder.bind(ingest, str(store)),
        DenseANN.options(autoscaling_config=scaling).bind(str(store), ingest, args.watch_interval_s),
        BM25.options(autoscaling_config=scaling).bind(str(store), ingest, args.watch_interval_s),
        Ranker.bind(str(store), ingest, args.watch_interval_s),
        writer,
        args.model_dump(),
    )
