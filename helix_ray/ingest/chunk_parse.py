"""Cut a text into atoms, the smallest units :mod:`helix_ray.ingest.chunk` may cut
between (sentences, lines, a heading line), each with the strength of the boundary before
it and the Markdown heading path it sits under; and tell which kind of text it is.

Each kind has its own parser; the boundaries they mark, strongest first:

====================  ==========================================================
Markdown              heading (``#`` before ``##`` …), block (paragraph, fenced
                      code, list, table), list item, line, sentence, line wrap
chat transcript       turn (``Name: …``, ``[date] Name: …``), paragraph, sentence
code                  blank line before a top-level line, top-level ``def``/
                      ``class``/dedent, blank line, nested ``def``, line
text                  paragraph, sentence, line wrap
====================  ==========================================================

A sentence ending in ":" is kept with the fence, list or table it introduces, a heading
line with what follows it, a decorator or comment with the code it heads. Markdown
headings are ATX (``## Title``, not underlined); lines end at ``\\n`` (``\\r\\n`` too).
No atom is whitespace only, so a text of whitespace only has none.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

__all__ = ["TITLE_CHARS", "Atoms", "detect_kind", "heading_title", "lead_title", "parse"]

# Boundary strengths, weakest first; a heading of level h is 20 - h (``#`` 19, ``######`` 14).
GLUE = 0  # after a heading line, inside a fence's first/last line, after a decorator
HARD = 1  # between the token-cut pieces of one over-long atom (cut by the chunker, not here)
WRAP = 3  # a line break inside a sentence
SENTENCE = 5
LINE = 6
SUBBLOCK = 7  # a blank line inside a fence or list item, a nested list item
ITEM = 8  # a list item; a nested def in code
LEAD_IN = 9  # before "Run this:" when a fence, list or table follows it
BLOCK = 10  # a blank line between blocks
STATEMENT = 11  # a top-level def/class or dedent to column 0 in code
TOP = 12  # a chat turn; a blank line before a top-level line in code

_HEADING = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
_FENCE_OPEN = re.compile(r"[ \t]*(`{3,}|~{3,})(.*)$")
_ITEM = re.compile(r"[ \t]*(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_TABLE_ROW = re.compile(r"[ \t]*\|")
_TABLE_RULE = re.compile(r"[ \t|:\-]+$")
_TURN = re.compile(
    r"(?:\[[^\]\n]{1,40}\][ \t]*)?"  # [2024-05-01 10:02]
    r"(?:\d{1,2}:\d{2}(?::\d{2})?(?:[ \t]*[AaPp][Mm])?[ \t]*-?[ \t]*)?"  # 10:02 -
    r"(\w[\w .'’()@-]{0,39}?)[ \t]*:[ \t]+\S"  # Name: text
)
_DEF = re.compile(
    r"(?:async[ \t]+)?def[ \t]|class[ \t]|(?:export[ \t]+)?(?:default[ \t]+)?(?:async[ \t]+)?function\b"
    r"|func[ \t]|fn[ \t]|pub(?:\([\w ]*\))?[ \t]|impl\b|struct[ \t]|enum[ \t]|interface[ \t]|trait[ \t]"
    r"|(?:public|private|protected|static|internal|override)[ \t]"
)
_CODE_LINE = re.compile(
    r"(?:import|from[ \t]+\S+[ \t]+import|return|if|elif|else|for|while|try|except|finally|with|raise|yield"
    r"|const|let|var|package|using|namespace|#include|#define|switch|case|throw|await|@\w)\b"
)
_COMMENT = ("#", "//", "/*", "*", "--", ";")
_SENT_END = re.compile(r"(?:[.!?]+|…)[\"'”’»)\]*_`]*(?=\s)|[。！？]+[」』”’)）]*")
_ENDS_SENTENCE = re.compile(r"[.!?…:;。！？][\"'”’»)\]*_`」』）]*$")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e", "cf", "fig", "no",
                            "etc"})


def parse(text: str, kind: str) -> Atoms:
    """The atoms of ``text`` read as ``kind``: ``"markdown"``, ``"chat"``, ``"code"`` or
    ``"text"``."""
    atoms = Atoms(text)
    _PARSERS[kind](atoms)
    return atoms


def detect_kind(text: str) -> str:
    """``"chat"`` when most lines open a turn (``Name: …``, ``[date] Name: …``) of a few
    speakers who take turns; ``"markdown"`` for a fenced code block; ``"code"`` when most
    lines are indented or read as code (``def``, ``import``, braces, ``;``);
    ``"markdown"`` for a heading, two list items or a table; else ``"text"``. A script
    (``#!``) is code whatever its comments look like."""
    lines = [line for line in text.split("\n", 4000)[:4000] if line.strip()]
    if _is_chat(lines):
        return "chat"
    if any(_fence_mark(line) for line in lines):
        return "markdown"
    if text.startswith("#!") or _is_code(lines):
        return "code"
    items = sum(1 for line in lines if _ITEM.match(line))
    if items >= 2 or any(_HEADING.match(line) for line in lines) or sum(1 for line in lines
                                                                         if _TABLE_ROW.match(line)) >= 2:
        return "markdown"
    return "text"


def heading_title(line: str) -> str | None:
    """The title of a Markdown heading ``line`` (``""`` for a bare ``#``); None for any
    other line."""
    heading = _HEADING.match(line)
    return None if heading is None else _title(heading)


#: The longest first line :func:`lead_title` takes for a title.
TITLE_CHARS = 160


def lead_title(text: str) -> str | None:
    """``text``'s first line when it reads as the title of what follows (a paper's title
    over its abstract, a note's or a commit's subject over its body): at most twice
    :data:`TITLE_CHARS` long, with more text after it, and neither a Markdown heading (the
    heading path names those), a chat turn, nor the first line of a hard-wrapped
    paragraph (it stops mid-sentence and the next line goes on in lower case). Prose and
    Markdown only: a chat transcript's date line heads only the first part of a long
    transcript, often one session of several, and a long function's later chunks keep
    its names in their code. Cut to :data:`TITLE_CHARS` characters; None when it is no
    title."""
    first, _, rest = text.lstrip().partition("\n")
    first = first.strip()
    after = rest.strip()
    if not first or not after or len(first) > 2 * TITLE_CHARS:
        return None
    if _HEADING.match(first) or _speaker(first) is not None or detect_kind(text) not in ("text", "markdown"):
        return None
    if (first[-1].isalnum() or first[-1] in ",;(") and after[0].islower():
        return None
    return first if len(first) <= TITLE_CHARS else first[:TITLE_CHARS - 1].rstrip() + "…"


# --------------------------------------------------------------------------- detection and line tests


def _speaker(line: str) -> str | None:
    m = _TURN.match(line)
    if not m or len(m.group(1).split()) > 4 or _DEF.match(m.group(1)) or _CODE_LINE.match(m.group(1)):
        return None
    return m.group(1).strip().casefold()


def _is_chat(lines: list[str]) -> bool:
    speakers = [s for s in map(_speaker, lines) if s is not None]
    distinct = len(set(speakers))
    return len(speakers) >= 2 and 2 * len(speakers) >= len(lines) and distinct <= max(2, len(speakers) // 2)


def _is_code(lines: list[str]) -> bool:
    """Whether most lines that are not comments or list items (nor lines indented under
    one) are indented or read as code."""
    code = prose = 0
    in_list = False
    for line in lines:
        stripped = line.strip()
        in_list = bool(_ITEM.match(line)) or (in_list and line[0] in " \t")
        if in_list or stripped.startswith(_COMMENT):
            continue
        if line[0] in " \t" or _DEF.match(stripped) or _CODE_LINE.match(stripped) \
                or stripped.endswith(("{", "}", ";", ")", "):", "]", "=>", "\\")):
            code += 1
        else:
            prose += 1
    return code >= 3 and code >= 1.5 * prose


def _fence_mark(line: str) -> str | None:
    """The fence (a run of three or more backticks or tildes) a line opens a code block with."""
    m = _FENCE_OPEN.match(line)
    if m is None or (m.group(1)[0] == "`" and "`" in m.group(2)):
        return None
    return m.group(1)


def _closes(stripped: str, mark: str) -> bool:
    return stripped.startswith(mark) and not stripped.strip(mark[0])


def _title(heading: re.Match[str]) -> str:
    return re.sub(r"(?:^|[ \t]+)#+$", "", heading.group(2) or "").strip()


# --------------------------------------------------------------------------- atoms


def fenced_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each fenced code block of Markdown ``text``, from its opening
    fence to the end of its closing one (an unclosed fence runs to the end): a ``#``
    line inside one is code (a shell comment), not a heading."""
    spans, opened = [], None
    for a, b in _lines(text):
        line = text[a:b]
        if opened is None:
            mark = _fence_mark(line)
            if mark:
                opened = (a, mark)
        elif _closes(line.strip(), opened[1]):
            spans.append((opened[0], b))
            opened = None
    if opened is not None:
        spans.append((opened[0], len(text)))
    return spans


def _lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of each line's content, without its ``\\n`` or ``\\r\\n``."""
    out = []
    pos, n = 0, len(text)
    while pos < n:
        nl = text.find("\n", pos)
        end = n if nl < 0 else nl
        out.append((pos, end - 1 if end > pos and text[end - 1] == "\r" else end))
        pos = end + 1
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t")) if "\t" not in line else len(line.expandtabs(4)) - len(
        line.expandtabs(4).lstrip(" "))


class Atoms:
    """The atoms of one text, with the strength of the boundary before each and the
    heading path each sits under; the parsers below fill it line by line."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.strengths: list[int] = []
        self.paths: list[tuple[str, ...]] = []
        self.headings: list[bool] = []
        self.fenced: list[bool] = []  # inside a fenced code block, after its opening line
        self.path: tuple[str, ...] = ()
        self.pending: int | None = None  # the strength a block's first atom takes
        self.ended_sentence = False
        self.ended_colon = False

    def start_block(self, strength: int) -> None:
        self.pending = strength

    def block_strength(self, lead_in: bool = False) -> int:
        """The strength before a block. A fence, list or table (``lead_in``) right after
        a sentence ending in ":" takes that sentence along: the cut moves before it."""
        if not (lead_in and self.ended_colon):
            return BLOCK
        if self.strengths[-1] != GLUE:
            self.strengths[-1] = max(self.strengths[-1], LEAD_IN)
        return ITEM  # weaker than the cut before the sentence, stronger than any inside the block

    def add(self, a: int, b: int, strength: int, *, keep_indent: bool = False, heading: bool = False,
            fenced: bool = False) -> None:
        text = self.text
        while b > a and text[b - 1].isspace():
            b -= 1
        if not keep_indent:
            while a < b and text[a].isspace():
                a += 1
        if a >= b:
            return
        if self.pending is not None:
            strength, self.pending = self.pending, None
        if self.headings and self.headings[-1]:
            strength = GLUE  # a heading line stays with what follows it
        self.starts.append(a)
        self.ends.append(b)
        self.strengths.append(strength)
        self.paths.append(self.path)
        self.headings.append(heading)
        self.fenced.append(fenced)
        self.ended_colon = False

    def prose_line(self, a: int, b: int, strength: int) -> None:
        """A line of prose, cut after each sentence; ``strength`` WRAP means the line
        continues a paragraph (a sentence boundary if the line before ended one)."""
        text = self.text
        if strength == WRAP and self.ended_sentence:
            strength = SENTENCE
        cut = a
        for m in _SENT_END.finditer(text, a, b):
            nxt = m.end()
            while nxt < b and text[nxt].isspace():
                nxt += 1
            if nxt >= b:
                break
            if m.group()[0] in ".!?…" and not _sentence_ends(text, m.start(), nxt, cut):
                continue
            self.add(cut, m.end(), strength)
            strength, cut = SENTENCE, nxt
        self.add(cut, b, strength)
        tail = text[max(a, b - 8):b].rstrip()
        self.ended_sentence = bool(_ENDS_SENTENCE.search(tail))
        self.ended_colon = tail.endswith(":")

    def code_line(self, a: int, b: int, strength: int, *, fenced: bool = False) -> None:
        self.add(a, b, strength, keep_indent=True, fenced=fenced)


def _sentence_ends(text: str, dot: int, nxt: int, floor: int) -> bool:
    """Whether the ``.!?`` at ``dot`` ends a sentence, the next one starting at ``nxt``:
    not before a lower-case word, and not after a known abbreviation or an initial."""
    if text[nxt].islower():
        return False
    if text[dot] != ".":
        return True
    word = text[max(floor, dot - 5):dot].rsplit(None, 1)[-1:] or [""]
    w = word[0].lstrip("(\"'").casefold()
    return not (w in _ABBREVIATIONS or (len(w) == 1 and w.isalpha()))


def _parse_markdown(atoms: Atoms) -> None:
    text = atoms.text
    lines = _lines(text)
    stack: list[tuple[int, str]] = []
    i, n = 0, len(lines)
    while i < n:
        a, b = lines[i]
        line = text[a:b]
        if not line.strip():
            i += 1
            continue
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            while stack and stack[-1][0] >= level:
                stack.pop()
            stack.append((level, _title(heading)))
            atoms.path = tuple(title for _, title in stack if title)
            atoms.start_block(20 - level)
            atoms.add(a, b, GLUE, heading=True)
            i += 1
        elif _fence_mark(line):
            atoms.start_block(atoms.block_strength(lead_in=True))
            i = _fence(atoms, lines, i)
        elif _ITEM.match(line):
            atoms.start_block(atoms.block_strength(lead_in=True))
            i = _list(atoms, lines, i)
        elif _TABLE_ROW.match(line):
            atoms.start_block(atoms.block_strength(lead_in=True))
            while i < n and _TABLE_ROW.match(text[lines[i][0]:lines[i][1]]):
                row = text[lines[i][0]:lines[i][1]]
                atoms.code_line(*lines[i], GLUE if _TABLE_RULE.match(row) else LINE)
                i += 1
        elif _indent(line) >= 4:  # an indented code block
            atoms.start_block(BLOCK)
            while i < n and (_indent(text[lines[i][0]:lines[i][1]]) >= 4 or not text[lines[i][0]:lines[i][1]].strip()):
                atoms.code_line(*lines[i], LINE)
                i += 1
        else:
            atoms.start_block(BLOCK)
            first = i
            while i < n:
                line = text[lines[i][0]:lines[i][1]]
                if not line.strip() or (i > first and (_HEADING.match(line) or _fence_mark(line)
                                                        or _ITEM.match(line))):
                    break
                atoms.prose_line(*lines[i], WRAP)
                i += 1


def _fence(atoms: Atoms, lines: list[tuple[int, int]], i: int) -> int:
    """A fenced code block from line ``i``: its lines as atoms, the fences glued to the
    first and last; an unclosed fence runs to the end. Returns the line after it."""
    text = atoms.text
    mark = _fence_mark(text[lines[i][0]:lines[i][1]]) or "```"
    atoms.code_line(*lines[i], GLUE)
    strength, i = GLUE, i + 1
    while i < len(lines):
        a, b = lines[i]
        stripped = text[a:b].strip()
        i += 1
        if _closes(stripped, mark):
            atoms.code_line(a, b, GLUE, fenced=True)
            break
        if not stripped:
            strength = SUBBLOCK if strength == LINE else strength
            continue
        atoms.code_line(a, b, strength, fenced=True)
        strength = LINE
    return i


def _list(atoms: Atoms, lines: list[tuple[int, int]], i: int) -> int:
    """A list from line ``i``: items, their continuation lines and the blank lines and
    fences inside them, up to the first line that is none of these. Returns the line after it."""
    text = atoms.text
    n = len(lines)
    base = _indent(text[lines[i][0]:lines[i][1]])
    gap = False
    fence: str | None = None
    fence_line = -1
    first = i
    while i < n:
        a, b = lines[i]
        line = text[a:b]
        stripped = line.strip()
        if not stripped:
            k = i + 1
            while k < n and not text[lines[k][0]:lines[k][1]].strip():
                k += 1
            if k >= n:
                break
            following = text[lines[k][0]:lines[k][1]]
            if fence is None and not _ITEM.match(following) and _indent(following) <= base:
                break
            gap, i = True, k
            continue
        indent = _indent(line)
        opening = _fence_mark(line)
        if fence is not None:
            closes = _closes(stripped, fence)
            atoms.code_line(a, b, GLUE if closes or fence_line == i - 1 else SUBBLOCK if gap else LINE, fenced=True)
            fence = None if closes else fence
        elif i > first and indent <= base and (_HEADING.match(line) or opening):
            break
        elif opening:
            atoms.code_line(a, b, SUBBLOCK)
            fence, fence_line = opening, i
        elif _ITEM.match(line):
            atoms.prose_line(a, b, ITEM if indent <= base else SUBBLOCK)
        elif indent > base or not gap:
            atoms.prose_line(a, b, SUBBLOCK if gap else WRAP)
        else:
            break
        gap = False
        i += 1
    return i


def _parse_prose(atoms: Atoms, *, turns: bool = False) -> None:
    """Plain text, or with ``turns`` a chat transcript: paragraphs, turns, sentences."""
    text, gap = atoms.text, True
    for a, b in _lines(text):
        line = text[a:b]
        if not line.strip():
            gap = True
            continue
        if turns and _speaker(line) is not None:
            atoms.prose_line(a, b, TOP)
        else:
            atoms.prose_line(a, b, BLOCK if gap else LINE if not turns and _ITEM.match(line) else WRAP)
        gap = False


def _parse_code(atoms: Atoms) -> None:
    text = atoms.text
    gap, first, prev_indent, prev_lead = False, True, 0, False
    for a, b in _lines(text):
        line = text[a:b]
        stripped = line.strip()
        if not stripped:
            gap = True
            continue
        indent = _indent(line)
        is_def = bool(_DEF.match(stripped))
        if first:
            strength = BLOCK
        elif stripped[0] in ")]}":
            strength = WRAP  # a closing bracket stays with what it closes
        elif prev_lead:
            strength = LINE if gap else WRAP  # a decorator or comment stays with what it heads
        elif indent == 0 and (gap or is_def or prev_indent > 0):
            strength = TOP if gap else STATEMENT
        elif gap:
            strength = BLOCK
        else:
            strength = ITEM if is_def else LINE
        atoms.code_line(a, b, strength)
        prev_indent = indent
        prev_lead = stripped.startswith(("@", *_COMMENT)) and not stripped.startswith("*/")
        gap = first = False


_PARSERS: dict[str, Callable[[Atoms], None]] = {
    "markdown": _parse_markdown, "chat": functools.partial(_parse_prose, turns=True), "code": _parse_code,
    "text": _parse_prose}

