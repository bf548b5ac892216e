"""Loaders on tiny fictional fixtures (tests/fixtures/eval/), plus the real LoCoMo file if present."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from helix_ray.eval import (
    LOCOMO_CONVERSATIONS,
    LOCOMO_HELDOUT,
    LOCOMO_TUNE,
    EvalDoc,
    EvalQuery,
    EvalSet,
    load_beir,
    load_locomo,
    load_longmemeval,
    normalise_locomo_evidence,
    parse_locomo_datetime,
    parse_longmemeval_datetime,
)

from tests.helpers import LOCOMO

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "eval"
MINI_LOCOMO = FIXTURES / "mini_locomo.json"
MINI_BEIR = FIXTURES / "mini_beir"
MINI_LME = FIXTURES / "mini_longmemeval.json"
REAL_LOCOMO = LOCOMO  # under HELIX_DATA, when it is set (tests/helpers.py)


# --------------------------------------------------------------------------- helpers / records


def test_split_constants() -> None:
    assert len(LOCOMO_CONVERSATIONS) == 10
    assert LOCOMO_TUNE == ("conv-26", "conv-30", "conv-41", "conv-42", "conv-43")
    assert LOCOMO_HELDOUT == ("conv-44", "conv-47", "conv-48", "conv-49", "conv-50")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (["D1:3"], ["D1:3"]),
        (["D8:6; D9:17"], ["D8:6", "D9:17"]),
        (["D:11:26"], ["D11:26"]),
        (["D30:05"], ["D30:5"]),
        (["D9:1 D4:4  D4:6"], ["D9:1", "D4:4", "D4:6"]),
        (["D"], []),
        (["D1:3", "D1:03"], ["D1:3"]),
    ],
)
def test_normalise_locomo_evidence(raw: list[str], expected: list[str]) -> None:
    assert normalise_locomo_evidence(raw) == expected


def test_parse_dates() -> None:
    assert parse_locomo_datetime("1:56 pm on 8 May, 2023") == "2023-05-08T13:56:00Z"
    assert parse_locomo_datetime("12:05 am on 15 May, 2023") == "2023-05-15T00:05:00Z"
    assert parse_locomo_datetime("12:30 pm on 1 Dec, 2022") == "2022-12-01T12:30:00Z"
    assert parse_longmemeval_datetime("2023/05/20 (Sat) 02:21") == "2023-05-20T02:21:00Z"
    with pytest.raises(ValueError, match="expected the form"):
        parse_locomo_datetime("8 May 2023")
    with pytest.raises(ValueError, match="impossible"):
        parse_locomo_datetime("1:56 pm on 31 February, 2023")
    with pytest.raises(ValueError, match="expected the form"):
        parse_longmemeval_datetime("20-05-2023")


def test_records_are_frozen_and_gold_must_be_non_empty() -> None:
    doc = EvalDoc(id="d", text="t", created_at=None, session_id=None, speaker=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        doc.text = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="must exclude it"):
        EvalQuery(id="q", text="t", gold=frozenset(), category=None, corpus_id="c")
    with pytest.raises(ValueError, match="frozenset"):
        EvalQuery(id="q", text="t", gold={"d"}, category=None, corpus_id="c")  # type: ignore[arg-type]
    query = EvalQuery(id="q", text="t", gold=frozenset({"d"}), category=None, corpus_id="missing")
    with pytest.raises(ValueError, match="does not hold"):
        EvalSet(name="x", corpora={"c": [doc]}, queries=[query])


# --------------------------------------------------------------------------- LoCoMo


def test_locomo_mini_default_categories() -> None:
    evalset = load_locomo(MINI_LOCOMO)
    assert evalset.name == "locomo"
    assert list(evalset.corpora) == ["conv-x1", "conv-x2"]
    assert evalset.n_docs == 12
    gold = {q.id: set(q.gold) for q in evalset.queries}
    assert gold == {
        "conv-x1:q0": {"conv-x1:D1:3"},
        "conv-x1:q1": {"conv-x1:D1:2", "conv-x1:D2:1"},  # "D1:2; D2:1"
        "conv-x1:q2": {"conv-x1:D2:3"},  # "D:2:3"
        # q3 empty evidence -> excluded; q4 cat 5 -> excluded
        "conv-x1:q5": {"conv-x1:D2:1"},  # "D2:01" kept, "D2:9" (no such turn) dropped
        "conv-x2:q0": {"conv-x2:D1:1", "conv-x2:D1:3"},  # space-separated
        # q1 evidence "D" and q3 "D8:6; D9:17" resolve to nothing -> excluded
        "conv-x2:q2": {"conv-x2:D2:2"},
    }
    by_id = {q.id: q for q in evalset.queries}
    assert by_id["conv-x1:q1"].category == "1"
    assert by_id["conv-x1:q1"].corpus_id == "conv-x1"
    assert by_id["conv-x1:q1"].text == "What did Ben do before riding to the harbour?"
    # LoCoMo dates no question: each is asked at its conversation's last session.
    assert by_id["conv-x1:q1"].question_date == "2023-05-15T00:05:00Z"
    assert by_id["conv-x2:q0"].question_date == "2022-02-20T19:10:00Z"


def test_locomo_mini_documents() -> None:
    docs = {d.id: d for d in load_locomo(MINI_LOCOMO).corpora["conv-x1"]}
    assert list(docs)[:2] == ["conv-x1:D1:1", "conv-x1:D1:2"]
    image_turn = docs["conv-x1:D1:3"]
    assert image_turn.text == (
        "Ana: I adopted a grey cat called Pebble last week! [image: a photo of a grey cat on a windowsill]"
    )
    assert image_turn.speaker == "Ana"
    assert image_turn.session_id == "conv-x1:session_1"
    assert image_turn.created_at == "2023-05-08T13:56:00Z"
    plain = docs["conv-x1:D2:1"]
    assert plain.text == "Ben: Chain is fixed, I rode to the harbour yesterday."
    assert plain.created_at == "2023-05-15T00:05:00Z"  # 12:05 am
    assert plain.session_id == "conv-x1:session_2"


def test_locomo_mini_filters() -> None:
    all_cats = load_locomo(MINI_LOCOMO, categories=None)
    assert Counter(q.category for q in all_cats.queries) == {"1": 2, "2": 2, "4": 2, "5": 1}
    only_five = load_locomo(MINI_LOCOMO, categories=("5",))
    assert [q.id for q in only_five.queries] == ["conv-x1:q4"]
    one_conv = load_locomo(MINI_LOCOMO, conversations=["conv-x2"])
    assert list(one_conv.corpora) == ["conv-x2"]
    assert {q.corpus_id for q in one_conv.queries} == {"conv-x2"}


def test_locomo_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="locomo10.json"):
        load_locomo(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="directory"):
        load_locomo(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="Could not parse"):
        load_locomo(bad)
    bad.write_text(json.dumps({"sample_id": "conv-1"}))
    with pytest.raises(ValueError, match="JSON list of samples"):
        load_locomo(bad)
    with pytest.raises(ValueError, match="unknown conversations.*--conversations tune, heldout"):
        load_locomo(MINI_LOCOMO, conversations=["conv-26"])
    with pytest.raises(ValueError, match="Wrap a single one"):
        load_locomo(MINI_LOCOMO, conversations="conv-x1")
    with pytest.raises(ValueError, match="allowed LoCoMo categories"):
        load_locomo(MINI_LOCOMO, categories=(6,))
    with pytest.raises(ValueError, match="Wrap a single category"):
        load_locomo(MINI_LOCOMO, categories=4)  # type: ignore[arg-type]


@pytest.mark.skipif(not REAL_LOCOMO.is_file(), reason="set HELIX_DATA to the folder holding locomo/locomo10.json")
def test_real_locomo_counts() -> None:
    evalset = load_locomo(REAL_LOCOMO)
    assert list(evalset.corpora) == list(LOCOMO_CONVERSATIONS)
    assert evalset.n_docs == 5882
    # README: cats 1-4 = 1,540 questions, 1,536 with non-empty evidence, 1,534 fully resolvable;
    # two keep a partial gold set after dropping a non-existent turn id.
    assert len(evalset.queries) == 1536
    assert Counter(q.category for q in evalset.queries) == {"1": 282, "2": 321, "3": 92, "4": 841}
    docs = {d.id: d for d in evalset.corpora["conv-26"]}
    assert docs["conv-26:D1:1"].created_at == "2023-05-08T13:56:00Z"
    sessions = load_locomo(REAL_LOCOMO, granularity="session")
    assert sessions.n_docs == 272
    assert [(q.id, q.category) for q in sessions.queries] == [(q.id, q.category) for q in evalset.queries]
    assert {q.question_date for q in evalset.queries if q.corpus_id == "conv-26"} == {"2023-10-22T09:55:00Z"}
    tune = load_locomo(REAL_LOCOMO, conversations=LOCOMO_TUNE)
    heldout = load_locomo(REAL_LOCOMO, conversations=LOCOMO_HELDOUT)
    assert len(tune.queries) + len(heldout.queries) == 1536
    assert tune.n_docs + heldout.n_docs == 5882


# --------------------------------------------------------------------------- BEIR


def test_beir_mini() -> None:
    evalset = load_beir(MINI_BEIR)
    assert evalset.name == "mini_beir"
    assert list(evalset.corpora) == ["mini_beir"]
    docs = {d.id: d for d in evalset.corpora["mini_beir"]}
    assert len(docs) == 4  # blank line in corpus.jsonl skipped
    assert docs["d1"].text == "Tide pools\nTide pools hold small crabs and anemones at low tide."
    assert docs["d2"].text == "def add(a, b):\n    return a + b"  # empty title -> text only
    assert docs["d1"].created_at is None and docs["d1"].session_id is None
    # q2 only has score 0, q4 is not in the test split; d99 is not in the corpus
    assert {q.id: set(q.gold) for q in evalset.queries} == {"q3": {"d2"}, "q1": {"d1", "d3"}}
    assert all(q.corpus_id == "mini_beir" and q.category is None for q in evalset.queries)
    train = load_beir(MINI_BEIR, split="train")
    assert [(q.id, set(q.gold)) for q in train.queries] == [("q4", {"d4"})]


def test_beir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="No folder"):
        load_beir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="corpus.jsonl"):
        load_beir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"splits available .*\['test', 'train'\]"):
        load_beir(MINI_BEIR, split="dev")
    folder = tmp_path / "broken"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "title": "", "text": "x"}\n')
    (folder / "queries.jsonl").write_text('{"_id": "q1", "text": "x"}\n')
    (folder / "qrels" / "test.tsv").write_text("q1\td1\t1\n")
    with pytest.raises(ValueError, match="query-id<TAB>corpus-id<TAB>score"):
        load_beir(folder)
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n{broken\n')
    with pytest.raises(ValueError, match="line 2"):
        load_beir(folder)


# --------------------------------------------------------------------------- LongMemEval


def test_longmemeval_mini_sessions() -> None:
    evalset = load_longmemeval(MINI_LME)
    assert evalset.name == "mini_longmemeval"
    assert [q.id for q in evalset.queries] == ["lm-q1", "lm-q3"]  # lm-q2_abs excluded
    assert list(evalset.corpora) == ["lm-q1", "lm-q3"]
    q1, q3 = evalset.queries
    assert q1.gold == frozenset({"answer_s-102"})
    assert q1.category == "single-session-user"
    assert q1.corpus_id == "lm-q1"
    assert q1.question_date == "2023-06-01T18:45:00Z"
    assert q3.gold == frozenset({"answer_s-301", "answer_s-303"})  # answer_s-999 not in haystack
    docs = evalset.corpora["lm-q1"]
    assert [d.id for d in docs] == ["s-101", "answer_s-102", "s-103"]
    assert docs[1].text == (
        "user: I painted the garden shed teal this weekend.\nassistant: Teal is a cheerful choice."
    )
    assert docs[0].created_at == "2023-05-20T02:21:00Z"
    assert docs[1].session_id == "answer_s-102"


def test_longmemeval_mini_turns() -> None:
    evalset = load_longmemeval(MINI_LME, granularity="turn")
    q1, q3 = evalset.queries
    assert q1.gold == frozenset({"answer_s-102:1"})
    assert q3.gold == frozenset({"answer_s-301:1", "answer_s-303:3"})
    docs = {d.id: d for d in evalset.corpora["lm-q3"]}
    assert len(docs) == 7
    assert docs["answer_s-303:3"].text == "user: Also, my old violin needs new strings."
    assert docs["answer_s-303:3"].speaker == "user"
    assert docs["answer_s-303:3"].session_id == "answer_s-303"
    assert docs["answer_s-303:3"].created_at == "2023-12-03T12:15:00Z"


def test_longmemeval_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="granularity"):
        load_longmemeval(MINI_LME, granularity="round")
    with pytest.raises(FileNotFoundError, match="LongMemEval"):
        load_longmemeval(tmp_path / "longmemeval_s.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"question_id": "q"}))
    with pytest.raises(ValueError, match="JSON list of questions"):
        load_longmemeval(bad)
    item = json.loads(MINI_LME.read_text())[0]
    item["haystack_dates"] = item["haystack_dates"][:1]
    bad.write_text(json.dumps([item]))
    with pytest.raises(ValueError, match="parallel"):
        load_longmemeval(bad)
    del item["answer_session_ids"]
    bad.write_text(json.dumps([item]))
    with pytest.raises(ValueError, match="answer_session_ids"):
        load_longmemeval(bad)
