"""Stage 2: validate and normalise raw records; derive what a record does not give.

:func:`normalise` is pure: raw dict in, either a row of
:data:`helix_ray.schema.GENERATION_SCHEMA` or a quarantine row out. A given value is
never overwritten; derivation fills only what is missing.

Derivation rules (each tested in ``tests/test_normalize.py``):

``type`` — first rule that matches:
  1. a fenced code block → ``code``
  2. "we decided / chose / picked / went with / agreed / settled on", "decision:" → ``decision``
  3. two or more numbered or bulleted steps, or "how to" / "to do X, run" → ``procedural``
  4. a file path, a ``module.function()`` call or a shell command line → ``code``
  5. a conversation turn (transcript source, speaker) or a dated event → ``episodic``
  6. otherwise → ``semantic``

``salience`` = type prior (episodic .40, semantic .50, code .50, procedural .60,
decision .70) + .15 for an explicit marker ("always", "never", "important", "must",
"critical", "remember") + .10 for an error string (``...Error``, ``Exception``,
``Traceback``, ``FATAL``, ``exit code``) − .20 for test code (``metadata.code.test``)
− ``ingest.ask_discount`` (.40) for a chat turn (``metadata.speaker``) that only asks ("What
are their names?", "Cool! How was it?"); a pinned memory gets at least .90; kept within [0, 1].

``confidence`` by source: user-confirmed (``source`` user / human / confirmed, or
``metadata.confirmed``) .90; documents (markdown) .80; what was said in a conversation
(transcript, LoCoMo) .70; anything else (api, agent) .60; inferred / llm .50.

``id`` (when the record gives none) names the record's user: a Markdown section's is
``md:<user>/<docs>/<path>#<slug>``, any other record's the content hash of its user and text
(:mod:`helix_ray.ingest.ids`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import Path
from typing import Any

from helix_ray import tokens
from helix_ray.config import ChunkConfig, ValidationConfig
from helix_ray.ingest import chunk, chunk_parse
from helix_ray.ingest.ids import SECTION_KEY, markdown_id
from helix_ray.schema import MEMORY_SCHEMA, MEMORY_TYPES, chunk_id, content_hash, parent_of

TYPE_PRIOR = {"episodic": 0.40, "semantic": 0.50, "code": 0.50, "procedural": 0.60, "decision": 0.70}
#: Salience a test gives up (``metadata.code.test``, :func:`helix_ray.schema.is_test_path`):
#: asked where something is done, an agent wants the code that does it, not its test.
TEST_DISCOUNT = 0.20

_FENCE = re.compile(r"```")
_DECISION = re.compile(
    r"\b(?:we|i|they|team|the team)\s+(?:have\s+|had\s+)?(?:decided|chose|picked|opted|agreed|settled on|went with)\b"
    r"|\bdecision\s*:|\bdecided to\b|\bwe(?:'ll| will) go with\b",
    re.I,
)
_STEPS = re.compile(r"^\s*(?:\d+[.)]|[-*•])\s+\S", re.M)
_INLINE_STEPS = re.compile(r"(?:^|\s)1[.)]\s.+\s2[.)]\s", re.S)
_HOWTO = re.compile(r"\bhow to\b|\bto [a-z][\w -]{2,40}, (?:run|use|do|call|set|open)\b|\bsteps?\b:", re.I)
_PATH = re.compile(
    r"(?:^|[\s`'\"(])(?:[\w.-]+/)+[\w.-]+\.[A-Za-z0-9]{1,6}\b"
    r"|\b[\w-]+\.(?:py|go|rs|ts|tsx|js|java|rb|c|h|cpp|yaml|yml|toml|json|sql|sh|ini|cfg|proto)\b"
)
_CALL = re.compile(r"\b[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+\(|\b[a-z_]+_[a-z_]+\(")
_SHELL = re.compile(r"(?:^|`)\s*(?:\$ |make |git |pip |kubectl |docker |cargo |npm |go |python )\S", re.M)
_DATE = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.? \d{1,2}\b"
    r"|\b\d{1,2} (?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\b"
    r"|\b(?:yesterday|last (?:week|night|month)|this morning|on (?:mon|tues|wednes|thurs|fri|satur|sun)day)\b",
    re.I,
)
_SENTENCE_END = re.compile(r"(?<=[.!?？])\s+")
_QUESTION_MARKS = ("?", "？")
#: The longest sentence read as an aside around a question ("Wow!", "Thanks, John.", "Can't wait!").
_ASIDE_WORDS = 3
_MARKER = re.compile(r"\b(?:always|never|important|must|critical|remember)\b", re.I)
_ERROR = re.compile(r"\b\w*(?:Error|Exception)\b|Traceback|\bFATAL\b|\bexit code\b|\bpanicked\b|\bsegfault", re.I)

_KNOWN_KEYS = frozenset(f.name for f in MEMORY_SCHEMA)
_INTERNAL_KEYS = frozenset({"_source", "_position", "_reject", "_raw", "_code", SECTION_KEY, "minhash"})
_CONFIRMED = {"user", "human", "confirmed", "user-confirmed"}
_DOCUMENT_PREFIXES = ("markdown", "doc", "docs")
_CONVERSATION = {"transcript", "locomo", "chat"}
_INFERRED = {"inferred", "llm", "model"}


def derive_type(text: str, *, conversational: bool = False) -> str:
    """A memory's type read from its text: a decision, a procedure (steps, a how-to),
    code (a fenced block, a path, a call, a shell command), an event (a date, or a
    conversation's turn) or a fact. A text holding fenced code is code unless its prose
    outside the fences reads as a decision or a procedure (a runbook with its commands)."""
    fenced = bool(_FENCE.search(text))
    prose = _outside_fences(text) if fenced else text
    if _DECISION.search(prose):
        return "decision"
    if len(_STEPS.findall(prose)) >= 2 or _INLINE_STEPS.search(prose) or _HOWTO.search(prose):
        return "procedural"
    if fenced:
        return "code"
    if _PATH.search(text) or _CALL.search(text) or _SHELL.search(text):
        return "code"
    if conversational or _DATE.search(text):
        return "episodic"
    return "semantic"


def _outside_fences(text: str) -> str:
    """``text`` without its fenced code blocks."""
    out, at = [], 0
    for a, b in chunk_parse.fenced_spans(text):
        out.append(text[at:a])
        at = b
    return "".join(out) + text[at:]


def asks_only(text: str, speaker: Any) -> bool:
    """Whether a chat turn (``"<speaker>: <text>"``, as transcripts store it) only asks:
    it asks at least once, and each of its other sentences is a short aside: before its
    last question any sentence of three words or fewer ("Cool.", "Thanks, John!"), after
    it only an exclamation ("Can't wait!"). A turn that also states something ("Guess
    what? I got married."), or shares an image, does not; nor does a memory without a
    speaker (``speaker`` not a non-empty string)."""
    if not isinstance(speaker, str) or not speaker:
        return False
    prefix = f"{speaker}: "
    body = text[len(prefix):] if text.startswith(prefix) else text
    sentences = [s for s in _SENTENCE_END.split(body.strip()) if s]
    asked = [i for i, s in enumerate(sentences) if s.endswith(_QUESTION_MARKS)]
    return bool(asked) and all(
        s.endswith(_QUESTION_MARKS) or (len(s.split()) <= _ASIDE_WORDS and (i < asked[-1] or s.endswith("!")))
        for i, s in enumerate(sentences))


def derive_salience(text: str, mem_type: str, pinned: bool, metadata: dict[str, Any] | None = None,
                    ask_discount: float = 0.0) -> float:
    value = TYPE_PRIOR[mem_type]
    metadata = metadata or {}
    code = metadata.get("code")
    if isinstance(code, dict) and code.get("test") is True:  # a test: less salient than the code it tests
        value -= TEST_DISCOUNT
    if ask_discount and asks_only(text, metadata.get("speaker")):
        value -= ask_discount
    if _MARKER.search(text):
        value += 0.15
    if _ERROR.search(text):
        value += 0.10
    if pinned:
        value = max(value, 0.90)
    return round(min(max(value, 0.0), 1.0), 4)


def derive_confidence(source: str, metadata: dict[str, Any]) -> float:
    kind = source.split(":", 1)[0].lower()
    if metadata.get("confirmed") is True or kind in _CONFIRMED:
        return 0.90
    if kind.startswith(_DOCUMENT_PREFIXES):
        return 0.80
    if kind in _CONVERSATION:
        return 0.70
    if kind in _INFERRED:
        return 0.50
    return 0.60


#: The largest ``metadata.turn`` (a position in a session) a record may give.
MAX_TURN = 2**31 - 1


class Rejected(Exception):
    """A record that cannot be ingested. The quarantine reason reads
    ``"<code>: <sentence>"``; the code (``missing_text``, ``empty_text``, ``wrong_type``,
    ``unknown_type``, ``out_of_range``, ``bad_time``, ``too_long``, ``invalid_utf8``,
    ``bad_json``, ``missing_user``, ``bad_id``, ``too_deep``; ``not_read``: a
    data file inside a Markdown folder source) lets a report count them."""

    def __init__(self, code: str, sentence: str):
        super().__init__(f"{code}: {sentence}")
        self.code = code


MAX_ACCESS_COUNT = 2**31 - 1
#: Longest id a memory may bring (a URL path of the HTTP API names it: PATCH, DELETE).
MAX_ID_CHARS = 512
MAX_METADATA_DEPTH = 32


def _check_id(mem_id: str) -> None:
    """An id the HTTP API can name again: at most :data:`MAX_ID_CHARS` characters, none a
    control character (a very long id, or one ending in a newline, could be written but
    then neither PATCHed nor DELETEd)."""
    if len(mem_id) > MAX_ID_CHARS:
        raise Rejected("too_long", f"id is {len(mem_id):,} characters long; at most {MAX_ID_CHARS}")
    bad = next((i for i, ch in enumerate(mem_id) if ord(ch) < 32 or 127 <= ord(ch) < 160), None)
    if bad is not None:
        raise Rejected("bad_id", f"id holds the control character U+{ord(mem_id[bad]):04X} at position {bad}; "
                                 "use printable characters")


def _depth(value: Any, level: int = 1) -> int:
    """How deep ``value`` nests (a dict or list is one level), stopping past the limit."""
    if level > MAX_METADATA_DEPTH or not isinstance(value, (dict, list)):
        return level - 1 if not isinstance(value, (dict, list)) else level
    children = value.values() if isinstance(value, dict) else value
    return max([level, *(_depth(v, level + 1) for v in children)])


def _metadata_json(metadata: dict[str, Any]) -> str:
    """``metadata`` as stored: JSON text. NaN and ±Infinity, which JSON cannot carry
    (Python's reader and writer take them; a float column of a Parquet file holds them
    for a missing value), become null, as JavaScript's ``JSON.stringify`` writes them, so
    every strict JSON reader takes the stored text back. Lone surrogates, which UTF-8
    cannot carry, are refused."""
    try:
        text = json.dumps(metadata, sort_keys=True, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(metadata), sort_keys=True, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected("invalid_utf8", "metadata is not valid UTF-8 (it holds lone surrogates)") from None
    return text


def _finite(value: Any) -> Any:
    """``value`` with every NaN and ±Infinity float inside it replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _parse_time(value: Any, field: str) -> dt.datetime:
    """An aware UTC time, or :class:`Rejected` (never another error: a time Python or
    Arrow cannot hold is a bad record, not a failed ingest)."""
    try:
        parsed = _read_time(value, field)
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        parsed = parsed.astimezone(dt.timezone.utc)
        parsed.timestamp()
    except (OverflowError, OSError, ValueError):
        raise Rejected("bad_time", f"{field}={value!r} is outside the times a memory can hold (years 1–9999, "
                       "epoch seconds or milliseconds)") from None
    return parsed


def _read_time(value: Any, field: str) -> dt.datetime:
    if isinstance(value, dt.datetime):
        parsed = value
    elif isinstance(value, dt.date):  # a Parquet date32 column: the day's start, UTC
        parsed = dt.datetime(value.year, value.month, value.day)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        # Epoch seconds (milliseconds when too large to be seconds).
        seconds = value / 1000.0 if value > 1e11 else value
        parsed = dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)
    elif isinstance(value, str):
        text = value.strip().replace("Z", "+00:00") if value.strip().endswith("Z") else value.strip()
        try:
            parsed = dt.datetime.fromisoformat(text)
        except ValueError:
            raise Rejected(
                "bad_time", f"{field}={value!r} is not a time; use ISO-8601 (e.g. 2025-03-14T10:22:00Z) or epoch seconds"
            ) from None
    else:
        raise Rejected("bad_time", f"{field} must be an ISO-8601 string or epoch seconds, got {type(value).__name__}")
    return parsed


def _optional_str(row: dict[str, Any], field: str) -> str | None:
    value = row.get(field)
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise Rejected("wrong_type", f"{field} must be a string, got {type(value).__name__}")
    return value


def _unit_float(row: dict[str, Any], field: str) -> float | None:
    value = row.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Rejected("wrong_type", f"{field} must be a number within [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise Rejected("out_of_range", f"{field}={value!r} is outside [0, 1]")
    return float(value)


def normalise_one(raw: dict[str, Any], config: ValidationConfig, *, default_time: dt.datetime,
                  ask_discount: float = 0.0) -> dict[str, Any]:
    """Validate one raw record; return a memory row or raise :class:`Rejected`.
    ``ask_discount``: ``IngestConfig.ask_discount`` (salience a turn that only asks gives up)."""
    if "_reject" in raw:
        raise Rejected(raw.get("_code", "bad_json"), raw["_reject"])
    if "text" not in raw or raw["text"] is None:
        raise Rejected("missing_text", "text is missing; every memory needs a non-empty 'text' string")
    text = raw["text"]
    if not isinstance(text, str):
        raise Rejected("wrong_type", f"text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected("invalid_utf8", "text is not valid UTF-8 (it holds lone surrogates or undecodable bytes)") from None
    text = text.replace("\r\n", "\n").strip()
    if not text:
        raise Rejected("empty_text", "text is empty or only whitespace")
    if len(text) > config.max_text_chars:
        raise Rejected(
            "too_long", f"text has {len(text)} characters; the limit is {config.max_text_chars} "
            "(split it into smaller memories or raise validation.max_text_chars)"
        )
    user = _optional_str(raw, "user") or config.default_user
    if not user:
        raise Rejected("missing_user", "user is missing; give each record a 'user' or pass --user for the whole source")
    mem_type = raw.get("type")
    if mem_type is not None and mem_type not in MEMORY_TYPES:
        raise Rejected("unknown_type", f"type={mem_type!r} is unknown; allowed: {', '.join(MEMORY_TYPES)}")
    metadata = raw.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise Rejected("wrong_type", "metadata is a string but not JSON; give a JSON object") from None
    if not isinstance(metadata, dict):
        raise Rejected("wrong_type", f"metadata must be a JSON object, got {type(metadata).__name__}")
    if _depth(metadata) > MAX_METADATA_DEPTH:
        raise Rejected("too_deep", f"metadata nests more than {MAX_METADATA_DEPTH} levels deep; flatten it")
    turn = metadata.get("turn")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn <= MAX_TURN):
        raise Rejected("wrong_type", f"metadata.turn must be a whole number from 0 to {MAX_TURN} (the memory's "
                                     f"position in its session, which orders the session), got {turn!r}")
    extra = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS and k not in _INTERNAL_KEYS}
    if extra:  # keys the schema does not name are kept, not dropped
        metadata = {**extra, **metadata}
    pinned = raw.get("pinned", False)
    if not isinstance(pinned, bool):
        raise Rejected("wrong_type", f"pinned must be true or false, got {pinned!r}")
    access_count = raw.get("access_count", 0) or 0
    if isinstance(access_count, bool) or not isinstance(access_count, int) or access_count < 0:
        raise Rejected("wrong_type", f"access_count must be a whole number >= 0, got {access_count!r}")
    if access_count > MAX_ACCESS_COUNT:
        raise Rejected("out_of_range", f"access_count={access_count} is above {MAX_ACCESS_COUNT} (a 32-bit count)")
    salience = _unit_float(raw, "salience")
    confidence = _unit_float(raw, "confidence")
    created_at = _parse_time(raw["created_at"], "created_at") if raw.get("created_at") is not None else default_time
    last = raw.get("last_accessed_at")
    last_accessed_at = _parse_time(last, "last_accessed_at") if last is not None else None

    source = _optional_str(raw, "source") or Path(str(raw.get("_source", "api"))).name
    session_id = _optional_str(raw, "session_id")
    if mem_type is None:
        conversational = "speaker" in metadata or source.split(":", 1)[0] in _CONVERSATION
        mem_type = derive_type(text, conversational=conversational)
    if salience is None:
        salience = derive_salience(text, mem_type, pinned, metadata, ask_discount)
    if confidence is None:
        confidence = derive_confidence(source, metadata)
    raw_id = raw.get("id")
    if raw_id is None or raw_id == "":
        section = raw.get(SECTION_KEY)
        mem_id = markdown_id(user, section) if isinstance(section, str) else content_hash(text, user)
    elif isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool):
        mem_id = str(raw_id)
    else:
        raise Rejected("wrong_type", f"id must be a string, got {type(raw_id).__name__}")
    _check_id(mem_id)
    parent = parent_of(mem_id)
    if parent is not None and (metadata.get("chunk") or {}).get("parent") != parent:
        raise Rejected("wrong_type", f"id {mem_id!r} ends in '#chunk<n>', which names a chunk Helix stores a long "
                                     "memory as; give the memory's own id (a long text is chunked for you)")
    return {
        "id": mem_id,
        "text": text,
        "type": mem_type,
        "user": user,
        "project": (_optional_str(raw, "project") or "").strip() or None,  # blank: none (recall refuses "")
        "session_id": session_id,
        "created_at": created_at,
        "last_accessed_at": last_accessed_at,
        "access_count": access_count,
        "salience": salience,
        "confidence": confidence,
        "pinned": pinned,
        "source": source,
        "metadata": _metadata_json(metadata),
        "content_hash": content_hash(text, ""),
    }


def normalise(
    raws: list[dict[str, Any]], config: ValidationConfig, *, default_time: dt.datetime,
    chunking: ChunkConfig | None = None, ask_discount: float = 0.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split raw records into (memory rows, quarantine rows); with ``chunking``, a long
    record becomes its chunks' rows. Nothing is dropped silently."""
    rows, quarantined = [], []
    for raw in raws:
        try:
            row = normalise_one(raw, config, default_time=default_time, ask_discount=ask_discount)
        except Rejected as why:
            quarantined.append(quarantine_row(raw, str(why)))
            continue
        rows.extend(split_long(row, chunking) if chunking is not None else [row])
    return rows, quarantined


#: Tokens kept free in each chunk for the line naming where it sits (title > headings).
HEADING_TOKENS = 24


def split_long(row: dict[str, Any], config: ChunkConfig) -> list[dict[str, Any]]:
    """A normalised row as the memories it is stored as: itself, or, when its text is
    longer than ``config.max_tokens``, one row per chunk: id ``<id>#chunk<n>``, the
    chunk's text under a line naming where it sits, and ``metadata.chunk`` = {parent, n,
    of, headings, own_from: where the chunk's own text starts, after that line and the
    overlap; ``repeated``: how many chunks of the same text in a row it stands for, where
    more than one}. Every other field is the parent's."""
    if parent_of(row["id"]) is not None:  # a chunk already (a compaction reads chunks back)
        return [row]
    room = max(config.max_tokens - HEADING_TOKENS, config.max_tokens // 2)  # the heading line comes on top
    pieces = chunk.split(row["text"], max_tokens=room, overlap_tokens=min(config.overlap_tokens, room // 2))
    if len(pieces) <= 1:
        return [row]
    metadata = json.loads(row["metadata"])
    title = " — ".join(str(metadata[k]) for k in ("file", "section") if isinstance(metadata.get(k), str)) or None
    if (title is None and config.lead_title and row.get("type") != "code"
            and (title := chunk.lead_title(row["text"])) is not None):
        # Every chunk after the first repeats the text's own title line: make room for it.
        # Not in code: a module's docstring reads as prose, yet its header names a file.
        room = max(room - tokens.token_counter()(title), config.max_tokens // 2)
        pieces = chunk.split(row["text"], max_tokens=room, overlap_tokens=min(config.overlap_tokens, room // 2))
    parts: list[tuple[str, dict[str, Any]]] = []
    for at, piece in enumerate(pieces):
        # The first chunk starts as its text does (a section's text names its file and heading).
        text = chunk.encoder_text(piece, title if at else None)
        if parts and text == parts[-1][0]:  # a line repeated for pages (a log): one chunk says how often
            parts[-1][1]["repeated"] = parts[-1][1].get("repeated", 1) + 1
            continue
        parts.append((text, {"parent": row["id"], "n": len(parts) + 1, "headings": list(piece.heading_path),
                             "own_from": len(text) - len(piece.own_text)}))  # where it stops repeating the one before
    if len(parts) == 1:
        return [row]
    return [{**row, "id": chunk_id(row["id"], part["n"]), "text": text, "content_hash": content_hash(text, ""),
             "metadata": _metadata_json({**metadata, "chunk": {**part, "of": len(parts)}})} for text, part in parts]


def quarantine_row(raw: dict[str, Any], reason: str) -> dict[str, Any]:
    body = raw.get("_raw")
    if body is None:
        body = json.dumps(
            {k: v for k, v in raw.items() if not k.startswith("_")}, ensure_ascii=False, default=str
        )
    if isinstance(body, str):
        body = body.encode("utf-8", errors="backslashreplace").decode("utf-8")
    return {
        "source": str(raw.get("_source", "api")),
        "position": str(raw.get("_position", "")),
        "reason": reason,
        "raw": body,
    }
