"""Stage 2: scope and route.

**Scope.** The tenant (``user``) is mandatory: it selects the tenant's contiguous row
range in the generation, so the retrievers never see another tenant's rows. Project,
types, time window and pinned become a boolean mask over that range, applied inside
both retrievers before their top-k (never after).

**Route.** A skip-retrieval router: nearest centroid over embeddings of example queries
that need no memory (arithmetic, "format this JSON") and of ones that do. It skips only
when the query is close to the no-memory centroid *and* clearly closer to it than to the
memory one (conservative by default); the decision and both similarities are reported.
"""

from __future__ import annotations

import datetime as dt
import re
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from helix_ray.config import RouterConfig
from helix_ray.errors import InvalidArgument
from helix_ray.schema import MEMORY_TYPES

if TYPE_CHECKING:
    from helix_ray.store.generation import ScopeColumns

MAX_QUERY_CHARS = 8000
#: More than any model's context window: a larger budget is a mistake, refused rather than echoed back.
MAX_BUDGET_TOKENS = 10_000_000


@dataclass(frozen=True)
class Scope:
    user: str
    project: str | None = None
    types: tuple[str, ...] | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    pinned: bool | None = None
    project_mode: str = "filter"  # "filter" | "prefer" (boost in ranking instead)


def as_time(name: str, value: object, *, end_of_day: bool = False) -> dt.datetime | None:
    """A time bound as an aware datetime (naive ones are UTC). A date without a time of
    day is the day's first microsecond, or with ``end_of_day`` (``until``) its last: the
    window ``since=until=2025-05-21`` is that whole day."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if isinstance(value, str):
        text = value
        try:
            value = dt.date.fromisoformat(text.strip())
        except ValueError:
            try:
                parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                raise InvalidArgument(name, text, "it must be an ISO-8601 time such as 2025-03-14 or "
                                      "2025-03-14T10:00:00Z") from None
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)
    if isinstance(value, dt.date):
        day = dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc)
        return day + dt.timedelta(days=1, microseconds=-1) if end_of_day else day
    raise InvalidArgument(name, value, "it must be an ISO-8601 string or a datetime")


#: Most context turns a recall accepts (only the latest ``context.max_turns`` are read).
MAX_CONTEXT_TURNS = 64


def check_context(context: object) -> tuple[str, ...]:
    """The context turns of a conversational recall, oldest first, blank ones left out;
    raise :class:`InvalidArgument` for anything but a list of strings."""
    if context is None:
        return ()
    if isinstance(context, str) or not isinstance(context, (list, tuple)):
        raise InvalidArgument("context", context if isinstance(context, str) else type(context).__name__,
                              "it must be a list of the conversation's recent turns (strings), oldest first",
                              "Pass context=['earlier turn', 'latest turn'], and the question as the query.")
    if len(context) > MAX_CONTEXT_TURNS:
        raise InvalidArgument("context", f"<{len(context)} turns>", f"it holds at most {MAX_CONTEXT_TURNS} turns",
                              "Pass the latest turns only.")
    turns = []
    for n, turn in enumerate(context):
        if not isinstance(turn, str):
            raise InvalidArgument(f"context[{n}]", turn, "every context turn must be a string")
        if len(turn) > MAX_QUERY_CHARS:
            raise InvalidArgument(f"context[{n}]", f"<{len(turn)} characters>",
                                  f"a context turn must be at most {MAX_QUERY_CHARS} characters")
        if turn.strip():
            turns.append(turn.strip())
    return tuple(turns)


#: A transcript line: a speaker's label (a name or a role, at most four words), a colon, text;
#: the label may follow a quote mark, a list dash or a bracketed time, and be in bold.
_TURN = re.compile(r"^\s*(?:[>*-]\s+)?(?:\[[^\]]{1,32}\]\s*)?(?P<bold>\*\*|__)?"
                   r"(?P<label>[^\W\d_][\w.'’ ]{0,39}?)(?P=bold)?\s*:(?:\*\*|__)?\s+\S")
#: Labels of log and compiler lines, which look like turns and are not.
_NOT_SPEAKERS = frozenset({"error", "warning", "warn", "info", "debug", "note", "fatal", "trace", "critical",
                           "caused by", "exception", "traceback", "hint", "help", "file", "todo", "fixme"})
#: Role labels written in capitals that are speakers all the same.
_ROLES = frozenset({"user", "assistant", "human", "ai", "system", "bot", "me", "you", "q", "a"})


def _speaker(line: str) -> str | None:
    """The speaker label ``line`` starts with, or None."""
    match = _TURN.match(line)
    if match is None:
        return None
    label = match.group("label").strip()
    lowered = label.lower()
    if len(label.split()) > 4 or lowered in _NOT_SPEAKERS or lowered.endswith(("error", "exception", "warning")):
        return None
    if label.isupper() and lowered not in _ROLES:  # ERROR, INFO, HTTP, ...
        return None
    return lowered


def speaker_of(text: str) -> str | None:
    """The speaker of a conversation turn stored as ``"<speaker>: <text>"`` (as the
    transcript and LoCoMo readers store a turn), lower-cased; None for other text and for
    a text of several speakers' turns (a whole session, or a chunk of one)."""
    lines = text.splitlines()
    speaker = _speaker(lines[0][:80]) if lines else None
    if speaker is None or any(_speaker(line[:80]) not in (None, speaker) for line in lines[1:]):
        return None
    return speaker


def named_speakers(query: str, speakers: Iterable[str]) -> set[str]:
    """The ``speakers`` (labels as :func:`speaker_of` gives them) that ``query`` names: the
    label, or its first word, as a word of the query ("What kind of art does Caroline
    make?" names "caroline"; "what did the user ask" names "user"). A query that is itself
    a labelled turn is read without its label: the asker is not the subject."""
    if _speaker(query) is not None:
        query = query.split(":", 1)[1]
    lowered = query.lower()
    words = set(re.findall(r"[^\W_]+", lowered))  # "Bob's" names bob
    return {s for s in speakers if s.split()[0] in words or (" " in s and s in lowered)}


def split_transcript(query: str) -> tuple[str, tuple[str, ...]] | None:
    """A query that is a conversation's recent turns — lines ``"<speaker>: <text>"`` of
    two or more speakers, a speaker's line repeated once there are three or more, as an
    agent pastes its window — as ``(its last line, the turns before it, oldest first)``,
    the two that :meth:`Recaller.recall` takes as ``query`` and ``context``; None for any
    other query (one line, a log, a stack trace, headers). A line without a label carries
    on the turn before it."""
    lines = [line.strip() for line in query.splitlines() if line.strip()]
    if len(lines) < 3:
        return None
    speakers = [_speaker(line) for line in lines]
    labelled = [s for s in speakers if s is not None]
    if len(labelled) < 2 or len(set(labelled)) < 2 or (len(labelled) > 2 and len(set(labelled)) == len(labelled)):
        return None
    turns: list[str] = []
    for line, speaker in zip(lines[:-1], speakers[:-1]):
        if speaker is None and turns:
            turns[-1] += "\n" + line
        else:
            turns.append(line)
    return lines[-1], tuple(turns)


def make_scope(
    *,
    query: object,
    user: object,
    budget_tokens: object,
    k: object,
    project: str | None = None,
    types: Sequence[str] | str | None = None,
    since: object = None,
    until: object = None,
    pinned: bool | None = None,
    project_mode: str = "filter",
) -> Scope:
    """Check a recall request; raise :class:`InvalidArgument` saying what is allowed."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidArgument("query", query, "it must be a non-empty string", "Pass the question to recall for.")
    if not any(unicodedata.category(ch)[0] in "LNSP" for ch in query[:MAX_QUERY_CHARS]):
        # NULs, control and zero-width characters only: nothing to search for
        raise InvalidArgument("query", query[:40], "it must hold a letter, digit, symbol or punctuation (it holds "
                              "only control, format or space characters)", "Pass the question to recall for.")
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidArgument("query", f"<{len(query)} characters>", f"it must be at most {MAX_QUERY_CHARS} characters")
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as exc:
        around = query[max(0, exc.start - 20): exc.end + 20]  # its repr shows the surrogate as one \udxxx
        raise InvalidArgument("query", around, f"it must be valid Unicode text; character {exc.start} is a lone "
                              "surrogate", "Decode the text with errors='replace' first.") from None
    if not isinstance(user, str) or not user.strip():
        raise InvalidArgument("user", user, "it must be the tenant's non-empty user id (recall is always per user)")
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) \
            or not 0 < budget_tokens <= MAX_BUDGET_TOKENS:
        raise InvalidArgument("budget_tokens", budget_tokens,
                              f"it must be a whole number of tokens > 0 and at most {MAX_BUDGET_TOKENS:,}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 200:
        raise InvalidArgument("k", k, "it must be a whole number from 1 to 200")
    if isinstance(types, str):
        types = [types]
    if types is not None:
        types = tuple(types)
        unknown = [t for t in types if t not in MEMORY_TYPES]
        if not types:
            raise InvalidArgument("types", [], f"it must name at least one type, each one of {', '.join(MEMORY_TYPES)}",
                                  "Leave types out to recall every type.")
        if unknown:
            raise InvalidArgument("types", list(types), f"each must be one of {', '.join(MEMORY_TYPES)}")
    if project is not None and (not isinstance(project, str) or not project.strip()):
        raise InvalidArgument("project", project, "it must be a non-empty project name (a memory without a project "
                              "has none, not an empty one)", "Leave project out to recall across every project.")
    if project_mode not in ("filter", "prefer"):
        raise InvalidArgument("project_mode", project_mode, "it must be 'filter' or 'prefer'")
    start, end = as_time("since", since), as_time("until", until, end_of_day=True)
    if start and end and start > end:
        raise InvalidArgument("since", since, f"it must not be later than until={until!r}", "Swap them or widen the window.")
    return Scope(user=user, project=project, types=types, since=start, until=end, pinned=pinned,
                 project_mode=project_mode)


def build_mask(columns: ScopeColumns, start: int, end: int, scope: Scope) -> np.ndarray | None:
    """Boolean mask over rows [start, end) for every filter but the tenant; None if none.
    ``columns``: the generation's :attr:`~helix_ray.store.generation.Generation.scope_columns`."""
    mask = None

    def both(m: np.ndarray) -> None:
        nonlocal mask
        mask = m if mask is None else mask & m

    if scope.project is not None and scope.project_mode == "filter":
        both(columns.projects.isin(start, end, (scope.project,)))
    if scope.types is not None:
        both(columns.types.isin(start, end, scope.types))
    if scope.since is not None:
        both(columns.created_at[start:end] >= _micros(scope.since))
    if scope.until is not None:
        both(columns.created_at[start:end] <= _micros(scope.until))
    if scope.pinned is not None:
        both(columns.pinned[start:end] == scope.pinned)
    return mask


def _micros(value: dt.datetime) -> int:
    return int(value.timestamp() * 1_000_000)


# ----------------------------------------------------------------------------- router

NO_MEMORY_EXAMPLES = (
    "what is 2 + 2",
    "compute 17 * 23",
    "what is 15% of 240",
    "format this JSON",
    "pretty print this json object",
    "convert this YAML to JSON",
    "translate 'good morning' to French",
    "write a regex that matches an email address",
    "sort this list alphabetically",
    "what does HTTP status 404 mean in general",
    "explain what a Python list comprehension is",
    "reverse this string",
    "how many seconds are in a day",
    "fix the indentation of this code",
    "rename the variable x to count in this snippet",
)
MEMORY_EXAMPLES = (
    "what did we decide about the database",
    "why did we choose this library",
    "how do I deploy our service",
    "what was the error we saw last time",
    "where is the config file for the ingest worker",
    "what does the user prefer for formatting",
    "when did we release version 2",
    "what happened during the outage",
    "how did we fix the connection error",
    "what is our convention for naming branches",
    "who owns the billing service",
    "what did I tell you about my vacation",
    "when did Caroline go to the support group",
    "what are the steps to rotate the keys",
    "which port does the gateway listen on",
)
_ARITHMETIC = re.compile(r"^\s*(?:what is|compute|calculate)?\s*[-+*/×÷^().\d\s%=?]+\s*$", re.I)
#: An operator between two numbers: "2 + 2", "12*7", "(3-1)/2" — not "4222", "0.30" or a
#: date (dates are removed first, :data:`_DATE`).
_OPERATION = re.compile(r"[\d)]\s*[-+*/×÷^%]\s*[\d(]")
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


@dataclass(frozen=True)
class Route:
    skip: bool
    reason: str
    no_memory_similarity: float
    memory_similarity: float


class Router:
    def __init__(self, embedder, config: RouterConfig):
        self.config = config
        self.no_memory = _centroid(embedder.embed_queries(list(NO_MEMORY_EXAMPLES)))
        self.memory = _centroid(embedder.embed_queries(list(MEMORY_EXAMPLES)))

    def route(self, query: str, query_vector: np.ndarray, config: RouterConfig | None = None) -> Route:
        config = config or self.config
        if not config.enabled:
            return Route(False, "router disabled", 0.0, 0.0)
        no_sim = float(query_vector @ self.no_memory)
        mem_sim = float(query_vector @ self.memory)
        if _ARITHMETIC.match(query) and _OPERATION.search(_DATE.sub(" ", query)):
            return Route(True, "arithmetic expression", no_sim, mem_sim)
        if no_sim >= config.min_similarity and no_sim - mem_sim >= config.margin:
            return Route(True, "closest to the no-memory examples", no_sim, mem_sim)
        return Route(False, "needs memory", no_sim, mem_sim)


def _centroid(vectors: np.ndarray) -> np.ndarray:
    c = vectors.mean(axis=0)
    return (c / np.linalg.norm(c)).astype(np.float32)

