"""The soft time window a query names, the margins that make it soft, and the windows of
the ``date:`` entity keys.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo

UTC = timezone.utc

#: "N units ago" covers the day N units back ± this share of the distance (at least a day):
#: "two weeks ago" reaches 10–18 days back, "a year ago" ± 110 days.
AGO_MARGIN = 0.3
#: "last week", "this month", "last year", "last summer": ± this share of the window's length
#: (a week ± 1 day, a 30-day month ± 5 days, a year ± 55 days, a day or a weekend ± 0).
CALENDAR_MARGIN = 0.15
#: "in the past 30 days": the start moves back by this share of the length; the end stays now.
ROLLING_MARGIN = 0.15
#: "May 8, 2023", "in March", "in 2022" mean what they say.
ABSOLUTE_MARGIN = 0.0
#: "recently", "lately": the window that far back from now.
RECENT = timedelta(days=14)

#: The open side of "before May" and of "after next week" (nothing bounds it).
UNBOUNDED_START = datetime.min.replace(tzinfo=UTC)
UNBOUNDED_END = datetime.max.replace(tzinfo=UTC)

KINDS = ("relative", "absolute", "since", "until", "range")


def as_utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive datetime is read as UTC."""
    if not isinstance(moment, datetime):
        raise TypeError(f"Got {type(moment).__name__}; pass a datetime (a naive one is read as UTC)")
    return moment.replace(tzinfo=UTC) if moment.utcoffset() is None else moment.astimezone(UTC)


@dataclass(frozen=True)
class TimeWindow:
    """A soft window ``[start, end)`` around the exact window ``[core_start, core_end)``.

    All four are UTC-aware. ``expression`` is the query text that named the window; ``kind``
    is ``relative`` (anchored on now: "yesterday", "two weeks ago"), ``absolute`` (a named
    date, month, season or year), ``since`` (from a time to now), ``until`` (everything before
    a time) or ``range`` ("between March and May"). An open side is :data:`UNBOUNDED_START` or
    :data:`UNBOUNDED_END`.
    """

    start: datetime
    end: datetime
    expression: str
    kind: str
    core_start: datetime
    core_end: datetime

    def __post_init__(self) -> None:
        for name in ("start", "end", "core_start", "core_end"):
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.utcoffset() != timedelta(0):
                raise ValueError(
                    f"Got {name}={value!r}; a TimeWindow holds UTC-aware datetimes "
                    "(convert with .astimezone(timezone.utc))"
                )
        if not self.start <= self.core_start <= self.core_end <= self.end or self.start >= self.end:
            raise ValueError(
                f"Got start={self.start}, core=[{self.core_start}, {self.core_end}), end={self.end}; "
                "they must satisfy start <= core_start <= core_end <= end and start < end"
            )
        if self.kind not in KINDS:
            raise ValueError(f"Got kind {self.kind!r}; it must be one of {', '.join(KINDS)}")

    def __contains__(self, moment: datetime) -> bool:
        return self.start <= as_utc(moment) < self.end

    def weight(self, moment: datetime) -> float:
        """1.0 inside the core window, falling linearly to 0.0 at the soft edges; 0.0 outside."""
        t = as_utc(moment)
        if not self.start <= t < self.end:
            return 0.0
        if t < self.core_start:
            return (t - self.start) / (self.core_start - self.start)
        if t >= self.core_end:
            return (self.end - t) / (self.end - self.core_end)
        return 1.0

    def as_dict(self, zone: tzinfo | None = None) -> dict[str, str]:
        """For ``explain``: the expression, the kind and the four bounds as ISO 8601
        strings, in ``zone`` (the asker's: "last week" from Berlin reads Monday to Sunday
        there) or else UTC."""
        def iso(moment: datetime) -> str:
            return (moment.astimezone(zone) if zone is not None else moment).isoformat()

        return {"expression": self.expression, "kind": self.kind, "start": iso(self.start), "end": iso(self.end),
                "core_start": iso(self.core_start), "core_end": iso(self.core_end)}


def add_months(day: date, months: int) -> date:
    """``day`` moved by whole months, clamped to the month's last day (Jan 31 + 1 → Feb 28)."""
    year, month0 = divmod(day.year * 12 + day.month - 1 + months, 12)
    return date(year, month0 + 1, min(day.day, calendar.monthrange(year, month0 + 1)[1]))


_KEY = re.compile(r"date:(\d{4})(?:-(?:w(\d{2})|(\d{2})(?:-(\d{2}))?))?")


def key_window(key: str) -> tuple[datetime, datetime] | None:
    """The UTC window ``[start, end)`` of a ``date:`` key (a day, an ISO week, a month or a
    year, as :func:`helix_ray.when.mentions` writes them), or None for any other string."""
    m = _KEY.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        return None
    year, week, month, day = m.groups()
    try:
        if week:
            first = date.fromisocalendar(int(year), int(week), 1)
            stop = first + timedelta(days=7)
        elif day:
            first = date(int(year), int(month), int(day))
            stop = first + timedelta(days=1)
        elif month:
            first = date(int(year), int(month), 1)
            stop = add_months(first, 1)
        else:
            first, stop = date(int(year), 1, 1), date(int(year) + 1, 1, 1)
    except (ValueError, OverflowError):  # "date:2023-02-30", "date:9999" (no year after it)
        return None
    return datetime.combine(first, time(), UTC), datetime.combine(stop, time(), UTC)
