"""Time expressions in queries and memories, resolved by rules (no model).

* :func:`query_window`: the span of time a query points at ("last weekend", "two months
  ago", "since the migration in May"), as a soft :class:`TimeWindow` resolved against the
  moment the question is asked.
* :func:`asks_when`: whether a query asks for a time or a duration ("when did…", "how long…").
* :func:`stated_day`: the first calendar day a text names with its year (a dated heading
  or file name: "2024-05-03", "3 May 2024").
* :func:`mentions`: the dates a memory states, as entity keys (``date:2023-05-07``,
  ``date:2023-w18``, ``date:2023-05``, ``date:2023``, ``time:duration``), resolved against
  the memory's own creation time; :func:`has_time` says whether it states any time at all,
  and :func:`key_window` turns a ``date:`` key back into its window.

Conventions. Windows are half-open ``[start, end)`` in UTC. Calendar arithmetic (which day
"yesterday" is, where a month starts) happens in the anchor's time zone; a naive anchor is
UTC. Weeks start on Monday (ISO 8601). A month, a day, a season, a quarter or a holiday named
without a year is the most recent one begun by the anchor ("in June", asked in May 2023, is
June 2022; "at Christmas" is Christmas 2022). Holidays are Christmas (Eve, Day), Boxing Day,
New Year's (Eve, Day), Valentine's Day, Easter (Sunday, Monday), Independence Day (the
Fourth of July), Halloween, the United States' Thanksgiving and "the holidays" (20 December
to 2 January); "over Christmas" and Easter reach two days to each side, Thanksgiving one.
Relative windows are soft: each side is widened, in whole days, by a share of the window's
length (:data:`CALENDAR_MARGIN`, :data:`ROLLING_MARGIN`) or of the distance back
(:data:`AGO_MARGIN`), while ``core_start``/``core_end`` keep what the words name. Named dates,
months and years (:data:`ABSOLUTE_MARGIN`) are not widened.

Ambiguous words need context. ``May`` and ``March`` are months only when capitalised, and
every month name needs a day, a year or a preposition next to it ("in May", "May 8",
"8 May 2023", "May 2023"; never "I may go" or "we march"); abbreviations ("Sep") need a day
or a year. Weekdays need a determiner ("last Friday", "on Monday"), bare years a preposition
("in 2022"), and so do holidays ("at Christmas", "last Easter"; never "a Christmas tree") and
quarters ("in Q3", "Q3 2024"; "last quarter", but not "the last quarter" of a game). "second"
is never a unit of time.

The module is pure and deterministic, imports only the standard library, and never raises on
odd text (impossible dates are skipped); it raises TypeError only for an anchor that is not a
datetime.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time

from helix_ray.when.scan import Found, read
from helix_ray.when.window import (
    ABSOLUTE_MARGIN,
    AGO_MARGIN,
    CALENDAR_MARGIN,
    RECENT,
    ROLLING_MARGIN,
    UNBOUNDED_END,
    UNBOUNDED_START,
    UTC,
    TimeWindow,
    key_window,
)

__all__ = [
    "TimeWindow",
    "query_window",
    "asks_when",
    "mentions",
    "has_time",
    "stated_day",
    "key_window",
    "AGO_MARGIN",
    "CALENDAR_MARGIN",
    "ROLLING_MARGIN",
    "ABSOLUTE_MARGIN",
    "RECENT",
    "UNBOUNDED_START",
    "UNBOUNDED_END",
]

_CLOCK = re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d\b|\b(?:1[0-2]|0?[1-9])\s*(?:(?:am|pm)\b|[ap]\.m\.)"
                    r"|\b(?:noon|midnight|o'clock)\b")  # read on lower-cased text


def _anchor(moment: datetime) -> datetime:
    """The anchor in its own zone (its calendar days are the ones that count); naive is UTC."""
    if not isinstance(moment, datetime):
        raise TypeError(f"Got {type(moment).__name__} as the anchor time; pass a datetime (a naive one is read as UTC)")
    return moment.replace(tzinfo=UTC) if moment.utcoffset() is None else moment


def _to_window(found: Found, text: str) -> TimeWindow | None:
    assert found.window is not None
    bounds = []
    for i, moment in enumerate(found.window):
        if moment is None:
            bounds.append(UNBOUNDED_START if i < 2 else UNBOUNDED_END)
            continue
        try:
            bounds.append(moment.astimezone(UTC))
        except (OverflowError, ValueError):  # a window at the edge of year 1 or 9999
            return None
    start, core_start, core_end, end = bounds
    try:
        return TimeWindow(start, end, " ".join(text[found.begin:found.stop].split()), found.kind, core_start, core_end)
    except ValueError:  # an empty or inverted window, e.g. at the edge of the calendar
        return None


def query_window(query: str, now: datetime) -> TimeWindow | None:
    """The window named by the first time expression in ``query``, resolved against ``now``
    (when the question is asked; naive is UTC), or None when the query names no time.

    When a relative expression comes with a named day ("what did Jo finish last Friday, as
    mentioned on 23 January 2022?"), the day is when it was said: "last Friday" is read
    against it rather than against ``now``.
    """
    anchor = _anchor(now)
    if not isinstance(query, str):
        return None
    found = [f for f in read(query, anchor, durations=False) if f.window is not None]
    said_on = next((f.day for f in found[1:] if f.day is not None), None)
    if found and found[0].kind == "relative" and said_on is not None:
        again = read(query, datetime.combine(said_on, time(12), tzinfo=anchor.tzinfo), durations=False)
        found = [f for f in again if f.begin == found[0].begin and f.window is not None] + found
    for f in found:
        window = _to_window(f, query)
        if window is not None:
            return window
    return None


def mentions(text: str, created_at: datetime) -> list[str]:
    """The times a memory states, as entity keys, resolved against its ``created_at``.

    ``date:2023-05-07`` for a day, ``date:2023-w18`` for an ISO week (a week, a weekend),
    ``date:2023-05`` for a month, ``date:2023`` for a year or a season, and ``time:duration``
    when the text says how long something lasted ("for three years", "took a week").
    Lower case, deduplicated, in first-seen order. Windows with no calendar unit
    ("recently", "in the past month") give no key.
    """
    anchor = _anchor(created_at)
    if not isinstance(text, str):
        return []
    seen: dict[str, None] = {}
    for found in read(text, anchor, durations=True):
        seen.update(dict.fromkeys(found.keys))
    return list(seen)


_ANY_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)


def has_time(text: str) -> bool:
    """Whether ``text`` states a time at all: a date, a relative day or period ("recently"
    included), a duration, or a clock time ("10:30", "3pm")."""
    if not isinstance(text, str):
        return False
    return _CLOCK.search(text.lower()) is not None or bool(read(text, _ANY_ANCHOR, durations=True))


def stated_day(text: str) -> date | None:
    """The first calendar day ``text`` names with its year ("2024-05-03", "3 May 2024",
    "May 3rd, 2024"), or None: a day named without its year, a relative day ("yesterday")
    or a month is no day here, as it depends on when the text was written; nor is the
    start of a span ("since 2024-05-03", "from … to …"). A day given as a span's end
    ("until 2024-05-03") is read as that day."""
    if not isinstance(text, str):
        return None
    text = _LABEL_COLON.sub(" ", text)  # "3 May 2024: deploy", as a heading writes it
    return next((f.day for f in read(text, _ANY_ANCHOR, durations=False) if f.day is not None), None)


_LABEL_COLON = re.compile(r":(?=\s|$)")


# Both read lower-cased text; the lookahead lets most positions fail on their first letter.
# ("say when" is left out: "what did she say when Mel called" is about the call, not a time.)
_OPENS_WITH_WHEN = re.compile(r"\W*when\b(?![^,]*,)(?!.*\b(?:what|who|whom|whose|which|where|why|how)\b)", re.DOTALL)
_ASKS_WHEN = re.compile(
    r"""\b(?=[whsutbakrf])(?:
        \bwhen(?:['’]s|\s+(?:exactly|approximately|roughly|precisely))?\s+
            (?:did|do|does|was|were|is|are|will|would|has|have|had|can|could|should|shall|might|must)\b
      | \bwhen['’]s\b
      | \b(?:what|which)\s+(?:exact\s+|specific\s+|particular\s+)?
            (?:dates?|days?|years?|months?|weeks?|weekends?|season|decade|hour
               |time(?=\s+(?:of|do|does|did|is|was|were|will|would|should|can|could|are|has|have|had)\b|\s*[?.!]|\s*$)
            )\b(?!-)
      | \bwhat(?:['’]s|\s+(?:is|was|were))\s+the\s+(?:date|day|time|year|month)\b
      | \bhow\s+long\b
      | \bhow\s+(?:many|much)\s+(?:more\s+|fewer\s+|less\s+)?(?:time|minutes|hours|days|weeks|months|years|decades)\b
      | \b(?:since|until|till|by)\s+when\b
      | \bat\s+what\s+(?:point|time|age)\b
      | \b(?:know|tell\s+me|remember|recall|wonder|find\s+out)\s+when\b
    )""",
    re.VERBOSE,
)


def asks_when(query: str) -> bool:
    """Whether ``query`` asks for a time or a duration: "when did…", "what year…", "how long
    ago…", "how many weeks between…", "since when…", "what time is…".

    A "when" that opens a clause ("When I deploy, what breaks?", "what did she say when Mel
    called?") is not a question about time. "when" counts when an auxiliary verb follows it
    ("when did", "when is"), after "tell me" / "remember" / "know", or when it opens a query
    with no second clause ("When Jon lost his job?").
    """
    if not isinstance(query, str):
        return False
    lowered = query.lower()
    return _ASKS_WHEN.search(lowered) is not None or _OPENS_WITH_WHEN.match(lowered) is not None
