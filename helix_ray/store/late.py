"""A generation's late-interaction tokens as append-only segments: read by
:class:`SegmentedTokens`, written by :func:`write_late`.

The token bytes of a store are far larger than anything else a memory carries (64
bytes and a 4-byte scale per token, ~60 tokens a memory), and an old memory's tokens
never change. So they live in **segments**, files that are never rewritten once
published::

    late/segments/<name>.tokens.npy   int8 (T, 64)
    late/segments/<name>.scales.npy   float32 (T,)
    late/segment.npy                  int16 (N,): each row's segment, an index into the
                                      manifest's ``late.segments``
    late/start.npy                    int64 (N,): its first token in that segment
    late/length.npy                   int32 (N,): its token count

A segment is named after the generation that wrote it (``g000007``). Publishing the
next generation hard-links the previous generation's segments that its rows still
point at into the new folder (a copy where the filesystem refuses the link), writes
only the new rows' tokens as one new segment, and rewrites the per-row pointers (14
bytes a row). Each generation folder stays whole on its own: deleting an older one
removes a name, not the bytes a newer one links.

Merging (:func:`plan_segments`): when more than half of the kept segments' tokens are
dead (no row points at them: deleted or replaced memories), every live token is
rewritten into the one new segment. Otherwise, when the segments would number more than
:data:`MAX_SEGMENTS`, the smallest ones are merged with the new rows, the fewest that
bring the count down to ``MAX_SEGMENTS // 2`` (size-tiered: the largest segment, the
bulk of an old store, is rewritten only when dead tokens call for it). So a deleted
memory's tokens (not its text) may stay in a linked segment until a merge; a forgotten
user's never do: a segment holding any of their tokens is not linked, its live rows are
rewritten (:meth:`helix_ray.store.db.StoreDB.erased_ids`).

Generations written before segments hold ``late/{tokens,scales,offsets}.npy`` (memory i:
rows ``offsets[i]:offsets[i+1]``): they read as one segment, and the next publish links
those two files in as a segment of the generation that wrote them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, Union

import numpy as np

from helix_ray.store.rows import RowFile
from helix_ray.token_encoder import DIM, PassageTokens, TokenLookup

#: More segments than this and the smallest are merged (see the module docstring).
MAX_SEGMENTS = 8
#: Rows gathered at a time when a merge rewrites tokens from mapped segments.
_GATHER_ROWS = 1 << 14
POINTER_FILES = ("segment", "start", "length")


@dataclass(frozen=True)
class Segment:
    """One segment of a published generation: its name, its two files, its token count,
    and the manifest records (:mod:`helix_ray.store.integrity`) of those files, by the
    name they get in a generation that links them (None: not recorded)."""

    name: str
    tokens_path: Path
    scales_path: Path
    tokens: int
    records: dict[str, dict[str, Any] | None] = field(default_factory=dict)


def segment_file(name: str, kind: str) -> str:
    """The path of segment ``name``'s ``kind`` ("tokens" or "scales") file in a generation."""
    return f"late/segments/{name}.{kind}.npy"


class SegmentedTokens(TokenLookup):
    """A generation's token vectors with :class:`PassageTokens`' ``lookup`` / ``take`` /
    ``len`` contract: ``take`` reads the rows asked for from the segments they point into
    with ``pread`` (:mod:`helix_ray.store.rows`: a serving process maps none of the
    segments' bytes). The per-row pointers are memory-mapped (14 bytes a row, read for
    the ~100 candidates of a query); ``length`` holds each row's token count."""

    def __init__(self, segments: list[Segment], segment: np.ndarray, start: np.ndarray, length: np.ndarray):
        self.segments = segments
        self.segment, self.start, self.length = map(_plain, (segment, start, length))
        self.arrays = [(RowFile(s.tokens_path), RowFile(s.scales_path)) for s in segments]

    @classmethod
    def open(cls, folder: Path, info: dict[str, Any], files: dict[str, Any]) -> "SegmentedTokens":
        """The tokens of the generation in ``folder`` from its manifest's ``late`` record
        (``info``) and ``files``: segments, or the single-file layout of earlier versions."""
        late = folder / "late"
        if "segments" not in info:
            offsets = np.load(late / "offsets.npy", mmap_mode="r")
            name = f"g{int(folder.name):06d}" if folder.name.isdigit() else "g000000"
            records = {segment_file(name, kind): files.get(f"late/{kind}.npy") for kind in ("tokens", "scales")}
            one = Segment(name, late / "tokens.npy", late / "scales.npy", int(offsets[-1]), records)
            starts = np.asarray(offsets[:-1], np.int64)
            return cls([one], np.zeros(len(starts), np.int16), starts, np.diff(offsets).astype(np.int32))
        segments = []
        for s in info["segments"]:
            names = {kind: segment_file(s["name"], kind) for kind in ("tokens", "scales")}
            segments.append(Segment(s["name"], folder / names["tokens"], folder / names["scales"], int(s["tokens"]),
                                    {n: files.get(n) for n in names.values()}))
        segment, start, length = (np.load(late / f"{n}.npy", mmap_mode="r") for n in POINTER_FILES)
        return cls(segments, segment, start, length)

    def __len__(self) -> int:
        return len(self.length)

    def take(self, rows: np.ndarray) -> PassageTokens:
        """The passages ``rows``, in that order, as a new compact block."""
        rows = np.asarray(rows, dtype=np.int64)
        return gather(self.arrays, np.asarray(self.segment[rows], np.int64), np.asarray(self.start[rows], np.int64),
                      np.asarray(self.length[rows], np.int64))


def _plain(array: np.ndarray) -> np.ndarray:
    """A memory-mapped array as a plain ndarray over the same mapping: indexing it skips
    ``np.memmap``'s Python-level bookkeeping."""
    return array.view(np.ndarray) if isinstance(array, np.memmap) else array


#: A source of token rows: a segment's file (:class:`RowFile`) or a block in memory.
Rows = Union[RowFile, np.ndarray]


def gather(sources: Sequence[tuple[Rows, Rows]], source: np.ndarray, start: np.ndarray,
           length: np.ndarray) -> PassageTokens:
    """Passage k = tokens ``start[k]:start[k] + length[k]`` of ``sources[source[k]]``
    (each a (tokens, scales) pair), as one compact block in that order. Each source is
    read once, for its own passages, in file order."""
    offsets = np.zeros(len(length) + 1, np.int64)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    used = np.unique(source[length > 0]).tolist()
    tokens = np.empty((total, sources[used[0]][0].shape[1] if used else DIM), np.int8)
    scales = np.empty(total, np.float32)
    for s in used:
        mine = np.flatnonzero((source == s) & (length > 0))
        mine = mine[np.argsort(start[mine], kind="stable")]
        n = length[mine]
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # each token's place in its passage
        at = np.repeat(offsets[mine], n) + within
        index = np.repeat(start[mine], n) + within  # the tokens' rows in the source
        tokens[at], scales[at] = (part.ranges(start[mine], n) if isinstance(part, RowFile) else part[index]
                                  for part in sources[s])
    return PassageTokens(tokens, scales, offsets)


class TokenBlock(Protocol):
    """New rows' tokens as ingest hands them over: a :class:`PassageTokens`, or any
    stand-in with its ``len`` and ``take``."""

    def __len__(self) -> int: ...

    def take(self, rows: np.ndarray) -> PassageTokens: ...


@dataclass
class TokenRows:
    """The token vectors of the rows of a generation to publish. Row i is carried over
    when ``carried[i]`` ≥ 0 (its tokens stay where row ``carried[i]`` of ``previous``
    points: nothing is copied), else it is row ``fresh[i]`` of ``new``."""

    previous: SegmentedTokens | None
    carried: np.ndarray  # int64 (N,): the previous generation's row, or -1
    new: TokenBlock
    fresh: np.ndarray  # int64 (N,): the row of ``new``, or -1
    #: rows of ``previous`` whose tokens no segment of this generation may keep (a
    #: forgotten user's): the segments holding them are rewritten
    purge: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def of(cls, new: TokenBlock) -> "TokenRows":
        """Every row new: row i is ``new``'s row i."""
        n = len(new)
        return cls(None, np.full(n, -1, np.int64), new, np.arange(n, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.carried)

    def take(self, rows: np.ndarray) -> "TokenRows":
        """These rows, in this order (pointers only: no token is copied)."""
        rows = np.asarray(rows, dtype=np.int64)
        return TokenRows(self.previous, self.carried[rows], self.new, self.fresh[rows], self.purge)


@dataclass
class SegmentPlan:
    """What :func:`write_late` does: link ``kept`` (indexes of the previous generation's
    segments), and write one new segment of the rows ``rewrite`` marks (new rows and
    rows of merged segments). ``reason`` says why segments were merged, if they were."""

    kept: list[int]
    rewrite: np.ndarray  # bool (N,)
    reason: str | None


def plan_segments(rows: TokenRows, seg: np.ndarray, length: np.ndarray, max_segments: int) -> SegmentPlan:
    """The merge rule of the module docstring. ``seg`` / ``length``: each row's segment in
    the previous generation (read for carried rows only) and token count."""
    previous = rows.previous
    carried = rows.carried >= 0
    used = np.unique(seg[carried]).tolist() if previous is not None else []
    live = {s: int(length[carried & (seg == s)].sum()) for s in used}
    size = {s: previous.segments[s].tokens for s in used} if previous is not None else {}
    total = sum(size.values())
    if total and total - sum(live.values()) > total / 2:
        return SegmentPlan([], np.ones(len(rows), bool), "more than half of the segments' tokens are dead")
    kept, reason = list(used), None
    if previous is not None and len(rows.purge):
        tainted = set(np.asarray(previous.segment[rows.purge]).tolist())
        kept = [s for s in kept if s not in tainted]
        reason = "segments holding forgotten memories rewritten" if len(kept) < len(used) else None
    count = len(kept) + int(bool((~carried | ~np.isin(seg, kept)).any()))  # and a new one, if rows are written
    if count > max_segments:
        merge = sorted(kept, key=lambda s: (size[s], s))[: len(kept) + 1 - max_segments // 2]
        kept = [s for s in kept if s not in merge]
        reason = f"{count} segments: the {len(merge)} smallest merged"
    return SegmentPlan(kept, ~carried | ~np.isin(seg, kept), reason)


def write_late(folder: Path, rows: TokenRows, name: str, *, max_segments: int | None = None
               ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Write ``rows``' tokens under ``folder/late`` (a generation being staged) as the
    module docstring describes; the new segment, if any, is called ``name``, and
    ``max_segments`` defaults to :data:`MAX_SEGMENTS`. Returns
    the manifest's ``late`` record and the integrity records of the linked files (their
    contents are the previous generation's, so its records stand)."""
    n = len(rows)
    previous = rows.previous
    seg = np.full(n, -1, np.int64)
    start = np.zeros(n, np.int64)
    length = np.zeros(n, np.int64)
    carried = rows.carried >= 0
    if previous is not None and carried.any():
        picked = rows.carried[carried]
        seg[carried] = previous.segment[picked]
        start[carried] = previous.start[picked]
        length[carried] = previous.length[picked]
    sources: list[tuple[Rows, Rows]] = [] if previous is None else list(previous.arrays)
    fresh_rows = np.flatnonzero(~carried)
    if len(fresh_rows):  # the new rows' tokens are read where they are: one more source
        block = rows.new if isinstance(rows.new, PassageTokens) else rows.new.take(rows.fresh[fresh_rows])
        at = rows.fresh[fresh_rows] if block is rows.new else np.arange(len(fresh_rows))
        offsets = np.asarray(block.offsets, np.int64)
        seg[fresh_rows], start[fresh_rows] = len(sources), offsets[at]
        length[fresh_rows] = offsets[at + 1] - offsets[at]
        sources.append((block.tokens, block.scales))
    plan = plan_segments(rows, seg, length, MAX_SEGMENTS if max_segments is None else max_segments)

    late = folder / "late"
    (late / "segments").mkdir(parents=True)
    listed: list[dict[str, Any]] = []
    records: dict[str, dict[str, Any]] = {}
    pointer = np.zeros(n, np.int16)
    for position, s in enumerate(plan.kept):
        assert previous is not None
        segment = previous.segments[s]
        for kind, source in (("tokens", segment.tokens_path), ("scales", segment.scales_path)):
            target = segment_file(segment.name, kind)
            link_or_copy(source, folder / target)
            if segment.records.get(target):
                records[target] = dict(segment.records[target] or {})
        listed.append({"name": segment.name, "tokens": segment.tokens})
        pointer[carried & (seg == s)] = position
    written = np.flatnonzero(plan.rewrite)
    if len(written):
        tokens = _write_segment(late / "segments", name, sources, seg[written], start[written], length[written])
        listed.append({"name": name, "tokens": tokens})
        pointer[written] = len(listed) - 1
        starts = np.zeros(len(written) + 1, np.int64)
        np.cumsum(length[written], out=starts[1:])
        start[written] = starts[:-1]
    np.save(late / "segment.npy", pointer)
    np.save(late / "start.npy", start)
    np.save(late / "length.npy", length.astype(np.int32))
    info: dict[str, Any] = {"tokens": int(length.sum()), "segments": listed}
    if plan.reason:
        info["merged"] = plan.reason
    return info, records


def _write_segment(folder: Path, name: str, sources: Sequence[tuple[Rows, Rows]], source: np.ndarray,
                   start: np.ndarray, length: np.ndarray) -> int:
    """Segment ``name``: the passages ``(source, start, length)`` gathered in order from
    ``sources``, a chunk of rows at a time (a merge reads segments of any size).
    Returns its token count."""
    total = int(length.sum())
    tokens_path, scales_path = folder / f"{name}.tokens.npy", folder / f"{name}.scales.npy"
    if total == 0:
        np.save(tokens_path, np.zeros((0, DIM), np.int8))
        np.save(scales_path, np.zeros(0, np.float32))
        return 0
    tokens = np.lib.format.open_memmap(tokens_path, mode="w+", dtype=np.int8, shape=(total, DIM))
    scales = np.lib.format.open_memmap(scales_path, mode="w+", dtype=np.float32, shape=(total,))
    at = 0
    for lo in range(0, len(length), _GATHER_ROWS):
        hi = min(lo + _GATHER_ROWS, len(length))
        block = gather(sources, source[lo:hi], start[lo:hi], length[lo:hi])
        end = at + int(block.offsets[-1])
        tokens[at:end], scales[at:end] = block.tokens, block.scales
        at = end
    tokens.flush()
    scales.flush()
    del tokens, scales
    return total


def link_or_copy(source: Path, target: Path) -> None:
    """Hard-link ``source`` (a file that never changes) as ``target``; copy it where
    linking fails (another filesystem, one that has no hard links, the link count at its
    limit)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
