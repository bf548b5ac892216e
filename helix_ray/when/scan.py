"""Reading a text: every expression the rules find, then what surrounds each one.

The words before an expression can narrow it ("the end of May", "the last week of August"),
step from it ("the Friday before 17 September", "the week before Christmas"), bound it ("since the migration in May",
"before 2022", "as of November") or open a range with the next one ("between March and May").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Callable

from helix_ray.when.rules import (
    NUM,
    RULES,
    UNIT,
    WEEKDAY,
    WEEKDAYS,
    Context,
    Hit,
    add_months,
    ago,
    number,
    thirds,
    unit,
    words,
)
from helix_ray.when.window import CALENDAR_MARGIN

_PART_OF = re.compile(rf"""(?:\b(?:in|during|at|by|towards?|around|over)\s+)?(?:\bthe\s+)?\b
    (?: (?P<third>beginning|start|middle|end)
      | (?P<half>first|second)\s+half
      | (?P<quarter>first|second|third|fourth|last)\s+quarter
      | (?P<ord>first|second|third|fourth|last)\s+(?:(?P<n>{NUM})\s+)?(?P<unit>weekend|weeks?|days?) )
    \s+of\s+(?:the\s+)?$""", re.IGNORECASE | re.VERBOSE)
_STEP_FROM = re.compile(rf"(?:\b(?:the|a|last)\s+)?(?:\b(?P<n>{NUM})\s+)?\b(?P<unit>{WEEKDAY}|weekend|{UNIT})\s+"
                        r"(?P<dir>before|after|prior\s+to)\s+$", re.IGNORECASE)
_BOUND = re.compile(r"\b(?P<bound>since|before|until|till|til|after|prior\s+to|up\s+(?:to|until)|from|between|as\s+of)"
                    r"\s+(?P<gap>(?:[a-z][\w'’-]*\s+){0,4})$", re.IGNORECASE)
_BOUND_WORDS = {"since", "before", "until", "till", "til", "after", "prior", "up", "from", "between", "as"}
# Bounds that may stand a few words before their time, around an event: "since the migration in May".
_GAP_ALLOWED = {"since", "before", "until", "till", "til", "after", "prior to"}
_RANGE_JOIN = re.compile(r"\s*(?:and|to|until|till|through|thru|-|–|—)\s*", re.IGNORECASE)
_ORDINAL = {"first": 0, "second": 1, "third": 2, "fourth": 3}
_LOOKBACK = 60  # characters: the longest qualifier or bound read before an expression


@dataclass(frozen=True)
class Found:
    """One expression as read: where it is, what it names, and its entity keys."""

    begin: int
    stop: int
    kind: str
    keys: tuple[str, ...]
    # (soft start, core start, core end, soft end) in the anchor's zone, None where unbounded;
    # None for a duration
    window: tuple[datetime | None, datetime | None, datetime | None, datetime | None] | None = None
    day: date | None = None  # the calendar day it names, when it names one with its year


def read(text: str, anchor: datetime, *, durations: bool) -> list[Found]:
    """Every time expression in ``text``, left to right, resolved against ``anchor`` (aware,
    in the zone whose calendar days count). ``durations=False`` skips "for three years"."""
    ctx = Context(text, anchor)
    found: list[Found] = []
    floor = 0  # a lookback never reaches into the previous expression
    range_start: tuple[int, int, Hit, re.Match[str] | None] | None = None  # after "between"/"from"
    for begin, stop, m, hit in _expressions(ctx, durations):
        previous_stop, floor = floor, stop
        opened, range_start = range_start, None
        match: re.Match[str] | None = m
        q, narrowed = _qualify(ctx, max(previous_stop, begin - _LOOKBACK), begin, hit)
        if narrowed is not None and q is not None:
            begin, hit, match = q.start(), narrowed, None
        if hit.start is None or hit.end is None:
            found.append(_plain(begin, stop, hit))
            continue
        if opened is not None and _RANGE_JOIN.fullmatch(text, opened[1], begin):
            joined = _range(ctx, opened, stop, hit)
            if joined is not None:
                found[-1] = joined
                continue
        lo = max(previous_stop, begin - _LOOKBACK)
        b = None if _BOUND_WORDS.isdisjoint(text[lo:begin].lower().split()) else _BOUND.search(text, lo, begin)
        bound = " ".join(b["bound"].lower().split()) if b else ""
        gap = bool(b and b["gap"].strip())
        if b is None or (gap and bound not in _GAP_ALLOWED):
            found.append(_plain(begin, stop, hit))
        elif bound in ("between", "from"):  # a range's first end; alone, "from" is a place ("moved from")
            range_start = (b.start(), stop, hit, match)
            found.append(_plain(begin, stop, hit))
        else:
            found.append(_bounded(ctx, bound, gap, b.start(), stop, hit))
    return found


def _expressions(ctx: Context, durations: bool) -> list[tuple[int, int, re.Match[str], Hit]]:
    """The rules' matches that resolve, without overlaps: the earliest first, then the longest.
    A rule runs only when the text has one of its words, so most text costs one tokenising pass."""
    present = words(ctx.text)
    candidates = []
    for order, rule in enumerate(RULES if durations else RULES[:-1]):
        if rule.words.isdisjoint(present):
            continue
        for m in rule.pattern.finditer(ctx.text):
            hit = _safe(rule.resolve, m, ctx)
            if hit is not None:
                candidates.append((m.start(), m.start() - m.end(), order, m, hit))
    candidates.sort(key=lambda c: c[:3])
    chosen: list[tuple[int, int, re.Match[str], Hit]] = []
    for begin, negative_length, _, m, hit in candidates:
        if not chosen or begin >= chosen[-1][1]:
            chosen.append((begin, begin - negative_length, m, hit))
    return chosen


def _safe(step: Callable[..., Hit | None], *args: object) -> Hit | None:
    try:
        return step(*args)
    except (ValueError, OverflowError, KeyError):  # "Feb 30", year 10000, "9999 decades ago"
        return None


def _qualify(ctx: Context, lo: int, begin: int, hit: Hit) -> tuple[re.Match[str] | None, Hit | None]:
    """A part of the period ("the end of May") or a step from it ("the week before May 8")."""
    if hit.start is None or hit.end is None or hit.open_end:
        return None, None
    last_words = ctx.text[lo:begin].lower().split()[-2:]  # the patterns end in one of them
    if last_words[-1:] == ["of"] or last_words == ["of", "the"]:
        q = _PART_OF.search(ctx.text, lo, begin)
        if q is not None and hit.grain and hit.end - hit.start > timedelta(days=7):
            return q, _safe(_part_of, q, hit, ctx)
    if last_words[-1:] in (["before"], ["after"]) or last_words == ["prior", "to"]:
        q = _STEP_FROM.search(ctx.text, lo, begin)
        return q, (_safe(_step_from, q, hit, ctx) if q is not None else None)
    return None, None


def _part_of(q: re.Match[str], hit: Hit, ctx: Context) -> Hit | None:
    assert hit.start is not None and hit.end is not None
    first, stop, grain = hit.start.date(), hit.end.date(), hit.grain
    if q["third"]:
        first, stop = thirds(first, stop, {"beginning": 0, "start": 0, "middle": 1, "end": 2}[q["third"].lower()])
    elif q["half"]:
        months = (stop.year - first.year) * 12 + stop.month - first.month
        middle = add_months(first, months // 2) if months >= 2 else first.replace(day=16)
        first, stop = (first, middle) if q["half"].lower() == "first" else (middle, stop)
    elif q["quarter"]:  # of a year
        if (stop.year - first.year) * 12 + stop.month - first.month != 12:
            return None
        which = q["quarter"].lower()
        first = add_months(first, 3 * (3 if which == "last" else _ORDINAL[which]))
        stop = add_months(first, 3)
    elif q["unit"].lower() == "weekend":
        if q["ord"].lower() == "last":
            last_day = stop - timedelta(days=1)
            saturday = last_day - timedelta(days=(last_day.weekday() - 5) % 7)
        else:
            saturday = first + timedelta(days=(5 - first.weekday()) % 7 + 7 * _ORDINAL[q["ord"].lower()])
        first, stop, grain = saturday, saturday + timedelta(days=2), "week"
    else:
        days = (number(q["n"]) if q["n"] else 1) * (7 if q["unit"].lower().startswith("week") else 1)
        if q["ord"].lower() == "last":
            first = stop - timedelta(days=days)
        else:
            first += timedelta(days=days * _ORDINAL[q["ord"].lower()])
        stop, grain = first + timedelta(days=days), ("week" if days == 7 else grain)
    if not hit.start.date() <= first < stop <= hit.end.date():
        return None
    return ctx.period(first, stop, grain, hit.kind, 0.0 if hit.kind == "absolute" else CALENDAR_MARGIN)


def _step_from(q: re.Match[str], hit: Hit, ctx: Context) -> Hit | None:
    """"the Friday before X", "the week after X", "two days before X"."""
    assert hit.start is not None and hit.end is not None
    before = q["dir"].lower() != "after"
    first_day = hit.start.date()
    last_day = (hit.end - timedelta(microseconds=1)).date()
    name = q["unit"].lower()
    if name in WEEKDAYS:
        wd = WEEKDAYS.index(name)
        if before:
            day = first_day - timedelta(days=(first_day.weekday() - wd) % 7 or 7)
        else:
            day = last_day + timedelta(days=(wd - last_day.weekday()) % 7 or 7)
        return ctx.day(day, hit.kind)
    if name == "weekend":
        if before:
            saturday = first_day - timedelta(days=2)
            saturday -= timedelta(days=(saturday.weekday() - 5) % 7)
        else:
            saturday = last_day + timedelta(days=(5 - last_day.weekday()) % 7 or 7)
        return ctx.period(saturday, saturday + timedelta(days=2), "week", hit.kind, 0.0)
    name = unit(name)
    if not q["n"] and name in ("day", "week"):
        length = timedelta(days=1 if name == "day" else 7)
        first = first_day - length if before else last_day + timedelta(days=1)
        return ctx.period(first, first + length, name, hit.kind, 0.0)
    n = number(q["n"]) if q["n"] else 1
    return ago(ctx, ctx.midnight(first_day if before else last_day), n if before else -n, name)


def keys(hit: Hit) -> tuple[str, ...]:
    """The entity key of what ``hit`` names: ``date:2023-05-07``, ``date:2023-w18`` (ISO week),
    ``date:2023-05``, ``date:2023``, ``time:duration``; none for a window with no unit."""
    if hit.duration:
        return ("time:duration",)
    if hit.grain is None or hit.start is None:
        return ()
    day = hit.start.date()
    if hit.grain == "day":
        return (f"date:{day.isoformat()}",)
    if hit.grain == "week":
        iso = day.isocalendar()
        return (f"date:{iso.year:04d}-w{iso.week:02d}",)
    if hit.grain == "month":
        return (f"date:{day.year:04d}-{day.month:02d}",)
    return (f"date:{day.year:04d}",)


def _explicit_day(hit: Hit) -> date | None:
    named = hit.start is not None and hit.grain == "day" and hit.kind == "absolute" and not hit.yearless
    return hit.start.date() if named and hit.start is not None else None


def _plain(begin: int, stop: int, hit: Hit) -> Found:
    window = None
    if hit.start is not None and hit.end is not None:
        window = (hit.soft_start, hit.start, hit.end, hit.soft_end)
    return Found(begin, stop, hit.kind, keys(hit), window, _explicit_day(hit))


def _bounded(ctx: Context, bound: str, gap: bool, begin: int, stop: int, hit: Hit) -> Found:
    """since / after: from the time to now; before / until / as of: everything up to it.

    Right after the bound word the edge is exact ("after May 8" starts May 9, "before May"
    ends April 30); a few words later the bound is an event inside the time ("after the launch
    in May" starts May 1, "before the launch in May" ends May 31).
    """
    assert hit.start is not None and hit.end is not None
    if bound in ("since", "after"):
        exact = bound == "after" and not gap
        core_start = hit.end if exact else hit.start
        soft_start = hit.end - hit.margin if exact else hit.soft_start
        core_end = ctx.now if ctx.now > core_start else None  # a future start: open-ended
        return Found(begin, stop, "since", keys(hit), (soft_start, core_start, core_end, core_end))
    exact = bound == "before" and not gap
    core_end = hit.start if exact else hit.end
    soft_end = hit.start + hit.margin if exact else hit.soft_end
    return Found(begin, stop, "until", keys(hit), (None, None, core_end, soft_end), _explicit_day(hit))


def _range(ctx: Context, opened: tuple[int, int, Hit, re.Match[str] | None], stop: int, last: Hit) -> Found | None:
    """"between March and May 2023": the first end takes its year from the last when it names none."""
    begin, _, first, first_match = opened
    assert last.start is not None and last.end is not None
    if first.yearless and not last.yearless and first_match is not None:
        resolve = next(rule.resolve for rule in RULES if rule.pattern is first_match.re)
        again = _safe(resolve, first_match, Context(ctx.text, last.end - timedelta(microseconds=1)))
        first = again if again is not None else first
    if first.start is None or first.start >= last.end:
        return None
    window = (first.soft_start, first.start, last.end, last.soft_end)
    return Found(begin, stop, "range", keys(first) + keys(last), window)
