"""Scope and route (helix_ray.recall.scope): argument checks, the filter mask, the
skip-retrieval router, and tenant isolation end to end as a property."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from helix_ray.config import RetrievalConfig, RouterConfig, load_config
from helix_ray.errors import InvalidArgument
from helix_ray.recall import scope
from helix_ray.recall.dense import SCAN_BELOW_SHARE
from helix_ray.schema import GENERATION_SCHEMA, MEMORY_TYPES
from helix_ray.store.generation import ScopeColumns
from tests.helpers import TENANT_PROJECTS, TENANT_START, TENANT_TOPICS, TENANT_USERS

UTC = dt.timezone.utc
OK = dict(query="what did we decide", user="alice", budget_tokens=512, k=10)


# --------------------------------------------------------------------------- make_scope


@pytest.mark.parametrize(
    ("change", "received", "allowed"),
    [
        ({"query": ""}, "query=''", "non-empty string"),
        ({"query": "   "}, "query='   '", "non-empty string"),
        ({"query": None}, "query=None", "non-empty string"),
        ({"user": None}, "user=None", "user id"),
        ({"user": ""}, "user=''", "user id"),
        ({"budget_tokens": 0}, "budget_tokens=0", "> 0"),
        ({"budget_tokens": -5}, "budget_tokens=-5", "> 0"),
        ({"budget_tokens": 1.5}, "budget_tokens=1.5", "whole number"),
        ({"budget_tokens": True}, "budget_tokens=True", "whole number"),
        ({"k": 0}, "k=0", "from 1 to 200"),
        ({"k": 201}, "k=201", "from 1 to 200"),
        ({"k": "5"}, "k='5'", "from 1 to 200"),
        ({"types": ["bogus"]}, "types=['bogus']", "episodic, semantic, procedural, decision, code"),
        ({"types": "bogus"}, "types=['bogus']", "episodic"),
        ({"types": ["code", "memo"]}, "types=['code', 'memo']", "episodic"),
        ({"types": []}, "types=[]", "at least one type"),
        ({"query": "\x00\u200b\t"}, "query='\\x00\\u200b\\t'", "letter, digit, symbol or punctuation"),
        ({"budget_tokens": 10**30}, "budget_tokens=" + str(10**30), "at most 10,000,000"),
        ({"project_mode": "boost"}, "project_mode='boost'", "'filter' or 'prefer'"),
        ({"since": "yesterday"}, "since='yesterday'", "ISO-8601"),
        ({"until": 17}, "until=17", "ISO-8601"),
        ({"since": "2025-06-01", "until": "2025-01-01"}, "since='2025-06-01'", "until='2025-01-01'"),
    ],
)
def test_bad_arguments_say_what_was_received_and_allowed(change, received, allowed):
    with pytest.raises(InvalidArgument) as info:
        scope.make_scope(**{**OK, **change})
    message = str(info.value)
    assert message.startswith(f"Got {received};"), message
    assert allowed in message


def test_query_too_long_reports_its_length_not_its_text():
    with pytest.raises(InvalidArgument) as info:
        scope.make_scope(**{**OK, "query": "x" * (scope.MAX_QUERY_CHARS + 1)})
    assert f"<{scope.MAX_QUERY_CHARS + 1} characters>" in str(info.value)
    assert str(scope.MAX_QUERY_CHARS) in str(info.value)


def test_query_with_a_lone_surrogate_is_refused_clearly():
    with pytest.raises(InvalidArgument, match="lone surrogate") as info:
        scope.make_scope(**{**OK, "query": "why \ud800 nats"})
    assert "'why \\ud800 nats'" in str(info.value)  # shown escaped, once: the message stays valid UTF-8
    str(info.value).encode("utf-8")


def test_an_empty_project_is_refused_not_matched_against_nothing():
    for project in ("", "   "):
        with pytest.raises(InvalidArgument, match="Leave project out"):
            scope.make_scope(**{**OK, "project": project})


def test_good_scope_normalises_times_and_types():
    sc = scope.make_scope(**{**OK, "types": "code", "since": "2025-03-01", "until": dt.date(2025, 3, 2),
                             "project": "atlas"})
    assert sc.types == ("code",)
    assert sc.since == dt.datetime(2025, 3, 1, tzinfo=UTC)
    assert sc.until == dt.datetime(2025, 3, 2, 23, 59, 59, 999_999, tzinfo=UTC)  # a date: the whole day
    assert scope.make_scope(**{**OK, "until": "2025-03-02"}).until == sc.until
    naive = scope.make_scope(**{**OK, "since": dt.datetime(2025, 3, 1, 12)})
    assert naive.since == dt.datetime(2025, 3, 1, 12, tzinfo=UTC)
    # since == until is a valid (one-instant) window.
    scope.make_scope(**{**OK, "since": "2025-03-01T10:00:00Z", "until": "2025-03-01T10:00:00Z"})


# --------------------------------------------------------------------------- build_mask


def table_of(rows: list[dict]) -> pa.Table:
    defaults = dict(session_id=None, last_accessed_at=None, access_count=0, salience=0.5, confidence=0.6,
                    pinned=False, source="api", metadata="{}", content_hash="h", n_tokens=3)
    return pa.Table.from_pylist([{**defaults, **r} for r in rows], schema=GENERATION_SCHEMA)


def columns_of(rows: list[dict]) -> ScopeColumns:
    return ScopeColumns.from_table(table_of(rows))


MASK_ROWS = [
    # row 0 belongs to another tenant: build_mask only ever looks at [start, end)
    dict(id="x", text="x", type="code", user="bob", project="atlas", created_at=dt.datetime(2025, 1, 1, tzinfo=UTC)),
    dict(id="a", text="a", type="code", user="alice", project="atlas", created_at=dt.datetime(2025, 1, 1, tzinfo=UTC)),
    dict(id="b", text="b", type="decision", user="alice", project="beacon",
         created_at=dt.datetime(2025, 2, 1, tzinfo=UTC), pinned=True),
    dict(id="c", text="c", type="episodic", user="alice", project=None, created_at=dt.datetime(2025, 3, 1, tzinfo=UTC)),
    dict(id="d", text="d", type="code", user="alice", project="atlas",
         created_at=dt.datetime(2025, 4, 1, 8, 30, tzinfo=UTC)),
]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({}, None),
        ({"project": "atlas"}, [True, False, False, True]),
        ({"project": "atlas", "project_mode": "prefer"}, None),  # a boost in ranking, not a filter
        ({"types": ["code"]}, [True, False, False, True]),
        ({"types": ["decision", "episodic"]}, [False, True, True, False]),
        ({"since": "2025-02-01"}, [False, True, True, True]),  # inclusive
        ({"until": "2025-03-01T00:00:00Z"}, [True, True, True, False]),  # inclusive
        ({"since": "2025-01-15", "until": "2025-03-15"}, [False, True, True, False]),
        ({"until": "2025-04-01T08:30:00Z"}, [True, True, True, True]),
        ({"until": "2025-04-01T08:29:59Z"}, [True, True, True, False]),
        ({"until": "2025-04-01"}, [True, True, True, True]),  # a date: through the end of that day
        ({"since": "2025-04-01", "until": "2025-04-01"}, [False, False, False, True]),  # the whole day
        ({"until": "2025-03-31"}, [True, True, True, False]),
        ({"pinned": True}, [False, True, False, False]),
        ({"project": "atlas", "types": ["code"], "since": "2025-02-01"}, [False, False, False, True]),
    ],
)
def test_build_mask_hand_computed(filters, expected):
    cols = columns_of(MASK_ROWS)
    sc = scope.make_scope(**{**OK, **filters})
    mask = scope.build_mask(cols, 1, 5, sc)
    if expected is None:
        assert mask is None
    else:
        assert mask.dtype == bool and mask.tolist() == expected


def test_build_mask_codes_hold_across_chunks_and_for_values_nobody_has():
    """The filters compare per-row codes (ScopeColumns.types / projects): a
    generation read from several record batches has a dictionary per chunk, and the codes
    must still name one value each; a project or type no row holds matches nothing, and
    a row without a project matches no project."""
    halves = [MASK_ROWS[:3], MASK_ROWS[3:] + [dict(id="e", text="e", type="semantic", user="alice", project="zephyr",
                                                    created_at=dt.datetime(2025, 5, 1, tzinfo=UTC))]]
    table = pa.concat_tables([table_of(half) for half in halves])
    assert table.column("project").num_chunks == 2
    cols = ScopeColumns.from_table(table)
    rows = MASK_ROWS[1:] + halves[1][-1:]  # rows 1-5: the range build_mask looks at
    for filters in ({"project": "atlas"}, {"project": "zephyr"}, {"project": "nowhere"},
                    {"types": ["code", "semantic"]}, {"types": ["procedural"]}, {"types": ["episodic"], "project": "atlas"}):
        mask = scope.build_mask(cols, 1, 6, scope.make_scope(**{**OK, **filters}))
        expected = [("project" not in filters or r["project"] == filters["project"])
                    and ("types" not in filters or r["type"] in filters["types"]) for r in rows]
        assert mask.tolist() == expected, filters
    assert scope.build_mask(cols, 1, 6, scope.make_scope(**{**OK, "project": "nowhere"})).sum() == 0


# --------------------------------------------------------------------------- router


@pytest.fixture(scope="module")
def embedder():
    from helix_ray.embedder import get_embedder

    return get_embedder()


def route(embedder, query, config=RouterConfig()):
    from helix_ray.recall.embed import embed_query

    return scope.Router(embedder, config).route(query, embed_query(embedder, query))


@pytest.mark.parametrize("query", ["what is 17 * 23", "compute 17 * 23", "calculate (3 + 4) * 5", "12 / 4 + 3 ="])
def test_router_skips_arithmetic(embedder, query):
    decision = route(embedder, query)
    assert decision.skip and decision.reason == "arithmetic expression"


@pytest.mark.parametrize("query", ["4222", "0.30", "404", "2025-04-09", "v2.1.0", "port 4222?"])
def test_router_does_not_take_a_number_for_arithmetic(embedder, query):
    """A port, a version, a status code or a date is something to look up, not to compute."""
    assert route(embedder, query).reason != "arithmetic expression"


@pytest.mark.parametrize("query", [
    "what did we decide about the database?",
    "why did we choose Postgres for billing?",
    "how do I deploy our service",
    "what was the error we saw last time in the gateway",
    "what is our convention for commit messages",
])
def test_router_keeps_memory_questions(embedder, query):
    decision = route(embedder, query)
    assert not decision.skip and decision.reason == "needs memory"
    assert decision.memory_similarity > decision.no_memory_similarity


@pytest.mark.parametrize("query", ["format this JSON", "pretty print this json"])
def test_router_skips_obvious_no_memory_requests(embedder, query):
    decision = route(embedder, query)
    assert decision.skip and decision.reason == "closest to the no-memory examples"
    assert decision.no_memory_similarity >= RouterConfig().min_similarity
    assert decision.no_memory_similarity - decision.memory_similarity >= RouterConfig().margin


def test_router_threshold_is_what_decides(embedder):
    # Measured 0.841 for "format this JSON": a stricter threshold keeps retrieval on.
    assert not route(embedder, "format this JSON", RouterConfig(min_similarity=0.9)).skip
    assert not route(embedder, "what did we decide about the database?", RouterConfig(min_similarity=0.5)).skip


def test_router_disabled_never_skips(embedder):
    decision = route(embedder, "what is 17 * 23", RouterConfig(enabled=False))
    assert not decision.skip and decision.reason == "router disabled"


# --------------------------------------------------------------------------- tenant isolation

VOCAB = sorted({w.strip(".,").lower() for t in TENANT_TOPICS for w in t.split()} | {"zqx-4471", "shard", "lunch"})
DENSE_PATHS = {
    "binary-scan": load_config(RetrievalConfig),
    "hnsw": load_config(RetrievalConfig, overrides={"dense": {"exact_below": 0}}),  # force the HNSW leg
}


def moment(day: int, hour: int) -> dt.datetime:
    return TENANT_START + dt.timedelta(days=day, hours=hour)


queries = st.one_of(
    st.sampled_from(TENANT_TOPICS),  # verbatim: every other tenant holds the same sentence
    st.lists(st.sampled_from(VOCAB), min_size=1, max_size=6).map(" ".join),
)
window_edge = st.one_of(st.none(), st.tuples(st.integers(-5, 305), st.integers(0, 23)))


def in_scope(record: dict, user, project, types, since, until) -> bool:
    created = dt.datetime.fromisoformat(record["created_at"])
    return (record["user"] == user and (project is None or record["project"] == project)
            and (types is None or record["type"] in types)
            and (since is None or created >= since) and (until is None or created <= until))


@pytest.mark.parametrize("path", sorted(DENSE_PATHS))
@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    user=st.sampled_from(TENANT_USERS),
    project=st.sampled_from([None, *TENANT_PROJECTS]),  # None twice: filters often leave nothing
    types=st.one_of(st.none(), st.lists(st.sampled_from(MEMORY_TYPES), min_size=2, max_size=4, unique=True)),
    edges=st.tuples(window_edge, window_edge),
    query=queries,
    k=st.integers(1, 15),
)
def test_tenant_isolation_and_scope_filters(tenant_memory, tenant_store, path, user, project, types, edges, query, k):
    _, records = tenant_store
    times = [moment(*e) if e is not None else None for e in edges]
    if None not in times:
        times.sort()
    since, until = times
    result = tenant_memory.recall(query, user=user, project=project, types=types, since=since, until=until,
                                  k=k, budget_tokens=4000, explain=True, config=DENSE_PATHS[path])

    allowed = {rid for rid, r in records.items() if in_scope(r, user, project, types, since, until)}
    event("scope holds memories" if allowed else "scope is empty")
    # Every candidate the retrievers produced (not only what was packed) is in scope.
    assert set(result.explain["id"].to_list()) <= allowed
    for item in result.items:
        record = records[item.id]
        assert record["user"] == user
        assert item.project == record["project"] and (project is None or item.project == project)
        assert types is None or item.type in types
        created = dt.datetime.fromisoformat(item.created_at)
        assert created == dt.datetime.fromisoformat(record["created_at"])
        assert (since is None or created >= since) and (until is None or created <= until)
    # Not vacuous: when the scope holds memories and the router let the query through,
    # something comes back.
    if allowed and not result.flags["router_skip"]:
        assert result.items
        if "dense_first_pass" in result.flags:  # absent only when the strong-signal skip fired
            # A filter that keeps under SCAN_BELOW_SHARE of the tenant scans what it keeps.
            share = len(allowed) / sum(r["user"] == user for r in records.values())
            graph = path == "hnsw" and share >= SCAN_BELOW_SHARE
            expected = ("hnsw", "hnsw+binary") if graph else ("binary",)
            assert result.flags["dense_first_pass"] in expected, (share, result.flags["dense_first_pass"])
    if not allowed:
        assert result.items == []


def test_identical_text_in_four_tenants_stays_with_its_owner(tenant_memory, tenant_store):
    _, records = tenant_store
    topic = TENANT_TOPICS[5]
    owners = {r["user"] for r in records.values() if r["text"].startswith(topic)}
    assert len(owners) >= 2  # the sentence really is shared
    for user in sorted(owners):
        result = tenant_memory.recall(topic, user=user, k=5, budget_tokens=4000)
        assert result.items
        top = min(result.items, key=lambda it: it.rank)
        assert records[top.id]["user"] == user and records[top.id]["text"].startswith(topic)
        assert all(records[it.id]["user"] == user for it in result.items)


def test_user_with_no_memories_gets_nothing(tenant_memory):
    result = tenant_memory.recall("database migrations", user="mallory")
    assert result.items == [] and result.total_tokens == 0
    assert result.flags["empty_scope"] == "no memories for this user"
