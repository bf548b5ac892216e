"""Time expressions (helix_ray.when): query windows, "when" questions, memory mentions.

Every window is checked exactly against hand-computed dates. The anchor is NOW, a Monday:
this week is May 8–14, last week May 1–7, last weekend May 6–7. Soft margins, in whole days:
calendar windows ± 15% of their length (a week ± 1, a 30/31-day month ± 5, a year ± 55),
"N ago" ± 30% of the distance (at least 1), rolling windows start 15% of their length earlier.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_ray import when
from helix_ray.when import (
    UNBOUNDED_END,
    UNBOUNDED_START,
    TimeWindow,
    asks_when,
    has_time,
    key_window,
    mentions,
    query_window,
    stated_day,
)

UTC = timezone.utc
NOW = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)  # a Monday


def d(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


# (query, expression, kind, core_start, core_end, start, end)
WINDOWS = [
    # named days: a day is not widened (15% of one day rounds to 0)
    ("what did I do today", "today", "relative", d(2023, 5, 8), d(2023, 5, 9), d(2023, 5, 8), d(2023, 5, 9)),
    ("what broke yesterday?", "yesterday", "relative", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("notes from last night", "last night", "relative", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("the day before yesterday", "the day before yesterday", "relative",
     d(2023, 5, 6), d(2023, 5, 7), d(2023, 5, 6), d(2023, 5, 7)),
    ("what is due tomorrow", "tomorrow", "relative", d(2023, 5, 9), d(2023, 5, 10), d(2023, 5, 9), d(2023, 5, 10)),
    # weeks (Monday first): 7 days × 0.15 → ± 1 day
    ("deploys this week", "this week", "relative", d(2023, 5, 8), d(2023, 5, 15), d(2023, 5, 7), d(2023, 5, 16)),
    ("what did we ship last week", "last week", "relative", d(2023, 5, 1), d(2023, 5, 8), d(2023, 4, 30), d(2023, 5, 9)),
    ("errors in the past week", "in the past week", "relative",
     d(2023, 5, 1, 13, 56), NOW, d(2023, 4, 30, 13, 56), NOW),
    # weekends: Saturday and Sunday, 2 days × 0.15 → ± 0
    ("plans for this weekend", "this weekend", "relative", d(2023, 5, 13), d(2023, 5, 15), d(2023, 5, 13), d(2023, 5, 15)),
    ("what did Mel do last weekend", "last weekend", "relative",
     d(2023, 5, 6), d(2023, 5, 8), d(2023, 5, 6), d(2023, 5, 8)),
    ("it rained over the weekend", "over the weekend", "relative",
     d(2023, 5, 6), d(2023, 5, 8), d(2023, 5, 6), d(2023, 5, 8)),
    # months: May has 31 days → ± 5 (4.65 rounds up); April 30 → ± 5 (4.5 rounds up)
    ("bugs this month", "this month", "relative", d(2023, 5, 1), d(2023, 6, 1), d(2023, 4, 26), d(2023, 6, 6)),
    ("what changed last month", "last month", "relative", d(2023, 4, 1), d(2023, 5, 1), d(2023, 3, 27), d(2023, 5, 6)),
    # years: 365 × 0.15 = 54.75 → ± 55
    ("goals for this year", "this year", "relative", d(2023, 1, 1), d(2024, 1, 1), d(2022, 11, 7), d(2024, 2, 25)),
    ("what happened last year", "last year", "relative", d(2022, 1, 1), d(2023, 1, 1), d(2021, 11, 7), d(2023, 2, 25)),
    # weekdays: "last X" is before today, "on X" may be today
    ("the meeting last Monday", "last Monday", "relative", d(2023, 5, 1), d(2023, 5, 2), d(2023, 5, 1), d(2023, 5, 2)),
    ("the playdate last Friday", "last Friday", "relative", d(2023, 5, 5), d(2023, 5, 6), d(2023, 5, 5), d(2023, 5, 6)),
    ("what did I do on Sunday", "on Sunday", "relative", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("the standup on Monday", "on Monday", "relative", d(2023, 5, 8), d(2023, 5, 9), d(2023, 5, 8), d(2023, 5, 9)),
    ("lunch next Friday", "next Friday", "relative", d(2023, 5, 12), d(2023, 5, 13), d(2023, 5, 12), d(2023, 5, 13)),
    # N units ago: the day N units back ± 30% of the distance, at least a day
    ("the bug from 3 days ago", "3 days ago", "relative", d(2023, 5, 5), d(2023, 5, 6), d(2023, 5, 4), d(2023, 5, 7)),
    ("a few days ago", "a few days ago", "relative", d(2023, 5, 5), d(2023, 5, 6), d(2023, 5, 4), d(2023, 5, 7)),
    # 14 days × 0.3 = 4.2 → 4: covers 10 to 18 days back
    ("what did I fix two weeks ago", "two weeks ago", "relative",
     d(2023, 4, 24), d(2023, 4, 25), d(2023, 4, 20), d(2023, 4, 29)),
    ("a couple of weeks ago", "a couple of weeks ago", "relative",
     d(2023, 4, 24), d(2023, 4, 25), d(2023, 4, 20), d(2023, 4, 29)),
    ("about 10 days ago", "about 10 days ago", "relative", d(2023, 4, 28), d(2023, 4, 29), d(2023, 4, 25), d(2023, 5, 2)),
    # March 8: 61 days back, × 0.3 = 18.3 → 18
    ("two months ago", "two months ago", "relative", d(2023, 3, 8), d(2023, 3, 9), d(2023, 2, 18), d(2023, 3, 27)),
    # 2022-05-08: 365 days back → 110
    ("a year ago", "a year ago", "relative", d(2022, 5, 8), d(2022, 5, 9), d(2022, 1, 18), d(2022, 8, 27)),
    # 4,383 days back (three leap days) × 0.3 = 1,314.9 → 1,315
    ("twelve years ago", "twelve years ago", "relative",
     d(2011, 5, 8), d(2011, 5, 9), d(2007, 10, 1), d(2014, 12, 14)),
    # 2 hours × 0.3 = 36 minutes
    ("the build 2 hours ago", "2 hours ago", "relative",
     d(2023, 5, 8, 11, 56), d(2023, 5, 8, 11, 56), d(2023, 5, 8, 11, 20), d(2023, 5, 8, 12, 32)),
    # rolling windows end now; 3 days × 0.15 rounds to 0, 14 × 0.15 = 2.1 → 2, 89 × 0.15 = 13.35 → 13
    ("errors in the last 3 days", "in the last 3 days", "relative",
     d(2023, 5, 5, 13, 56), NOW, d(2023, 5, 5, 13, 56), NOW),
    ("in the past 2 weeks", "in the past 2 weeks", "relative",
     d(2023, 4, 24, 13, 56), NOW, d(2023, 4, 22, 13, 56), NOW),
    ("over the past few months", "over the past few months", "relative",
     d(2023, 2, 8, 13, 56), NOW, d(2023, 1, 26, 13, 56), NOW),
    ("what did Melanie paint recently?", "recently", "relative", d(2023, 4, 24, 13, 56), NOW, d(2023, 4, 24, 13, 56), NOW),
    # months by name: the latest at or before now, not widened
    ("the outage in March", "in March", "absolute", d(2023, 3, 1), d(2023, 4, 1), d(2023, 3, 1), d(2023, 4, 1)),
    ("in May", "in May", "absolute", d(2023, 5, 1), d(2023, 6, 1), d(2023, 5, 1), d(2023, 6, 1)),
    ("camping in June", "in June", "absolute", d(2022, 6, 1), d(2022, 7, 1), d(2022, 6, 1), d(2022, 7, 1)),
    ("during March 2022", "during March 2022", "absolute", d(2022, 3, 1), d(2022, 4, 1), d(2022, 3, 1), d(2022, 4, 1)),
    ("Which book did Jolene read in January 2023?", "in January 2023", "absolute",
     d(2023, 1, 1), d(2023, 2, 1), d(2023, 1, 1), d(2023, 2, 1)),
    ("last March", "last March", "relative", d(2023, 3, 1), d(2023, 4, 1), d(2023, 2, 24), d(2023, 4, 6)),
    ("it started August last year", "August last year", "relative",
     d(2022, 8, 1), d(2022, 9, 1), d(2022, 7, 27), d(2022, 9, 6)),
    ("in mid-August 2023", "in mid-August 2023", "absolute",
     d(2023, 8, 11), d(2023, 8, 21), d(2023, 8, 11), d(2023, 8, 21)),
    # explicit dates
    ("what happened on May 7, 2023", "on May 7, 2023", "absolute", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("7 May 2023", "7 May 2023", "absolute", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("1:56 pm on 8 May, 2023", "on 8 May, 2023", "absolute", d(2023, 5, 8), d(2023, 5, 9), d(2023, 5, 8), d(2023, 5, 9)),
    ("the 2023-05-07 release", "2023-05-07", "absolute", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("the deploy on May 7th", "on May 7th", "absolute", d(2023, 5, 7), d(2023, 5, 8), d(2023, 5, 7), d(2023, 5, 8)),
    ("on May 9", "on May 9", "absolute", d(2022, 5, 9), d(2022, 5, 10), d(2022, 5, 9), d(2022, 5, 10)),
    ("on December 1,2023", "on December 1,2023", "absolute",
     d(2023, 12, 1), d(2023, 12, 2), d(2023, 12, 1), d(2023, 12, 2)),
    # years, seasons
    ("what did we use in 2022", "in 2022", "absolute", d(2022, 1, 1), d(2023, 1, 1), d(2022, 1, 1), d(2023, 1, 1)),
    ("summer 2024", "summer 2024", "absolute", d(2024, 6, 1), d(2024, 9, 1), d(2024, 6, 1), d(2024, 9, 1)),
    # June–August 2022, 92 days × 0.15 = 13.8 → 14
    ("what did we do last summer", "last summer", "relative",
     d(2022, 6, 1), d(2022, 9, 1), d(2022, 5, 18), d(2022, 9, 15)),
    # parts of a period and steps from a date
    ("the last week of August 2023", "the last week of August 2023", "absolute",
     d(2023, 8, 25), d(2023, 9, 1), d(2023, 8, 25), d(2023, 9, 1)),
    ("during the first weekend of October 2023", "during the first weekend of October 2023", "absolute",
     d(2023, 10, 7), d(2023, 10, 9), d(2023, 10, 7), d(2023, 10, 9)),
    ("in the beginning of January 2023", "in the beginning of January 2023", "absolute",
     d(2023, 1, 1), d(2023, 1, 11), d(2023, 1, 1), d(2023, 1, 11)),
    ("the week before 9 June 2023", "the week before 9 June 2023", "absolute",
     d(2023, 6, 2), d(2023, 6, 9), d(2023, 6, 2), d(2023, 6, 9)),
    ("the Friday before 17 September, 2023", "the Friday before 17 September, 2023", "absolute",
     d(2023, 9, 15), d(2023, 9, 16), d(2023, 9, 15), d(2023, 9, 16)),
    ("the weekend before 4th October, 2023", "the weekend before 4th October, 2023", "absolute",
     d(2023, 9, 30), d(2023, 10, 2), d(2023, 9, 30), d(2023, 10, 2)),
    # the period before last; the part of this one before or after now
    ("what did we ship the week before last", "the week before last", "relative",
     d(2023, 4, 24), d(2023, 5, 1), d(2023, 4, 23), d(2023, 5, 2)),
    ("the month before last", "the month before last", "relative", d(2023, 3, 1), d(2023, 4, 1), d(2023, 2, 24), d(2023, 4, 6)),
    ("the weekend before last", "the weekend before last", "relative",
     d(2023, 4, 29), d(2023, 5, 1), d(2023, 4, 29), d(2023, 5, 1)),
    ("bugs fixed earlier this month", "earlier this month", "relative", d(2023, 5, 1), NOW, d(2023, 4, 26), NOW),
    ("what is due later this week", "later this week", "relative", NOW, d(2023, 5, 15), NOW - timedelta(days=1), d(2023, 5, 16)),
    # quarters: a bare one is the latest begun (Q3 2022 in May 2023); 90 days × 0.15 → ± 14
    ("what did we ship in Q3", "in Q3", "absolute", d(2022, 7, 1), d(2022, 10, 1), d(2022, 7, 1), d(2022, 10, 1)),
    ("the Q1 2024 roadmap", "Q1 2024", "absolute", d(2024, 1, 1), d(2024, 4, 1), d(2024, 1, 1), d(2024, 4, 1)),
    ("what shipped last quarter", "last quarter", "relative", d(2023, 1, 1), d(2023, 4, 1), d(2022, 12, 18), d(2023, 4, 15)),
    ("in the first quarter of 2023", "in the first quarter of 2023", "absolute",
     d(2023, 1, 1), d(2023, 4, 1), d(2023, 1, 1), d(2023, 4, 1)),
    # holidays: the latest at or before now; Christmas and Easter reach two days around them
    ("what did we do at Christmas", "at Christmas", "absolute", d(2022, 12, 25), d(2022, 12, 26), d(2022, 12, 23), d(2022, 12, 28)),
    ("last Christmas", "last Christmas", "relative", d(2022, 12, 25), d(2022, 12, 26), d(2022, 12, 23), d(2022, 12, 28)),
    ("over Easter", "over Easter", "absolute", d(2023, 4, 9), d(2023, 4, 10), d(2023, 4, 7), d(2023, 4, 12)),
    ("on Thanksgiving 2022", "on Thanksgiving 2022", "absolute",
     d(2022, 11, 24), d(2022, 11, 25), d(2022, 11, 23), d(2022, 11, 26)),
    ("over the holidays", "over the holidays", "absolute", d(2022, 12, 20), d(2023, 1, 3), d(2022, 12, 20), d(2023, 1, 3)),
    ("the Friday before Thanksgiving", "the Friday before Thanksgiving", "absolute",
     d(2022, 11, 18), d(2022, 11, 19), d(2022, 11, 18), d(2022, 11, 19)),
    ("the fourth of July", "the fourth of July", "absolute", d(2022, 7, 4), d(2022, 7, 5), d(2022, 7, 4), d(2022, 7, 5)),
    # since: from the time to now
    ("what broke since May", "since May", "since", d(2023, 5, 1), NOW, d(2023, 5, 1), NOW),
    ("errors since the migration in May", "since the migration in May", "since", d(2023, 5, 1), NOW, d(2023, 5, 1), NOW),
    ("since last week", "since last week", "since", d(2023, 5, 1), NOW, d(2023, 4, 30), NOW),
    ("anything after May 1?", "after May 1", "since", d(2023, 5, 2), NOW, d(2023, 5, 2), NOW),
    ("what have I learned since 2022", "since 2022", "since", d(2022, 1, 1), NOW, d(2022, 1, 1), NOW),
    # until: everything before
    ("decisions before May 2023", "before May 2023", "until",
     UNBOUNDED_START, d(2023, 5, 1), UNBOUNDED_START, d(2023, 5, 1)),
    ("until May 7", "until May 7", "until", UNBOUNDED_START, d(2023, 5, 8), UNBOUNDED_START, d(2023, 5, 8)),
    ("before the release in March", "before the release in March", "until",
     UNBOUNDED_START, d(2023, 4, 1), UNBOUNDED_START, d(2023, 4, 1)),
    ("How many pets did Andrew have, as of September 2022?", "as of September 2022", "until",
     UNBOUNDED_START, d(2022, 10, 1), UNBOUNDED_START, d(2022, 10, 1)),
    # ranges; the first end takes the year of the second
    ("between March and May 2022", "between March and May 2022", "range",
     d(2022, 3, 1), d(2022, 6, 1), d(2022, 3, 1), d(2022, 6, 1)),
    ("Where was John between August 11 and August 15 2022?", "between August 11 and August 15 2022", "range",
     d(2022, 8, 11), d(2022, 8, 16), d(2022, 8, 11), d(2022, 8, 16)),
    ("from last Monday to yesterday", "from last Monday to yesterday", "range",
     d(2023, 5, 1), d(2023, 5, 8), d(2023, 5, 1), d(2023, 5, 8)),
    ("between Christmas and New Year's", "between Christmas and New Year's", "range",
     d(2022, 12, 25), d(2023, 1, 2), d(2022, 12, 23), d(2023, 1, 3)),
]


@pytest.mark.parametrize(("query", "expression", "kind", "core_start", "core_end", "start", "end"), WINDOWS,
                         ids=[w[0] for w in WINDOWS])
def test_query_window(query, expression, kind, core_start, core_end, start, end):
    window = query_window(query, NOW)
    assert window == TimeWindow(start, end, expression, kind, core_start, core_end)


NO_TIME = [
    "how do I rotate the API key",
    "what did Caroline say about painting",
    "May I ask where the config lives?",  # "May" with no day, year or preposition
    "I may go to the march downtown",  # lower-case verbs
    "April said the tests pass",  # a name
    "why does the build take so long",
    "what's the second step of the release",  # "second" is not a unit
    "Cyberpunk 2077 crashes on start",  # a year needs a preposition
    "the 3-year-old server keeps rebooting",
    "summer vibes playlist",
    "Where did Caroline move from?",
    "put a Christmas tree in the lobby",  # a holiday needs a preposition, "last", "this" or a year
    "found an easter egg in the settings page",
    "Q3: why is the build slow",  # a quarter needs a preposition or a year
    "the plan for Q3",  # "for" is no such preposition: a plan for Q3 may be this year's or last
    "he scored twice in the last quarter",  # of a game
    "",
]


@pytest.mark.parametrize("query", NO_TIME)
def test_no_time_in_ordinary_queries(query):
    assert query_window(query, NOW) is None
    assert not has_time(query)
    assert mentions(query, NOW) == []


def test_the_first_expression_wins_and_from_is_a_place_when_alone():
    window = query_window("Where did Caroline move from 4 years ago, and what did she do last week?", NOW)
    assert window is not None
    assert (window.expression, window.core_start) == ("4 years ago", d(2019, 5, 8))


def test_a_named_day_sets_when_a_relative_expression_was_said():
    """"last Friday … on 23 January, 2022" is the Friday before that Sunday, not before NOW."""
    window = query_window("What did Joanna just finish last Friday on 23 January, 2022?", NOW)
    assert window is not None
    assert (window.expression, window.core_start, window.core_end) == ("last Friday", d(2022, 1, 21), d(2022, 1, 22))
    window = query_window("a hike a few years back, as mentioned on June 26, 2023?", NOW)
    assert window is not None and window.core_start == d(2020, 6, 26)


def test_after_a_future_time_is_open_ended():
    window = query_window("what is planned after next week", NOW)
    assert window is not None
    assert (window.kind, window.core_start, window.end) == ("since", d(2023, 5, 22), UNBOUNDED_END)


def test_the_anchor_zone_decides_the_calendar_day():
    """At 20:00 on May 7 in New York it is already May 8 in UTC; "yesterday" is May 6 there."""
    new_york = datetime(2023, 5, 7, 20, 0, tzinfo=ZoneInfo("America/New_York"))
    window = query_window("what did I do yesterday", new_york)
    assert window is not None
    assert (window.start, window.end) == (d(2023, 5, 6, 4), d(2023, 5, 7, 4))  # EDT is UTC-4
    assert mentions("I went to a support group yesterday", new_york) == ["date:2023-05-06"]


def test_naive_means_utc():
    naive = NOW.replace(tzinfo=None)
    for query, *_ in WINDOWS:
        assert query_window(query, naive) == query_window(query, NOW)


def test_an_anchor_must_be_a_datetime():
    with pytest.raises(TypeError, match="pass a datetime"):
        query_window("yesterday", "2023-05-08")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass a datetime"):
        mentions("yesterday", None)  # type: ignore[arg-type]


def test_margins_are_module_constants():
    assert (when.AGO_MARGIN, when.CALENDAR_MARGIN, when.ROLLING_MARGIN, when.ABSOLUTE_MARGIN) == (0.3, 0.15, 0.15, 0.0)
    assert when.RECENT == timedelta(days=14)


def test_window_weight_contains_and_as_dict():
    window = query_window("two weeks ago", NOW)
    assert window is not None
    assert window.weight(d(2023, 4, 24, 12)) == 1.0  # inside the core day
    assert window.weight(d(2023, 4, 22)) == 0.5  # halfway down the 4-day margin
    assert window.weight(d(2023, 4, 27)) == 0.5
    assert window.weight(d(2023, 4, 29)) == 0.0  # the end is exclusive
    assert d(2023, 4, 20) in window and d(2023, 4, 29) not in window
    assert datetime(2023, 4, 21) in window  # naive is UTC
    assert window.as_dict() == {
        "expression": "two weeks ago",
        "kind": "relative",
        "start": "2023-04-20T00:00:00+00:00",
        "end": "2023-04-29T00:00:00+00:00",
        "core_start": "2023-04-24T00:00:00+00:00",
        "core_end": "2023-04-25T00:00:00+00:00",
    }


def test_time_window_rejects_bad_values():
    with pytest.raises(ValueError, match="UTC-aware"):
        TimeWindow(datetime(2023, 5, 1), d(2023, 5, 2), "x", "absolute", d(2023, 5, 1), d(2023, 5, 2))
    with pytest.raises(ValueError, match="start <= core_start"):
        TimeWindow(d(2023, 5, 2), d(2023, 5, 1), "x", "absolute", d(2023, 5, 2), d(2023, 5, 1))
    with pytest.raises(ValueError, match="one of relative"):
        TimeWindow(d(2023, 5, 1), d(2023, 5, 2), "x", "soon", d(2023, 5, 1), d(2023, 5, 2))


ASKS_WHEN = [
    ("When did Caroline go to the LGBTQ support group?", True),
    ("when was the API key last rotated", True),
    ("When's the next release?", True),
    ("What date did we ship v2?", True),
    ("What year did John start surfing?", True),
    ("In which month's game did John score 40 points?", True),
    ("How long ago was Caroline's 18th birthday?", True),
    ("How long has Melanie been creating art?", True),
    ("How many weeks between the launch and the outage?", True),
    ("Since when do we pin numpy?", True),
    ("What time is the standup?", True),
    ("Do you remember when we moved to Postgres?", True),
    ("When Jon has lost his job as a banker?", True),  # no second clause: asks for the time
    ("When I deploy, what breaks?", False),
    ("When we run the tests, which ones are flaky?", False),
    ("when you rotate the key, do I need to restart the workers", False),
    ("When I deploy what breaks?", False),
    ("What did Caroline say when Melanie asked about painting?", False),
    ("how do I rotate the API key", False),
    ("What time management techniques do they use?", False),
    ("what time zone does the server use?", False),
    ("What day-to-day tasks does Deborah do?", False),
    ("How many times did the job fail?", False),
]


@pytest.mark.parametrize(("query", "expected"), ASKS_WHEN)
def test_asks_when(query, expected):
    assert asks_when(query) is expected


CREATED = NOW  # the memory's own creation time

# Realistic chat turns, created on Monday 2023-05-08.
MENTIONS = [
    ("I went to a LGBTQ support group yesterday and it was so powerful.", ["date:2023-05-07"]),
    ("We had a doggy playdate last Friday. It was a bit crazy!", ["date:2023-05-05"]),
    ("Yesterday I met some artists in Boston; two weeks ago I was in Rome for 3 days.",
     ["date:2023-05-07", "date:2023-04-24", "time:duration"]),
    ("The release went out on 2023-05-07, the same day as the May 7 outage.", ["date:2023-05-07"]),
    ("It happened on 7 May 2023, a Sunday.", ["date:2023-05-07"]),
    ("I adopted her two years ago when I was feeling lonely.", ["date:2021"]),
    ("Last week I won my second tournament!", ["date:2023-w18"]),
    ("Last weekend our city held a pride parade!", ["date:2023-w18"]),
    ("I've been playing professionally for just under a year now.", ["time:duration"]),
    ("Last year, I helped renovate a community center. It took a lot of work.", ["date:2022"]),
    ("I moved here last month and started the new job in March.", ["date:2023-04", "date:2023-03"]),
    ("I graduated in 2019 and have worked in IT since 2020.", ["date:2019", "date:2020"]),
    ("Gonna explore more and volunteer at shelters next month. See you tomorrow!", ["date:2023-06", "date:2023-05-09"]),
    ("This was my Rocky Mountains trip last summer.", ["date:2022"]),
    ("The week before 9 June 2023 I gave a talk at a school.", ["date:2023-w22"]),
    ("We went camping a few weeks ago and it rained recently.", ["date:2023-04-17"]),
    ("They'd been sad for months, but they laughed today.", ["time:duration", "date:2023-05-08"]),
    ("May I join? I'll be there in May, or I may march with them.", ["date:2023-05"]),
    ("It's been my stress-buster since childhood!", []),
    ("YESTERDAY the CI was red", ["date:2023-05-07"]),
    ("We went skiing over Christmas, and at Easter 2021 too.", ["date:2022-12-25", "date:2021-04-04"]),
]


@pytest.mark.parametrize(("text", "expected"), MENTIONS, ids=[m[0][:40] for m in MENTIONS])
def test_mentions(text, expected):
    assert mentions(text, CREATED) == expected
    assert has_time(text) is bool(expected)


@pytest.mark.parametrize(("year", "day"), [(2019, 21), (2021, 4), (2023, 9), (2025, 20)])
def test_easter_is_the_gregorian_computus(year, day):
    assert when.rules.easter(year) == datetime(year, 4, day).date()
    assert when.rules.easter(2024) == datetime(2024, 3, 31).date()


def test_has_time_sees_clock_times_and_loose_times():
    assert has_time("standup moved to 10:30")
    assert has_time("call at 3pm")
    assert has_time("it broke recently")  # a time, with no entity key
    assert mentions("it broke recently", CREATED) == []
    assert not has_time("the ratio is 3 to 4")


@pytest.mark.parametrize(("key", "window"), [
    ("date:2023-05-07", (d(2023, 5, 7), d(2023, 5, 8))),
    ("date:2023-w18", (d(2023, 5, 1), d(2023, 5, 8))),
    ("date:2023-05", (d(2023, 5, 1), d(2023, 6, 1))),
    ("date:2023", (d(2023, 1, 1), d(2024, 1, 1))),
    ("date:2023-02-30", None),
    ("time:duration", None),
    ("topic:date", None),
])
def test_key_window(key, window):
    assert key_window(key) == window


@pytest.mark.parametrize(("text", "day"), [
    ("2024-05-03", d(2024, 5, 3).date()),
    ("2024-05-03-standup", d(2024, 5, 3).date()),  # a file name
    ("3 May 2024: rollback", d(2024, 5, 3).date()),  # a heading's label colon
    ("Deploy, May 3rd, 2024", d(2024, 5, 3).date()),
    ("Moved 2024-05-03, reverted 2024-05-09", d(2024, 5, 3).date()),  # the first one
    ("at 10:30 on 2024/05/03", d(2024, 5, 3).date()),
    ("May 3", None),  # no year: which May 3 depends on when it was written
    ("yesterday", None),
    ("in May 2024", None),  # a month is no day
    ("since 2024-05-03", None),  # a bound, not the day it happened
    ("2024-13-45", None),
    ("Notes", None),
])
def test_stated_day(text, day):
    assert stated_day(text) == day


ODD = [
    "Feb 30, 2023", "31 September", "2023-13-45", "2023-02-29", "in the last 0 days", "0 days ago",
    "9999 years ago", "the last 9999 years", "in 9999", "December 31, 9999", "the day after December 31, 9999",
    "after 9999-12-31", "since Jan 1, 1800", "🎉🎉 yesterday 🎉", "\x00\ud800 May 8", "May 2023 2024",
    "between May and March", "the first half of", "of of of May May May", "last last last week",
]


@pytest.mark.parametrize("text", ODD)
@pytest.mark.parametrize("anchor", [NOW, datetime(1, 1, 1), datetime(9999, 12, 31, 23, 59),
                                    datetime(2023, 5, 8, tzinfo=timezone(timedelta(hours=-12)))])
def test_odd_text_never_raises(text, anchor):
    window = query_window(text, anchor)
    assert window is None or window.start < window.end
    assert all(k == k.lower() for k in mentions(text, anchor))
    has_time(text)
    asks_when(text)
    stated_day(text)


def test_odd_dates_resolve_or_vanish():
    assert query_window("Feb 30, 2023", NOW) is None
    assert mentions("Feb 30, 2023", NOW) == []
    assert mentions("May 2023 2024", NOW) == ["date:2023-05"]
    leap = query_window("on Feb 29", NOW)  # the latest Feb 29 at or before NOW
    assert leap is not None and leap.core_start == d(2020, 2, 29)


def test_long_text():
    text = ("We met yesterday and talked about nothing in particular for a while. " * 1500)[:100_000]
    assert mentions(text, NOW) == ["date:2023-05-07", "time:duration"]
    window = query_window(text, NOW)
    assert window is not None and window.expression == "yesterday"


_WORDS = ["yesterday", "last", "next", "week", "weekend", "May", "may", "March", "8", "2023", "in", "since",
          "before", "between", "and", "ago", "two", "a", "few", "days", "months", "the", "of", "Friday", "on",
          "summer", "early", "first", "half", "2023-05-08", ",", "for", "years", "end", "after"]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(_WORDS) | st.text(max_size=4), max_size=14), st.datetimes(timezones=st.just(UTC)))
def test_random_word_salad(words, anchor):
    text = " ".join(words)
    window = query_window(text, anchor)
    if window is not None:
        assert window.start <= window.core_start <= window.core_end <= window.end
        assert window.expression in " ".join(text.split())
    for key in mentions(text, anchor):
        assert key == "time:duration" or key_window(key) is not None


def test_the_package_imports_only_the_standard_library():
    """helix_ray.when sits at layer 0: recall and ingest import it, it imports neither."""
    import ast
    import sys
    from pathlib import Path

    package = Path(when.__file__).parent
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    outside = {n for n in imported if not n.startswith("helix_ray.when") and n.split(".")[0] not in sys.stdlib_module_names}
    assert not outside, f"helix_ray/when imports {sorted(outside)}; it may import only the standard library"
