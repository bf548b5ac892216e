"""The records every benchmark loader returns, and the file readers they share.

Every loader (:mod:`helix_ray.eval.locomo`, :mod:`helix_ray.eval.beir`,
:mod:`helix_ray.eval.longmemeval`) returns an :class:`EvalSet`: one or more corpora
(each a separate memory store to search) and the queries with their gold document
ids. Queries whose gold cannot be resolved to a document of their corpus are
excluded by the loader, so every returned query has a non-empty gold set (the
metrics refuse empty gold).

Timestamps are ISO-8601 strings in UTC (``"2023-05-08T13:56:00Z"``). The
benchmarks give wall-clock times without a zone; they are labelled UTC as is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "EvalDoc",
    "EvalQuery",
    "EvalSet",
]


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True)
class EvalDoc:
    """One retrievable unit (a turn, a session, an abstract, a function).

    ``id`` is unique within its corpus; ``created_at`` is ISO-8601 (UTC, or with its
    offset) or None. ``type`` is the memory type the store gives the document (None: the
    runner's rule, episodic for a turn, semantic otherwise); ``metadata`` is stored with
    it (a code symbol's path and language, a commit's sha). ``metadata`` is left out of
    the hash (a dict has none), so two docs that differ only there hash alike and
    compare unequal.
    """

    id: str
    text: str
    created_at: str | None = None
    session_id: str | None = None
    speaker: str | None = None
    type: str | None = None
    metadata: dict[str, Any] | None = dataclasses.field(default=None, hash=False)


@dataclasses.dataclass(frozen=True, slots=True)
class EvalQuery:
    """One question: search corpus ``corpus_id``; any id in ``gold`` is relevant.

    ``gold`` is never empty. ``category`` is the benchmark's label as a string
    (LoCoMo "1".."5", LongMemEval question_type) or None. ``question_date`` is
    ISO-8601 UTC or None: the moment the question is asked, given to recall as ``now``.
    ``context`` holds conversation turns said just before the question, oldest first
    (empty unless the loader was asked for them): what an agent has in its window when
    it asks.
    """

    id: str
    text: str
    gold: frozenset[str]
    category: str | None
    corpus_id: str
    question_date: str | None = None
    context: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.context, tuple):
            raise ValueError(
                f"Got context of type {type(self.context).__name__} for query {self.id!r}; "
                "EvalQuery.context must be a tuple of strings. Wrap it: tuple(turns)."
            )
        if not isinstance(self.gold, frozenset):
            raise ValueError(
                f"Got gold of type {type(self.gold).__name__} for query {self.id!r}; EvalQuery.gold "
                "must be a frozenset of doc ids. Wrap it: frozenset(ids)."
            )
        if not self.gold:
            raise ValueError(
                f"Got an empty gold set for query {self.id!r}; a query without gold ids cannot be "
                "scored. The loader must exclude it instead of building an EvalQuery."
            )


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A benchmark ready to run: ``corpora[corpus_id]`` lists the docs of one store."""

    name: str
    corpora: dict[str, list[EvalDoc]]
    queries: list[EvalQuery]

    def __post_init__(self) -> None:
        missing = sorted({q.corpus_id for q in self.queries} - set(self.corpora))
        if missing:
            raise ValueError(
                f"Got queries that search corpora {missing[:5]} which the EvalSet {self.name!r} does "
                f"not hold (it has {sorted(self.corpora)[:5]}...). Add those corpora or drop the queries."
            )

    @property
    def n_docs(self) -> int:
        """Total number of documents over all corpora."""
        return sum(len(docs) for docs in self.corpora.values())


# --------------------------------------------------------------------------- file helpers


def _require_file(path: str | os.PathLike[str], expected: str) -> Path:
    """Return ``path`` as a Path if it is an existing file, else raise FileNotFoundError."""
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(
            f"Got a directory {str(p)!r}; expected {expected}. Pass the file path, not its folder."
        )
    if not p.is_file():
        raise FileNotFoundError(f"No file at {str(p)!r}; expected {expected}. Check the path.")
    return p


def _read_json(path: Path, expected: str) -> Any:
    """Parse a JSON file, turning a syntax error into a ValueError naming the file."""
    try:
        with path.open("r", encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"Could not parse {str(path)!r} as JSON ({exc}); expected {expected}. "
            "Check the file is complete and not a different format."
        ) from exc


def _read_jsonl(path: Path, expected: str) -> list[dict[str, Any]]:
    """Parse a JSON-lines file (blank lines skipped); each line must be an object."""
    rows: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"Could not parse line {line_no} of {str(path)!r} as JSON ({exc}); expected "
                    f"{expected}, one JSON object per line. Fix or remove that line."
                ) from exc
            if not isinstance(row, dict):
                raise ValueError(
                    f"Got a {type(row).__name__} on line {line_no} of {str(path)!r}; expected "
                    f"{expected}, one JSON object per line."
                )
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- dates


def _iso(year: int, month: int, day: int, hour: int, minute: int, raw: str) -> str:
    """Format a validated wall-clock time as ``YYYY-MM-DDTHH:MM:00Z``."""
    try:
        value = dt.datetime(year, month, day, hour, minute)
    except ValueError as exc:
        raise ValueError(f"Got an impossible date/time {raw!r} ({exc}); fix the source record.") from exc
    return value.strftime("%Y-%m-%dT%H:%M:00Z")
