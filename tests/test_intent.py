"""The intent reader (recall/intent.py): which questions ask for code, which for its
history, which for neither; and what each favours, on hand-made pools."""

from __future__ import annotations

import pytest

from helix_ray.recall import intent


@pytest.mark.parametrize("query", [
    "Why is the HAProxy ingress opt-in instead of the default for helix serve?",
    "why doesn't ingest restart an embedding actor that dies",
    "What was the reason for pinning uvicorn?",
    "Which commit added the Retry-After header?",
    "when did we switch the tokenizer?",
    "what changed in compaction last week",
    "Why does parse_query() lower-case its input?",  # a reason, though it names code
])
def test_questions_asking_why_or_what_changed_ask_for_history(query):
    assert intent.read(query) == "history"


@pytest.mark.parametrize("query", [
    "where are API keys checked?",
    "Where does recall walk the memory graph from the top candidates?",
    "Which function splits a long document into chunks?",
    "What calls publish() when an ingest writes a new generation?",
    "How does a chat turn's vector borrow from the previous turn?",
    "Which class holds the delta's rows?",
    "What retries a failed write to the delta?",  # a verb and its object: what does it
    "what happens when a replica dies in the middle of a recall",
])
def test_questions_asking_where_or_how_or_naming_code_ask_for_code(query):
    assert intent.read(query) == "code"


@pytest.mark.parametrize("query", [
    "What did Caroline research?",
    "the user's favourite colour",
    "Melanie's kids, e.g. their names",
    "Dr. Smith said the scan was clear.",
    "what does services/gateway/auth.py check",  # names code; a note about the file answers as well
    "how do I rotate the API keys",  # asks for steps
    "What books does Melanie read?",  # a plural noun, then a verb
    "What has the team decided about the launch?",
    "",
])
def test_other_questions_ask_for_neither(query):
    assert intent.read(query) is None


@pytest.mark.parametrize("query, tests", [
    ("which test covers the API key check?", True),
    ("Where are the compaction tests?", True),
    ("what asserts that a deleted memory stays deleted", True),
    ("where are API keys checked?", False),
    ("Which function splits a long document into chunks?", False),
])
def test_a_question_for_code_favours_tests_only_when_it_asks_for_them(query, tests):
    types = ["code", "code", "decision", "semantic"]
    ids = ["code:ann/shop:auth.py::check_key", "code:ann/shop:tests/test_auth.py::test_check_key#chunk1",
           "git:ann/shop:0123456789ab", "note-1"]
    assert intent.asks_for_tests(query) is tests
    assert intent.favoured("code", query, types, ids).tolist() == [not tests, tests, False, False]
    assert intent.favoured("history", query, types, ids).tolist() == [False, False, True, True]
