"""Benchmark loaders: LoCoMo, BEIR-layout folders (SciFact, CoSQA) and LongMemEval.

Every loader returns an :class:`EvalSet`: one or more corpora (each a separate
memory store to search) and the queries with their gold document ids. Queries
whose gold cannot be resolved to a document of their corpus are excluded here,
so every returned query has a non-empty gold set (the metrics refuse empty gold).

Timestamps are ISO-8601 strings in UTC (``"2023-05-08T13:56:00Z"``). The
benchmarks give wall-clock times without a zone; they are labelled UTC as is.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "EvalDoc",
    "EvalQuery",
    "EvalSet",
    "LOCOMO_CONVERSATIONS",
    "LOCOMO_HELDOUT",
    "LOCOMO_TUNE",
    "load_beir",
    "load_locomo",
    "load_longmemeval",
    "normalise_locomo_evidence",
    "parse_locomo_datetime",
    "parse_longmemeval_datetime",
]

#: The ten LoCoMo conversations, in file order.
LOCOMO_CONVERSATIONS: tuple[str, ...] = (
    "conv-26", "conv-30", "conv-41", "conv-42", "conv-43",
    "conv-44", "conv-47", "conv-48", "conv-49", "conv-50",
)  # fmt: skip
#: Conversations used for tuning (choose parameters here only).
LOCOMO_TUNE: tuple[str, ...] = ("conv-26", "conv-30", "conv-41", "conv-42", "conv-43")
#: Conversations held out for the final report.
LOCOMO_HELDOUT: tuple[str, ...] = tuple(c for c in LOCOMO_CONVERSATIONS if c not in LOCOMO_TUNE)

LOCOMO_CATEGORIES: tuple[int, ...] = (1, 2, 3, 4, 5)


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True)
class EvalDoc:
    """One retrievable unit (a turn, a session, an abstract, a function).

    ``id`` is unique within its corpus; ``created_at`` is ISO-8601 UTC or None.
    """

    id: str
    text: str
    created_at: str | None = None
    session_id: str | None = None
    speaker: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EvalQuery:
    """One question: search corpus ``corpus_id``; any id in ``gold`` is relevant.

    ``gold`` is never empty. ``category`` is the benchmark's label as a string
    (LoCoMo "1".."5", LongMemEval question_type) or None. ``question_date`` is
    ISO-8601 UTC or None.
    """

    id: str
    text: str
    gold: frozenset[str]
    category: str | None
    corpus_id: str
    question_date: str | None = None

    def __post_init__(self) -> None:
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


# --------------------------------------------------------------------------- date parsing

_MONTHS = {
    name: number
    for number, names in enumerate(
        [
            ("january", "jan"), ("february", "feb"), ("march", "mar"), ("april", "apr"),
            ("may",), ("june", "jun"), ("july", "jul"), ("august", "aug"),
            ("september", "sep", "sept"), ("october", "oct"), ("november", "nov"),
            ("december", "dec"),
        ],
        start=1,
    )
    for name in names
}  # fmt: skip

_LOCOMO_DATE = re.compile(
    r"^\s*(\d{1,2}):(\d{2})\s*([ap])\.?m\.?\s+on\s+(\d{1,2})\s+([A-Za-z]+)\.?,?\s+(\d{4})\s*$",
    re.IGNORECASE,
)
_LONGMEMEVAL_DATE = re.compile(
    r"^\s*(\d{4})/(\d{1,2})/(\d{1,2})\s*(?:\([A-Za-z]+\))?\s*(?:(\d{1,2}):(\d{2}))?\s*$"
)


def _iso(year: int, month: int, day: int, hour: int, minute: int, raw: str) -> str:
    """Format a validated wall-clock time as ``YYYY-MM-DDTHH:MM:00Z``."""
    try:
        value = dt.datetime(year, month, day, hour, minute)
    except ValueError as exc:
        raise ValueError(f"Got an impossible date/time {raw!r} ({exc}); fix the source record.") from exc
    return value.strftime("%Y-%m-%dT%H:%M:00Z")


def parse_locomo_datetime(raw: str) -> str:
    """``"1:56 pm on 8 May, 2023"`` -> ``"2023-05-08T13:56:00Z"`` (12 am = 00:xx).

    Locale-independent; month names may be full or three-letter.
    """
    match = _LOCOMO_DATE.match(raw) if isinstance(raw, str) else None
    month = _MONTHS.get(match.group(5).lower()) if match else None
    if match is None or month is None:
        raise ValueError(
            f"Got LoCoMo date {raw!r}; expected the form '1:56 pm on 8 May, 2023' "
            "(h:mm am|pm on day Month, year). Fix the session_<n>_date_time value."
        )
    hour, minute = int(match.group(1)), int(match.group(2))
    if not 1 <= hour <= 12:
        raise ValueError(f"Got LoCoMo date {raw!r} with hour {hour}; a 12-hour clock needs 1-12.")
    hour = hour % 12 + (12 if match.group(3).lower() == "p" else 0)
    return _iso(int(match.group(6)), month, int(match.group(4)), hour, minute, raw)


def parse_longmemeval_datetime(raw: str) -> str:
    """``"2023/05/20 (Sat) 02:21"`` -> ``"2023-05-20T02:21:00Z"`` (missing time = 00:00)."""
    match = _LONGMEMEVAL_DATE.match(raw) if isinstance(raw, str) else None
    if match is None:
        raise ValueError(
            f"Got LongMemEval date {raw!r}; expected the form '2023/05/20 (Sat) 02:21'. "
            "Fix the haystack_dates / question_date value."
        )
    year, month, day = (int(match.group(i)) for i in (1, 2, 3))
    hour = int(match.group(4)) if match.group(4) else 0
    minute = int(match.group(5)) if match.group(5) else 0
    return _iso(year, month, day, hour, minute, raw)


# --------------------------------------------------------------------------- LoCoMo

_EVIDENCE_SPLIT = re.compile(r"[;\s]+")
_DIA_ID = re.compile(r"^D:?(\d+):(\d+)$", re.IGNORECASE)
_SESSION_KEY = re.compile(r"^session_(\d+)$")
_LOCOMO_EXPECTED = "the LoCoMo locomo10.json format: a JSON list of samples with sample_id, conversation, qa"


def normalise_locomo_evidence(evidence: Iterable[str]) -> list[str]:
    """Split and canonicalise LoCoMo evidence strings into ``D<session>:<turn>`` ids.

    Splits each string on ``[;\\s]+``, maps ``"D:11:26"`` -> ``"D11:26"`` and strips
    leading zeros (``"D30:05"`` -> ``"D30:5"``). Tokens that are not of the form
    ``D<n>:<m>`` (e.g. ``"D"``) are dropped. Order kept, duplicates removed. Does
    not check that the ids exist in a conversation.
    """
    out: list[str] = []
    for item in evidence:
        for token in _EVIDENCE_SPLIT.split(str(item)):
            match = _DIA_ID.match(token)
            if match is None:
                continue
            dia_id = f"D{int(match.group(1))}:{int(match.group(2))}"
            if dia_id not in out:
                out.append(dia_id)
    return out


def _locomo_docs(sample_id: str, conversation: dict[str, Any]) -> list[EvalDoc]:
    """The turns of one conversation as EvalDocs, sessions in numeric order."""
    sessions = sorted(
        (int(m.group(1)), key) for key in conversation if (m := _SESSION_KEY.match(key))
    )
    docs: list[EvalDoc] = []
    for number, key in sessions:
        turns = conversation[key]
        if not isinstance(turns, list):
            raise ValueError(
                f"Got {key} of type {type(turns).__name__} in {sample_id}; expected a list of turns "
                "({speaker, dia_id, text}). Fix the conversation record."
            )
        raw_date = conversation.get(f"{key}_date_time")
        created_at = parse_locomo_datetime(raw_date) if raw_date else None
        session_id = f"{sample_id}:session_{number}"
        for turn in turns:
            if not isinstance(turn, dict) or "dia_id" not in turn or "speaker" not in turn:
                raise ValueError(
                    f"Got turn {turn!r} in {sample_id} {key}; expected an object with speaker, "
                    "dia_id and text. Fix the conversation record."
                )
            text = f"{turn['speaker']}: {turn.get('text', '')}"
            if turn.get("blip_caption"):
                text += f" [image: {turn['blip_caption']}]"
            docs.append(
                EvalDoc(
                    id=f"{sample_id}:{turn['dia_id']}",
                    text=text,
                    created_at=created_at,
                    session_id=session_id,
                    speaker=turn["speaker"],
                )
            )
    seen: set[str] = set()
    for doc in docs:
        if doc.id in seen:
            raise ValueError(
                f"Got dia_id {doc.id!r} twice; turn ids must be unique within a conversation. "
                "Fix the LoCoMo file."
            )
        seen.add(doc.id)
    return docs


def _check_categories(categories: Iterable[int | str] | None) -> frozenset[str] | None:
    """Validate LoCoMo categories (1-5, ints or digit strings); None means all."""
    if categories is None:
        return None
    if isinstance(categories, (str, int)):
        raise ValueError(
            f"Got categories={categories!r}; expected a collection of LoCoMo categories from "
            f"{LOCOMO_CATEGORIES}. Wrap a single category in a tuple, e.g. (4,)."
        )
    chosen = {str(c) for c in categories}
    allowed = {str(c) for c in LOCOMO_CATEGORIES}
    if not chosen or not chosen <= allowed:
        raise ValueError(
            f"Got categories={tuple(categories)!r}; allowed LoCoMo categories are "
            f"{LOCOMO_CATEGORIES} (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, "
            "5 adversarial). Pass a non-empty subset, e.g. (1, 2, 3, 4)."
        )
    return frozenset(chosen)


def load_locomo(
    path: str | os.PathLike[str],
    categories: Iterable[int | str] | None = (1, 2, 3, 4),
    conversations: Iterable[str] | None = None,
) -> EvalSet:
    """Load LoCoMo (``locomo10.json``) as one corpus per conversation, one doc per turn.

    * corpus_id = sample_id (``"conv-26"``); doc id = ``"<sample_id>:<dia_id>"``
      (``"conv-26:D1:3"``); text = ``"<speaker>: <text>"`` plus
      ``" [image: <blip_caption>]"`` for image turns; created_at = the session's
      date_time in ISO-8601 UTC; session_id = ``"<sample_id>:session_<n>"``.
    * query id = ``"<sample_id>:q<i>"`` with ``i`` the 0-based index in the
      sample's ``qa`` list (stable under category filtering); category = ``"1"``..``"5"``.
    * gold = normalised evidence (:func:`normalise_locomo_evidence`) that resolves
      to a turn; unresolvable ids are dropped, and a question whose evidence is
      empty or resolves to nothing is excluded (counts logged at INFO).
    * ``categories``: which categories to keep (None = all five; default excludes
      5, adversarial). ``conversations``: sample_ids to keep (None = all), e.g.
      :data:`LOCOMO_TUNE` or :data:`LOCOMO_HELDOUT`.
    """
    file = _require_file(path, "the LoCoMo locomo10.json file")
    wanted_categories = _check_categories(categories)
    data = _read_json(file, _LOCOMO_EXPECTED)
    if not isinstance(data, list) or not all(
        isinstance(s, dict) and {"sample_id", "conversation", "qa"} <= set(s) for s in data
    ):
        raise ValueError(f"Got {str(file)!r} that does not match {_LOCOMO_EXPECTED}. Pass locomo10.json.")
    available = [s["sample_id"] for s in data]
    if conversations is None:
        wanted = set(available)
    else:
        if isinstance(conversations, str):
            raise ValueError(
                f"Got conversations={conversations!r}; expected a collection of sample_ids. "
                f"Wrap a single one in a tuple, e.g. ({conversations!r},)."
            )
        wanted = set(conversations)
        unknown = sorted(wanted - set(available))
        if unknown:
            raise ValueError(
                f"Got unknown conversations {unknown} for {str(file)!r}; available sample_ids are "
                f"{available}. Pass a subset of those (e.g. LOCOMO_TUNE)."
            )

    corpora: dict[str, list[EvalDoc]] = {}
    queries: list[EvalQuery] = []
    stats = {"empty_evidence": 0, "unresolved": 0, "ids_dropped": 0, "other_category": 0}
    for sample in data:
        sample_id = sample["sample_id"]
        if sample_id not in wanted:
            continue
        docs = _locomo_docs(sample_id, sample["conversation"])
        corpora[sample_id] = docs
        turn_ids = {doc.id for doc in docs}
        for index, qa in enumerate(sample["qa"]):
            if "category" not in qa or "question" not in qa:
                raise ValueError(
                    f"Got qa[{index}] of {sample_id} without question/category (keys {sorted(qa)}); "
                    "every LoCoMo QA needs question, evidence and category."
                )
            category = str(qa["category"])
            if wanted_categories is not None and category not in wanted_categories:
                stats["other_category"] += 1
                continue
            evidence = qa.get("evidence") or []
            if not evidence:
                stats["empty_evidence"] += 1
                continue
            candidates = [f"{sample_id}:{d}" for d in normalise_locomo_evidence(evidence)]
            gold = frozenset(c for c in candidates if c in turn_ids)
            tokens = [t for e in evidence for t in _EVIDENCE_SPLIT.split(str(e)) if t]
            resolved = [normalise_locomo_evidence([t]) for t in tokens]
            stats["ids_dropped"] += sum(1 for r in resolved if not r or f"{sample_id}:{r[0]}" not in turn_ids)
            if not gold:
                stats["unresolved"] += 1
                logger.debug("LoCoMo %s qa[%d]: evidence %r resolves to no turn", sample_id, index, evidence)
                continue
            queries.append(
                EvalQuery(
                    id=f"{sample_id}:q{index}",
                    text=str(qa["question"]),
                    gold=gold,
                    category=category,
                    corpus_id=sample_id,
                )
            )
    logger.info(
        "LoCoMo %s: %d conversations, %d turns, %d queries kept; excluded %d (other category), "
        "%d (empty evidence), %d (evidence resolves to no turn); %d evidence ids dropped",
        file, len(corpora), sum(len(d) for d in corpora.values()), len(queries),
        stats["other_category"], stats["empty_evidence"], stats["unresolved"], stats["ids_dropped"],
    )  # fmt: skip
    return EvalSet(name="locomo", corpora=corpora, queries=queries)


# --------------------------------------------------------------------------- BEIR


def _read_qrels(path: Path) -> list[tuple[str, str, float]]:
    """Rows ``(query_id, corpus_id, score)`` of a BEIR qrels TSV with its header."""
    rows: list[tuple[str, str, float]] = []
    with path.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh, delimiter="\t")
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != ["query-id", "corpus-id", "score"]:
            raise ValueError(
                f"Got header {header!r} in {str(path)!r}; expected a BEIR qrels TSV whose first line is "
                "'query-id<TAB>corpus-id<TAB>score'. Add the header or fix the delimiter."
            )
        for line_no, row in enumerate(reader, start=2):
            if not row or not "".join(row).strip():
                continue
            if len(row) < 3:
                raise ValueError(
                    f"Got {row!r} on line {line_no} of {str(path)!r}; expected three tab-separated "
                    "fields query-id, corpus-id, score."
                )
            try:
                score = float(row[2])
            except ValueError as exc:
                raise ValueError(
                    f"Got score {row[2]!r} on line {line_no} of {str(path)!r}; expected a number. "
                    "Fix that qrels line."
                ) from exc
            rows.append((row[0].strip(), row[1].strip(), score))
    return rows


def load_beir(folder: str | os.PathLike[str], split: str = "test") -> EvalSet:
    """Load a BEIR-layout folder as one shared corpus (corpus_id = the folder's name).

    Expects ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl``
    (``_id``, ``text``) and ``qrels/<split>.tsv`` (header query-id, corpus-id,
    score) directly in ``folder``. Doc text = ``title + "\\n" + text`` when the
    title is non-empty, else ``text``. Only queries with at least one qrels row of
    score > 0 whose corpus-id exists are kept, in qrels order; gold = those
    corpus-ids (grades are not kept: binary relevance). category = None.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(
            f"No folder at {str(root)!r}; expected a BEIR folder holding corpus.jsonl, queries.jsonl "
            "and qrels/<split>.tsv. Check the path."
        )
    corpus_file, queries_file = root / "corpus.jsonl", root / "queries.jsonl"
    for needed in (corpus_file, queries_file):
        if not needed.is_file():
            hint = " (found a beir_format/ subfolder: pass that)" if (root / "beir_format").is_dir() else ""
            raise FileNotFoundError(
                f"No {needed.name} in {str(root)!r}{hint}; expected a BEIR folder holding corpus.jsonl, "
                "queries.jsonl and qrels/<split>.tsv at its top level."
            )
    qrels_file = root / "qrels" / f"{split}.tsv"
    if not qrels_file.is_file():
        splits = sorted(p.stem for p in (root / "qrels").glob("*.tsv")) if (root / "qrels").is_dir() else []
        raise FileNotFoundError(
            f"No qrels file {str(qrels_file)!r} for split={split!r}; splits available in {str(root)!r}: "
            f"{splits}. Pass one of them as split."
        )

    corpus_id = os.path.basename(os.path.normpath(os.path.abspath(root)))
    docs: list[EvalDoc] = []
    doc_ids: set[str] = set()
    for row in _read_jsonl(corpus_file, "BEIR corpus rows {_id, title, text}"):
        if "_id" not in row:
            raise ValueError(
                f"Got a corpus row without _id in {str(corpus_file)!r} (keys {sorted(row)}); "
                "expected BEIR corpus rows {_id, title, text}."
            )
        doc_id = str(row["_id"])
        if doc_id in doc_ids:
            raise ValueError(f"Got corpus _id {doc_id!r} twice in {str(corpus_file)!r}; ids must be unique.")
        doc_ids.add(doc_id)
        title, text = str(row.get("title") or ""), str(row.get("text") or "")
        docs.append(EvalDoc(id=doc_id, text=f"{title}\n{text}" if title.strip() else text))

    query_text: dict[str, str] = {}
    for row in _read_jsonl(queries_file, "BEIR query rows {_id, text}"):
        if "_id" not in row or "text" not in row:
            raise ValueError(
                f"Got a query row with keys {sorted(row)} in {str(queries_file)!r}; expected BEIR query "
                "rows {_id, text}."
            )
        query_text[str(row["_id"])] = str(row["text"])

    gold: dict[str, set[str]] = {}
    missing_docs: set[str] = set()
    for query_id, doc_id, score in _read_qrels(qrels_file):
        if score <= 0:
            continue
        entry = gold.setdefault(query_id, set())
        if doc_id in doc_ids:
            entry.add(doc_id)
        else:
            missing_docs.add(doc_id)
    missing_queries = [q for q in gold if q not in query_text]
    if missing_docs or missing_queries:
        logger.warning(
            "BEIR %s/%s: %d qrels corpus-ids not in corpus.jsonl, %d query-ids not in queries.jsonl "
            "(dropped)", root, split, len(missing_docs), len(missing_queries),
        )  # fmt: skip
    queries = [
        EvalQuery(id=q, text=query_text[q], gold=frozenset(ids), category=None, corpus_id=corpus_id)
        for q, ids in gold.items()
        if ids and q in query_text
    ]
    logger.info("BEIR %s/%s: %d docs, %d queries", root, split, len(docs), len(queries))
    return EvalSet(name=corpus_id, corpora={corpus_id: docs}, queries=queries)


# --------------------------------------------------------------------------- LongMemEval

_LONGMEMEVAL_KEYS = (
    "question_id", "question_type", "question", "haystack_session_ids",
    "haystack_dates", "haystack_sessions", "answer_session_ids",
)  # fmt: skip
_LONGMEMEVAL_EXPECTED = (
    "the LongMemEval format: a JSON list of questions with " + ", ".join(_LONGMEMEVAL_KEYS)
)
GRANULARITIES: tuple[str, ...] = ("session", "turn")


def _turn_line(turn: Any, where: str) -> tuple[str, str]:
    """``(role, content)`` of one LongMemEval turn, validated."""
    if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
        raise ValueError(
            f"Got turn {str(turn)[:80]!r} in {where}; expected an object with role and content. "
            "Fix the haystack session."
        )
    return str(turn["role"]), str(turn["content"])


def load_longmemeval(path: str | os.PathLike[str], granularity: str = "session") -> EvalSet:
    """Load LongMemEval (``longmemeval_s.json`` etc.); each question is its own corpus.

    * Questions whose question_id ends in ``"_abs"`` (abstention) are excluded.
    * corpus_id = question_id; category = question_type; question_date is ISO-8601.
    * ``granularity="session"``: doc id = session id, text = the session's turns
      as ``"<role>: <content>"`` lines (all roles), created_at = its haystack date;
      gold = answer_session_ids present in the haystack.
    * ``granularity="turn"``: doc id = ``"<session_id>:<i>"`` with ``i`` the 1-based
      turn index in its session (as LongMemEval's own turn ids), text =
      ``"<role>: <content>"``, speaker = role; gold = turns with ``has_answer``
      true inside the answer sessions.
    * A question whose gold resolves to nothing is excluded (logged at WARNING);
      a repeated haystack session id keeps its first copy.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"Got granularity={granularity!r}; allowed values are {GRANULARITIES}. "
            "Use 'session' (the benchmark's standard unit) or 'turn'."
        )
    file = _require_file(path, "a LongMemEval JSON file (e.g. longmemeval_s.json)")
    data = _read_json(file, _LONGMEMEVAL_EXPECTED)
    if not isinstance(data, list):
        raise ValueError(
            f"Got a JSON {type(data).__name__} in {str(file)!r}; expected {_LONGMEMEVAL_EXPECTED}."
        )

    corpora: dict[str, list[EvalDoc]] = {}
    queries: list[EvalQuery] = []
    n_abs = 0
    no_gold: list[str] = []
    for index, item in enumerate(data):
        missing = [k for k in _LONGMEMEVAL_KEYS if not isinstance(item, dict) or k not in item]
        if missing:
            raise ValueError(
                f"Got item {index} of {str(file)!r} without {missing}; expected {_LONGMEMEVAL_EXPECTED}."
            )
        qid = str(item["question_id"])
        if qid.endswith("_abs"):
            n_abs += 1
            continue
        ids, dates, sessions = item["haystack_session_ids"], item["haystack_dates"], item["haystack_sessions"]
        if not len(ids) == len(dates) == len(sessions):
            raise ValueError(
                f"Got question {qid!r} with {len(ids)} haystack_session_ids, {len(dates)} haystack_dates "
                f"and {len(sessions)} haystack_sessions; the three lists must be parallel (same length)."
            )
        answer_sessions = {str(s) for s in item["answer_session_ids"]}
        docs: list[EvalDoc] = []
        gold: set[str] = set()
        seen: set[str] = set()
        for session_id, raw_date, session in zip(ids, dates, sessions):
            session_id = str(session_id)
            if session_id in seen:
                logger.warning(
                    "LongMemEval %s: session %s repeated in haystack; first copy kept", qid, session_id
                )
                continue
            seen.add(session_id)
            created_at = parse_longmemeval_datetime(raw_date) if raw_date else None
            where = f"question {qid!r} session {session_id!r}"
            lines = [_turn_line(turn, where) for turn in session]
            if granularity == "session":
                text = "\n".join(f"{role}: {content}" for role, content in lines)
                docs.append(EvalDoc(id=session_id, text=text, created_at=created_at, session_id=session_id))
                if session_id in answer_sessions:
                    gold.add(session_id)
                continue
            for turn_no, ((role, content), turn) in enumerate(zip(lines, session), start=1):
                doc_id = f"{session_id}:{turn_no}"
                docs.append(
                    EvalDoc(
                        id=doc_id,
                        text=f"{role}: {content}",
                        created_at=created_at,
                        session_id=session_id,
                        speaker=role,
                    )
                )
                if session_id in answer_sessions and turn.get("has_answer") is True:
                    gold.add(doc_id)
        if not gold:
            no_gold.append(qid)
            continue
        raw_qdate = item.get("question_date")
        corpora[qid] = docs
        queries.append(
            EvalQuery(
                id=qid,
                text=str(item["question"]),
                gold=frozenset(gold),
                category=str(item["question_type"]),
                corpus_id=qid,
                question_date=parse_longmemeval_datetime(raw_qdate) if raw_qdate else None,
            )
        )
    if no_gold:
        logger.warning(
            "LongMemEval %s (%s): %d questions excluded, gold resolves to nothing: %s",
            file, granularity, len(no_gold), no_gold[:5],
        )  # fmt: skip
    logger.info(
        "LongMemEval %s (%s): %d questions kept, %d abstention excluded, %d docs",
        file, granularity, len(queries), n_abs, sum(len(d) for d in corpora.values()),
    )  # fmt: skip
    return EvalSet(name=file.stem, corpora=corpora, queries=queries)
