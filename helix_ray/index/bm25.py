"""BM25 index files: how text becomes terms, and building and loading a bm25s index.

A generation's ``bm25/`` folder holds a bm25s index (saved by bm25s, memory-mapped on
load), the :class:`Analyzer` it was built with (``helix_analyzer.json``) and each
document's analysed terms as ids of its vocabulary (``helix_terms.npy``,
``helix_term_offsets.npy``), so the next generation re-analyses only new documents.
Queries and the online delta analyse text with the recorded analyzer; scoring a query
within a tenant is :mod:`helix_ray.recall.lexical`'s.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

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
    ``writeBoolean`` and "parse the config" meets ``parse_config`` (docs/quality.md). A
    generation records the analyzer its index was built with; its queries and the
    online delta use that one."""

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

    def words(self, texts: list[str]) -> list[str]:
        """Each text's terms (:meth:`tokenize`'s, in order) as one string, a space between
        two: what an ingest's transform stage hands the driver (:class:`TermsOfWords`
        numbers them). A term is a run of word characters, so it holds no space."""
        return [" ".join(terms) for terms in self.tokenize(texts, return_ids=False)]

    def to_dict(self) -> dict[str, object]:
        return {"stemmer": self.stemmer or "", "split_identifiers": self.split_identifiers}

    @classmethod
    def from_dict(cls, data: dict[str, object] | None) -> "Analyzer":
        """From a manifest's or an index folder's record; a record without
        ``split_identifiers`` means no splitting."""
        data = data or {}
        return cls(stemmer=str(data.get("stemmer", "english") or "") or None,
                   split_identifiers=bool(data.get("split_identifiers", False)))


def lexical_text(text: str, expansions: Sequence[str]) -> str:
    """What BM25 indexes for a memory: its text, then its doc2query expansions a line each."""
    return text + ("\n" + "\n".join(expansions) if expansions else "")


def expansions_of(text: str, lexical: str) -> list[str] | None:
    """The expansions :func:`lexical_text` put after ``text`` (a query holding a newline
    comes back as two, which index the same text); None when ``lexical`` does not start
    with ``text`` (it was made from another text)."""
    if not lexical.startswith(text):
        return None
    return lexical[len(text) + 1:].split("\n") if len(lexical) > len(text) else []


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
    def analyse(cls, analyzer: Analyzer, texts: Sequence[str], vocab: Sequence[str] = (),
                block: int = 20000) -> "Terms":
        """``texts`` analysed, with terms numbered after ``vocab`` (extended by new ones).
        Texts go ``block`` at a time: bm25s answers with a Python list of ints per text,
        which for a million texts would take gigabytes at once."""
        vocab = list(vocab)
        index = {t: i for i, t in enumerate(vocab)}
        lengths, ids = [], []
        for lo in range(0, len(texts), block):
            docs, local = analyzer.tokenize(list(texts[lo:lo + block]))
            counts = np.fromiter(map(len, docs), np.int64, count=len(docs))
            flat = np.fromiter(itertools.chain.from_iterable(docs), np.int32, count=int(counts.sum()))
            # New terms are numbered in the order they first occur: bm25s numbers them in
            # a set's order, which changes with Python's hash seed from run to run.
            term_of = [""] * len(local)
            for term, i in local.items():
                term_of[i] = term
            present, first = np.unique(flat, return_index=True)
            to_vocab = np.full(len(local), -1, np.int32)
            for i in present[np.argsort(first)].tolist():
                to_vocab[i] = index.setdefault(term_of[i], len(index))
                if to_vocab[i] == len(vocab):
                    vocab.append(term_of[i])
            lengths.append(counts)
            ids.append(to_vocab[flat])
        offsets = np.zeros(len(texts) + 1, np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return cls(np.concatenate(ids) if ids else np.zeros(0, np.int32), offsets, vocab)

    def take(self, rows: np.ndarray, block: int = 8192,
             empty: Callable[[int], np.ndarray] | None = None) -> "Terms":
        """Documents ``rows``, in that order. Runs of rows that follow one another here
        (what an ingest mostly takes: the rows it carries, then a sort by tenant) are
        copied a slice at a time; scattered rows are gathered term by term, ``block``
        rows at a time (the positions to gather are 8 bytes a term: at a million
        memories, ~0.5 GB for all rows at once). ``empty(n)``: the int32 array of n
        terms to write them into (a memory map, say), a new one by default."""
        rows = np.asarray(rows, np.int64)
        all_offsets = np.asarray(self.offsets)
        starts, ends = all_offsets[rows], all_offsets[rows + 1]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(ends - starts, out=offsets[1:])
        ids = np.asarray(self.ids)
        out = np.empty(int(offsets[-1]), np.int32) if empty is None else empty(int(offsets[-1]))
        breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # where a run of adjacent documents ends
        if len(breaks) > len(rows) // 16:
            for lo in range(0, len(rows), block):
                hi = min(lo + block, len(rows))
                at = np.repeat(starts[lo:hi] - offsets[lo:hi], ends[lo:hi] - starts[lo:hi])
                at += np.arange(offsets[lo], offsets[hi], dtype=np.int64)
                out[offsets[lo]:offsets[hi]] = ids[at]
            return Terms(out, offsets, self.vocab)
        if not len(rows):
            return Terms(out, offsets, self.vocab)
        firsts, lasts = np.r_[0, breaks], np.r_[breaks, len(rows)]
        for first, last in zip(firsts.tolist(), lasts.tolist()):
            out[offsets[first]:offsets[last]] = ids[starts[first]:ends[last - 1]]
        return Terms(out, offsets, self.vocab)

    def then(self, other: "Terms") -> "Terms":
        """These documents followed by ``other``'s, whose vocabulary extends this one's."""
        if other.vocab[: len(self.vocab)] != self.vocab:
            raise ValueError("the second block's vocabulary must extend the first's")
        if not len(self):  # a first ingest: no copy of every occurrence (~0.2 GB at a million memories)
            return other
        if not len(other):
            return Terms(self.ids, self.offsets, other.vocab)
        return Terms(np.concatenate([self.ids, other.ids]).astype(np.int32, copy=False),
                     np.concatenate([self.offsets, other.offsets[1:] + self.offsets[-1]]), other.vocab)

    def compacted(self, block: int = 1 << 20) -> "Terms":
        """Only the terms some document holds, renumbered in their present order: the
        terms of deleted memories alone leave the vocabulary, as from a full rebuild.
        The terms in use are marked ``block`` occurrences at a time (a count of all at
        once takes an int64 copy of every occurrence: ~0.6 GB at a million memories)."""
        ids = np.asarray(self.ids)
        used = np.zeros(len(self.vocab), bool)
        for lo in range(0, len(ids), block):
            used[ids[lo:lo + block]] = True
        if used.all():  # nothing to drop: no copy of every occurrence (~0.2 GB at a million memories)
            return self
        renumber = (np.cumsum(used) - 1).astype(np.int32)
        return Terms(renumber[ids], np.asarray(self.offsets), [t for t, u in zip(self.vocab, used) if u])


class TermsOfWords:
    """:class:`Terms` of N documents from their words (:meth:`Analyzer.words`), given a
    batch at a time in any order of batches (rows ``0 … N − 1``, each once): the same
    terms, numbered the same way, as :meth:`Terms.analyse` of the texts would give.

    An ingest's transform stage analyses its batch's texts in parallel on the cluster;
    the driver only numbers the words, in C but for one dictionary lookup per distinct
    term of a batch (Arrow splits and dictionary-encodes them). Given ``path``, the
    numbered terms go into that file as the batches come, not the heap (at a million
    memories, ~0.2 GB)."""

    def __init__(self, n: int, path: Path | None = None):
        self.n = n
        self.index: dict[str, int] = {}  # term → number, in the order batches brought them
        self.ids: list[np.ndarray] = []  # per batch, its rows' terms one after another (without a path)
        self.path, self.written = path, 0
        if path is not None:
            path.write_bytes(b"")
        self.rows: list[np.ndarray] = []  # per batch, its rows
        self.lengths = np.full(n, -1, np.int64)

    def add(self, rows: np.ndarray, words: Sequence[str] | np.ndarray) -> None:
        """Rows ``rows``' words (one string each)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        rows = np.asarray(rows, np.int64)
        if len(rows) != len(words):
            raise ValueError(f"{len(words)} word strings for {len(rows)} rows")
        if len(rows) and (rows.min() < 0 or rows.max() >= self.n or (self.lengths[rows] >= 0).any()
                          or len(np.unique(rows)) < len(rows)):
            raise ValueError(f"rows outside 0..{self.n - 1}, or given twice")
        given = pa.array(list(words), pa.string())
        if given.null_count:
            raise ValueError("a row's words are None: expected a string (empty when it has no terms)")
        # "" splits into one empty term: a row without terms becomes a null list instead.
        split = pc.utf8_split_whitespace(pc.if_else(pc.equal(given, ""), pa.scalar(None, pa.string()), given))
        self.lengths[rows] = pc.fill_null(pc.list_value_length(split), 0).to_numpy(zero_copy_only=False)
        encoded = split.flatten().dictionary_encode()
        to_number = np.fromiter((self.index.setdefault(t, len(self.index)) for t in encoded.dictionary.to_pylist()),
                                np.int32, count=len(encoded.dictionary))
        ids = to_number[encoded.indices.to_numpy(zero_copy_only=False)]
        if self.path is None:
            self.ids.append(ids)
        else:
            with open(self.path, "ab") as fh:
                fh.write(ids.tobytes())
            self.written += len(ids)
        self.rows.append(rows)

    def terms(self, vocab: Sequence[str] = (), empty: Callable[[int], np.ndarray] | None = None,
              block: int = 1 << 20) -> Terms:
        """The documents' terms in row order, numbered after ``vocab`` as
        :meth:`Terms.analyse` with it would: a term ``vocab`` holds keeps its number
        there, the others follow in the order they first occur. ``empty(n)``: the
        int32 array of n terms to write them into (as :meth:`Terms.take`). Raises
        ValueError unless every row came. Takes the batches' terms: call it once."""
        if (self.lengths < 0).any():
            raise ValueError(f"words came for {int((self.lengths >= 0).sum())} of {self.n} rows")
        came = np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64)
        if self.path is not None:
            ids = np.memmap(self.path, np.int32, "r", shape=(self.written,)) if self.written \
                else np.zeros(0, np.int32)
        else:
            ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        self.ids = []
        offsets = np.zeros(len(came) + 1, np.int64)
        np.cumsum(self.lengths[came], out=offsets[1:])
        place = np.empty(self.n, np.int64)  # each row's place among the rows as they came
        place[came] = np.arange(len(came))
        terms = Terms(ids, offsets, list(self.index)).take(place, empty=empty)
        del ids
        # Numbered by first occurrence in row order (the batches' order changes from run
        # to run; the generation's files must not), after the terms ``vocab`` holds.
        flat = terms.ids
        first = np.full(len(terms.vocab), len(flat), np.int64)
        for lo in range(0, len(flat), block):
            seen, at = np.unique(flat[lo:lo + block], return_index=True)
            first[seen] = np.minimum(first[seen], at + lo)
        given = {t: i for i, t in enumerate(vocab)}
        known = np.fromiter((given.get(t, -1) for t in terms.vocab), np.int64, count=len(terms.vocab))
        fresh = np.flatnonzero(known < 0)
        fresh = fresh[np.argsort(first[fresh], kind="stable")]
        number = known.astype(np.int32)
        number[fresh] = np.arange(len(given), len(given) + len(fresh), dtype=np.int32)
        for lo in range(0, len(flat), block):
            flat[lo:lo + block] = number[flat[lo:lo + block]]
        return Terms(flat, terms.offsets, [*vocab, *(terms.vocab[i] for i in fresh.tolist())])


def bm25_matrix(terms: Terms, *, k1: float, b: float, block: int = 8192,
                empty: Callable[[str, int, Any], np.ndarray] | None = None) -> dict[str, object]:
    """The score matrix bm25s's ``index()`` builds (method "lucene", float32), vectorised:
    one score per (term, document) pair holding it, idf × tf / (tf + k1·(1 − b + b·|d| /
    avgdl)), with idf = ln(1 + (N − df + 0.5) / (df + 0.5)) (Lucene's BM25); stored by
    term (CSC), documents ascending. bm25s counts terms a document at a time in Python;
    this counts ``block`` documents at a time, twice: once for each term's document
    frequency, then to score the pairs and put them in place. Only the result is held
    whole (8 bytes a pair; a million memories hold ~50 million pairs), never a
    temporary of every term occurrence. ``empty(name, n, dtype)``: the array of n pairs'
    ``data`` or ``indices`` to fill (a memory map, say), a new one by default.
    ``test_lexical`` checks it against bm25s."""
    n_docs, n_vocab = len(terms), len(terms.vocab)
    lengths = np.diff(np.asarray(terms.offsets))
    blocks = [(lo, min(lo + block, n_docs)) for lo in range(0, n_docs, block)]
    df = np.zeros(n_vocab, np.int64)
    for lo, hi in blocks:
        df += np.diff(_counted(terms, lo, hi).indptr)
    indptr = np.zeros(n_vocab + 1, np.int64)
    np.cumsum(df, out=indptr[1:])
    # bm25s: idf rounded to float32, the rest in float64, the product stored as float32.
    idf = np.log(1 + (n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
    avgdl = lengths.mean()
    make = empty or (lambda name, n, dtype: np.empty(n, dtype))
    data, indices = make("data", int(indptr[-1]), np.float32), make("indices", int(indptr[-1]), np.int32)
    filled = indptr[:-1].copy()  # where each term's next pair goes
    for lo, hi in blocks:
        counts = _counted(terms, lo, hi)
        block_df = np.diff(counts.indptr)
        at = np.repeat(filled - counts.indptr[:-1], block_df) + np.arange(len(counts.data))
        filled += block_df
        doc = counts.indices + lo
        tf = counts.data.astype(np.float64)
        norm = lengths[doc].astype(np.float64)  # k1 · ((1 − b) + b · |d| / avgdl) + tf
        norm *= b
        norm /= avgdl
        norm += 1 - b
        norm *= k1
        norm += tf
        tf /= norm
        tf *= np.repeat(idf, block_df)
        data[at] = tf
        indices[at] = doc
    return {"data": data, "indices": indices, "indptr": indptr, "num_docs": n_docs}


def _counted(terms: Terms, lo: int, hi: int):
    """Documents ``lo``..``hi``'s terms counted: a CSC matrix (documents numbered from
    ``lo``) of one entry per (term, document) pair, documents ascending within a term.
    scipy's COO → CSC conversion counts them (linear, in C)."""
    from scipy import sparse

    offsets = np.asarray(terms.offsets)
    docs = np.repeat(np.arange(hi - lo, dtype=np.int32), np.diff(offsets[lo:hi + 1]))
    ids = np.asarray(terms.ids[offsets[lo]:offsets[hi]], np.int32)
    counts = sparse.csc_matrix((np.ones(len(docs), np.float32), (docs, ids)),
                               shape=(hi - lo, len(terms.vocab)))
    counts.sum_duplicates()
    return counts


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
    folder.mkdir(parents=True, exist_ok=True)
    # The score matrix is filled in files beside the index, not the heap (8 bytes a pair:
    # ~0.4 GB at a million memories), and bm25s's save copies them to its own names.
    scratch = {name: folder / f".{name}-scratch.npy" for name in ("data", "indices")}
    if len(terms):
        retriever.scores = bm25_matrix(
            terms, k1=retriever.k1, b=retriever.b,
            empty=lambda name, n, dtype: np.lib.format.open_memmap(scratch[name], "w+", dtype, (n,)))
        retriever.vocab_dict = {t: i for i, t in enumerate(terms.vocab)}
        retriever.vocab_dict[""] = len(terms.vocab)  # as bm25s's index() adds it
        retriever.nonoccurrence_array = None
    else:  # bm25s cannot index nothing (an empty store, or every memory deleted): no terms, no docs
        retriever.scores = {"data": np.zeros(0, np.float32), "indices": np.zeros(0, np.int32),
                            "indptr": np.zeros(1, np.int32), "num_docs": 0}
        retriever.vocab_dict = {}
        retriever.nonoccurrence_array = None
    retriever.save(str(folder))
    del retriever
    for path in scratch.values():
        path.unlink(missing_ok=True)
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
    else:  # an index without the analyzer record: a stemmer name alone, no splitting
        stemmer_file = folder / "helix_stemmer.txt"
        analyzer = Analyzer.from_dict({"stemmer": stemmer_file.read_text().strip() if stemmer_file.is_file() else ""})
    return BM25Index(retriever, analyzer)
