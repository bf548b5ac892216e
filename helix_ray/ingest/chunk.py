"""Split a long text into token-counted chunks along its structure.

:func:`split` is pure and deterministic: text in, :class:`Chunk` list out. A text of at
most ``max_tokens`` tokens is one chunk equal to the whole text (the empty string too).
A longer one is cut into atoms (the smallest units a cut may fall between: sentences,
lines, a heading line, pieces of an over-long sentence), each boundary between two atoms
ranked by the structure it marks (a heading over a block over a sentence over a line
wrap; :mod:`helix_ray.ingest.chunk_parse` parses Markdown, chat transcripts, code and
plain text into atoms, and tells which one a text is).

A range of atoms over the budget (``max_tokens - overlap_tokens``) is cut at its
strongest boundaries; the pieces that fit are packed greedily, consecutive ones together
up to the budget, and a piece still too long is cut the same way one strength down. So
a fenced block, a list or a turn that fits the budget is never cut, and a cut falls
between sentences wherever one does. A sentence ending in ":" stays with the fence, list
or table it introduces, and a heading with what follows it. A sentence or line longer
than the budget is cut by tokens, at a space where one is near (a base64 blob chunks
too). So that chunks are not stubs, the last two of a run are evened out and a piece
under a quarter of the budget joins a neighbour it fits with (never the end of another
section, whose heading the chunk would lose).

Each chunk after the first starts with up to ``overlap_tokens`` tokens repeated from the
end of the one before: whole sentences or lines where they fit, else whole words; none
before a Markdown heading (a section starts clean) nor out of a fenced block. Every
chunk's text is counted exactly: none is over ``max_tokens``, overlap included.

Counting: a token is at least one UTF-8 byte, so a text of at most ``max_tokens`` bytes
is one chunk uncounted (English prose runs four to five characters a token, so at the
default 256 that is most memories of up to about 50 tokens); any other text is counted
once whole, which estimates every candidate chunk, and each chunk once more, exactly.

A longer text of whitespace only gives one empty chunk: :func:`split` never returns an
empty list.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from helix_ray import tokens
from helix_ray.ingest.chunk_parse import HARD, SENTENCE, TITLE_CHARS, Atoms, detect_kind, heading_title, lead_title, parse

__all__ = ["KINDS", "Chunk", "detect_kind", "encoder_text", "lead_title", "split"]

KINDS = ("auto", "markdown", "chat", "code", "text")
MIN_MAX_TOKENS = 16
"""The smallest ``max_tokens``: a hard cut needs room for any one character (at most
four tokens, one per UTF-8 byte) after the overlap is reserved."""

_SPACE = re.compile(r"\s")


@dataclass(frozen=True)
class Chunk:
    """One piece of a split text.

    ``text`` is ``source[text_start:end]``: the overlap repeated from the previous chunk
    (``text_start < start``; none for the first chunk) and then the chunk's own part
    ``source[start:end]``. Own parts do not overlap and come in order; between them lies
    only whitespace. ``heading_path`` names the Markdown headings the chunk sits under,
    outermost first (``("Guide", "Deploy", "Rollback")``); empty outside Markdown.
    ``n_tokens`` counts ``text``; a short text's single chunk counts it on first use."""

    text: str
    index: int
    heading_path: tuple[str, ...]
    start: int
    end: int
    text_start: int
    _n_tokens: int | None = field(default=None, repr=False, compare=False)
    _encoding: str = field(default=tokens.ENCODING, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        n = self._n_tokens
        if n is None:
            n = _count(tokens.encoding(self._encoding), self.text)
            object.__setattr__(self, "_n_tokens", n)
        return n

    @property
    def own_text(self) -> str:
        """The chunk's own part, without the overlap: ``source[start:end]``."""
        return self.text[self.start - self.text_start:]


def split(text: str, *, max_tokens: int = 256, overlap_tokens: int = 32, kind: str = "auto",
          encoding: str = tokens.ENCODING) -> list[Chunk]:
    """``text`` cut into chunks of at most ``max_tokens`` tokens each, overlap included.

    ``overlap_tokens``: at most this many tokens of each chunk repeat the end of the one
    before (0: none); at most half of ``max_tokens``. ``kind``: ``"markdown"``, ``"chat"``,
    ``"code"``, ``"text"``, or ``"auto"`` to tell by :func:`detect_kind`. ``encoding``:
    the tiktoken encoding that counts (:mod:`helix_ray.tokens`). A text of at most
    ``max_tokens`` tokens comes back whole as one chunk, with no heading path; a text of
    at most ``max_tokens`` UTF-8 bytes is not even counted (a token is at least one byte).
    Raises ValueError for a ``kind``, ``max_tokens`` or ``overlap_tokens`` out of range
    (and TypeError for a text that is not a str); never for what the text holds."""
    if not isinstance(text, str):
        raise TypeError(f"Got text of type {type(text).__name__}; split takes a str")
    _check(max_tokens, overlap_tokens, kind)
    n = len(text)
    if n * 4 <= max_tokens or (n <= max_tokens and (text.isascii()
                                                    or len(text.encode("utf-8", "surrogatepass")) <= max_tokens)):
        return [Chunk(text, 0, (), 0, n, 0, None, encoding)]
    enc = tokens.encoding(encoding)
    ids = enc.encode(text, disallowed_special=())
    if len(ids) <= max_tokens:
        return [Chunk(text, 0, (), 0, n, 0, len(ids), encoding)]
    if kind == "auto":
        kind = detect_kind(text)
    atoms = parse(text, kind)
    if not atoms.starts:
        return [Chunk("", 0, (), 0, 0, 0, 0, encoding)]
    plan = _Plan(atoms, enc, _token_lengths(encoding), ids, max_tokens - overlap_tokens)
    ranges = plan.merge_stubs(plan.pack(0, len(plan.starts)))
    return plan.finish(ranges, max_tokens, overlap_tokens, encoding)


def encoder_text(chunk: Chunk, title: str | None = None) -> str:
    """The text the encoders see for ``chunk``: one short line naming where it sits
    (``title > Deploy > Rollback``), then its text, so a chunk under ``## Rollback``
    matches "how do I roll back the deploy" though it never says so itself.

    ``title`` is e.g. the source file or the parent memory's first line
    (:func:`lead_title`); its first line only is used, cut to ``TITLE_CHARS`` characters.
    Each heading is cut to 48 characters and only the innermost three are kept; a name
    equal to the one before it (a title repeated as the ``#`` heading) or to the heading
    line the chunk itself opens with is left out. Nothing to name: the chunk's text
    unchanged."""
    names: list[str] = []
    lead = (title or "").strip().split("\n", 1)[0].strip()
    for limit, name in ((TITLE_CHARS, lead), *((48, h) for h in chunk.heading_path[-3:])):
        name = name if len(name) <= limit else name[:limit - 1].rstrip() + "…"
        if name and (not names or names[-1].casefold() != name.casefold()):
            names.append(name)
    opening = heading_title(chunk.text.lstrip("\r\n").split("\n", 1)[0].rstrip("\r"))
    if names and opening is not None and chunk.heading_path and names[-1] == chunk.heading_path[-1] == opening:
        names.pop()
    return f"{' > '.join(names)}\n{chunk.text}" if names else chunk.text


# --------------------------------------------------------------------------- checks


def _check(max_tokens: Any, overlap_tokens: Any, kind: Any) -> None:
    if kind not in KINDS:
        raise ValueError(f"Got kind {kind!r}; it must be one of {', '.join(map(repr, KINDS))}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < MIN_MAX_TOKENS:
        raise ValueError(f"Got max_tokens={max_tokens!r}; it must be an int of at least {MIN_MAX_TOKENS}")
    if (not isinstance(overlap_tokens, int) or isinstance(overlap_tokens, bool)
            or not 0 <= overlap_tokens <= max_tokens // 2):
        raise ValueError(f"Got overlap_tokens={overlap_tokens!r}; it must be an int from 0 to half of max_tokens "
                         f"({max_tokens // 2}); 0 turns overlap off")


def _count(enc: Any, text: str) -> int:
    return len(enc.encode(text, disallowed_special=()))


# --------------------------------------------------------------------------- packing


class _Plan:
    """The atoms of a text, none over ``budget`` tokens (longer ones cut by tokens), and
    the packing of ranges of them into chunks.

    The text is tokenised once, whole (``ids``); a range of atoms is estimated as the
    number of those tokens it overlaps, which is its count alone give or take a token at
    each end, so no atom and no candidate chunk is counted on its own. Chunks are counted
    exactly once, in :meth:`finish`. Positions are compared in UTF-8 bytes, as tokens are."""

    def __init__(self, atoms: Atoms, enc: Any, lengths: dict[int, int], ids: list[int], budget: int) -> None:
        self.text, self.enc, self.budget, self.lengths = atoms.text, enc, budget, lengths
        self.offsets = list(itertools.accumulate(map(lengths.__getitem__, ids), initial=0))  # token starts, bytes
        self.exact: dict[tuple[int, int], int] = {}
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.strengths: list[int] = []
        self.paths: list[tuple[str, ...]] = []
        self.headings: list[bool] = []
        self.fenced: list[bool] = []
        to_bytes = _ByteOffsets(self.text)
        byte_starts: list[int] = []
        byte_ends: list[int] = []
        for k, (a, b) in enumerate(zip(atoms.starts, atoms.ends)):
            ab, bb = to_bytes(a), to_bytes(b)
            # an estimate can be a few tokens short (a character split across tokens at an end): count near the budget
            if self._overlapped(ab, bb) <= budget - 8 or _count(enc, self.text[a:b]) <= budget:
                pieces = [(a, b)]
                byte_starts.append(ab)
                byte_ends.append(bb)
            else:
                pieces = list(self._cut(a, b))
                byte_starts += (to_bytes.within(a, ab, pa) for pa, _ in pieces)
                byte_ends += (to_bytes.within(a, ab, pb) for _, pb in pieces)
            for j, (pa, pb) in enumerate(pieces):
                self.starts.append(pa)
                self.ends.append(pb)
                self.strengths.append(atoms.strengths[k] if j == 0 else HARD)
                self.paths.append(atoms.paths[k])
                self.headings.append(atoms.headings[k] and j == 0)
                self.fenced.append(atoms.fenced[k])
        self.first_token = [bisect.bisect_right(self.offsets, a) - 1 for a in byte_starts]
        self.end_token = [bisect.bisect_left(self.offsets, b) for b in byte_ends]

    def _overlapped(self, a: int, b: int) -> int:
        """How many of the whole text's tokens overlap bytes ``a:b``."""
        return bisect.bisect_left(self.offsets, b) - bisect.bisect_right(self.offsets, a) + 1

    def estimate(self, lo: int, hi: int) -> int:
        """Tokens of atoms ``lo:hi`` and the whitespace between them (see the class)."""
        return self.end_token[hi - 1] - self.first_token[lo]

    def fits(self, lo: int, hi: int) -> bool:
        """Whether atoms ``lo:hi`` fit the budget; counted exactly when the estimate is
        too close to call, so a block that fits is never cut for want of a token."""
        estimate = self.estimate(lo, hi)
        if estimate <= self.budget or estimate > self.budget + 4:
            return estimate <= self.budget
        if (lo, hi) not in self.exact:
            self.exact[lo, hi] = _count(self.enc, self.text[self.starts[lo]:self.ends[hi - 1]])
        return self.exact[lo, hi] <= self.budget

    def _cut(self, a: int, b: int) -> Iterator[tuple[int, int]]:
        """An over-long atom in pieces of at most ``budget`` tokens, cut after a space in
        the last third of a piece where there is one, else between tokens."""
        text, enc, budget = self.text, self.enc, self.budget
        window = budget * 6  # characters; doubled while they hold fewer than ``budget`` tokens
        while a < b:
            while True:
                hi = min(b, a + window)
                ids = enc.encode(text[a:hi], disallowed_special=())
                if len(ids) > budget or hi == b:
                    break
                window *= 2
            if len(ids) <= budget:
                yield a, b
                return
            starts = list(itertools.accumulate(map(self.lengths.__getitem__, ids[:budget]), initial=0))
            limit = budget
            while True:
                cut = a + _char_offset(text[a:hi], starts[limit])
                space = text.rfind(" ", a + (cut - a) * 2 // 3, cut + 1)
                end = max(space if space > a else cut, a + 1)
                piece_end = end
                while piece_end > a + 1 and text[piece_end - 1].isspace():
                    piece_end -= 1
                n = _count(enc, text[a:piece_end])
                if n <= budget:
                    break
                if limit == 1:  # one character is at most four tokens, well within any budget
                    end = piece_end = a + 1
                    break
                limit = max(1, limit - max(1, n - budget))
            yield a, piece_end
            a = end
            while a < b and text[a].isspace():
                a += 1

    def pack(self, lo: int, hi: int, carry: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """Atoms ``lo:hi`` as chunk ranges: cut at the strongest boundaries inside, the
        fitting pieces packed, the others packed the same way one strength down.
        ``carry`` is a stub just before ``lo`` (a heading and its one-line intro before a
        long paragraph) that the first chunk takes in if it fits."""
        head = carry[0] if carry else lo
        if self.fits(head, hi):
            return [(head, hi)]
        if hi - lo <= 1:
            return [carry, (lo, hi)] if carry else [(lo, hi)]
        top = max(self.strengths[lo + 1:hi])
        cuts = [lo, *(k for k in range(lo + 1, hi) if self.strengths[k] == top), hi]
        out: list[tuple[int, int]] = []
        run: list[tuple[int, int]] = [carry] if carry else []
        for x, y in zip(cuts, cuts[1:]):
            if self.fits(x, y):
                run.append((x, y))
                continue
            groups = self._greedy(run)
            stub = groups and self.estimate(*groups[-1]) < self.budget // 4 and self._may_join(groups[-1][0], x)
            carry = groups.pop() if stub else None
            out += groups
            out += self.pack(x, y, carry)
            run = []
        return out + self._greedy(run)

    def _greedy(self, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Consecutive fitting pieces packed up to the budget; then pieces move from the
        end of the last-but-one chunk to the last while that lowers the larger of the two."""
        groups: list[list[tuple[int, int]]] = []
        for piece in pieces:
            if groups and self.fits(groups[-1][0][0], piece[1]):
                groups[-1].append(piece)
            else:
                groups.append([piece])
        if len(groups) >= 2:
            before, last = groups[-2], groups[-1]
            while len(before) > 1:
                moved = self.estimate(before[-1][0], last[-1][1])
                if moved >= self.estimate(before[0][0], before[-1][1]) or not self.fits(before[-1][0], last[-1][1]):
                    break
                last.insert(0, before.pop())
        return [(group[0][0], group[-1][1]) for group in groups]

    def merge_stubs(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` with each stub (under a quarter of the budget: a short block or
        section beside one that had to be cut) joined to a neighbour it fits with, across
        the weaker of its two boundaries."""
        out = list(ranges)
        k = 0
        while k < len(out):
            lo, hi = out[k]
            options = []
            if self.estimate(lo, hi) < self.budget // 4:
                if k > 0 and self.fits(out[k - 1][0], hi) and self._may_join(out[k - 1][0], lo):
                    options.append((self.strengths[lo], k - 1))
                if k + 1 < len(out) and self.fits(lo, out[k + 1][1]) and self._may_join(lo, out[k + 1][0]):
                    options.append((self.strengths[out[k + 1][0]], k + 1))
            if not options:
                k += 1
                continue
            j = min(options)[1]
            first = min(j, k)
            out[first:first + 2] = [(out[first][0], out[first + 1][1])]
            k = first
        return out

    def _may_join(self, lo: int, x: int) -> bool:
        """Whether atoms ``lo:x`` may share a chunk with the atoms from ``x`` on: yes
        unless ``x`` opens a section and ``lo:x`` is the end of a sibling section, whose
        heading the chunk would neither show nor keep in its heading path."""
        if not self.headings[x] or self.headings[lo]:
            return True
        context = self.context(lo, x)
        return self.paths[x][:len(context)] == context

    def context(self, lo: int, hi: int) -> tuple[str, ...]:
        """The heading path all of atoms ``lo:hi`` sit under."""
        path = self.paths[lo]
        for other in self.paths[lo + 1:hi]:
            if other is not path:
                path = _common(path, other)
        return path

    def finish(self, ranges: list[tuple[int, int]], max_tokens: int, overlap_tokens: int,
               encoding: str) -> list[Chunk]:
        """The chunks of ``ranges``, each with the longest overlap that keeps it within
        ``max_tokens``, counted exactly; a range counted over ``max_tokens`` without
        overlap (the estimate is off by a token or two at its ends) is packed again."""
        text, enc = self.text, self.enc
        chunks: list[Chunk] = []
        k, cut_before = 0, False
        while k < len(ranges):
            lo, hi = ranges[k]
            start, end = self.starts[lo], self.ends[hi - 1]
            text_start, n = start, -1
            if chunks and overlap_tokens and not self.headings[lo] and not cut_before:
                for candidate in self._overlaps(ranges[k - 1], lo, overlap_tokens):
                    if _count(enc, text[candidate:chunks[-1].end]) <= overlap_tokens:
                        total = _count(enc, text[candidate:end])
                        if total <= max_tokens:
                            text_start, n = candidate, total
                            break
            if n < 0:
                n = _count(enc, text[start:end])
                if n > max_tokens and hi - lo > 1:
                    ranges[k:k + 1] = self._repack(lo, hi, n - max_tokens)
                    continue
            cut_before = n > max_tokens
            if cut_before:  # one atom whose estimate was short: cut by tokens, with no overlap after it
                for a, b in self._cut(start, end):
                    chunks.append(Chunk(text[a:b], len(chunks), self.context(lo, hi), a, b, a, None, encoding))
                k += 1
                continue
            chunks.append(Chunk(text[text_start:end], len(chunks), self.context(lo, hi), start, end, text_start, n,
                                encoding))
            k += 1
        return chunks

    def _repack(self, lo: int, hi: int, excess: int) -> list[tuple[int, int]]:
        """Atoms ``lo:hi``, counted ``excess`` tokens over the limit, packed again with
        that much less room; halved at their strongest boundary if that changes nothing."""
        budget, self.budget = self.budget, max(1, self.budget - excess - 1)
        try:
            ranges = self.pack(lo, hi)
        finally:
            self.budget = budget
        if len(ranges) > 1:
            return ranges
        middle = (lo + hi) / 2
        cut = max(range(lo + 1, hi), key=lambda k: (self.strengths[k], -abs(k - middle)))
        return [(lo, cut), (cut, hi)]

    def _overlaps(self, previous: tuple[int, int], current: int, overlap_tokens: int) -> list[int]:
        """Where the overlap taken from the chunk ``previous`` may start, for the chunk
        starting at atom ``current``: at a sentence or line within ``overlap_tokens`` of
        its end, longest first, then at a line wrap or a cut; else at a word (or, in a text
        without spaces, a token) of its last atom. Never inside a fenced block unless the
        chunk itself starts inside one (the end of a block does not explain what follows)."""
        lo, hi = previous
        first = hi
        while first > lo and self.estimate(first - 1, hi) <= overlap_tokens:
            first -= 1
        allowed = [k for k in range(first, hi) if self.fenced[current] or not self.fenced[k]]
        if allowed or self.fenced[hi - 1]:
            starts = [k for k in allowed if k == lo or self.strengths[k] >= SENTENCE]
            return [self.starts[k] for k in starts + [k for k in allowed if k not in starts]]
        a, b = self.starts[hi - 1], self.ends[hi - 1]
        ids = self.enc.encode(self.text[a:b], disallowed_special=())
        ends = list(itertools.accumulate(map(self.lengths.__getitem__, reversed(ids)), initial=0))
        size = ends[-1]
        out: list[int] = []
        for back in range(min(overlap_tokens, len(ids)), max(overlap_tokens // 2, 1) - 1, -1):
            pos = a + _char_offset(self.text[a:b], size - ends[back])
            if pos > a and not self.text[pos - 1].isspace():
                space = _SPACE.search(self.text, pos, b)
                if space is not None:
                    pos = space.end()
            if pos < b and (not out or pos > out[-1]):
                out.append(pos)
        return out


class _ByteOffsets:
    """The UTF-8 byte offsets of a text's character offsets, asked in order."""

    def __init__(self, text: str) -> None:
        self.text, self.ascii, self.char, self.byte = text, text.isascii(), 0, 0

    def __call__(self, char: int) -> int:
        if self.ascii:
            return char
        self.byte += len(self.text[self.char:char].encode("utf-8", "surrogatepass"))
        self.char = char
        return self.byte

    def within(self, char: int, byte: int, later: int) -> int:
        """The byte offset of ``later``, given that of an earlier ``char``, out of order."""
        return later if self.ascii else byte + len(self.text[char:later].encode("utf-8", "surrogatepass"))


def _char_offset(text: str, byte: int) -> int:
    """The character offset of UTF-8 byte offset ``byte`` of ``text``; inside a
    character, the offset of that character (it goes with what follows)."""
    if text.isascii():
        return byte
    data = text.encode("utf-8", "surrogatepass")
    while 0 < byte < len(data) and data[byte] & 0xC0 == 0x80:
        byte -= 1
    return len(data[:byte].decode("utf-8", "surrogatepass"))


class _TokenLengths(dict[int, int]):
    """Token id → its length in bytes, looked up on first use."""

    def __init__(self, enc: Any) -> None:
        super().__init__()
        self.enc = enc

    def __missing__(self, token: int) -> int:
        self[token] = length = len(self.enc.decode_single_token_bytes(token))
        return length


@functools.lru_cache(maxsize=4)
def _token_lengths(name: str) -> _TokenLengths:
    return _TokenLengths(tokens.encoding(name))


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return a[:k]
