"""BM25 top-k selection (helix_ray.recall.lexical.top_k_rows) against a naive full sort,
and the analyzer that turns text into BM25 terms (helix_ray.index.bm25).

The fast path bounds the k-th best score by a strided sample; it must return exactly what
sorting every row would, ties (by position) and zero scores included.
"""

from __future__ import annotations

import numpy as np
import pytest

from helix_ray.index import bm25
from helix_ray.recall import lexical


def naive_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(len(scores)), -scores))
    return np.array([i for i in order if scores[i] > 0][:k], dtype=np.int64)


def scores_with_ties(n: int, seed: int, zero_fraction: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Few distinct values (many ties), some rows not matching at all (score 0).
    scores = rng.integers(1, 40, size=n).astype(np.float32) / 4
    scores[rng.random(n) < zero_fraction] = 0.0
    return scores


@pytest.mark.parametrize("n", [0, 1, 7, 100, 70_000, 300_001])
@pytest.mark.parametrize("k", [1, 10, 100])
@pytest.mark.parametrize("zero_fraction", [0.0, 0.5, 0.999])
def test_top_k_rows_matches_a_full_sort(n, k, zero_fraction):
    scores = scores_with_ties(n, seed=n + k, zero_fraction=zero_fraction)
    np.testing.assert_array_equal(lexical.top_k_rows(scores, k), naive_top_k(scores, k))


def test_the_sample_threshold_is_used_and_stays_exact(monkeypatch):
    """With a tiny sample the threshold is low and many rows pass it; the answer must not change."""
    monkeypatch.setattr(lexical, "SAMPLE_ROWS", 8)
    scores = scores_with_ties(5_000, seed=3, zero_fraction=0.3)
    scores[4_999] = 100.0  # the best row is the last one, outside most strides
    got = lexical.top_k_rows(scores, 25)
    np.testing.assert_array_equal(got, naive_top_k(scores, 25))
    assert got[0] == 4_999


def test_no_positive_score_gives_nothing():
    assert lexical.top_k_rows(np.zeros(100_000, np.float32), 10).tolist() == []
    assert lexical.top_k_rows(np.ones(10, np.float32), 0).tolist() == []


@pytest.mark.parametrize("text, parts", [
    ("def writeBoolean(self, n):", ["write", "Boolean"]),
    ("raise HTTPServerError from e", ["HTTP", "Server", "Error"]),
    ("see helix_ray/recall/lexical.py and parse_config_v2", ["helix", "ray", "parse", "config", "v", "2"]),
    ("_private __dunder__ snake_", []),  # one word each once the underscores go
    ("plain words, an ACRONYM and Capitalised ones", []),
])
def test_identifier_parts(text, parts):
    assert bm25.identifier_parts(text) == parts


CODE_DOCS = [
    "def writeBoolean(self, n):\n    self.stream.write(TYPE_BOOL_TRUE if n else TYPE_BOOL_FALSE)",
    "def read_json_file(p):\n    return decoder.decode(open(p).text)",
    "The boolean flag in the settings page is written by the admin.",
]


@pytest.mark.parametrize("split", [True, False])
def test_a_question_in_words_finds_the_identifier_only_when_split(tmp_path, split):
    analyzer = bm25.Analyzer(split_identifiers=split)
    bm25.build_bm25(CODE_DOCS, tmp_path / "bm25", analyzer=analyzer)
    index = bm25.load_bm25(tmp_path / "bm25")
    assert index.analyzer == analyzer  # the folder records how it was built
    hits = lexical.search(index, "python read a json file", start=0, end=3, mask=None, top_k=3,
                          strong_score=0.85, strong_gap=0.15)
    if split:
        assert hits.rows[0] == 1
    else:
        assert 1 not in hits.rows.tolist()  # "read_json_file" is one term; the query has no other
    # The identifier itself stays a term either way: an exact name still matches.
    exact = lexical.search(index, "writeBoolean", start=0, end=3, mask=None, top_k=3,
                           strong_score=0.85, strong_gap=0.15)
    assert exact.rows.tolist()[0] == 0


def test_an_index_without_an_analyzer_record_loads_as_it_was_built(tmp_path):
    """Indexes written before the analyzer record hold only a stemmer name: no splitting."""
    bm25.build_bm25(CODE_DOCS, tmp_path / "bm25", analyzer=bm25.Analyzer(split_identifiers=False))
    (tmp_path / "bm25" / bm25.ANALYZER_FILE).unlink()
    (tmp_path / "bm25" / "helix_stemmer.txt").write_text("english")
    assert bm25.load_bm25(tmp_path / "bm25").analyzer == bm25.Analyzer("english", split_identifiers=False)
    assert bm25.Analyzer.from_dict({"stemmer": ""}) == bm25.Analyzer(None, split_identifiers=False)


def test_the_score_matrix_is_the_one_bm25s_builds(tmp_path):
    """build_bm25 computes bm25s's matrix itself (vectorised): same pairs, same scores."""
    import bm25s

    rng = np.random.default_rng(7)
    words = "retry budget gateway parse_config writeBoolean canary rollout ledger the of a cache shard".split()
    texts = [" ".join(rng.choice(words, int(rng.integers(0, 30)))) for _ in range(300)] + ["", "the of a"]
    analyzer = bm25.Analyzer()
    reference = bm25s.BM25()
    reference.index(analyzer.tokenize(texts), show_progress=False)
    bm25.build_bm25(texts, tmp_path / "ours", analyzer=analyzer)
    ours = bm25.load_bm25(tmp_path / "ours").retriever
    assert ours.vocab_dict.keys() == reference.vocab_dict.keys()
    # bm25s numbers terms in set order; compare column by column through the terms
    for term, j in reference.vocab_dict.items():
        if term == "":
            continue
        i = ours.vocab_dict[term]
        a, b = ours.scores["indptr"][i:i + 2], reference.scores["indptr"][j:j + 2]
        np.testing.assert_array_equal(ours.scores["indices"][a[0]:a[1]], reference.scores["indices"][b[0]:b[1]])
        np.testing.assert_allclose(ours.scores["data"][a[0]:a[1]], reference.scores["data"][b[0]:b[1]], rtol=1e-6)
    assert ours.scores["num_docs"] == reference.scores["num_docs"] == len(texts)
    # the matrix was filled in scratch files beside the index (not the heap): none is left
    assert not [p.name for p in (tmp_path / "ours").iterdir() if p.name.startswith(".")]


def test_the_score_matrix_is_the_same_whatever_the_block_of_documents():
    """Counting a few documents at a time gives the matrix of counting them all at once,
    to the bit: pairs from later blocks follow earlier ones within each term."""
    rng = np.random.default_rng(11)
    words = [f"w{i}" for i in range(40)]
    texts = [" ".join(rng.choice(words, int(rng.integers(0, 25)))) for _ in range(200)]
    terms = bm25.Terms.analyse(bm25.Analyzer(), texts)
    whole = bm25.bm25_matrix(terms, k1=1.5, b=0.75)
    for block in (1, 7, 64):
        part = bm25.bm25_matrix(terms, k1=1.5, b=0.75, block=block)
        for key in ("data", "indices", "indptr"):
            assert part[key].dtype == whole[key].dtype
            np.testing.assert_array_equal(part[key], whole[key])
    given: dict[str, np.ndarray] = {}  # the arrays to fill, from the caller (build_bm25 gives memory maps)
    into = bm25.bm25_matrix(terms, k1=1.5, b=0.75, block=7,
                            empty=lambda name, n, dtype: given.setdefault(name, np.full(n, -1, dtype)))
    assert into["data"] is given["data"] and into["indices"] is given["indices"]
    for key in ("data", "indices"):
        np.testing.assert_array_equal(into[key], whole[key])


def test_terms_take_gives_the_documents_asked_in_that_order():
    """Runs of adjacent documents (copied a slice at a time) and scattered ones (gathered
    term by term) come out as each document's own terms."""
    rng = np.random.default_rng(3)
    words = "retry budget gateway canary rollout ledger cache shard replica quota".split()
    texts = [" ".join(rng.choice(words, int(rng.integers(0, 12)))) for _ in range(400)]
    terms = bm25.Terms.analyse(bm25.Analyzer(), texts)
    own = [terms.ids[terms.offsets[i]:terms.offsets[i + 1]].tolist() for i in range(len(terms))]
    runs = np.r_[np.arange(0, 150), np.arange(390, 400), np.arange(200, 380)]  # three runs
    scattered = rng.permutation(400)[:300]
    for rows in (runs, scattered, np.array([], np.int64), np.array([7])):
        for block in (65536, 7):  # scattered rows are gathered a block at a time
            taken = terms.take(rows, block=block)
            assert len(taken) == len(rows) and taken.vocab == terms.vocab
            assert [taken.ids[taken.offsets[i]:taken.offsets[i + 1]].tolist() for i in range(len(rows))] == \
                [own[r] for r in rows]
    given: list[np.ndarray] = []  # the array to write into, from the caller (ingest gives a file's memory map)
    into = terms.take(scattered, empty=lambda n: given.append(np.full(n, -1, np.int32)) or given[0])
    assert into.ids is given[0] and into.ids.tolist() == sum((own[r] for r in scattered), [])


def test_terms_analysed_a_block_at_a_time_are_those_of_one_pass():
    analyzer = bm25.Analyzer(stemmer="english", split_identifiers=True)
    texts = [f"the parse_tree of HTTPServer {i} runs in region {i % 5}" for i in range(40)] + ["", "the"]
    whole = bm25.Terms.analyse(analyzer, texts, ["region", "zzz"])
    blocks = bm25.Terms.analyse(analyzer, texts, ["region", "zzz"], block=3)
    assert blocks.vocab[:2] == ["region", "zzz"] and sorted(blocks.vocab) == sorted(whole.vocab)
    np.testing.assert_array_equal(blocks.offsets, whole.offsets)
    assert [blocks.vocab[i] for i in blocks.ids] == [whole.vocab[i] for i in whole.ids]
    assert len(blocks.vocab) > 10 and blocks.offsets[-1] > 100


def test_terms_of_words_batched_in_any_order_are_those_analysed_at_once():
    """The transform stage hands the driver each batch's words; numbered there, a batch
    at a time in the order the batches come, they are the terms one pass of the analyser
    over the texts in row order gives: the same ids, offsets and vocabulary, after the
    old rows' vocabulary when there is one."""
    analyzer = bm25.Analyzer(stemmer="english", split_identifiers=True)
    texts = [f"the parse_tree of HTTPServer {i} in region {i % 5} word{i % 7} ünïcode" for i in range(40)]
    texts += ["", "the", "line one\nline two"]  # no terms (nothing, a stop-word), two lines
    order = np.random.default_rng(0).permutation(len(texts))
    for vocab in ([], ["region", "zzz"]):
        whole = bm25.Terms.analyse(analyzer, texts, vocab)
        words = bm25.TermsOfWords(len(texts))
        for lo in range(0, len(texts), 6):
            rows = order[lo:lo + 6]
            words.add(rows, analyzer.words([texts[i] for i in rows]))
        given: list[np.ndarray] = []
        terms = words.terms(vocab, empty=lambda n: given.append(np.zeros(n, np.int32)) or given[0], block=7)
        assert terms.vocab == whole.vocab and len(whole.vocab) > 20 and terms.ids is given[0]
        np.testing.assert_array_equal(terms.offsets, whole.offsets)
        np.testing.assert_array_equal(terms.ids, whole.ids)
    words = bm25.TermsOfWords(3)
    words.add(np.array([0, 2]), ["a b", ""])
    with pytest.raises(ValueError, match="given twice"):
        words.add(np.array([1, 2]), ["c", "d"])
    with pytest.raises(ValueError, match="words came for 2 of 3 rows"):
        words.terms()
    with pytest.raises(ValueError, match="2 word strings for 1 rows"):
        words.add(np.array([1]), ["c", "d"])


def test_compacted_terms_drop_the_vocabulary_no_document_holds_and_keep_the_rest():
    terms = bm25.Terms(np.array([3, 0, 3, 1], np.int32), np.array([0, 2, 4]), ["a", "b", "gone", "d"])
    compact = terms.compacted()
    assert compact.vocab == ["a", "b", "d"]
    assert [compact.vocab[i] for i in compact.ids] == [terms.vocab[i] for i in terms.ids]
    np.testing.assert_array_equal(compact.offsets, terms.offsets)
    assert compact.compacted() is compact  # every term held: no copy
    by_one = terms.compacted(block=1)  # the terms in use marked an occurrence at a time: the same
    assert by_one.vocab == compact.vocab and by_one.ids.tolist() == compact.ids.tolist()


_VOCAB_OF = """
from helix_ray.index.bm25 import Analyzer, Terms
texts = ["Kafka lag on the gateway; zeta alpha retries", "beta alpha gateway", "omega kafka", "delta"]
print(Terms.analyse(Analyzer(), texts, block=2).vocab)
"""


def test_terms_are_numbered_as_they_first_occur_whatever_the_hash_seed():
    """A generation's BM25 files are the same from run to run: the vocabulary follows
    the texts, not the order of a set (which changes with Python's hash seed)."""
    import os
    import subprocess
    import sys

    terms = bm25.Terms.analyse(bm25.Analyzer(stemmer=None), ["zeta alpha", "beta alpha", "gamma zeta"], block=2)
    assert terms.vocab == ["zeta", "alpha", "beta", "gamma"]
    runs = [subprocess.run([sys.executable, "-c", _VOCAB_OF], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")]
    assert runs[0] == runs[1] == runs[2] and "kafka" in runs[0]
