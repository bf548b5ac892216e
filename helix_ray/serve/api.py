"""The HTTP contract: request and response models, error sentences, settings checks and
the latency window behind ``GET /v1/stats``. No Ray here.

Request models reject unknown fields (``extra="forbid"``). JSON types are checked by
the models; values (an empty query, a budget of 0, an unknown memory type) are checked
by the same functions the library uses (:func:`helix_ray.recall.scope.make_scope`,
:func:`helix_ray.ingest.normalize.normalise_one`), so the HTTP error carries the same
sentence as the Python error.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from helix_ray.config import DEFAULT_BUDGET_TOKENS, RetrievalConfig, deep_merge
from helix_ray.errors import InvalidArgument, short_repr
from helix_ray.schema import MEMORY_TYPES


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- recall


class RecallRequest(_Request):
    """A recall request. ``user`` may be left out when an API key is sent: the key's
    user is used (and a different ``user`` is refused)."""

    query: str = Field(description="The question to recall memories for (non-empty, at most 8000 characters).")
    budget_tokens: int | None = Field(None, description="Token budget of the packed result (cl100k tokens, > 0; "
                                                        "default `default_budget_tokens` of the settings, "
                                                        f"{DEFAULT_BUDGET_TOKENS}).")
    user: str | None = Field(None, description="The tenant; defaults to the API key's user.")
    project: str | None = Field(None, description="Only memories of this project.")
    types: list[str] | None = Field(None, description="Only these memory types: episodic, semantic, procedural, "
                                                       "decision, code.")
    since: str | None = Field(None, description="ISO-8601 time: only memories created at or after it.")
    until: str | None = Field(None, description="ISO-8601 time: only memories created at or before it (a date "
                                                "alone, e.g. 2025-03-14, means the end of that day, UTC).")
    k: int | None = Field(None, description="Items selected before packing (1–200; default from the settings).")
    context: list[str] | None = Field(None, description="The conversation's recent turns, oldest first, when the "
                                      "query is its latest turn: each is searched too, the latest weighing most "
                                      "(at most 64; the latest 8 are read).")
    now: str | None = Field(None, description="ISO-8601 time the question is asked at (default: the server's clock); "
                            "time words in the query ('last week') are read against it.")
    explain: bool = Field(False, description="Return every candidate's ranks, signals and fate.")

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


class MemoryIn(_Request):
    """One memory to write. Missing ``type``, ``salience`` and ``confidence`` are derived
    by the ingest rules; a missing ``id`` is a stable hash of user and text."""

    text: str
    id: str | None = Field(None, min_length=1, pattern=r"\S", description="Any non-blank string; '/' is fine.")
    user: str | None = Field(None, description="Defaults to the API key's user.")
    type: str | None = None
    project: str | None = None
    session_id: str | None = None
    created_at: str | None = Field(None, description="ISO-8601; defaults to now.")
    salience: float | None = None
    confidence: float | None = None
    pinned: StrictBool | None = None  # true or false, as ingest requires; not "yes"
    source: str | None = None
    metadata: dict[str, Any] | None = None


class MemoryBatch(_Request):
    memories: list[MemoryIn] = Field(description="1 to 1000 memories, written together.")


class MemoryPatch(_Request):
    """Fields to change; the others keep their value."""

    text: str | None = None
    type: str | None = None
    project: str | None = None
    session_id: str | None = None
    salience: float | None = None
    confidence: float | None = None
    pinned: StrictBool | None = None  # true or false, as ingest requires; not "yes"
    source: str | None = None
    metadata: dict[str, Any] | None = None


class WriteResponse(BaseModel):
    ids: list[str]
    delta_version: int
    generation: int | None


class FeedbackIn(_Request):
    """The memories of a recall that answered the query: labelled queries from which
    ``helix adapt --from-feedback`` fits the store's query adapter."""

    query: str = Field(max_length=4000)
    memory_ids: list[str] = Field(min_length=1, max_length=100)
    user: str | None = Field(None, description="Defaults to the API key's user.")


class FeedbackOut(BaseModel):
    recorded: int


class AdaptIn(_Request):
    """Fit the store's query adapter on the recorded feedback (``helix adapt
    --from-feedback`` without stopping the server)."""

    users: list[str] | None = Field(None, description="Only these users' feedback (default: every user's).")
    force: bool = Field(False, description="Save the adapter even if cross-validation shows no gain.")


class MemoryChanged(BaseModel):
    id: str
    delta_version: int
    deleted: bool = False
    generation: int | None = None


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


def check_settings(base: dict[str, Any], overrides: dict[str, Any],
                   received: dict[str, Any] | None = None) -> RetrievalConfig:
    """The effective config for ``base`` ← ``overrides``; :class:`InvalidArgument`
    naming each bad key, what it got and what is allowed, and quoting ``received`` (the
    request's own patch; default ``overrides``).

    Checked as JSON, strictly: ``true`` is not the number 1, nor ``"yes"`` a boolean
    (lax validation would take both and keep them in the overrides as they were sent)."""
    merged = deep_merge(deep_merge(RetrievalConfig().model_dump(mode="json"), base), overrides)
    try:  # onto the defaults: a patch may name one weight of one type's row
        return RetrievalConfig.model_validate_json(json.dumps(merged), strict=True)
    except ValidationError as exc:
        raise InvalidArgument("settings", overrides if received is None else received,
                              "; ".join(_setting_errors(exc)),
                              "GET /v1/settings lists every key and its current value.") from None


def _setting_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        if tuple(err["loc"][:2]) == ("rank", "type_weights") and len(err["loc"]) > 2 \
                and err["loc"][2] not in MEMORY_TYPES:  # not four "Field required" about its row
            sentence = f"rank.type_weights.{err['loc'][2]} is not a memory type (allowed: {', '.join(MEMORY_TYPES)})"
            if sentence not in out:
                out.append(sentence)
            continue
        if err["type"] == "extra_forbidden":
            parent = err["loc"][:-1]
            model: Any = RetrievalConfig
            for part in parent:
                field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
                model = field.annotation if field is not None else None
            allowed = ", ".join(model.model_fields) if hasattr(model, "model_fields") else "see GET /v1/settings"
            out.append(f"{path} is not a setting (allowed here: {allowed})")
        else:
            out.append(f"{path}={short_repr(err.get('input'))}: {err['msg']}")
    return out


# ----------------------------------------------------------------------------- errors


def request_error_sentence(errors: Sequence[Mapping[str, Any]]) -> str:
    """One sentence for FastAPI's request validation errors (unknown field, wrong JSON
    type, missing field)."""
    parts = []
    union_noise = {"list_type", "model_type", "model_attributes_type", "dict_type"}
    meaningful = [e for e in errors if e.get("type") not in union_noise] or errors
    for err in meaningful[:5]:
        loc = [p for p in err.get("loc", ()) if p != "body" and not str(p).startswith(("list[", "MemoryIn"))]
        where = _where(loc)
        kind = err.get("type")
        if kind == "extra_forbidden":
            parts.append(f"Got unknown field {where!r}; remove it (the allowed fields are in the OpenAPI schema "
                         "at /docs)")
        elif kind == "missing":
            parts.append(f"The field {where!r} is required; add it (the fields are in the OpenAPI schema at /docs)")
        elif kind == "json_invalid":
            at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
            why = (err.get("ctx") or {}).get("error") or err.get("msg")
            parts.append(f"The request body is not valid JSON{at}"
                         + (f" ({why})" if why not in (None, "invalid JSON", "JSON decode error") else "")
                         + "; check its quotes, commas and brackets")
        elif isinstance(err.get("input"), (bytes, bytearray)):  # FastAPI did not parse it: not sent as JSON
            parts.append("The request body must be JSON, sent with the header Content-Type: application/json")
        else:
            parts.append(f"Got {where}={short_repr(err.get('input'))}; {err.get('msg', 'invalid value')}")
    return "; ".join(p.rstrip(".") for p in parts) + "."


def _where(loc: Sequence[Any]) -> str:
    """A field's place in the body, as a sentence names it: ``memories[1].text`` (a
    leading index is a record of a list posted to ``/v1/memories``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]" if out else f"memories[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "the request body"


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
