"""BEIR-layout folders (SciFact, CoSQA): one shared corpus, queries with graded qrels."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet, _read_jsonl

logger = logging.getLogger(__name__)

__all__ = ["load_beir"]


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
