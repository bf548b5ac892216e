"""The HTTP contract: request and response models, the schema of a settings patch, the
error for a body that is not UTF-8 and the latency window behind ``GET /v1/stats``. No
Ray here. What HTTP shares with MCP and :class:`helix_ray.Memory` is in
:mod:`helix_ray.live.inputs` (the memory a write sends, the sentence for a model's
errors) and :mod:`helix_ray.live.settings` (the settings check).

Request models reject unknown fields (``extra="forbid"``). JSON types are checked by
the models; values (an empty query, a budget of 0, an unknown memory type) are checked
by the same functions the library uses (:func:`helix_ray.recall.scope.make_scope`,
:func:`helix_ray.ingest.normalize.normalise_one`), so the HTTP error carries the same
sentence as the Python error. The OpenAPI schema declares those value checks too
(:func:`~helix_ray.live.inputs.declare`), so that a request the schema calls valid is
one the server takes.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from helix_ray.config import DEFAULT_BUDGET_TOKENS, RetrievalConfig
from helix_ray.errors import InvalidArgument
from helix_ray.live.inputs import (MAX_BATCH, NON_BLANK, SPACE, TIME, MemoryIn, RequestModel, declare, whole,
                                   whole_turn)
from helix_ray.recall.adapter import MAX_FEEDBACK_IDS, MAX_FEEDBACK_QUERY_CHARS
from helix_ray.recall.scope import MAX_BUDGET_TOKENS, MAX_CONTEXT_TURNS, MAX_QUERY_CHARS
from helix_ray.schema import MEMORY_TYPES


def not_null(**constraints: Any) -> Callable[[dict[str, Any]], None]:
    """:func:`declare` for an optional field that may be left out but not sent as null
    (the library refuses a null there)."""
    def apply(schema: dict[str, Any]) -> None:
        branches = [b for b in schema.pop("anyOf", [schema]) if b.get("type") != "null"]
        schema.update(branches[0], **constraints)
        schema.pop("default", None)
    return apply


#: An integer as JSON Schema reads one: 6 or 6.0, never ``true`` or ``"6"``.
WholeNumber = Annotated[StrictInt, BeforeValidator(whole)]


#: A string with a character that is neither white space, a control character nor an
#: invisible format character (a query needs a letter, digit, symbol or punctuation mark).
PRINTABLE = rf"[^{SPACE}\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]"
TYPE_ENUM = {"type": "string", "enum": list(MEMORY_TYPES)}


# ----------------------------------------------------------------------------- recall


class RecallRequest(RequestModel):
    """A recall request. ``user`` may be left out when an API key is sent: the key's
    user is used (and a different ``user`` is refused)."""

    query: str = Field(description="The question to recall memories for: at most 8000 characters, with a "
                                   "letter, digit, symbol or punctuation mark among them.",
                       json_schema_extra=declare(minLength=1, maxLength=MAX_QUERY_CHARS, pattern=PRINTABLE))
    budget_tokens: WholeNumber | None = Field(None, description="Token budget of the packed result (cl100k tokens, "
                                      f"1–{MAX_BUDGET_TOKENS:,}; default `default_budget_tokens` of the settings, "
                                      f"{DEFAULT_BUDGET_TOKENS}).",
                                      json_schema_extra=declare(minimum=1, maximum=MAX_BUDGET_TOKENS))
    user: str | None = Field(None, description="The tenant; defaults to the API key's user.")
    project: str | None = Field(None, description="Only memories of this project (a non-blank name).",
                                json_schema_extra=declare(minLength=1, pattern=NON_BLANK))
    types: list[str] | None = Field(None, description="Only these memory types (at least one): episodic, semantic, "
                                    "procedural, decision, code.",
                                    json_schema_extra=declare(minItems=1, items=TYPE_ENUM))
    since: str | None = Field(None, description="ISO-8601 time: only memories created at or after it (not later "
                                                "than `until`).",
                              json_schema_extra=declare(**TIME))
    until: str | None = Field(None, description="ISO-8601 time: only memories created at or before it (a date "
                                                "alone, e.g. 2025-03-14, means the end of that day, UTC).",
                              json_schema_extra=declare(**TIME))
    k: WholeNumber | None = Field(None, description="Items selected before packing (1–200; default from the "
                                  "settings).", json_schema_extra=declare(minimum=1, maximum=200))
    context: list[str] | None = Field(None, description="The conversation's recent turns, oldest first, when the "
                                      "query is its latest turn: each is searched too, the latest weighing most "
                                      f"(at most {MAX_CONTEXT_TURNS} turns of at most {MAX_QUERY_CHARS} characters; "
                                      "the latest 8 are read).",
                                      json_schema_extra=declare(maxItems=MAX_CONTEXT_TURNS, items={
                                          "type": "string", "maxLength": MAX_QUERY_CHARS}))
    now: str | None = Field(None, description="ISO-8601 time the question is asked at (default: the server's clock); "
                            "time words in the query ('last week') are read against it.",
                            json_schema_extra=declare(**TIME))
    explain: StrictBool = Field(False, description="Return every candidate's ranks, signals and fate.")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"query": "why did we choose NATS for the event bus?", "budget_tokens": 400, "k": 6}]})


class RecallItemOut(BaseModel):
    id: str
    text: str
    type: str
    rank: int = Field(description="1-based rank after ranking and diversity (before lost-in-the-middle order).")
    score: float
    n_tokens: int
    truncated: bool
    created_at: str
    session_id: str | None
    project: str | None
    signals: dict[str, float]
    parent: str | None = Field(None, description="The memory this item is a chunk of (a long memory is stored "
                               "as chunks, id '<parent>#chunk<n>'); null for a whole memory.")
    origin: str = Field(description="'generation' (published) or 'delta' (written since the last compaction).")


class RecallResponse(BaseModel):
    query: str
    user: str
    items: list[RecallItemOut] = Field(description="Packed memories in final (lost-in-the-middle) order.")
    total_tokens: int
    budget_tokens: int
    timings_ms: dict[str, float] = Field(description="Per stage (embed, route, bm25, dense, fuse, expand, rank, "
                                                     "diversify, pack, total) and per hop (call_*), milliseconds.")
    flags: dict[str, Any] = Field(description="router_skip, strong_signal_skip, route, graph, diversity mode, and "
                                              "`degraded`: sentences naming what the answer was made without (a "
                                              "retriever leg or the Embedder that did not answer in time).")
    generation: int | None
    delta_version: int
    explain: list[dict[str, Any]] | None = None


# ----------------------------------------------------------------------------- memories


class MemoryBatch(RequestModel):
    memories: list[MemoryIn] = Field(description=f"1 to {MAX_BATCH} memories, written together.")


class MemoryPatch(RequestModel):
    """Fields to change (at least one); the others keep their value. A null ``type``,
    ``salience`` or ``confidence`` is derived again; a null ``project``, ``session_id``,
    ``source`` or ``metadata`` clears it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    text: str | None = Field(None, json_schema_extra=not_null(minLength=1, pattern=NON_BLANK))
    type: str | None = Field(None, json_schema_extra=declare(enum=list(MEMORY_TYPES)))
    project: str | None = None
    session_id: str | None = None
    salience: StrictFloat | None = Field(None, json_schema_extra=declare(minimum=0, maximum=1))
    confidence: StrictFloat | None = Field(None, json_schema_extra=declare(minimum=0, maximum=1))
    pinned: StrictBool | None = Field(None, json_schema_extra=not_null())  # true or false, as ingest requires
    source: str | None = None
    metadata: dict[str, Any] | None = Field(None, json_schema_extra=MemoryIn.model_fields["metadata"].json_schema_extra)

    @field_validator("metadata")
    @classmethod
    def _whole_turn(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return whole_turn(value)


class WriteResponse(BaseModel):
    ids: list[str]
    replaced: list[str] = Field(default=[], description="Those of `ids` that named a live memory already: the "
                                "write replaced its earlier version (every earlier chunk of a long one).")
    delta_version: int
    generation: int | None


class FeedbackIn(RequestModel):
    """The memories of a recall that answered the query: labelled queries from which
    ``helix adapt --from-feedback`` fits the store's query adapter."""

    query: str = Field(max_length=MAX_FEEDBACK_QUERY_CHARS, description="The query the memories answered "
                       f"(non-blank, at most {MAX_FEEDBACK_QUERY_CHARS} characters).",
                       json_schema_extra=declare(minLength=1, pattern=NON_BLANK))
    memory_ids: list[str] = Field(min_length=1, max_length=MAX_FEEDBACK_IDS, description="Ids of this user's "
                                  "memories (a 404 names those it does not hold).",
                                  json_schema_extra=declare(items={"type": "string", "minLength": 1}))
    user: str | None = Field(None, description="Defaults to the API key's user.")


class FeedbackOut(BaseModel):
    recorded: int


class AdaptIn(RequestModel):
    """Fit the store's query adapter on the recorded feedback (``helix adapt
    --from-feedback`` without stopping the server)."""

    users: list[str] | None = Field(None, description="Only these users' feedback (at least one user; default: "
                                    "every user's).", json_schema_extra=declare(minItems=1))
    force: StrictBool = Field(False, description="Save the adapter even if cross-validation shows no gain.")


class MemoryChanged(BaseModel):
    id: str
    delta_version: int
    deleted: bool = False
    generation: int | None = None


class UserForgotten(BaseModel):
    """What ``DELETE /v1/users/{user}`` erased: rows deleted from the database (access-log
    rows blanked), lines from the inbox files, keys from ``keys.json``."""

    user: str
    memories: int = Field(description="Memory rows, chunks included.")
    chunks: int = Field(description="Of those, chunks of long memories ('<id>#chunk<n>').")
    expansions: int = Field(description="doc2query expansions of those memories.")
    entities: int
    edges: int = Field(description="Graph edges touching the memories or the entities.")
    duplicates: int = Field(description="Links between a dropped near-duplicate and the memory kept.")
    feedback: int
    access_rows: int = Field(description="Access-log rows (recall hits), blanked: the log keeps its positions.")
    online_writes: int = Field(description="Rows of the online writes' log (puts and deletes).")
    inbox_lines: int = Field(description="Lines of the inbox files (online writes waiting for compaction).")
    quarantined: int = Field(description="Rejected records naming the user.")
    keys: int = Field(description="API keys of the user (revoked ones too).")
    adapter_removed: bool = Field(description="The query adapter was fitted on the user's queries and is gone: "
                                              "fit it again with POST /v1/admin/adapt.")
    compacted: bool = Field(description="The generation served now holds none of the user's rows (a compaction "
                                        "published it, or it held none) and every older generation and delta "
                                        "snapshot is deleted; false: the next compaction leaves the rows out.")
    generation: int | None = Field(description="The generation served now.")
    mirror_stale: bool = Field(default=False, description="The store's mirror may still hold the user's data (its "
                               "push failed, or no mirror was given): every push keeps no older generation "
                               "there until one completes.")


# ----------------------------------------------------------------------------- audit

#: Most records one ``GET /v1/admin/audit`` answers.
MAX_AUDIT_RECORDS = 10_000


class AuditRecordOut(BaseModel):
    """One admin action of the store's audit log (:mod:`helix_ray.store.audit`)."""

    time: str = Field(description="When it ended, ISO-8601 UTC.")
    actor: str = Field(description="'key:<key id>' (an admin key over HTTP), 'cli:<os user>' (a command on the "
                                   "host) or 'no-auth' (a server without keys).")
    actor_user: str | None = Field(description="The user of the actor's key.")
    action: str = Field(description="settings.patch, settings.reset, compact, adapt, forget-user, audit.read, "
                                    "key.create, key.revoke, backup, restore.")
    target: str | None = Field(description="What it acted on: the user forgotten, the key, the folder.")
    params: dict[str, Any] = Field(description="What it was asked with (never a key, a memory's text or a query).")
    outcome: Literal["ok", "refused", "failed"]
    status: int | None = Field(description="The HTTP status of the answer, or the exit code of a command.")
    detail: str | None = Field(None, description="The sentence of a refusal or failure.")
    result: dict[str, Any] | None = Field(None, description="Counts the action reported (compact, adapt, "
                                                            "forget-user).")


class AuditResponse(BaseModel):
    records: list[AuditRecordOut] = Field(description="The newest records, oldest first.")


# ----------------------------------------------------------------------------- settings

#: The knobs ``PATCH /v1/settings`` is meant for (any RetrievalConfig key is accepted).
LIVE_KNOBS = {
    "fusion.weights": "RRF list weights {dense, bm25}, each >= 0, one > 0",
    "fusion.k": "RRF k, 1–1000 (Cormack et al. 2009: 60)",
    "fusion.top_rank_bonus": "true/false: +0.05 for a 1st rank, +0.02 for 2nd–3rd",
    "diversity.mmr_lambda": "MMR λ in [0, 1]: 1 = relevance only",
    "rank.type_weights": "per type {similarity, recency, salience, confidence, graph} >= 0",
    "lexical.strong_signal_score": "[0, 1]",
    "lexical.strong_signal_gap": "[0, 1]",
    "lexical.strong_signal_skip": "true/false",
}


class SettingsResponse(BaseModel):
    effective: dict[str, Any] = Field(description="The RetrievalConfig every recall uses now.")
    overrides: dict[str, Any] = Field(description="What PATCH /v1/settings changed (persisted in the store).")
    base: dict[str, Any] = Field(description="The deployment's user_config retrieval overrides.")
    knobs: dict[str, str] = Field(LIVE_KNOBS, description="The knobs meant for live tuning and their ranges.")


def settings_patch_schema() -> dict[str, Any]:
    """The OpenAPI schema of a ``PATCH /v1/settings`` body: :class:`RetrievalConfig`'s,
    every key optional (a patch names what it changes and is deep-merged into the live
    overrides), unknown keys refused, and its two tables' keys named: the fusion lists and
    the memory types. Rules between keys stay in words (one fusion weight > 0)."""
    schema = RetrievalConfig.model_json_schema()
    defs = schema.pop("$defs")

    def partial(node: Any) -> Any:
        if isinstance(node, list):
            return [partial(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return {k: partial(v) for k, v in node.items() if k != "required"}

    out = partial(schema)
    weights = out["properties"]["fusion"]["properties"]["weights"]
    weights.update(properties={name: {"type": "number", "minimum": 0} for name in ("dense", "bm25")},
                   additionalProperties=False, description="Each >= 0, one > 0 (a patch that names one changes "
                   "that one only).", **{"not": {"required": ["dense", "bm25"], "properties": {
                       "dense": {"maximum": 0}, "bm25": {"maximum": 0}}}})
    rows = out["properties"]["rank"]["properties"]["type_weights"]
    row = rows.pop("additionalProperties")
    rows.update(properties={t: row for t in MEMORY_TYPES}, additionalProperties=False)
    out["properties"]["pack"]["properties"]["encoding"]["enum"] = [RetrievalConfig().pack.encoding]
    return out


# ----------------------------------------------------------------------------- errors


def undecodable_body(exc: UnicodeDecodeError) -> InvalidArgument:
    """The 422 for a body that is not UTF-8: said as such, with the byte that is not
    (a JSON reader would call it malformed JSON, FastAPI "an error parsing the body")."""
    around = exc.object[max(0, exc.start - 20):exc.start + 20]
    return InvalidArgument("body", around, f"a request body must be JSON encoded in UTF-8, and byte "
                           f"0x{exc.object[exc.start]:02x} at position {exc.start} is not UTF-8",
                           "Encode the body as UTF-8 and send it with Content-Type: application/json.")


# ----------------------------------------------------------------------------- stats


class LatencyWindow:
    """The last ``size`` timings per stage, for p50/p95 in ``GET /v1/stats``."""

    def __init__(self, size: int = 2048):
        self.size = size
        self.samples: dict[str, deque] = {}
        self.requests = 0

    def add(self, timings: dict[str, float]) -> None:
        self.requests += 1
        for stage, ms in timings.items():
            self.samples.setdefault(stage, deque(maxlen=self.size)).append(float(ms))

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for stage, values in self.samples.items():
            arr = np.fromiter(values, dtype=np.float64)
            out[stage] = {"n": int(len(arr)), "p50": round(float(np.percentile(arr, 50)), 3),
                          "p95": round(float(np.percentile(arr, 95)), 3)}
        return out
