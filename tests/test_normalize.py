"""Validation, normalisation and the derivation rules of type, salience, confidence."""

from __future__ import annotations

import datetime as dt
import functools
import json

import pytest

from helix_ray.config import IngestConfig, ValidationConfig
from helix_ray.ingest.normalize import (
    Rejected,
    asks_only,
    derive_confidence,
    derive_salience,
    derive_type,
    normalise,
    normalise_one,
)

NOW = dt.datetime(2025, 6, 1, tzinfo=dt.timezone.utc)
CFG = ValidationConfig(max_text_chars=1000)


def one(**raw):
    return normalise_one({"user": "dana", **raw}, CFG, default_time=NOW)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Use this:\n```python\nprint('x')\n```", "code"),
        ("Deploy billing:\n1. tag the release\n2. run the job\n```bash\nmake deploy\n```", "procedural"),
        ("We chose NATS over Kafka; the client:\n```python\nnats.connect()\n```", "decision"),
        ("The loader:\n```python\n# 1. read\n# 2. decided to parse\nsteps = [\n- a\n- b]\n```", "code"),
        ("We decided to use NATS over Kafka because it is simpler.", "decision"),
        ("The team chose Postgres for the ledger.", "decision"),
        ("To rotate the keys:\n1. run make rotate\n2. restart the gateway", "procedural"),
        ("How to run the linters before a push.", "procedural"),
        ("The worker lives in services/ingest/worker.py", "code"),
        ("Call atlas.bus.connect() before publishing.", "code"),
        ("Deployed v2.3 to production on 2025-03-14.", "episodic"),
        ("The gateway is stateless and horizontally scaled.", "semantic"),
    ],
)
def test_type_rules(text, expected):
    assert derive_type(text) == expected


def test_conversation_turn_is_episodic():
    assert derive_type("Ben: sounds good, see you there", conversational=True) == "episodic"


def test_salience_prior_markers_errors_and_pin():
    assert derive_salience("plain fact", "semantic", False) == 0.5
    assert derive_salience("Always run make lint", "procedural", False) == pytest.approx(0.75)
    assert derive_salience("def test_x(): ...", "code", False, {"code": {"test": True}}) == pytest.approx(0.3)
    assert derive_salience("def x(): ...", "code", False, {"code": {"test": False}}) == pytest.approx(0.5)
    assert derive_salience("got psycopg2.OperationalError", "semantic", False) == pytest.approx(0.6)
    assert derive_salience("Never force-push: it raised a GitError", "decision", False) == pytest.approx(0.95)
    assert derive_salience("plain fact", "episodic", True) == 0.9


@pytest.mark.parametrize(
    "text, asks",
    [
        ("Caroline: What pet do you have?", True),
        ("Caroline: Cool! What do you enjoy about them so much?", True),
        ("Tim: Thanks, John! How was it? Did it rain?", True),
        ("Melanie: Luna and Oliver! They are so sweet.", False),
        ("John: That photo is so stunning. Where was it?", False),  # states something too
        ("Tim: What's that? [image: a photo of a dog on a beach]", False),  # shares a picture
        ("Tim: Yes.", False),  # asks nothing
        ("Sam: Where is that? It looks gorgeous!", True),  # an exclamation after the question
        ("Sam: Guess what? I got married.", False),  # the question only leads in to a statement
        ("Sam: Where? At the lake.", False),
    ],
)
def test_a_chat_turn_that_only_asks_is_less_salient(text, asks):
    speaker, discount = text.split(":")[0], IngestConfig().ask_discount
    assert asks_only(text, speaker) is asks
    turn = {"user": "dana", "text": text, "metadata": {"speaker": speaker}}
    salience = normalise_one(turn, CFG, default_time=NOW, ask_discount=discount)["salience"]
    assert salience == pytest.approx(max(0.40 - discount, 0.0) if asks else 0.40)
    assert normalise_one(turn, CFG, default_time=NOW, ask_discount=0.0)["salience"] == pytest.approx(0.40)
    # A question outside a conversation (a note's open question) keeps its salience.
    note = {"user": "dana", "text": text.split(": ", 1)[1], "type": "episodic"}
    assert normalise_one(note, CFG, default_time=NOW, ask_discount=discount)["salience"] == pytest.approx(0.40)


def test_confidence_by_source():
    assert derive_confidence("user", {}) == 0.9
    assert derive_confidence("agent", {"confirmed": True}) == 0.9
    assert derive_confidence("markdown:notes/a.md", {}) == 0.8
    assert derive_confidence("transcript", {}) == 0.7
    assert derive_confidence("agent", {}) == 0.6
    assert derive_confidence("inferred", {}) == 0.5


def test_given_values_are_never_overwritten():
    row = one(text="We decided to always use NATS.", type="semantic", salience=0.1, confidence=0.2)
    assert (row["type"], row["salience"], row["confidence"]) == ("semantic", 0.1, 0.2)
    derived = one(text="We decided to always use NATS.")
    assert derived["type"] == "decision" and derived["salience"] == pytest.approx(0.85)


def test_defaults_and_stable_id():
    a = one(text="  The gateway is stateless.  ")
    b = one(text="The gateway is stateless.")
    assert a["text"] == "The gateway is stateless."
    assert a["id"] == b["id"] and len(a["id"]) == 20
    assert a["created_at"] == NOW and a["pinned"] is False and a["access_count"] == 0
    assert one(text="x", id=7)["id"] == "7"


def test_unknown_keys_are_kept_in_metadata():
    row = one(text="fact", ticket="ATL-12")
    assert '"ticket": "ATL-12"' in row["metadata"]


def test_times_are_parsed_to_utc():
    assert one(text="x", created_at="2025-03-14T10:22:00Z")["created_at"] == dt.datetime(
        2025, 3, 14, 10, 22, tzinfo=dt.timezone.utc)
    assert one(text="x", created_at=1_700_000_000)["created_at"].year == 2023
    assert one(text="x", created_at="2025-03-14T12:00:00+02:00")["created_at"].hour == 10
    # A date alone (a Parquet date32 column) is that day's start in UTC.
    assert one(text="x", created_at=dt.date(2025, 3, 14))["created_at"] == dt.datetime(2025, 3, 14, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize(
    "raw, code, words",
    [
        ({"user": "dana"}, "missing_text", "text is missing"),
        ({"text": "   ", "user": "dana"}, "empty_text", "empty"),
        ({"text": 42, "user": "dana"}, "wrong_type", "int"),
        ({"text": "x" * 1001, "user": "dana"}, "too_long", "1001"),
        ({"text": "ok", "user": "dana", "type": "opinion"}, "unknown_type", "'opinion'"),
        ({"text": "ok", "user": "dana", "salience": 1.7}, "out_of_range", "1.7"),
        ({"text": "ok", "user": "dana", "confidence": "high"}, "wrong_type", "'high'"),
        ({"text": "ok", "user": "dana", "created_at": "not-a-date"}, "bad_time", "not-a-date"),
        ({"text": "ok"}, "missing_user", "--user"),
        ({"text": "bad \udcff surrogate", "user": "dana"}, "invalid_utf8", "UTF-8"),
        ({"text": "ok", "user": "dana", "pinned": "yes"}, "wrong_type", "'yes'"),
        ({"text": "ok", "user": "dana", "metadata": [1]}, "wrong_type", "metadata"),
        # Times and counts Python or Arrow cannot hold: a bad record, not a failed ingest.
        ({"text": "ok", "user": "dana", "created_at": 1e20}, "bad_time", "outside the times"),
        ({"text": "ok", "user": "dana", "created_at": -1e13}, "bad_time", "outside the times"),
        ({"text": "ok", "user": "dana", "created_at": "9999-12-31T23:00:00-05:00"}, "bad_time", "outside"),
        ({"text": "ok", "user": "dana", "last_accessed_at": 1e300}, "bad_time", "last_accessed_at"),
        ({"text": "ok", "user": "dana", "access_count": 3_000_000_000}, "out_of_range", "3000000000"),
        # Ids the HTTP API could not name again (PATCH / DELETE): a control character, 100k characters.
        ({"text": "ok", "user": "dana", "id": "tab\tid\n"}, "bad_id", "U+0009 at position 3"),
        ({"text": "ok", "user": "dana", "id": "x" * 100_000}, "too_long", "100,000 characters"),
        ({"text": "ok", "user": "dana", "metadata": {"a": functools.reduce(lambda inner, _: [inner], range(32), 1)}},
         "too_deep", "more than 32 levels"),
        # UTF-8 cannot carry a lone surrogate: it is refused, not stored as it came.
        ({"text": "ok", "user": "dana", "metadata": {"who": "\udcff"}}, "invalid_utf8", "metadata"),
    ],
)
def test_each_kind_of_bad_row_is_rejected_with_a_reason(raw, code, words):
    with pytest.raises(Rejected) as info:
        normalise_one(raw, CFG, default_time=NOW)
    assert info.value.code == code
    assert words in str(info.value)


def test_normalise_splits_without_losing_rows():
    raws = [{"text": "good", "user": "u"}, {"text": "", "user": "u", "_source": "f.jsonl", "_position": "line 2"}]
    rows, quarantined = normalise(raws, CFG, default_time=NOW)
    assert len(rows) == 1 and len(quarantined) == 1
    assert quarantined[0]["position"] == "line 2" and quarantined[0]["reason"].startswith("empty_text")
    assert '"text": ""' in quarantined[0]["raw"]


def test_default_user_from_config():
    cfg = ValidationConfig(default_user="lee")
    assert normalise_one({"text": "x"}, cfg, default_time=NOW)["user"] == "lee"


def test_metadata_nan_and_infinity_are_stored_as_null_and_a_blank_project_as_none():
    """JSON cannot carry NaN (Python's reader and writer take it; a Parquet float column
    holds it for a missing value): stored as it came, it would be text no strict JSON
    reader takes back. It is stored as null, as JavaScript writes it; a blank project is
    no project."""
    row = normalise_one({"text": "ok", "user": "dana", "project": "  ", "weight": float("-inf"),
                         "metadata": {"score": float("nan"), "ok": 1.5, "deep": [{"x": float("inf")}]}},
                        CFG, default_time=NOW)
    assert json.loads(row["metadata"], parse_constant=lambda c: pytest.fail(f"{c} stored")) == \
        {"deep": [{"x": None}], "ok": 1.5, "score": None, "weight": None}
    assert row["project"] is None
