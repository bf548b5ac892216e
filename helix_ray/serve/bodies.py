"""The body of ``POST /v1/memories``: parsing, validation and its OpenAPI schema.

A body is one memory object, ``{"memories": [...]}`` or a bare list; each record is
checked against :class:`helix_ray.live.inputs.MemoryIn`, and a body that is not JSON or not
memories is the 422 of :class:`fastapi.exceptions.RequestValidationError`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from helix_ray.live.inputs import MAX_BATCH, MemoryIn
from helix_ray.serve.api import MemoryBatch, undecodable_body

_MEMORY_SCHEMA = MemoryIn.model_json_schema()
_MEMORY_LIST = TypeAdapter(list[MemoryIn])

#: A write body larger than this is parsed and validated in a thread, not on the
#: replica's event loop (which answers every other request and Serve's own calls).
PARSE_ON_LOOP_BYTES = 1 << 20


def write_records(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """A ``POST /v1/memories`` body as records (each a memory object, None fields left
    out) and whether it was one memory rather than a batch; a body that is not JSON or
    not memories raises the 422's :class:`RequestValidationError`."""
    try:
        payload = json.loads(body)
    except UnicodeDecodeError as exc:
        raise undecodable_body(exc) from None
    except ValueError as exc:  # JSONDecodeError says where; a UnicodeDecodeError does not
        pos = getattr(exc, "pos", None)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", *([] if pos is None else [pos])),
                                       "msg": "invalid JSON",
                                       "ctx": {"error": getattr(exc, "msg", None)}}]) from None
    except RecursionError:  # a 422, not a 500
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


#: A batch: each memory its own id (one left out derives from user and text, so the
#: same text twice is refused too).
_BATCH = {"type": "array", "items": _MEMORY_SCHEMA, "minItems": 1, "maxItems": MAX_BATCH, "uniqueItems": True,
          "description": f"1 to {MAX_BATCH} memories, each with its own id (or text, when the id is left out)."}

WRITE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    _MEMORY_SCHEMA,
    {"type": "object", "title": "MemoryBatch", "required": ["memories"], "additionalProperties": False,
     "properties": {"memories": _BATCH}},
    _BATCH,
]}}}}}
