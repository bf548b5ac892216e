"""What a question about a code base asks for: the code, or why the code is as it is.

Where a user's memories mix code (functions, classes) with its history (commits, decisions),
one question wants one kind: "where are API keys checked?" asks for the function that
checks them, not the commit titled "Check API keys on every request"; "why is HAProxy
opt-in?" asks for the commit or decision that says why. Both kinds match such a question's
words alike, and each type's weight row ranks them by their own evidence, so the words
alone do not separate them. :func:`read` reads the question by rules (no model), as
:mod:`helix_ray.when` reads time:

* **history**: a question asking for a reason ("why…", "what was the reason / rationale
  for…") or for a change ("what changed…", "which commit…", "when did we…", "who
  added…");
* **code**: otherwise, a question asking for a place or a mechanism ("where is/are/does…",
  "which function/class/module…", "what calls…", "how does/is…", "what happens when…"),
  or for what does a thing: "what" with a verb and its object ("what merges the hits",
  "what stops a recall"; a plural noun is followed by a verb instead: "what tools does").

What a question *names* does not count: "what does services/gateway/auth.py check" is as
often answered by a note about that file as by its code, and "how do I rotate the keys?"
asks for steps, not for code.

A question for code asks for the code that does something, not for its tests, unless
it speaks of tests ("which test covers…", "is X tested?"): code read from a test file
(:func:`helix_ray.schema.is_test_code`) is favoured only then, and other code only
otherwise.

The ranking multiplies the scores of the memories the intent favours
(:data:`FAVOURS`: code, or every other type) by ``1 + rank.intent_boost``, and only in a
candidate pool holding code: in memories without code these words ask about something
else ("where did we eat?").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from helix_ray.schema import MEMORY_TYPES, is_test_code

Intent = Literal["code", "history"]

#: The memory types each intent favours: code, or everything but code. A reason is stated
#: in a commit or a decision, but as often in a note the type rules call ``semantic``
#: ("we pinned uvicorn after the keep-alive bug"): the boost separates code from what was
#: said about it, not one kind of statement from another.
FAVOURS: dict[str, frozenset[str]] = {"code": frozenset({"code"}),
                                      "history": frozenset(MEMORY_TYPES) - {"code"}}

_HISTORY = re.compile(
    r"\bwhy\b|\b(?:what|which) (?:was|were|is|are) the (?:reason|rationale|motivation)s?\b"
    r"|\b(?:reason|rationale|motivation)s? (?:for|behind|why)\b|\bwhat changed\b"
    r"|\bwhich (?:commit|change|pull request|pr)\b|\bwhen (?:did|was|were) (?:we|they|you|i|it)\b"
    r"|\bwho (?:added|changed|removed|wrote|introduced|decided)\b",
    re.I,
)
_CODE_WORDS = re.compile(
    r"\bwhere (?:is|are|do|does|can|should|in the code)\b"
    r"|\b(?:which|what) (?:function|method|class|module|file|code|test|part of the code|line)s?\b"
    r"|\bwhat (?:calls|invokes|imports|raises)\b|\b(?:callers?|call sites?) of\b"
    r"|\bwhat (?!(?:is|was|does|has)\b)[a-z]+s (?:a|an|the|each|every|all|any|its|their|this|these)\b"
    r"|\bwhat happens (?:when|if|to|after|before)\b"
    r"|\bhow (?:is|are|does)\b|\b(?:implemented|implementation of|defined)\b",
    re.I,
)


def read(query: str) -> Intent | None:
    """The intent of ``query``: "history", "code", or None when it names neither."""
    if _HISTORY.search(query):
        return "history"
    if _CODE_WORDS.search(query):
        return "code"
    return None


_TESTS = re.compile(r"\btest(?:s|ed|ing)?\b|\bcover(?:s|ed|age)?\b|\bassert(?:s|ed|ion)?\b", re.I)


def asks_for_tests(query: str) -> bool:
    """Whether a question for code is about tests ("which test covers…", "is … tested?")."""
    return bool(_TESTS.search(query))


def favoured(intent: Intent, query: str, types: Sequence[str] | np.ndarray, ids: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Per candidate (its type and id), whether ``intent`` favours it: :data:`FAVOURS`'
    types, and for a question for code, code of test files only when the question is
    about tests and other code only when it is not."""
    out = np.isin(np.asarray(types), sorted(FAVOURS[intent]))
    if intent == "code":
        tests = asks_for_tests(query)
        for i in np.flatnonzero(out).tolist():
            out[i] = is_test_code(str(ids[i])) == tests
    return out
