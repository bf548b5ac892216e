"""Stage 7a: entities without an LLM.

Kinds: ``path`` (``services/ingest/worker.py``), ``url``, ``error`` (``OperationalError``,
``exit code 137``), ``identifier`` (``snake_case``, ``CamelCase``, ``dotted.names``,
``UPPER_ENV_VARS``), ``name`` (capitalised words that do not start a sentence, runs of
them joined: "Grafana Cloud"), ``date`` (ISO dates, "8 May 2023", "March 3").

An entity's key is ``kind:normalised text`` (lower case); the graph links memories that
mention the same key within one tenant.

Code and commits name more than their text shows (:func:`from_metadata`): a code memory
is linked to its file (``path``), to the symbol it defines and to the names it calls
(``identifier``), a commit to every file it touched. So a commit and the functions of
the files it changed share an entity node, and so do a function and the functions it
calls: graph expansion carries a question from one to the other.
"""

from __future__ import annotations

import json
import re

_URL = re.compile(r"https?://[^\s)>\]\"'`]+")
_PATH = re.compile(r"(?<![\w/])(?:\.{0,2}/)?(?:[\w.-]+/)+[\w.-]+(?:\.[A-Za-z0-9]{1,8})?|\b[\w-]+\.(?:py|go|rs|ts|tsx|js|java|rb|yaml|yml|toml|json|sql|sh|ini|cfg|proto|md)\b")
_ERROR = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Warning)\b|\bexit code \d+\b|\bE\d{3,5}\b|\bHTTP \d{3}\b")
_IDENT = re.compile(
    r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b"  # snake_case
    r"|\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+\b"  # CamelCase
    r"|\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?=\(|\b)"  # dotted.name
    r"|\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b"  # ENV_VAR
)
_ACRONYM = re.compile(r"\b[A-Z][A-Z0-9]{2,9}s?\b")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_DATE = re.compile(
    rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}} (?:{_MONTHS}),? \d{{4}}\b|\b(?:{_MONTHS}) \d{{1,2}}(?:, \d{{4}})?\b"
)
_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]+(?:\s+[A-Z][a-z]+)*\b")
_STOP_NAMES = frozenset(
    "I The A An We It This That These Those They He She You My Our Your His Her Their If When Then "
    "But And Or So Also After Before Yes No Not Hey Hi Thanks Thank Oh Wow Well Sure Okay Ok Great "
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday Today Yesterday Tomorrow".split()
    + _MONTHS.split("|")
)


def from_metadata(metadata: str | dict | None, text: str = "") -> list[str]:
    """The entity keys that a code memory's or a commit's metadata names (JSON text or a
    dict; any other memory: none): ``metadata.code`` gives its ``path``, its symbol (the
    short name and the dotted one) and the ``names`` it refers to; ``metadata.git`` the
    ``files`` it touched, and the last part of each dotted name its message mentions
    (``errors.callers_mistake`` → the function ``callers_mistake``)."""
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            return []
    if not isinstance(metadata, dict):
        return []
    found: dict[str, None] = {}
    code, git = metadata.get("code"), metadata.get("git")
    if isinstance(code, dict):
        if code.get("path"):
            found[f"path:{str(code['path']).lower()}"] = None
        symbol = str(code.get("symbol") or "")
        if symbol and not symbol.startswith("<"):
            found[f"identifier:{symbol.rsplit('.', 1)[-1].lower()}"] = None
            if code.get("module"):
                found[f"identifier:{code['module']}.{symbol}".lower()] = None
        for name in code.get("names") or ():
            found[f"identifier:{str(name).lower()}"] = None
    if isinstance(git, dict):
        for path in git.get("files") or ():
            found[f"path:{str(path).lower()}"] = None
        for m in _DOTTED.finditer(text):
            last = m.group(0).rsplit(".", 1)[-1].lower()
            if len(last) >= 3 and last not in _SUFFIXES:  # keys.py names a file, not a function py
                found[f"identifier:{last}"] = None
    return list(found)


_DOTTED = re.compile(r"(?<![/\w])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b")
_SUFFIXES = frozenset("py pyi md js jsx ts tsx go rs java rb json yaml yml toml sh txt cfg ini sql html css lock "
                      "ipynb whl gz zip".split())


def extract(text: str) -> list[str]:
    """Entity keys mentioned in ``text``, in first-seen order, without repeats."""
    found: dict[str, None] = {}

    def add(kind: str, value: str) -> None:
        value = value.strip(".,;:`'\"()[]")
        if len(value) >= 2:
            found.setdefault(f"{kind}:{value.lower()}", None)

    for m in _URL.finditer(text):
        add("url", m.group(0))
    scrubbed = _URL.sub(" ", text)
    for m in _PATH.finditer(scrubbed):
        if "/" in m.group(0) or "." in m.group(0):
            add("path", m.group(0))
    for m in _ERROR.finditer(scrubbed):
        add("error", m.group(0))
    for m in _DATE.finditer(scrubbed):
        add("date", m.group(0))
    for m in _IDENT.finditer(scrubbed):
        if f"path:{m.group(0).lower()}" not in found:
            add("identifier", m.group(0))
    for m in _ACRONYM.finditer(scrubbed):
        add("name", m.group(0))
    for m in _NAME.finditer(scrubbed):
        words = [w for w in m.group(0).split() if w not in _STOP_NAMES]
        if words:
            add("name", " ".join(words))
    return list(found)
