"""The expressions: one pattern per family, and the function that turns a match into what it
names (a :class:`Hit`) against an anchor time.

A resolver returns None when the match is not a time after all ("April said", "May I") and
may raise ValueError or OverflowError on impossible dates ("Feb 30", "9999 years ago"); the
caller skips both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import date, datetime, time, timedelta
from typing import Callable, NamedTuple

from helix_ray.when.window import (
    ABSOLUTE_MARGIN,
    AGO_MARGIN,
    CALENDAR_MARGIN,
    RECENT,
    ROLLING_MARGIN,
    add_months,
)

# ---------------------------------------------------------------------------------------------
# Vocabulary

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_MONTH_NUMBER = {name: i + 1 for i, name in enumerate(MONTHS)} | {m[:3]: i + 1 for i, m in enumerate(MONTHS)}
_MONTH_NUMBER["sept"] = 9
_CASED = {"march", "may", "mar"}  # verbs in lower case: months only as "March", "May", "Mar"
MONTH = "(?:{})".format("|".join(
    f"(?-i:{w.capitalize()})" if w in _CASED else w
    for w in list(MONTHS) + ["sept", "sep"] + [m[:3] for m in MONTHS if m != "may"]
))
WEEKDAY = f"(?:{'|'.join(WEEKDAYS)})"
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
            "a": 1, "an": 1, "couple": 2, "few": 3}
NUM = (r"(?:\d{1,4}|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve"
       r"|(?:a\s+)?couple(?:\s+of)?|(?:a\s+)?few|an?)")
UNIT = r"(?:minutes?|mins?|hours?|hrs?|days?|weeks?|fortnights?|months?|years?|yrs?|decades?)"
_UNIT_NAMES = {"min": "minute", "hr": "hour", "yr": "year"}
_YEAR = r"(?<![\d/.:-])(?:1[89]|2\d)\d\d(?![\d/:-]|\.\d)"
_PART_OF_DAY = r"(?:\s+(?:morning|afternoon|evening|night))?"
_SEASON_START = {"spring": 3, "summer": 6, "autumn": 9, "fall": 9, "winter": 12}
_THIRD = {"early": 0, "mid": 1, "late": 2}
# Words that make a bare month name or year a time ("since May", "before 2022", "of 2023").
_CONTEXT_WORDS = {"in", "during", "since", "before", "after", "until", "till", "til", "from",
                  "between", "through", "throughout", "of", "as", "around", "early", "mid",
                  "late", "last", "this", "next"}


def number(words: str) -> int:
    """The value of a :data:`NUM` match: "3" → 3, "a couple of" → 2, "a few" → 3."""
    for token in reversed(words.lower().split()):
        if token.isdigit():
            return int(token)
        if token in _NUMBERS:
            return _NUMBERS[token]
    raise ValueError(f"Got {words!r}, which is not a number this module reads")


def unit(word: str) -> str:
    """The singular name of a :data:`UNIT` match: "hrs" → "hour"."""
    word = word.lower()
    word = word[:-1] if word.endswith("s") else word
    return _UNIT_NAMES.get(word, word)


def monday(day: date) -> date:
    return day - timedelta(days=day.weekday())


def thirds(first: date, stop: date, which: int) -> tuple[date, date]:
    """The first, middle or last third (``which`` 0, 1, 2) of a month (days 1–10, 11–20,
    21–end) or of a longer period, by months (a year's Jan–Apr, May–Aug, Sep–Dec)."""
    months = (stop.year - first.year) * 12 + stop.month - first.month
    if months >= 3:
        step = months // 3
        return add_months(first, step * which), (stop if which == 2 else add_months(first, step * (which + 1)))
    cuts = [first, first.replace(day=11), first.replace(day=21), stop]
    return cuts[which], cuts[which + 1]


# ---------------------------------------------------------------------------------------------
# What an expression names


@dataclass(frozen=True)
class Hit:
    """A window ``[start, end)`` in the anchor's zone, widened by ``margin`` on each side
    (``start`` None: a duration, which names no window)."""

    start: datetime | None
    end: datetime | None
    margin: timedelta = timedelta(0)
    grain: str | None = None  # the entity key's unit: day, week, month, year; None: no key
    kind: str = "relative"  # or "absolute"
    open_end: bool = False  # ends at now ("in the past week"): never widened past it
    yearless: bool = False  # a month or a day named without its year
    duration: bool = False

    @property
    def soft_start(self) -> datetime:
        assert self.start is not None
        return self.start - self.margin

    @property
    def soft_end(self) -> datetime:
        assert self.end is not None
        return self.end if self.open_end else self.end + self.margin


_PREV_WORD = re.compile(r"([a-z]+)[\s,]*$", re.IGNORECASE)
_LIST_BEFORE = re.compile(rf"(?:{MONTH}|\d)[\s,.]*(?:and|to|or|through|thru|until|till|-|–|—)\s*$", re.IGNORECASE)


class Context:
    """The text being read and the anchor time it is read against, in the anchor's zone."""

    def __init__(self, text: str, anchor: datetime) -> None:
        self.text = text
        self.now = anchor
        self.today = anchor.date()

    def midnight(self, day: date) -> datetime:
        return datetime.combine(day, time(), tzinfo=self.now.tzinfo)

    def period(self, first: date, stop: date, grain: str | None, kind: str, fraction: float) -> Hit:
        """Days ``[first, stop)``, widened on each side by ``fraction`` of their number, rounded."""
        margin = timedelta(days=int((stop - first).days * fraction + 0.5))
        return Hit(self.midnight(first), self.midnight(stop), margin, grain, kind)

    def day(self, day: date, kind: str = "relative") -> Hit:
        return self.period(day, day + timedelta(days=1), "day", kind, 0.0)

    def in_context(self, m: re.Match[str]) -> bool:
        """A bare month name or year reads as a time after a preposition or in a list of them."""
        word = _PREV_WORD.search(self.text, max(0, m.start() - 24), m.start())
        if word and word.group(1).lower() in _CONTEXT_WORDS:
            return True
        return _LIST_BEFORE.search(self.text, max(0, m.start() - 24), m.start()) is not None


# ---------------------------------------------------------------------------------------------
# Resolvers, one per family


def _named_date(ctx: Context, year: str | None, month: int, day: int) -> Hit | None:
    if year:
        return ctx.day(date(int(year), month, day), "absolute")
    for y in range(ctx.today.year, ctx.today.year - 8, -1):  # Feb 29 waits for a leap year
        try:
            found = date(y, month, day)
        except ValueError:
            if day > 29 or month != 2:
                raise
            continue
        if found <= ctx.today:
            return replace(ctx.day(found, "absolute"), yearless=True)
    return None


def _month_number(name: str) -> int:
    name = name.lower().rstrip(".")
    return _MONTH_NUMBER[name] if name in _MONTH_NUMBER else _MONTH_NUMBER[name[:3]]


def _iso_day(m: re.Match[str], ctx: Context) -> Hit | None:
    return ctx.day(date(int(m["y"]), int(m["m"]), int(m["d"])), "absolute")


def _iso_month(m: re.Match[str], ctx: Context) -> Hit | None:
    first = date(int(m["y"]), int(m["m"]), 1)
    return ctx.period(first, add_months(first, 1), "month", "absolute", ABSOLUTE_MARGIN)


def _day_of_month(m: re.Match[str], ctx: Context) -> Hit | None:
    return _named_date(ctx, m["y"], _month_number(m["mon"]), int(m["d"]))


def _month(m: re.Match[str], ctx: Context) -> Hit | None:
    name = m["mon"].lower().rstrip(".")
    month = _month_number(name)
    rel = (m["rel"] or "").lower()
    t = ctx.today
    if m["y"]:
        year = int(m["y"])
    elif m["yrel"] and name in MONTHS:
        year = t.year + {"last": -1, "this": 0, "next": 1}[m["yrel"].lower()]
    elif name not in MONTHS or not (m["prep"] or rel or ctx.in_context(m)):
        return None  # "Sep" alone, "April said", "May I": not a month
    elif rel == "next":
        year = t.year if month > t.month else t.year + 1
    elif rel == "this":
        year = t.year
    elif rel == "last":
        year = t.year if month < t.month else t.year - 1
    else:
        year = t.year if month <= t.month else t.year - 1
    first = date(year, month, 1)
    stop = add_months(first, 1)
    if rel in _THIRD:
        first, stop = thirds(first, stop, _THIRD[rel])
    relative = rel in ("next", "this", "last") or bool(m["yrel"])
    hit = ctx.period(first, stop, "month", "relative" if relative else "absolute",
                     CALENDAR_MARGIN if relative else ABSOLUTE_MARGIN)
    return replace(hit, yearless=not m["y"] and not relative)


def _year(m: re.Match[str], ctx: Context) -> Hit | None:
    if not (m["prep"] or m["rel"] or m["the_year"] or ctx.in_context(m)):
        return None  # "Cyberpunk 2077", "port 2022"
    first = date(int(m["y"]), 1, 1)
    stop = date(first.year + 1, 1, 1)
    if m["rel"]:
        first, stop = thirds(first, stop, _THIRD[m["rel"].lower()])
    return ctx.period(first, stop, "year", "absolute", ABSOLUTE_MARGIN)


_DAY_OFFSETS = {"before_yesterday": -2, "yesterday": -1, "today": 0, "tomorrow": 1, "after_tomorrow": 2}


def _named_day(m: re.Match[str], ctx: Context) -> Hit | None:
    day = ctx.today + timedelta(days=_DAY_OFFSETS[m.lastgroup or "today"])
    return ctx.period(day, day + timedelta(days=1), "day", "relative", CALENDAR_MARGIN)


def _weekday(m: re.Match[str], ctx: Context) -> Hit | None:
    wd = WEEKDAYS.index(m["wd"].lower())
    rel = " ".join(m["rel"].lower().split())
    t = ctx.today
    if rel == "this":
        day = monday(t) + timedelta(days=wd)
    elif rel in ("next", "coming", "this coming"):
        day = t + timedelta(days=(wd - t.weekday()) % 7 or 7)
    else:  # "on": the latest such day, today included; "last" / "this past": before today
        back = (t.weekday() - wd) % 7
        day = t - timedelta(days=back if rel == "on" else back or 7)
    return ctx.period(day, day + timedelta(days=1), "day", "relative", CALENDAR_MARGIN)


def _weekend(m: re.Match[str], ctx: Context) -> Hit | None:
    rel = " ".join((m["rel"] or m["rel2"]).lower().split())
    saturday = monday(ctx.today) + timedelta(days=5)  # this week's
    if rel in ("before last", "after next"):
        saturday += timedelta(days=14 if rel == "after next" else -14)
    elif rel in ("last", "previous"):
        saturday -= timedelta(days=7)
    elif rel in ("next", "coming", "this coming"):
        saturday += timedelta(days=7)
    elif rel != "this" and ctx.today < saturday:  # "this past", "over the": the latest one
        saturday -= timedelta(days=7)
    return ctx.period(saturday, saturday + timedelta(days=2), "week", "relative", CALENDAR_MARGIN)


_STEPS = {"this": 0, "last": -1, "previous": -1, "next": 1, "coming": 1, "before last": -2, "after next": 2}


def _calendar(m: re.Match[str], ctx: Context) -> Hit | None:
    step = _STEPS[" ".join((m["rel"] or m["rel2"]).lower().split())]
    name = (m["unit"] or m["unit2"]).lower()
    t = ctx.today
    if name == "week":
        first = monday(t) + timedelta(days=7 * step)
        stop = first + timedelta(days=7)
    elif name == "month":
        first = add_months(t.replace(day=1), step)
        stop = add_months(first, 1)
    else:
        first, stop = date(t.year + step, 1, 1), date(t.year + step + 1, 1, 1)
    hit = ctx.period(first, stop, name, "relative", CALENDAR_MARGIN)
    return _split_at_now(hit, (m["part"] or "").lower(), ctx) if step == 0 else hit


def _split_at_now(hit: Hit, part: str, ctx: Context) -> Hit:
    """"earlier this month": the period's days up to now; "later this month": from now on."""
    assert hit.start is not None and hit.end is not None
    if part == "earlier" and hit.start < ctx.now:
        return replace(hit, end=ctx.now, open_end=True)
    if part == "later" and ctx.now < hit.end:
        return replace(hit, start=ctx.now)
    return hit


_FIXED_UNITS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1),
                "week": timedelta(days=7), "fortnight": timedelta(days=14)}
_CALENDAR_UNITS = {"month": 1, "year": 12, "decade": 120}  # in months
_AGO_GRAIN = {"minute": "day", "hour": "day", "day": "day", "week": "day", "fortnight": "day",
              "month": "month", "year": "year", "decade": "year"}


def back(moment: datetime, n: int, name: str) -> datetime:
    """``moment`` moved n units back (n < 0: forward); months and years by the calendar."""
    if name in _FIXED_UNITS:
        return moment - _FIXED_UNITS[name] * n
    return datetime.combine(add_months(moment.date(), -n * _CALENDAR_UNITS[name]), moment.timetz())


def ago(ctx: Context, reference: datetime, n: int, name: str) -> Hit | None:
    """n units before ``reference`` (n < 0: after), widened by :data:`AGO_MARGIN` of the distance."""
    if n == 0:
        return None
    if name in ("minute", "hour"):
        moment = back(reference, n, name)
        return Hit(moment, moment, abs(moment - reference) * AGO_MARGIN, "day", "relative")
    day = back(reference, n, name).date()
    distance = abs((reference.date() - day).days)
    margin = timedelta(days=max(1, int(distance * AGO_MARGIN + 0.5)))
    return replace(ctx.day(day), margin=margin, grain=_AGO_GRAIN[name])


def _ago(m: re.Match[str], ctx: Context) -> Hit | None:
    n = number(m["n"])
    return ago(ctx, ctx.now, -n if m["dir"].lower().startswith("from") else n, unit(m["unit"]))


def _rolling(m: re.Match[str], ctx: Context) -> Hit | None:
    n = number(m["n"]) if m["n"] else 1
    if n == 0:
        return None
    start = back(ctx.now, n, unit(m["unit"] or m["unit1"] or m["unit2"]))
    margin = timedelta(days=int((ctx.now - start) / timedelta(days=1) * ROLLING_MARGIN + 0.5))
    duration = (m["prep"] or "").lower() == "for"  # "for the past three years"
    return Hit(start, ctx.now, margin, None, "relative", open_end=True, duration=duration)


def _recent(m: re.Match[str], ctx: Context) -> Hit | None:
    if "other" in m[0].lower():  # "the other day": within the last week, not today
        return ctx.period(ctx.today - timedelta(days=7), ctx.today, None, "relative", 0.0)
    return Hit(ctx.now - RECENT, ctx.now, timedelta(0), None, "relative", open_end=True)


def _season(m: re.Match[str], ctx: Context) -> Hit | None:
    rel = (m["rel"] or "").lower()
    if not (m["y"] or rel or m["prep"]):
        return None  # "I'll fall", "summer vibes"
    start_month = _SEASON_START[m["s"].lower()]
    t = ctx.today
    if m["y"]:
        first = date(int(m["y"]), start_month, 1)
    else:
        latest = date(t.year if t.month >= start_month else t.year - 1, start_month, 1)
        ongoing = t < add_months(latest, 3)
        if rel in ("last", "past"):
            first = add_months(latest, -12) if ongoing else latest
        elif rel == "this":
            first = latest if ongoing else date(t.year, start_month, 1)
        elif rel == "next":
            first = add_months(latest, 12)
        else:
            first = latest
    stop = add_months(first, 3)
    if rel in _THIRD:
        first, stop = thirds(first, stop, _THIRD[rel])
    relative = rel in ("last", "past", "this", "next")
    return ctx.period(first, stop, "year", "relative" if relative else "absolute",
                      CALENDAR_MARGIN if relative else ABSOLUTE_MARGIN)


def _quarter(m: re.Match[str], ctx: Context) -> Hit | None:
    t = ctx.today
    current = (t.month - 1) // 3  # this quarter, 0–3
    if m["rel"]:
        year, index = divmod(t.year * 4 + current + _STEPS[m["rel"].lower()], 4)
    elif m["y"] or m["yrel"]:
        year, index = int(m["y"]) if m["y"] else t.year + _STEPS[m["yrel"].lower()], int(m["q"]) - 1
    elif m["prep"] or ctx.in_context(m):  # "in Q3": the latest Q3 begun by now
        index = int(m["q"]) - 1
        year = t.year if index <= current else t.year - 1
    else:
        return None  # "Q3" alone: a label as often as a time
    first = date(year, 3 * index + 1, 1)
    relative = bool(m["rel"] or m["yrel"])
    hit = ctx.period(first, add_months(first, 3), None, "relative" if relative else "absolute",
                     CALENDAR_MARGIN if relative else ABSOLUTE_MARGIN)
    return replace(hit, yearless=not (m["y"] or relative))


def easter(year: int) -> date:
    """Western Easter Sunday (the Gregorian computus, Meeus/Jones/Butcher)."""
    a, b, c = year % 19, year // 100, year % 100
    d, e = divmod(b, 4)
    g = (8 * b + 13) // 25
    h = (19 * a + b - d - g + 15) % 30
    i, k = divmod(c, 4)
    l = (32 + 2 * e + 2 * i - h - k) % 7  # noqa: E741 (the algorithm's own names)
    m = (a + 11 * h + 22 * l) // 451
    month, day = divmod(h + l - 7 * m + 114, 31)
    return date(year, month, day + 1)


def _thanksgiving(year: int) -> date:
    """The fourth Thursday of November (the United States')."""
    first = date(year, 11, 1)
    return first + timedelta(days=(3 - first.weekday()) % 7 + 21)


HOLIDAY = r"""(?:christmas(?:\s+(?:eve|day))?|xmas(?:\s+eve)?|new\s+year[’']?s(?:\s+(?:eve|day))?|halloween
    |valentine[’']?s(?:\s+day)?|thanksgiving|easter(?:\s+(?:sunday|monday))?|independence\s+day
    |(?:the\s+)?(?:fourth|4th)\s+of\s+july|boxing\s+day|the\s+holidays|the\s+holiday\s+season)"""
# A holiday after another and a joining word ("between Christmas and New Year's").
_HOLIDAY_LIST_BEFORE = re.compile(rf"\b{HOLIDAY}\b[\s,.]*(?:and|to|or|through|thru|until|till|-|–|—)\s*$",
                                  re.IGNORECASE | re.VERBOSE)

#: A holiday's first day in a year, its length in days, and the days it is widened by on
#: each side ("over Christmas" reaches the days around it).
_HOLIDAYS: dict[str, Callable[[int], tuple[date, int, int]]] = {
    "christmas eve": lambda y: (date(y, 12, 24), 1, 0),
    "christmas day": lambda y: (date(y, 12, 25), 1, 0),
    "christmas": lambda y: (date(y, 12, 25), 1, 2),
    "boxing day": lambda y: (date(y, 12, 26), 1, 0),
    "new year's eve": lambda y: (date(y, 12, 31), 1, 0),
    "new year's day": lambda y: (date(y, 1, 1), 1, 0),
    "new year's": lambda y: (date(y - 1, 12, 31), 2, 1),  # the night and the day after it
    "halloween": lambda y: (date(y, 10, 31), 1, 0),
    "valentine's day": lambda y: (date(y, 2, 14), 1, 0),
    "independence day": lambda y: (date(y, 7, 4), 1, 0),
    "thanksgiving": lambda y: (_thanksgiving(y), 1, 1),
    "easter": lambda y: (easter(y), 1, 2),  # Good Friday to Easter Monday
    "easter sunday": lambda y: (easter(y), 1, 0),
    "easter monday": lambda y: (easter(y) + timedelta(days=1), 1, 0),
    "holidays": lambda y: (date(y, 12, 20), 14, 0),  # the holidays of year y's end
}
_HOLIDAY_NAMES = {"xmas": "christmas", "xmas eve": "christmas eve", "new years": "new year's",
                  "new years eve": "new year's eve", "new years day": "new year's day",
                  "valentine's": "valentine's day", "valentines": "valentine's day",
                  "valentines day": "valentine's day", "fourth of july": "independence day",
                  "4th of july": "independence day", "holiday season": "holidays"}


def _holiday(m: re.Match[str], ctx: Context) -> Hit | None:
    rel = (m["rel"] or "").lower()
    name = " ".join(m["h"].lower().replace("’", "'").split()).removeprefix("the ")
    name = _HOLIDAY_NAMES.get(name, name)
    listed = _HOLIDAY_LIST_BEFORE.search(ctx.text, max(0, m.start() - 40), m.start()) is not None
    if not (m["prep"] or rel or m["y"] or "july" in m["h"].lower() or listed or ctx.in_context(m)):
        return None  # "a Christmas tree", "an Easter egg in the UI"
    days = _HOLIDAYS[name]
    t = ctx.today
    if m["y"]:
        year = int(m["y"])
    elif rel == "this":
        year = t.year if name != "new year's" else t.year + 1
    else:  # the latest begun by today ("last": before today; "next": the first after it)
        year = t.year + 1
        while days(year)[0] > t or (rel in ("last", "past") and days(year)[0] == t):
            year -= 1
        if rel == "next":
            year += 1
    first, length, widen = days(year)
    stop = first + timedelta(days=length)
    relative = bool(rel)
    kind = "relative" if relative else "absolute"
    hit = Hit(ctx.midnight(first), ctx.midnight(stop), timedelta(days=widen), "day" if length == 1 else None, kind)
    return replace(hit, yearless=not (m["y"] or relative))


def _duration(m: re.Match[str], ctx: Context) -> Hit | None:
    return Hit(None, None, duration=True)


# ---------------------------------------------------------------------------------------------
# The rules, in priority order for matches of the same place and length

Resolver = Callable[[re.Match[str], Context], "Hit | None"]
YEAR_WORD = "#year"  # stands for four digits in a row among a text's words


class Rule(NamedTuple):
    pattern: re.Pattern[str]
    resolve: Resolver
    words: frozenset[str]  # a text needs one of them (lower case) for the pattern to match


def _rule(pattern: str, resolve: Resolver, words: str) -> Rule:
    return Rule(re.compile(pattern, re.IGNORECASE | re.VERBOSE), resolve, frozenset(words.split()))


def words(text: str) -> set[str]:
    """The lower-case words of ``text`` (but "may" and "march" only when it has "May", "March"),
    plus :data:`YEAR_WORD` when it has four digits in a row."""
    found = set(_WORD.findall(text.lower()))
    for word in _CASED & found:  # "may", "march" are months only capitalised
        if word.capitalize() not in text:
            found.discard(word)
    if _FOUR_DIGITS.search(text):
        found.add(YEAR_WORD)
    return found


_WORD = re.compile(r"[a-z]+")
_FOUR_DIGITS = re.compile(r"\d{4}")
_MONTH_WORDS = " ".join(MONTHS) + " sept " + " ".join(m[:3] for m in MONTHS)
_UNIT_WORDS = ("minute minutes min mins hour hours hr hrs day days week weeks fortnight fortnights "
               "month months year years yr yrs decade decades")


_DAY_NUMBER = r"(?<![\d.:/])(?P<d>\d{1,2})(?:st|nd|rd|th)?"
_ON_WEEKDAY = rf"(?:\b(?:on|in|during)\s+)?(?:\b{WEEKDAY},?\s+)?"

RULES: list[Rule] = [
    # 2023-05-08, 2023/05/08
    _rule(r"(?<![\d/.-])(?P<y>\d{4})(?P<sep>[-/])(?P<m>\d{1,2})(?P=sep)(?P<d>\d{1,2})(?!\d)",
          _iso_day, YEAR_WORD),
    # 2023-05
    _rule(r"(?<![\d/.-])(?P<y>\d{4})-(?P<m>\d{2})(?![\d-])",
          _iso_month, YEAR_WORD),
    # (on Monday,) May 8(th)(, 2023)
    _rule(rf"""{_ON_WEEKDAY}\b(?P<mon>{MONTH})\b\.?\s+(?:the\s+)?{_DAY_NUMBER}(?![\d:])
            (?:(?:\s*,\s*|\s+)(?:of\s+)?(?P<y>{_YEAR}))?""",
          _day_of_month, _MONTH_WORDS),
    # (on) (the) 8(th) (of) May(, 2023)
    _rule(rf"""{_ON_WEEKDAY}(?:\bthe\s+)?{_DAY_NUMBER}\s*(?:of\s+)?(?P<mon>{MONTH})\b\.?
            (?:,?\s*(?P<y>{_YEAR}))?""",
          _day_of_month, _MONTH_WORDS),
    # in March, last March, mid-August 2023, May 2023, August last year
    _rule(rf"""(?:\b(?P<prep>in|during|throughout)\s+)?(?:\b(?P<rel>last|this|next|early|mid|late)[\s-]+)?
            \b(?P<mon>{MONTH})\b\.?
            (?:,?\s+(?:of\s+)?(?P<y>{_YEAR}) | \s+(?:of\s+)?(?P<yrel>last|this|next)\s+year\b)?""",
          _month, _MONTH_WORDS),
    # in 2022, late 2021, the year 2020
    _rule(rf"""(?:\b(?P<prep>in|during|throughout)\s+)?(?:\b(?P<rel>early|mid|late)[\s-]+)?
            (?P<the_year>\bthe\s+year\s+)?\b(?P<y>{_YEAR})""",
          _year, YEAR_WORD),
    # today, yesterday, last night, the day before yesterday, tomorrow
    _rule(rf"""(?P<before_yesterday>\b(?:the\s+)?day\s+before\s+yesterday)
            | (?P<after_tomorrow>\b(?:the\s+)?day\s+after\s+tomorrow)
            | (?P<yesterday>\byesterday{_PART_OF_DAY}|\blast\s+night)
            | (?P<tomorrow>\btomorrow{_PART_OF_DAY})
            | (?P<today>\b(?:earlier\s+)?today|\btonight|\bthis\s+(?:morning|afternoon|evening))\b""",
          _named_day, "today tonight yesterday tomorrow morning afternoon evening night"),
    # last Friday, on Monday, next Tuesday
    _rule(rf"""\b(?P<rel>last|this\s+past|past|previous|this\s+coming|coming|this|next|on)\s+
            (?P<wd>{WEEKDAY})\b{_PART_OF_DAY}""",
          _weekday, " ".join(WEEKDAYS)),
    # last weekend, over the weekend, the weekend before last
    _rule(r"""\b(?P<rel>last|this\s+past|past|previous|this\s+coming|coming|this|next|over\s+the)\s+weekend\b
            (?!\s+(?:of|before|after)\b)
            | \bthe\s+weekend\s+(?P<rel2>before\s+last|after\s+next)\b""",
          _weekend, "weekend"),
    # this week, last month, next year, earlier this month, the week before last
    # ("last week of August" is a part of August)
    _rule(r"""\b(?:(?P<part>earlier|later)\s+)?(?P<rel>this|last|previous|next|coming)\s+(?P<unit>week|month|year)\b
            (?!\s+(?:of|before|after)\b)
            | \bthe\s+(?P<unit2>week|month|year)\s+(?P<rel2>before\s+last|after\s+next)\b""",
          _calendar, "week month year"),
    # in Q3, Q1 2024, last quarter ("the last quarter" of a game is not one; "the first
    # quarter of 2023" is a part of 2023)
    _rule(rf"""(?:\b(?P<prep>in|during|throughout)\s+)?
            (?: (?<![\w-])(?-i:Q)(?P<q>[1-4])(?![\w:])
                (?:,?\s+(?:of\s+)?(?P<y>{_YEAR}) | \s+(?:of\s+)?(?P<yrel>last|this|next)\s+year\b)?
              | (?<!\bthe\s)\b(?P<rel>this|last|previous|next|coming)\s+quarter\b(?!\s+of\b) )""",
          _quarter, "q quarter"),
    # at Christmas, on Thanksgiving 2022, last Easter, over the holidays
    _rule(rf"""(?:\b(?P<prep>on|at|over|for|during|around|by|in)\s+)?(?:\b(?P<rel>last|this|next|past)\s+)?
            \b(?P<h>{HOLIDAY})\b
            (?:,?\s+(?:of\s+)?(?P<y>{_YEAR}))?""",
          _holiday, "christmas xmas new halloween valentine valentines thanksgiving easter independence "
                    "july boxing holidays holiday"),
    # in the last 3 days, over the past few months, the past week
    _rule(rf"""(?:\b(?P<prep>in|over|during|within|for|throughout)\s+)?
            (?: (?:\bthe\s+)?\b(?:last|past|previous)\s+(?P<n>{NUM})\s+(?P<unit>{UNIT})
              | \bthe\s+(?:last|past)\s+(?P<unit1>day|week|fortnight|month|year)
              | \b(?:this\s+)?past\s+(?P<unit2>week|fortnight|month|year) )\b
            (?!\s+(?:of|before|after)\b)""",
          _rolling, _UNIT_WORDS),
    # two weeks ago, a few months back, 3 days from now
    _rule(rf"""(?:\b(?:about|around|roughly|nearly|almost|over|just\s+over|just\s+under|more\s+than
                  |less\s+than|like)\s+)?
            \b(?P<n>{NUM})\s+(?P<unit>{UNIT})\s+(?P<dir>ago|back|from\s+now)\b""",
          _ago, "ago back now"),
    # recently, lately, the other day
    _rule(r"\b(?:recently|lately|of\s+late|the\s+other\s+day|(?:in\s+)?recent\s+(?:days|weeks))\b",
          _recent, "recently lately late day recent"),
    # last summer, in the fall, summer 2024, the summer of 2021
    _rule(rf"""(?:\b(?P<prep>in|during|over|throughout)\s+(?:the\s+)?)?
            (?:\b(?P<rel>last|this|next|past|early|mid|late)[\s-]+)?
            \b(?P<s>spring|summer|autumn|fall|winter)\b(?:\s+(?:of\s+)?(?P<y>{_YEAR}))?""",
          _season, "spring summer autumn fall winter"),
    # for three years, took a week, for ages: last, and read in memories only
    _rule(rf"""\b(?:for|took|take|takes|taking|lasted|lasts|lasting|spent|spend|spends|spending|been)\s+
            (?:(?:about|around|almost|nearly|over|roughly|just|under|more\s+than|less\s+than|only|at\s+least)\s+)*
            (?P<n>{NUM})\s+(?P<unit>{UNIT})\b(?!\s+(?:ago|back|old|from)\b)
            | \bfor\s+(?:years|months|weeks|decades|ages|so\s+long|a\s+(?:long\s+)?(?:while|time))\b""",
          _duration, _UNIT_WORDS + " ages long while time"),
]
