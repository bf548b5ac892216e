"""LoCoMo (``locomo10.json``): one corpus per conversation, one document per turn or
per session, questions optionally preceded by turns of their conversation."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet, _iso, _read_json, _require_file

logger = logging.getLogger(__name__)

__all__ = [
    "GRANULARITIES",
    "LOCOMO_CATEGORY_NAMES",
    "LOCOMO_CONVERSATIONS",
    "LOCOMO_HELDOUT",
    "LOCOMO_TUNE",
    "load_locomo",
    "normalise_locomo_evidence",
    "parse_locomo_datetime",
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
#: What the category labels mean (LoCoMo's evaluation code).
LOCOMO_CATEGORY_NAMES: dict[str, str] = {
    "1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "5": "adversarial",
}  # fmt: skip
#: What a document is: a dialogue turn, or a whole session.
GRANULARITIES: tuple[str, ...] = ("turn", "session")

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


@dataclasses.dataclass(frozen=True)
class _Session:
    """One session of a conversation: its number, date and turns (validated)."""

    number: int
    date: str | None  # as written in the file ("1:56 pm on 8 May, 2023")
    created_at: str | None  # ISO-8601 UTC
    turns: list[dict[str, Any]]


def _locomo_sessions(sample_id: str, conversation: dict[str, Any]) -> list[_Session]:
    """The sessions of one conversation in numeric order, each turn checked."""
    keys = sorted((int(m.group(1)), key) for key in conversation if (m := _SESSION_KEY.match(key)))
    sessions: list[_Session] = []
    for number, key in keys:
        turns = conversation[key]
        if not isinstance(turns, list):
            raise ValueError(
                f"Got {key} of type {type(turns).__name__} in {sample_id}; expected a list of turns "
                "({speaker, dia_id, text}). Fix the conversation record."
            )
        for turn in turns:
            if not isinstance(turn, dict) or "dia_id" not in turn or "speaker" not in turn:
                raise ValueError(
                    f"Got turn {turn!r} in {sample_id} {key}; expected an object with speaker, "
                    "dia_id and text. Fix the conversation record."
                )
        raw_date = conversation.get(f"{key}_date_time")
        created_at = parse_locomo_datetime(raw_date) if raw_date else None
        sessions.append(_Session(number, raw_date or None, created_at, turns))
    return sessions


def _turn_text(turn: dict[str, Any]) -> str:
    """``"<speaker>: <text>"``, plus ``" [image: <blip_caption>]"`` for an image turn."""
    text = f"{turn['speaker']}: {turn.get('text', '')}"
    if turn.get("blip_caption"):
        text += f" [image: {turn['blip_caption']}]"
    return text


def _session_id(sample_id: str, number: int) -> str:
    return f"{sample_id}:session_{number}"


def _turn_docs(sample_id: str, sessions: list[_Session]) -> list[EvalDoc]:
    """One EvalDoc per turn; ids must be unique within the conversation."""
    docs = [
        EvalDoc(
            id=f"{sample_id}:{turn['dia_id']}",
            text=_turn_text(turn),
            created_at=session.created_at,
            session_id=_session_id(sample_id, session.number),
            speaker=turn["speaker"],
        )
        for session in sessions
        for turn in session.turns
    ]
    seen: set[str] = set()
    for doc in docs:
        if doc.id in seen:
            raise ValueError(
                f"Got dia_id {doc.id!r} twice; turn ids must be unique within a conversation. "
                "Fix the LoCoMo file."
            )
        seen.add(doc.id)
    return docs


def _session_docs(sample_id: str, sessions: list[_Session]) -> list[EvalDoc]:
    """One EvalDoc per session that has turns: its date line, then one line per turn."""
    docs: list[EvalDoc] = []
    for session in sessions:
        if not session.turns:
            continue
        lines = ([session.date] if session.date else []) + [_turn_text(turn) for turn in session.turns]
        session_id = _session_id(sample_id, session.number)
        docs.append(EvalDoc(id=session_id, text="\n".join(lines), created_at=session.created_at,
                            session_id=session_id))
    return docs


def _query_context(query_id: str, sessions: list[_Session], evidence_sessions: set[int],
                   n: int) -> tuple[str, ...]:
    """``n`` consecutive turns, in order, of a session holding none of the question's
    evidence: which session and where in it are drawn with a generator seeded by the
    query id, so every run (and both granularities) give a question the same turns.
    Sessions with fewer than ``n`` turns are drawn only when no other is left (then the
    longest one is given whole)."""
    if n <= 0:
        return ()
    others = [s for s in sessions if s.turns and s.number not in evidence_sessions]
    if not others:
        logger.debug("LoCoMo %s: every session holds evidence; no context turns", query_id)
        return ()
    rng = random.Random(int.from_bytes(hashlib.sha256(query_id.encode()).digest()[:8], "big"))
    long_enough = [s for s in others if len(s.turns) >= n]
    if not long_enough:
        return tuple(_turn_text(t) for t in max(others, key=lambda s: len(s.turns)).turns)
    session = rng.choice(long_enough)
    start = rng.randrange(len(session.turns) - n + 1)
    return tuple(_turn_text(t) for t in session.turns[start:start + n])


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


def _wanted_conversations(conversations: Iterable[str] | None, available: list[str], file: str) -> set[str]:
    """The sample_ids to load (None: all), each checked against the file's."""
    if conversations is None:
        return set(available)
    if isinstance(conversations, str):
        raise ValueError(
            f"Got conversations={conversations!r}; expected a collection of sample_ids. "
            f"Wrap a single one in a tuple, e.g. ({conversations!r},)."
        )
    wanted = set(conversations)
    unknown = sorted(wanted - set(available))
    if unknown:
        raise ValueError(
            f"Got unknown conversations {unknown} for {file!r}; available sample_ids are "
            f"{available}. Pass a subset of those (LOCOMO_TUNE or LOCOMO_HELDOUT; on the command "
            "line, --conversations tune, heldout or sample ids separated by commas)."
        )
    return wanted


def _check_mode(granularity: str, query_context: int) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"Got granularity={granularity!r}; allowed values are {GRANULARITIES}. Use 'turn' (a "
            "document per dialogue turn) or 'session' (a document per session)."
        )
    if isinstance(query_context, bool) or not isinstance(query_context, int) or query_context < 0:
        raise ValueError(
            f"Got query_context={query_context!r}; give the number of conversation turns to put "
            "before each question, a whole number >= 0 (0: the question alone)."
        )


def _sample_queries(sample: dict[str, Any], sessions: list[_Session], wanted_categories: frozenset[str] | None,
                    granularity: str, query_context: int, stats: Counter[str]) -> list[EvalQuery]:
    """The scored questions of one sample, gold resolved to its turns or sessions."""
    sample_id = sample["sample_id"]
    session_of = {f"{sample_id}:{turn['dia_id']}": s.number for s in sessions for turn in s.turns}
    dates = [s.created_at for s in sessions if s.turns and s.created_at]
    present = max(dates) if dates else None  # the conversation's last session: when it is asked
    queries: list[EvalQuery] = []
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
        normalised = normalise_locomo_evidence(evidence)
        turns = frozenset(c for c in (f"{sample_id}:{d}" for d in normalised) if c in session_of)
        tokens = [t for e in evidence for t in _EVIDENCE_SPLIT.split(str(e)) if t]
        resolved = [normalise_locomo_evidence([t]) for t in tokens]
        stats["ids_dropped"] += sum(1 for r in resolved if not r or f"{sample_id}:{r[0]}" not in session_of)
        if not turns:
            stats["unresolved"] += 1
            logger.debug("LoCoMo %s qa[%d]: evidence %r resolves to no turn", sample_id, index, evidence)
            continue
        evidence_sessions = {session_of[t] for t in turns}
        evidence_sessions |= {int(m.group(1)) for d in normalised if (m := _DIA_ID.match(d))}
        query_id = f"{sample_id}:q{index}"
        gold = turns if granularity == "turn" else frozenset(_session_id(sample_id, session_of[t]) for t in turns)
        queries.append(
            EvalQuery(
                id=query_id,
                text=str(qa["question"]),
                gold=gold,
                category=category,
                corpus_id=sample_id,
                question_date=present,
                context=_query_context(query_id, sessions, evidence_sessions, query_context),
            )
        )
    return queries


#: The corpus id of :func:`as_haystack`'s one store.
HAYSTACK = "haystack"


def as_haystack(evalset: EvalSet, join: int) -> EvalSet:
    """A session-granularity LoCoMo set as one long-document haystack: every conversation's
    sessions in one corpus (:data:`HAYSTACK`), each ``join`` consecutive sessions of a
    conversation joined into one document (each keeps its date line, a blank line between
    them): id ``"<sample_id>:sessions_<first>-<last>"``, created_at the first session's.
    Gold becomes the joined documents holding the evidence sessions; each question keeps
    its own conversation's present as its date. With sessions of ~700 tokens, ``join`` 3
    gives documents of ~2,000 tokens, as long as the chat sessions of LongMemEval's
    haystacks."""
    if not isinstance(join, int) or isinstance(join, bool) or join < 1:
        raise ValueError(f"Got join={join!r}; give how many consecutive sessions make one document, an int "
                         "of at least 1 (3 makes documents of about 2,000 tokens).")
    docs: list[EvalDoc] = []
    joined_of: dict[str, str] = {}
    for sample_id, sessions in evalset.corpora.items():
        for start in range(0, len(sessions), join):
            group = sessions[start:start + join]
            first, last = (d.id.rsplit("_", 1)[1] for d in (group[0], group[-1]))
            doc_id = f"{sample_id}:sessions_{first}-{last}"
            docs.append(EvalDoc(id=doc_id, text="\n\n".join(d.text for d in group), created_at=group[0].created_at,
                                session_id=doc_id))
            joined_of.update((d.id, doc_id) for d in group)
    queries = [dataclasses.replace(q, corpus_id=HAYSTACK, gold=frozenset(joined_of[g] for g in q.gold))
               for q in evalset.queries]
    return EvalSet(name=evalset.name, corpora={HAYSTACK: docs}, queries=queries)


def load_locomo(
    path: str | os.PathLike[str],
    categories: Iterable[int | str] | None = (1, 2, 3, 4),
    conversations: Iterable[str] | None = None,
    granularity: str = "turn",
    query_context: int = 0,
) -> EvalSet:
    """Load LoCoMo (``locomo10.json``) as one corpus per conversation.

    * corpus_id = sample_id (``"conv-26"``).
    * ``granularity="turn"``: one doc per turn; doc id = ``"<sample_id>:<dia_id>"``
      (``"conv-26:D1:3"``); text = ``"<speaker>: <text>"`` plus
      ``" [image: <blip_caption>]"`` for image turns; created_at = the session's
      date_time in ISO-8601 UTC; session_id = ``"<sample_id>:session_<n>"``;
      gold = the evidence turns.
    * ``granularity="session"``: one doc per session that has turns; doc id =
      session_id = ``"<sample_id>:session_<n>"``; text = the session's date_time as
      written, then each turn as above, one per line; created_at = the session's
      date; gold = the sessions holding the evidence turns.
    * query id = ``"<sample_id>:q<i>"`` with ``i`` the 0-based index in the
      sample's ``qa`` list (stable under category filtering); category = ``"1"``..``"5"``;
      question_date = the conversation's last session date (LoCoMo dates no question:
      it is asked in the conversation's present).
    * The same questions are kept at both granularities: evidence is normalised
      (:func:`normalise_locomo_evidence`) and ids naming no turn are dropped; a question
      whose evidence is empty or resolves to nothing is excluded (counts logged at INFO).
    * ``categories``: which categories to keep (None = all five; default excludes
      5, adversarial). ``conversations``: sample_ids to keep (None = all), e.g.
      :data:`LOCOMO_TUNE` or :data:`LOCOMO_HELDOUT`.
    * ``query_context``: put that many turns before each question (``EvalQuery.context``):
      consecutive turns of a session holding none of its evidence, drawn with a
      generator seeded by the query id (the same at both granularities).
    """
    _check_mode(granularity, query_context)
    file = _require_file(path, "the LoCoMo locomo10.json file")
    wanted_categories = _check_categories(categories)
    data = _read_json(file, _LOCOMO_EXPECTED)
    if not isinstance(data, list) or not all(
        isinstance(s, dict) and {"sample_id", "conversation", "qa"} <= set(s) for s in data
    ):
        raise ValueError(f"Got {str(file)!r} that does not match {_LOCOMO_EXPECTED}. Pass locomo10.json.")
    wanted = _wanted_conversations(conversations, [s["sample_id"] for s in data], str(file))

    corpora: dict[str, list[EvalDoc]] = {}
    queries: list[EvalQuery] = []
    stats: Counter[str] = Counter()
    for sample in data:
        sample_id = sample["sample_id"]
        if sample_id not in wanted:
            continue
        sessions = _locomo_sessions(sample_id, sample["conversation"])
        turn_docs = _turn_docs(sample_id, sessions)  # checks the turn ids are unique
        corpora[sample_id] = turn_docs if granularity == "turn" else _session_docs(sample_id, sessions)
        queries += _sample_queries(sample, sessions, wanted_categories, granularity, query_context, stats)
    logger.info(
        "LoCoMo %s (%s): %d conversations, %d documents, %d queries kept; excluded %d (other category), "
        "%d (empty evidence), %d (evidence resolves to no turn); %d evidence ids dropped",
        file, granularity, len(corpora), sum(len(d) for d in corpora.values()), len(queries),
        stats["other_category"], stats["empty_evidence"], stats["unresolved"], stats["ids_dropped"],
    )  # fmt: skip
    return EvalSet(name="locomo", corpora=corpora, queries=queries)
