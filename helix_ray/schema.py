"""The memory record: defined once, as an Arrow schema and a typed record.

Every stage that passes memories along uses :data:`MEMORY_SCHEMA` (what a caller
supplies and the DuckDB ``memories`` table holds) or :data:`GENERATION_SCHEMA`
(the same plus the columns ingest derives, as stored in a generation's
``memories.arrow``). Times are UTC, microsecond precision.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
from typing import Any, Literal

import pyarrow as pa

MemoryType = Literal["episodic", "semantic", "procedural", "decision", "code"]
MEMORY_TYPES: tuple[str, ...] = ("episodic", "semantic", "procedural", "decision", "code")

TIMESTAMP = pa.timestamp("us", tz="UTC")

MEMORY_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("user", pa.string(), nullable=False),
        pa.field("project", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("created_at", TIMESTAMP, nullable=False),
        pa.field("last_accessed_at", TIMESTAMP),
        pa.field("access_count", pa.int32(), nullable=False),
        pa.field("salience", pa.float32(), nullable=False),
        pa.field("confidence", pa.float32(), nullable=False),
        pa.field("pinned", pa.bool_(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object
    ]
)

#: Columns ingest adds. ``content_hash`` makes re-ingest idempotent and lets an
#: incremental run reuse embeddings; ``n_tokens`` (cl100k) lets packing skip
#: tokenising on the query path.
DERIVED_FIELDS = [
    pa.field("content_hash", pa.string(), nullable=False),
    pa.field("n_tokens", pa.int32(), nullable=False),
]
GENERATION_SCHEMA = pa.schema(list(MEMORY_SCHEMA) + DERIVED_FIELDS)
#: A new row's columns from the read phase until stage 7a has counted its tokens:
#: :data:`GENERATION_SCHEMA` without ``n_tokens``, its last.
PENDING_SCHEMA = pa.schema([f for f in GENERATION_SCHEMA if f.name != "n_tokens"])

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string()),
        pa.field("position", pa.string()),  # 'line 3', 'row 3', or a Markdown file and section
        pa.field("reason", pa.string()),
        pa.field("raw", pa.string()),  # the record as received, JSON or repr
    ]
)


#: A chunk of a long memory has the id ``<parent id>#chunk<n>`` (n from 1): its parent is
#: the memory as written, which recall, PATCH and DELETE name by the parent id.
CHUNK_ID = re.compile(r"^(?P<parent>.+)#chunk(?P<n>[1-9][0-9]*)$", re.S)


def chunk_id(parent: str, n: int) -> str:
    """The id of chunk ``n`` (1-based) of memory ``parent``."""
    return f"{parent}#chunk{n}"


def parent_of(memory_id: str) -> str | None:
    """The parent id of a chunk's id; None for a memory that is not a chunk."""
    match = CHUNK_ID.match(memory_id)
    return match.group("parent") if match else None


#: A code memory read from a repository has the id ``code:<user>/<repo>:<path>::<symbol>``
#: (``helix_ray.ingest.repo_ids.code_id``; stores of an older Helix ``code:<folder>:<path>::<symbol>``):
#: neither the user part nor the repository name holds a ``:``, and a symbol no ``::``.
CODE_ID = re.compile(r"^code:[^:]*:(?P<path>.+)::(?P<symbol>[^:]+)$", re.S)
_TEST_NAME = re.compile(
    r"^(?:test_.*\.py|.*_test\.(?:py|go|rb|rs)|.*\.(?:test|spec)\.[jt]sx?|conftest\.py|.*Tests?\.(?:java|kt|cs|swift))$")
_TEST_DIRS = frozenset({"test", "tests", "__tests__", "spec", "testing"})


def is_test_path(rel: str) -> bool:
    """Whether the file at ``rel`` (a path from a repository's top) holds tests:
    ``tests/…``, ``test_x.py``, ``x_test.go``, ``x.spec.ts``, ``FooTest.java``…"""
    parts = rel.split("/")
    return bool(_TEST_NAME.match(parts[-1])) or any(p in _TEST_DIRS for p in parts[:-1])


#: The symbol of a module's own memory (its docstring and top-level statements) in a code id.
MODULE_SYMBOL = "<module>"

#: A Markdown section's ``metadata`` key saying where its ``created_at`` was read: "heading",
#: "front matter", "title", "file name" (the text states it), or :data:`FILE_SAVED` (the
#: file's modification time). A re-ingest takes a stated time again, never a saved one.
DATED = "dated"
FILE_SAVED = "saved"


def code_containers(memory_id: str) -> list[str]:
    """The ids of the code memories that would enclose ``memory_id``'s symbol, nearest
    first: ``…::Store.Keys.get`` → ``…::Store.Keys``, ``…::Store``, ``…::<module>``; a
    top-level symbol's module memory; none for a module memory or a memory that is not
    code. Whether those memories exist is the caller's to find out."""
    match = CODE_ID.match(memory_id)
    if match is None or match.group("symbol") == MODULE_SYMBOL:
        return []
    head = memory_id[: match.start("symbol")]
    parts = match.group("symbol").split(".")
    return [head + ".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)] + [head + MODULE_SYMBOL]


def is_test_code(memory_id: str) -> bool:
    """Whether ``memory_id`` (or its parent's, for a chunk) names a code memory of a test file."""
    match = CODE_ID.match(parent_of(memory_id) or memory_id)
    return match is not None and is_test_path(match.group("path"))


#: The shape of the ids :func:`content_hash` derives (its first 20 hex digits).
DERIVED_ID = re.compile(r"[0-9a-f]{20}")


def content_hash(text: str, user: str) -> str:
    """Stable id for a record that brings none: sha1 over tenant and text."""
    digest = hashlib.sha1(f"{user}\x1f{text}".encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:20]


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """One validated memory, as the stages see it."""

    id: str
    text: str
    type: str
    user: str
    project: str | None = None
    session_id: str | None = None
    created_at: dt.datetime = dataclasses.field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc)
    )
    last_accessed_at: dt.datetime | None = None
    access_count: int = 0
    salience: float = 0.5
    confidence: float = 0.7
    pinned: bool = False
    source: str = "api"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in MEMORY_TYPES:
            raise ValueError(
                f"Got type={self.type!r}; it must be one of {', '.join(MEMORY_TYPES)}."
            )
        for name in ("salience", "confidence"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"Got {name}={value!r}; it must be within [0, 1].")

    def to_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["metadata"] = json.dumps(self.metadata, sort_keys=True, ensure_ascii=False)
        return row


def records_to_table(records: list[MemoryRecord]) -> pa.Table:
    return pa.Table.from_pylist([r.to_row() for r in records], schema=MEMORY_SCHEMA)
