"""LongMemEval (``longmemeval_s.json`` etc.): each question searches its own haystack."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet, _iso, _read_json, _require_file

logger = logging.getLogger(__name__)

__all__ = ["load_longmemeval", "parse_longmemeval_datetime"]

_LONGMEMEVAL_DATE = re.compile(
    r"^\s*(\d{4})/(\d{1,2})/(\d{1,2})\s*(?:\([A-Za-z]+\))?\s*(?:(\d{1,2}):(\d{2}))?\s*$"
)


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


def _haystack(qid: str, item: dict[str, Any], granularity: str) -> tuple[list[EvalDoc], set[str]]:
    """The documents of one question's haystack at ``granularity``, and the ids of its gold ones."""
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
    return docs, gold


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
        docs, gold = _haystack(qid, item, granularity)
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
