"""Stage 3b: BM25 over memory text plus doc2query expansions (bm25s).

The index is built at ingest (:func:`build_bm25`) and memory-mapped at query time; the
:class:`Analyzer` it was built with (stemmer, identifier splitting) is recorded beside
it and in the manifest, and every query and the online delta analyse text the same way.
Scope filters are applied inside the retriever: scores are computed only for the
tenant's contiguous row range and masked by the other filters before the top-k is
taken, so a filtered-out memory can never take a slot.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import bm25s


@functools.lru_cache(maxsize=2)
def _stemmer(language: str):
    import Stemmer

    return Stemmer.Stemmer(language)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def identifier_parts(text: str) -> list[str]:
    """The words inside the compound identifiers of ``text``, in order:
    ``parse_config`` gives parse, config; ``writeBoolean`` write, Boolean;
    ``HTTPServerError`` HTTP, Server, Error. Plain words give nothing."""
    parts: list[str] = []
    for match in _IDENTIFIER.finditer(text):
        word = match.group(0)
        if "_" not in word and word.islower():
            continue
        pieces = [p for chunk in word.split("_") for p in _WORD_PART.findall(chunk)]
        if len(pieces) > 1:
            parts.extend(pieces)
    return parts


@dataclass(frozen=True)
class Analyzer:
    """How text becomes BM25 terms: bm25s's word pattern, English stop-words, a
    Snowball stemmer, and (``split_identifiers``) the words of each compound identifier
    as extra terms beside the identifier itself, so "write a boolean" meets
    ``writeBoolean`` and "parse the config" meets ``parse_config`` (CoSQA: BM25
    nDCG@10 .33 → .39, docs/quality.md). A generation records the analyzer its index
    was built with; its queries and the online delta use that one."""

    stemmer: str | None = "english"
    split_identifiers: bool = True

    def prepare(self, text: str) -> str:
        if not self.split_identifiers:
            return text
        parts = identifier_parts(text)
        return f"{text}\n{' '.join(parts)}" if parts else text

    def tokenize(self, texts: list[str], *, return_ids: bool = True):
        """``bm25s.tokenize`` of the prepared texts: ids + vocabulary to index, or
        (``return_ids=False``) a list of terms per text."""
        import bm25s

        return bm25s.tokenize(
            [self.prepare(t) for t in texts], stopwords="en",
            stemmer=_stemmer(self.stemmer) if self.stemmer else None,
            return_ids=return_ids, show_progress=False,
        )

    def to_dict(self) -> dict[str, object]:
        return {"stemmer": self.stemmer or "", "split_identifiers": self.split_identifiers}

    @classmethod
    def from_dict(cls, data: dict[str, object] | None) -> "Analyzer":
        """From a manifest's or an index folder's record; a record from before
        identifier splitting (no such key) did not split."""
        data = data or {}
        return cls(stemmer=str(data.get("stemmer", "english") or "") or None,
                   split_identifiers=bool(data.get("split_identifiers", False)))


def lexical_text(text: str, expansions: Sequence[str]) -> str:
    """What BM25 indexes for a memory: its text, then its doc2query expansions a line each."""
    return text + ("\n" + "\n".join(expansions) if expansions else "")


@dataclass
class Terms:
    """Analysed terms of N documents: ``ids[offsets[i]:offsets[i + 1]]`` are document
    i's, in order, as indexes into ``vocab`` (what the score matrix counts). A generation keeps
    them beside its index, so the next one re-analyses only new documents
    (:mod:`helix_ray.ingest.carry`)."""

    ids: np.ndarray  # int32, flat
    offsets: np.ndarray  # int64, N + 1
    vocab: list[str]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def analyse(cls, analyzer: Analyzer, texts: Sequence[str], vocab: Sequence[str] = ()) -> "Terms":
        """``texts`` analysed, with terms numbered after ``vocab`` (extended by new ones)."""
        vocab = list(vocab)
        offsets = np.zeros(len(texts) + 1, np.int64)
        if not texts:
            return cls(np.zeros(0, np.int32), offsets, vocab)
        docs, local = analyzer.tokenize(list(texts))
        index = {t: i for i, t in enumerate(vocab)}
        to_vocab = np.empty(len(local), np.int32)
        for term, i in local.items():
            to_vocab[i] = index.setdefault(term, len(index))
            if to_vocab[i] == len(vocab):
                vocab.append(term)
        np.cumsum([len(d) for d in docs], out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(docs), np.int32, count=int(offsets[-1]))
        return cls(to_vocab[flat], offsets, vocab)

    def take(self, rows: np.ndarray) -> "Terms":
        rows = np.asarray(rows, np.int64)
        starts, lengths = self.offsets[rows], self.offsets[rows + 1] - self.offsets[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return Terms(np.asarray(self.ids)[gather], offsets, self.vocab)

    def then(self, other: "Terms") -> "Terms":
        """These documents followed by ``other``'s, whose vocabulary extends this one's."""
        if other.vocab[: len(self.vocab)] != self.vocab:
            raise ValueError("the second block's vocabulary must extend the first's")
        return Terms(np.concatenate([self.ids, other.ids]).astype(np.int32),
                     np.concatenate([self.offsets, other.offsets[1:] + self.offsets[-1]]), other.vocab)

    def compacted(self) -> "Terms":
        """Only the terms some document holds, renumbered in their present order: the
        terms of deleted memories alone leave the vocabulary, as from a full rebuild."""
        ids = np.asarray(self.ids)
        used = np.bincount(ids, minlength=len(self.vocab)) > 0
        renumber = (np.cumsum(used) - 1).astype(np.int32)
        return Terms(renumber[ids], np.asarray(self.offsets), [t for t, u in zip(self.vocab, used) if u])


def bm25_matrix(terms: Terms, *, k1: float, b: float) -> dict[str, object]:
    """The score matrix bm25s's ``index()`` builds (method "lucene", float32), vectorised:
    one score per (term, document) pair holding it, idf × tf / (tf + k1·(1 − b + b·|d| /
    avgdl)), with idf = ln(1 + (N − df + 0.5) / (df + 0.5)) (Lucene's BM25); stored by
    term (CSC), documents ascending. bm25s counts terms a document at a time in Python:
    ~2 s at 10^5 memories, against ~0.3 s here. ``test_lexical`` compares both."""
    n_docs, n_vocab = len(terms), len(terms.vocab)
    lengths = np.diff(np.asarray(terms.offsets))
    docs = np.repeat(np.arange(n_docs, dtype=np.int64), lengths)
    pairs, tf = np.unique(np.asarray(terms.ids, np.int64) * n_docs + docs, return_counts=True)
    term, doc = np.divmod(pairs, n_docs)
    df = np.bincount(term, minlength=n_vocab)
    # bm25s: idf rounded to float32, the rest in float64, the product stored as float32
    idf = np.log(1 + (n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
    tf = tf.astype(np.float64)
    tfc = tf / (k1 * ((1 - b) + b * lengths[doc] / lengths.mean()) + tf)
    indptr = np.zeros(n_vocab + 1, np.int64)
    np.cumsum(df, out=indptr[1:])
    return {"data": (idf[term] * tfc).astype(np.float32), "indices": doc.astype(np.int32), "indptr": indptr,
            "num_docs": n_docs}


ANALYZER_FILE = "helix_analyzer.json"
TERMS_FILES = ("helix_terms.npy", "helix_term_offsets.npy")


def build_bm25(texts: list[str] | None, folder: Path, *, analyzer: Analyzer = Analyzer(),
               terms: Terms | None = None) -> Terms:
    """Index ``texts`` (or their ``terms``, already analysed by ``analyzer``) into
    ``folder``, with the terms beside it; returns the terms as saved (numbered as the
    index's vocabulary)."""
    import bm25s

    if terms is None:
        terms = Terms.analyse(analyzer, texts or [])
    terms = terms.compacted()
    retriever = bm25s.BM25()
    if len(terms):
        retriever.scores = bm25_matrix(terms, k1=retriever.k1, b=retriever.b)
        retriever.vocab_dict = {t: i for i, t in enumerate(terms.vocab)}
        retriever.vocab_dict[""] = len(terms.vocab)  # as bm25s's index() adds it
        retriever.nonoccurrence_array = None
    else:  # bm25s cannot index nothing (an empty store, or every memory deleted): no terms, no docs
        retriever.scores = {"data": np.zeros(0, np.float32), "indices": np.zeros(0, np.int32),
                            "indptr": np.zeros(1, np.int32), "num_docs": 0}
        retriever.vocab_dict = {}
        retriever.nonoccurrence_array = None
    retriever.save(str(folder))
    (folder / ANALYZER_FILE).write_text(json.dumps(analyzer.to_dict()))
    np.save(folder / TERMS_FILES[0], np.asarray(terms.ids, np.int32))
    np.save(folder / TERMS_FILES[1], np.asarray(terms.offsets, np.int64))
    return terms


def load_terms(folder: Path, vocab_dict: dict[str, int]) -> Terms | None:
    """The terms saved beside an index (memory-mapped), or None for an index without them."""
    if not all((folder / name).is_file() for name in TERMS_FILES):
        return None
    vocab = [""] * len(vocab_dict)
    for term, i in vocab_dict.items():
        vocab[i] = term
    ids, offsets = (np.load(folder / name, mmap_mode="r") for name in TERMS_FILES)
    return Terms(ids, offsets, vocab)


@dataclass
class BM25Index:
    retriever: bm25s.BM25
    analyzer: Analyzer

    def query_tokens(self, query: str) -> list[str]:
        return self.query_terms(query)[0]

    def query_terms(self, query: str) -> tuple[list[str], int]:
        """The query's analysed terms that the index knows, and how many terms it has in
        all (a term no memory holds cannot score, but it still says the query asks for
        something no memory says)."""
        tokens = self.analyzer.tokenize([query], return_ids=False)[0]
        vocab = self.retriever.vocab_dict
        return [t for t in tokens if t in vocab], len(tokens)

    def scores(self, tokens: list[str]) -> np.ndarray:
        if not tokens:
            return np.zeros(self.retriever.scores["num_docs"], dtype=np.float32)
        return self.retriever.get_scores(tokens)


def load_bm25(folder: Path) -> BM25Index:
    import bm25s

    retriever = bm25s.BM25.load(str(folder), mmap=True, load_corpus=False, show_progress=False)
    record = folder / ANALYZER_FILE
    if record.is_file():
        analyzer = Analyzer.from_dict(json.loads(record.read_text()))
    else:  # an index from before the analyzer record: a stemmer name alone, no splitting
        stemmer_file = folder / "helix_stemmer.txt"
        analyzer = Analyzer.from_dict({"stemmer": stemmer_file.read_text().strip() if stemmer_file.is_file() else ""})
    return BM25Index(retriever, analyzer)


@dataclass(frozen=True)
class LexicalHits:
    rows: np.ndarray  # int64 global row ids, best first
    scores: np.ndarray  # float32 raw BM25
    normalised: np.ndarray  # raw / the query's ceiling (see :func:`ceiling`), in [0, 1]
    strong_signal: bool


def ceiling(index: BM25Index, tokens: list[str], start: int = 0, end: int | None = None) -> float:
    """The best score any memory of rows [start, end) could reach for ``tokens``: Σ over
    query tokens of the token's highest per-memory score among those rows (one tenant's:
    another tenant's memories must not move this one's strong-signal decisions). A
    memory at 1.0 of it holds every query term at the best weight seen: the query is,
    lexically, that memory."""
    return float(sum(term_maxima(index, tokens, start, end)))


def term_maxima(index: BM25Index, tokens: list[str], start: int = 0, end: int | None = None) -> list[float]:
    """Per token, its highest per-memory score among rows [start, end); 0 for a token no
    memory there holds."""
    scores = index.retriever.scores
    vocab = index.retriever.vocab_dict
    data, indptr, indices = scores["data"], scores["indptr"], scores["indices"]
    whole = start <= 0 and (end is None or end >= scores["num_docs"])
    out = []
    for token in tokens:
        t = vocab[token]
        lo, hi = int(indptr[t]), int(indptr[t + 1])
        weights = np.asarray(data[lo:hi])
        if not whole and hi > lo:
            docs = np.asarray(indices[lo:hi])
            weights = weights[(docs >= start) & (docs < (scores["num_docs"] if end is None else end))]
        out.append(float(np.max(weights)) if len(weights) else 0.0)
    return out


SAMPLE_ROWS = 16_384
"""Rows in the strided sample that bounds the top-k threshold (see :func:`top_k_rows`)."""


def top_k_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` highest positive ``scores``, best first, ties by position.

    Exact, and cheap on a large tenant. The k-th largest score of any subset is a lower
    bound for the k-th largest of the whole, so the rows scoring at least the k-th best
    of a strided sample of :data:`SAMPLE_ROWS` hold the whole top-k; they are ~k·n/16k
    rows instead of every row that matches a query term (half to all of them at 10^6,
    where a partition over the matches cost 9 ms: docs/benchmarks.md, finding 4).
    """
    if k <= 0 or len(scores) == 0:
        return np.zeros(0, np.int64)
    threshold = 0.0
    if len(scores) > 4 * SAMPLE_ROWS:
        sample = scores[:: len(scores) // SAMPLE_ROWS]
        if len(sample) >= k:
            threshold = float(np.partition(sample, len(sample) - k)[len(sample) - k])
    hit = np.flatnonzero(scores >= threshold) if threshold > 0 else np.flatnonzero(scores > 0)
    k = min(k, len(hit))
    if k == 0:
        return np.zeros(0, np.int64)
    hit_scores = scores[hit]
    if k < len(hit):  # the k-th score, then every row above it and the first rows equal to it
        kth = np.partition(hit_scores, len(hit) - k)[len(hit) - k]
        above = hit[hit_scores > kth]
        top = np.concatenate([above, hit[hit_scores == kth][: k - len(above)]])
    else:
        top = hit
    return top[np.lexsort((top, -scores[top]))].astype(np.int64)


def search(
    index: BM25Index,
    query: str,
    *,
    start: int,
    end: int,
    mask: np.ndarray | None,
    top_k: int,
    strong_score: float,
    strong_gap: float,
) -> LexicalHits:
    """Top-k BM25 rows within [start, end) where ``mask`` (length end-start) is true.

    Strong signal: the top hit's normalised score, times the share of the query's terms
    the index knows, is at least ``strong_score``, and the top hit beats the second by
    at least ``strong_gap`` — the query names one memory exactly (an error string, a
    path), so fusion with the dense leg has nothing to add. (Without the share, "event
    bus" over a store where "bus" appears nowhere and "event" in one memory would name
    that memory.)
    """
    tokens, n_terms = index.query_terms(query)
    empty = LexicalHits(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32), False)
    if not tokens:
        return empty
    scores = np.asarray(index.scores(tokens)[start:end], dtype=np.float32)
    if mask is not None:  # BM25 scores are >= 0: a product, 0.2 ms over 10^6 rows where np.where took 3.4
        scores = scores * mask
    top = top_k_rows(scores, top_k)
    if len(top) == 0:
        return empty
    raw = scores[top]
    maxima = term_maxima(index, tokens, start, end)  # the tenant's own: other tenants' words do not count
    normalised = np.minimum(raw / (sum(maxima) or 1.0), 1.0).astype(np.float32)
    strong = is_strong(normalised, sum(m > 0 for m in maxima) / max(n_terms, 1), strong_score, strong_gap)
    return LexicalHits(rows=top.astype(np.int64) + start, scores=raw, normalised=normalised, strong_signal=strong)


def is_strong(normalised: np.ndarray, coverage: float, strong_score: float, strong_gap: float) -> bool:
    """The strong-signal test of :func:`search` on a list's normalised scores, best
    first; ``coverage``: the share of the query's terms that some memory holds."""
    if not len(normalised):
        return False
    second = float(normalised[1]) if len(normalised) > 1 else 0.0
    return bool(normalised[0] * coverage >= strong_score and normalised[0] - second >= strong_gap)
