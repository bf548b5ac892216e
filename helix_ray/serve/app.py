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

Around the endpoints here: :mod:`~helix_ray.serve.gate` refuses a request without a
valid key or with too large a body before it is read, :mod:`~helix_ray.serve.responses`
turns errors into their status and sentence, :mod:`~helix_ray.serve.bodies` parses a
write's body, and :mod:`~helix_ray.serve.fanout` runs the split graph with its timeouts.

``build_app(args)`` is a typed application builder: ``serve run
helix_ray.serve.app:build_app store=DIR`` or ``serve deploy configs/serve.yaml``.
(No ``from __future__ import annotations`` here: Serve reads ``build_app``'s annotation
to validate its arguments, and FastAPI reads the endpoints'.)
"""

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Coroutine, Literal, Optional, cast

from fastapi import Body, FastAPI, Header, Query, Request
from fastapi import Path as PathParameter
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from helix_ray import __version__
from helix_ray.config import IngestConfig, RetrievalConfig, deep_merge, load_config
from helix_ray.errors import Forbidden, InvalidArgument, StoreError
from helix_ray.ingest.run import initialise
from helix_ray.live.inputs import NON_BLANK, check_settings
from helix_ray.live.settings import settings_path
from helix_ray.recall.pipeline import Recaller
from helix_ray.recall.scope import as_time, check_context, make_scope
from helix_ray.serve import audit as audit_module
from helix_ray.serve import gate as gate_module
from helix_ray.serve import ratelimit
from helix_ray.serve.api import (
    MAX_AUDIT_RECORDS,
    AdaptIn,
    AuditResponse,
    FeedbackIn,
    FeedbackOut,
    LatencyWindow,
    MemoryChanged,
    MemoryPatch,
    RecallRequest,
    RecallResponse,
    SettingsResponse,
    UserForgotten,
    WriteResponse,
    settings_patch_schema,
)
from helix_ray.serve.bodies import PARSE_ON_LOOP_BYTES, WRITE_BODY, write_records
from helix_ray.serve.deployments import BM25, CPUS, RETRIEVER_AUTOSCALING, DenseANN, Embedder, Pipeline, Ranker, Writer
from helix_ray.serve.fanout import SplitGraph
from helix_ray.serve.gate import Gate, bearer, not_admin
from helix_ray.serve.ratelimit import RateLimiter
from helix_ray.serve.responses import (BODY, KEYED, RETRY_AFTER_S, add_error_handlers, errors, recall_response,
                                       replica_error)
from helix_ray.serve.shells import PipelineShell
from helix_ray.store.audit import read as read_audit
from helix_ray.store.generation import generation_counts
from helix_ray.store.keys import KeyStore
from helix_ray.store.mirror import open_mirror, push
from helix_ray.store.pointer import Pointer

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

    mirror: Optional[str] = Field(
        None, description="A pyarrow.fs URI (absolute folder, file://, s3://, gs://, hdfs://) the Writer pushes the "
                          "store to after every change; recall replicas then read a copy of it on their own node, "
                          "synced every watch_interval_s, so they may run on nodes that do not see the store folder. "
                          "The Writer and the ingress stay on the store's node (store_node).")
    mirror_cache: Optional[str] = Field(None, description="With a mirror: the folder of each node's copy (default: "
                                                          "under the node's temporary folder, one per URI).")
    store_node: Optional[str] = Field(None, description="With a mirror: the Ray node id of the node that sees the "
                                                        "store folder (default: the node that builds the app if it "
                                                        "sees it, else the first node that does).")

    rate_limit: float = Field(0.0, ge=0, description="Requests per second each API key may send to one ingress "
                                                      "replica, on average (a token bucket; over it: 429 with "
                                                      "Retry-After). 0: no limit.")
    rate_burst: int = Field(20, ge=1, description="...and at once: the bucket's size.")
    max_queued_requests: int = Field(
        64, ge=1, le=100_000,
        description="Serve's `max_queued_requests` of every deployment: the requests each caller (the HTTP "
                    "proxy for the HelixAPI ingress, an ingress replica for each stage or the Writer) keeps "
                    "waiting while every replica it could send them to has its `max_ongoing_requests`. One more "
                    "is refused at once: 503 with Retry-After, instead of a queue that grows without bound under "
                    "overload. Clients sending one request at a time are never refused while they are at most "
                    "this many (a caller counts a request as queued while it picks a replica for it, so a "
                    "burst of more at once may be refused before every replica is busy). Higher: a burst "
                    "waits longer instead of being refused.")

    @model_validator(mode="after")
    def _check_replicas(self) -> "ServeArgs":
        low, high = self.retriever_replicas
        if not 1 <= low <= high <= 16:
            raise ValueError(f"Got retriever_replicas={self.retriever_replicas}; it must be (min, max) with "
                             "1 <= min <= max <= 16.")
        if self.mirror is not None:
            open_mirror(self.mirror)  # a bad URI says what is allowed
            if self.graph == "inline":
                raise ValueError("Got graph='inline' with a mirror; the inline graph recalls in the ingress, which "
                                 "stays on the store's node. Use graph 'split' or 'compact', whose recall replicas "
                                 "read the mirror's copy on any node.")
        return self


class RefusalsInHelixWords(APIRoute):
    """A route whose handle call Serve refused before any replica took it (the callee's
    queue full: ``BackPressureError``; it failed to deploy: ``DeploymentUnavailableError``)
    answers Helix's 503: ``{"detail": sentence}`` saying nothing was changed, with
    Retry-After (:func:`helix_ray.serve.responses.replica_error`). The exception handlers
    cannot: Serve registers its own for these two classes on the ingress's app when the
    replica starts (plain text, no Retry-After unless the callee configures one), and
    those win over the handler of their base class."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def refused_in_helix_words(request: Request) -> Response:
            try:
                return await handler(request)
            except (BackPressureError, DeploymentUnavailableError) as exc:
                return await replica_error(request, exc)

        return refused_in_helix_words


api = FastAPI(
    title="Helix",
    version=__version__,
    description="Memory recall for coding agents. Every endpoint but /healthz needs "
                "'Authorization: Bearer <key>' unless the server runs with --no-auth.",
)
api.router.route_class = RefusalsInHelixWords


#: Recall hits are sent to the Writer's access log in batches, this often (seconds), and
#: at most this many are kept waiting when it cannot be reached.
ACCESS_FLUSH_S = 1.0
ACCESS_BUFFER = 100_000


api.add_middleware(Gate)
add_error_handlers(api)


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



@serve.deployment(name="HelixAPI", ray_actor_options={"num_cpus": CPUS["ingress"]}, max_ongoing_requests=128)
@serve.ingress(api)
class HelixAPI(SplitGraph):
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
        gate_module.SERVING["store"] = self.keys  # for the key-first middleware
        audit_module.SERVING["store"] = self.store  # and its audit of admin requests
        ratelimit.SERVING["limiter"] = RateLimiter(self.args.rate_limit, self.args.rate_burst) \
            if self.args.rate_limit and self.keys is not None else None
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
        return self.keys.user_for(bearer(authorization))

    def require_admin(self, authorization: Optional[str]) -> None:
        """Settings and compaction change the server for every user, forgetting a user
        erases one, and the audit log names every admin's actions: admin keys only (any
        caller when the server runs without keys, bound to 127.0.0.1)."""
        if self.keys is None:
            return
        record = self.keys.record_for(bearer(authorization))
        if not record.admin:
            raise Forbidden(not_admin(record.user))

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
    @api.post("/v1/recall", response_model=RecallResponse, responses=errors(*KEYED, 403, *BODY, 503),
              tags=["recall"],
              summary="Recall a user's memories for a query, packed into a token budget")
    async def recall(self, body: RecallRequest, authorization: Optional[str] = Header(None)) -> Response:
        clock = time.perf_counter()
        user = self.user_for(authorization, body.user)
        config = self.config()
        k = config.default_k if body.k is None else body.k
        budget = config.default_budget_tokens if body.budget_tokens is None else body.budget_tokens
        # The library's own checks, before any hop: the same sentences as in Python.
        make_scope(query=body.query, user=user, budget_tokens=budget, k=k, project=body.project,
                   types=body.types, since=body.since, until=body.until)
        request = dict(budget_tokens=budget, k=k, project=body.project, types=body.types,
                       since=body.since, until=body.until, explain=body.explain,
                       context=check_context(body.context) or None, now=as_time("now", body.now))
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


    # ---------------------------------------------------------------- writes
    @api.post("/v1/memories", status_code=201, response_model=WriteResponse, tags=["memories"],
              responses=errors(*KEYED, 403, 409, *BODY, 503),
              summary="Write one memory or a batch; durable before the answer, recallable at once",
              openapi_extra=WRITE_BODY)
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

    @api.patch("/v1/memories/{memory_id:path}", response_model=MemoryChanged, tags=["memories"],
               responses=errors(*KEYED, 404, *BODY, 503),
               summary="Change fields of a memory (a new version replaces it at once)")
    async def patch_memory(self, memory_id: str, body: MemoryPatch,
                           authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        user = self.authenticate(authorization)
        fields = body.model_dump(exclude_unset=True)
        if not fields:
            raise InvalidArgument("body", {}, "give at least one field to change: "
                                  + ", ".join(MemoryPatch.model_fields))
        return await self.writer.patch.remote(memory_id, fields, user)

    @api.delete("/v1/memories/{memory_id:path}", response_model=MemoryChanged, tags=["memories"],
                responses=errors(*KEYED, 404, 503),
                summary="Delete a memory: never returned again, also before compaction")
    async def delete_memory(self, memory_id: str, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        return await self.writer.delete.remote(memory_id, self.authenticate(authorization))

    @api.post("/v1/feedback", status_code=201, response_model=FeedbackOut, tags=["recall"],
              responses=errors(*KEYED, 403, 404, *BODY, 503),
              summary="Say which recalled memories answered a query (labelled queries for the query adapter)")
    async def feedback(self, body: FeedbackIn, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        user = self.user_for(authorization, body.user)
        return await self.writer.feedback.remote(body.query, body.memory_ids, user)

    @api.post("/v1/admin/adapt", responses=errors(*KEYED, 403, 409, *BODY, 503), tags=["admin"],
              summary="Fit the query adapter on the recorded feedback; the replicas use it from their next request")
    async def adapt(self, body: AdaptIn = Body(AdaptIn()), authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return await self.writer.adapt.remote(body.users, body.force)

    @api.post("/v1/admin/compact", responses=errors(*KEYED, 403, 422, 503), tags=["admin"],
              summary="Fold the delta into the next generation now: as a segment, or by rebuilding every file")
    async def compact(self, rebuild: bool = Query(False, description="Rebuild every file with the ingest pipeline "
                                                  "(taking in the generation's segments), even when the writes "
                                                  "would fold into a segment or nothing is pending."),
                      authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return await self.writer.compact.remote(rebuild)

    @api.delete("/v1/users/{user:path}", response_model=UserForgotten, tags=["admin"],
                responses=errors(*KEYED, 403, 404, 422, 503),
                summary="Forget a user: every memory, write, feedback row, recall hit and key of theirs, and "
                        "(compact) every generation that held them")
    async def forget_user(self, user: str = PathParameter(description="The user id, as a key or a memory names it.",
                                                          json_schema_extra={"pattern": NON_BLANK}),
                          compact: bool = Query(True, description="Also publish a generation without the user's "
                                                "rows now and delete every older generation and delta snapshot "
                                                "(the request lasts as long as a compaction); false: the next "
                                                "compaction leaves them out."),
                          authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return await self.writer.forget_user.remote(user, compact)

    @api.get("/v1/admin/audit", response_model=AuditResponse, responses=errors(*KEYED, 403, 422, 503), tags=["admin"],
             summary="The newest records of the store's audit log: who did which admin action, and how it ended")
    async def audit(self, limit: int = Query(100, ge=1, le=MAX_AUDIT_RECORDS, description="How many of the newest "
                                             f"records (1–{MAX_AUDIT_RECORDS:,})."),
                    authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        return {"records": await asyncio.to_thread(read_audit, self.store, limit=limit)}

    # ---------------------------------------------------------------- settings
    def _settings(self) -> dict[str, Any]:
        config = self.config()
        return {"effective": config.model_dump(), "overrides": self._overrides.read(), "base": self.base}

    @api.get("/v1/settings", response_model=SettingsResponse, responses=errors(*KEYED, 503), tags=["settings"],
             summary="The retrieval settings every recall uses now")
    async def get_settings(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.authenticate(authorization)
        return self._settings()

    @api.patch("/v1/settings", response_model=SettingsResponse, responses=errors(*KEYED, 403, *BODY, 503),
               tags=["settings"], summary="Change retrieval settings live (no restart); persisted in the store",
               openapi_extra={"requestBody": {"content": {"application/json": {"schema": settings_patch_schema()}}}})
    async def patch_settings(self, authorization: Optional[str] = Header(None), patch: dict[str, Any] = Body(
            ..., examples=[{"fusion": {"k": 30, "weights": {"bm25": 0.5}}, "diversity": {"mmr_lambda": 0.7}}],
            description="A partial RetrievalConfig, deep-merged into the live overrides. Typical knobs: "
                        "fusion.weights, fusion.k, fusion.top_rank_bonus, diversity.mmr_lambda, rank.type_weights, "
                        "lexical.strong_signal_score / _gap / _skip.")) -> dict[str, Any]:
        self.require_admin(authorization)
        check_settings(self.base, deep_merge(self._overrides.read(), patch), patch)  # 422 before the hop
        await self.writer.patch_settings.remote(patch, self.base)
        return self._settings()

    @api.delete("/v1/settings", response_model=SettingsResponse, responses=errors(*KEYED, 403, 503),
                tags=["settings"],
                summary="Drop the live overrides (back to the deployment's user_config)")
    async def reset_settings(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        self.require_admin(authorization)
        await self.writer.reset_settings.remote()
        return self._settings()

    # ---------------------------------------------------------------- health, stats
    @api.get("/healthz", responses=errors(503), tags=["admin"],
             summary="Liveness: the ingress answers and the store has a generation")
    async def healthz(self) -> dict[str, Any]:
        generation = self._generation.read()
        if generation is None:
            raise StoreError(f"Store {self.store} has no published generation.")
        return {"status": "ok", "generation": generation, "delta_version": self._delta.read() or 0}

    @api.get("/v1/stats", responses=errors(*KEYED, 503), tags=["admin"],
             summary="Generation, counts, delta size, p50/p95 per stage over recent requests")
    async def stats(self, authorization: Optional[str] = Header(None)) -> dict[str, Any]:
        record = self.keys.record_for(bearer(authorization)) if self.keys is not None else None
        generation = self._generation.read()
        if record is not None and not record.admin:
            # A user's key sees its own counts only: nothing about the other tenants.
            mine = await self.writer.user_stats.remote(record.user)
            return {"generation": generation, "user": record.user, **mine, "latency_ms": self.latency.summary(),
                    "requests_seen_by_this_ingress": self.latency.requests}
        writer = await self.writer.stats.remote()
        db = dict(writer["db"])
        db["user_memories"] = db.pop("by_user", {})
        return {
            "generation": generation,
            "generation_counts": generation_counts(self.store, generation) if generation is not None else {},
            "delta": writer["delta"],
            "last_compaction": writer["last_compaction"],
            "mirror": writer["mirror"],  # None without one; else whether it lags the store, since when
            "db": db,
            "latency_ms": self.latency.summary(),
            "requests_seen_by_this_ingress": self.latency.requests,
        }


#: The label Ray gives every node: its node id (a label selector pins a replica to it).
NODE_ID_LABEL = "ray.io/node-id"


def _mirrored(store: Path, args: ServeArgs) -> dict[str, Any]:
    """With a mirror: push the store there before any replica starts (a replica on
    another node starts from it), and the node the store's replicas stay on."""
    if args.mirror is None:
        return {}
    push(store, open_mirror(args.mirror))
    return {} if args.store_node else {"store_node": store_node(store)}


def store_node(store: Path) -> str:
    """The Ray node id of a node that sees ``store`` (its ``CURRENT``): this driver's
    node if it does, else the first live node that does (one probe task per node)."""
    import ray

    if not ray.is_initialized():
        raise StoreError("A mirror needs the store's node: set `store_node` to the Ray node id of the node that "
                         "sees the store folder (`ray list nodes`), or build the app on a driver of the cluster.")

    @ray.remote(num_cpus=0)
    def sees(path: str) -> bool:
        return os.path.isfile(os.path.join(path, "CURRENT"))

    here = ray.get_runtime_context().get_node_id()
    nodes = [here, *(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)]
    for node in nodes:
        if ray.get(sees.options(label_selector={NODE_ID_LABEL: node}).remote(str(store)), timeout=120):
            return node
    raise StoreError(f"No node of this Ray cluster sees the store {store} (checked {len(nodes)}): the Writer must "
                     "run where the store folder is. Start `helix serve` on that host, joined to the cluster.")


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
        log.warning("Starting a new, empty Helix store in %s", store)
        initialise(store, config=ingest)
    args = args.model_copy(update={"store": str(store), **_mirrored(store, args)})
    low, high = args.retriever_replicas
    scaling = {**RETRIEVER_AUTOSCALING, "min_replicas": low, "initial_replicas": low, "max_replicas": high}
    # Every caller's queue bounded: the proxy's to the ingress answers its 503 itself,
    # with Retry-After from backpressure_config; a handle's raises BackPressureError in
    # the ingress, which answers it as its own 503 (RefusalsInHelixWords).
    queue = args.max_queued_requests
    # With a mirror the Writer and the ingress stay where the store folder is; recall
    # replicas (below) read their node's copy of the mirror.
    pin = {"label_selector": {NODE_ID_LABEL: args.store_node}} if args.mirror else {}
    copy = {"mirror": args.mirror, "mirror_cache": args.mirror_cache} if args.mirror else {}
    writer = Writer.options(max_queued_requests=queue, ray_actor_options={"num_cpus": CPUS["writer"], **pin}).bind(
        str(store), ingest, compact_interval_s=args.compact_interval_s, compact_max_pending=args.compact_max_pending,
        compact_runner=args.compact_runner, mirror=args.mirror)
    pipelines = {**scaling, "max_replicas": min(high, 2)}  # each holds the models and every stage
    ingress = cast(Deployment, HelixAPI).options(  # what @serve.deployment made it; mypy keeps the class type
        user_config={"retrieval": args.retrieval}, max_queued_requests=queue,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S),
        ray_actor_options={"num_cpus": CPUS["ingress"], **pin})
    if args.graph == "compact":
        pipeline = Pipeline.options(autoscaling_config=pipelines, max_queued_requests=queue).bind(
            str(store), ingest, args.watch_interval_s, **copy)
        return ingress.bind(None, None, None, None, writer, args.model_dump(), pipeline)
    if args.graph == "inline":
        return ingress.options(autoscaling_config=pipelines, ray_actor_options={"num_cpus": CPUS["pipeline"]}).bind(
            None, None, None, None, writer, args.model_dump(), None, ingest)
    return ingress.bind(
        Embedder.options(max_queued_requests=queue).bind(ingest, str(store), **copy),
        DenseANN.options(autoscaling_config=scaling, max_queued_requests=queue).bind(
            str(store), ingest, args.watch_interval_s, **copy),
        BM25.options(autoscaling_config=scaling, max_queued_requests=queue).bind(
            str(store), ingest, args.watch_interval_s, **copy),
        Ranker.options(max_queued_requests=queue).bind(str(store), ingest, args.watch_interval_s, **copy),
        writer,
        args.model_dump(),
    )