"""LoCoMo (``locomo10.json``): one corpus per conversation, one document per turn."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet, _iso, _read_json, _require_file

logger = logging.getLogger(__name__)

__all__ = [
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
