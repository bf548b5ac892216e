"""What a front door takes in, checked the same way over HTTP, MCP and :class:`helix_ray.Memory`:
the memory a write sends (:class:`MemoryIn`, at most :data:`MAX_BATCH` at once), the
live retrieval settings (:func:`check_settings`) and the one sentence for a model's
validation errors (:func:`request_error_sentence`). No Ray, no HTTP framework.

Models reject unknown fields (:class:`RequestModel`). JSON types are checked by the
models; values (an empty text, an unknown memory type) by the same functions ingest
uses (:func:`helix_ray.ingest.normalize.normalise_one`), so every front door answers
with the same sentence. The OpenAPI schema of ``helix serve`` declares those value
checks too (:func:`declare`), so that a request the schema calls valid is one the
server takes.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, ValidationError, field_validator

from helix_ray.config import RetrievalConfig, deep_merge
from helix_ray.errors import InvalidArgument, short_repr
from helix_ray.ingest.normalize import MAX_ID_CHARS, MAX_METADATA_DEPTH, MAX_TURN
from helix_ray.schema import MEMORY_TYPES

#: Most memories one write takes (``POST /v1/memories``, ``WriterCore.add``).
MAX_BATCH = 1000


class RequestModel(BaseModel):
    """A request's model: an unknown field is refused, not dropped."""

    model_config = ConfigDict(extra="forbid")


def declare(**constraints: Any) -> Callable[[dict[str, Any]], None]:
    """JSON Schema keywords for a field whose value the library checks, and words the
    error for: they go into the OpenAPI schema (on the field's non-null branch), not
    into pydantic, which would answer with its own sentence instead of Helix's."""
    def apply(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") != "null":
                branch.update(constraints)
    return apply


def whole(value: Any) -> Any:
    """A float with no fraction as the int it is: JSON Schema's ``integer`` is any
    number without a fraction (6.0 too), and strict ints (no ``true``, no ``"6"``) would
    refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: The characters ``str.strip()`` removes (``str.isspace``), spelt out: a regex ``\s``
#: means another set in Python than in the JSON Schema (ECMA-262) dialect.
SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: A string with a character ``str.strip()`` keeps.
NON_BLANK = f"[^{SPACE}]"
#: A string without a control character (an id the API's paths can name again).
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
#: An ISO-8601 date (the whole day) or date and time (no offset: UTC).
TIME = {"anyOf": [{"format": "date"}, {"format": "date-time"}]}


def whole_turn(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    """``metadata`` with a ``turn`` of 12.0 as 12 (:func:`whole`): ingest takes whole
    numbers only, and JSON does not tell 12.0 from 12."""
    if metadata is not None and isinstance(metadata.get("turn"), float):
        return {**metadata, "turn": whole(metadata["turn"])}
    return metadata


class MemoryIn(RequestModel):
    """One memory to write. Missing ``type``, ``salience`` and ``confidence`` are derived
    by the ingest rules; a missing ``id`` is a stable hash of user and text."""

    text: str = Field(description="The memory: non-blank (at most `validation.max_text_chars` characters, 2,000,000 "
                                  "by default; a long one is stored as chunks).",
                      json_schema_extra=declare(minLength=1, pattern=NON_BLANK))
    id: str | None = Field(None, description=f"Any non-blank string of at most {MAX_ID_CHARS} characters with no "
                           "control character; '/' is fine. Not one of the shape Helix derives (20 hex digits) unless "
                           "it is this memory's own, nor ending in '#chunk<n>'.",
                           json_schema_extra=declare(minLength=1, maxLength=MAX_ID_CHARS, pattern=NO_CONTROL,
                                                     allOf=[{"pattern": NON_BLANK}]))
    user: str | None = Field(None, description="Defaults to the API key's user.")
    type: str | None = Field(None, json_schema_extra=declare(enum=list(MEMORY_TYPES)))
    project: str | None = None
    session_id: str | None = None
    created_at: str | None = Field(None, description="ISO-8601; defaults to now.", json_schema_extra=declare(**TIME))
    salience: StrictFloat | None = Field(None, json_schema_extra=declare(minimum=0, maximum=1))
    confidence: StrictFloat | None = Field(None, json_schema_extra=declare(minimum=0, maximum=1))
    pinned: StrictBool | None = None  # true or false, as ingest requires; not "yes"
    source: str | None = None
    metadata: dict[str, Any] | None = Field(
        None, description=f"Any JSON object nesting at most {MAX_METADATA_DEPTH} levels; `turn`, if given, orders a "
                          "session's memories.",
        json_schema_extra=declare(properties={"turn": {"type": ["integer", "null"], "minimum": 0,
                                                       "maximum": MAX_TURN}}))

    @field_validator("metadata")
    @classmethod
    def _whole_turn(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return whole_turn(value)

    @field_validator("id")
    @classmethod
    def _id_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an id must hold a character that is not white space (or leave id out: a stable "
                             "hash of user and text is used)")
        return value


def check_settings(base: dict[str, Any], overrides: dict[str, Any],
                   received: dict[str, Any] | None = None) -> RetrievalConfig:
    """The effective config for ``base`` ← ``overrides``; :class:`InvalidArgument`
    naming each bad key, what it got and what is allowed, and quoting ``received`` (the
    request's own patch; default ``overrides``).

    Checked as JSON, strictly: ``true`` is not the number 1, nor ``"yes"`` a boolean
    (lax validation would take both and keep them in the overrides as they were sent)."""
    merged = _whole_numbers(deep_merge(deep_merge(RetrievalConfig().model_dump(mode="json"), base), overrides))
    try:  # onto the defaults: a patch may name one weight of one type's row
        return RetrievalConfig.model_validate_json(json.dumps(merged), strict=True)
    except ValidationError as exc:
        raise InvalidArgument("settings", overrides if received is None else received,
                              "; ".join(_setting_errors(exc)),
                              "GET /v1/settings lists every key and its current value.") from None


def _whole_numbers(value: Any) -> Any:
    """``value`` with :func:`whole` applied inside it: an int setting may be sent as 6.0
    (a float setting takes an int as it is)."""
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    return whole(value)


def _setting_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
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
