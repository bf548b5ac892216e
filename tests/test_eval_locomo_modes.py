"""LoCoMo's loader modes (a document per session, the question's date, turns before the
question) on a small LoCoMo-shaped file each test writes, and how the runner hands
them to the systems: the query string, recall's ``now`` and ``context``, chunks
counted as their documents."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from helix_ray.config import IngestConfig
from helix_ray.eval import EvalQuery, load_locomo
from helix_ray.eval import runner

DATES = {1: "1:56 pm on 8 May, 2023", 2: "12:05 am on 15 May, 2023", 3: "9:30 am on 2 June, 2023",
         4: "4:00 pm on 20 June, 2023"}


def _turn(session: int, n: int, speaker: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"speaker": speaker, "dia_id": f"D{session}:{n}", "text": text, **extra}


def _conversation() -> dict[str, Any]:
    """Three sessions of five, six and four turns; a date for a fourth session that has none
    (as conv-26 of the real file has), which is not the conversation's present."""
    conv: dict[str, Any] = {"speaker_a": "Ana", "speaker_b": "Ben"}
    lengths = {1: 5, 2: 6, 3: 4}
    for s, length in lengths.items():
        conv[f"session_{s}_date_time"] = DATES[s]
        conv[f"session_{s}"] = [_turn(s, n, "Ana" if n % 2 else "Ben", f"session {s} line {n} about topic{s}x{n}")
                                for n in range(1, length + 1)]
    conv["session_1"][2] = _turn(1, 3, "Ana", "I adopted a grey cat called Pebble!",
                                 blip_caption="a photo of a grey cat", img_url=["https://example.invalid/p.jpg"])
    conv["session_4_date_time"] = DATES[4]
    return conv


QA = [
    {"question": "What is the name of Ana's cat?", "answer": "Pebble", "evidence": ["D1:3"], "category": 4},
    {"question": "What links lines one and two?", "answer": "x", "evidence": ["D1:1; D2:2"], "category": 1},
    {"question": "When was line three said?", "answer": "x", "evidence": ["D3:3"], "category": 2},
    {"question": "Unanswerable?", "answer": "x", "evidence": [], "category": 3},
    {"question": "Adversarial?", "evidence": ["D1:1"], "category": 5},
    {"question": "Where is line nine?", "answer": "x", "evidence": ["D2:9"], "category": 4},
]


@pytest.fixture()
def locomo(tmp_path: Path) -> Path:
    path = tmp_path / "locomo_like.json"
    second = _conversation()
    path.write_text(json.dumps([{"sample_id": "conv-a", "conversation": _conversation(), "qa": QA},
                                {"sample_id": "conv-b", "conversation": second, "qa": QA[:3]}]))
    return path


# --------------------------------------------------------------------------- loader


def test_session_documents(locomo: Path) -> None:
    evalset = load_locomo(locomo, granularity="session")
    docs = {d.id: d for d in evalset.corpora["conv-a"]}
    assert list(docs) == ["conv-a:session_1", "conv-a:session_2", "conv-a:session_3"]  # session 4 has no turns
    first = docs["conv-a:session_1"]
    lines = first.text.split("\n")
    assert lines[0] == DATES[1]
    assert lines[1] == "Ana: session 1 line 1 about topic1x1"
    assert lines[3] == "Ana: I adopted a grey cat called Pebble! [image: a photo of a grey cat]"
    assert len(lines) == 1 + 5
    assert first.created_at == "2023-05-08T13:56:00Z"
    assert first.session_id == "conv-a:session_1"
    assert docs["conv-a:session_2"].created_at == "2023-05-15T00:05:00Z"


def test_session_gold_and_the_same_questions_as_turns(locomo: Path) -> None:
    turns = load_locomo(locomo)
    sessions = load_locomo(locomo, granularity="session")
    assert [q.id for q in sessions.queries] == [q.id for q in turns.queries]
    assert [q.id for q in turns.queries] == ["conv-a:q0", "conv-a:q1", "conv-a:q2", "conv-b:q0", "conv-b:q1",
                                              "conv-b:q2"]  # q3 empty evidence, q4 cat 5, q5 no such turn
    gold = {q.id: set(q.gold) for q in sessions.queries if q.corpus_id == "conv-a"}
    assert gold == {"conv-a:q0": {"conv-a:session_1"}, "conv-a:q1": {"conv-a:session_1", "conv-a:session_2"},
                    "conv-a:q2": {"conv-a:session_3"}}
    assert {q.id: set(q.gold) for q in turns.queries}["conv-a:q1"] == {"conv-a:D1:1", "conv-a:D2:2"}
    for q in sessions.queries:
        assert q.gold <= {d.id for d in sessions.corpora[q.corpus_id]}
    assert [q.text for q in sessions.queries] == [q.text for q in turns.queries]


def test_haystack_joins_sessions_of_every_conversation_into_one_store(locomo: Path) -> None:
    from helix_ray.eval.locomo import HAYSTACK, as_haystack

    sessions = load_locomo(locomo, granularity="session")
    hay = as_haystack(sessions, 2)
    assert list(hay.corpora) == [HAYSTACK]
    docs = {d.id: d for d in hay.corpora[HAYSTACK]}
    assert list(docs) == ["conv-a:sessions_1-2", "conv-a:sessions_3-3", "conv-b:sessions_1-2", "conv-b:sessions_3-3"]
    one, two = (d.text for d in sessions.corpora["conv-a"][:2])
    assert docs["conv-a:sessions_1-2"].text == one + "\n\n" + two  # each session keeps its date line
    assert docs["conv-a:sessions_1-2"].created_at == "2023-05-08T13:56:00Z"
    gold = {q.id: set(q.gold) for q in hay.queries}
    assert gold["conv-a:q1"] == {"conv-a:sessions_1-2"}  # evidence in sessions 1 and 2: one document
    assert gold["conv-b:q2"] == {"conv-b:sessions_3-3"}
    assert [q.question_date for q in hay.queries] == [q.question_date for q in sessions.queries]
    assert {q.corpus_id for q in hay.queries} == {HAYSTACK}
    assert as_haystack(sessions, 1).corpora[HAYSTACK][0].text == one
    with pytest.raises(ValueError, match="at least 1"):
        as_haystack(sessions, 0)


def test_question_date_is_the_conversations_last_session(locomo: Path) -> None:
    for granularity in ("turn", "session"):
        for q in load_locomo(locomo, granularity=granularity).queries:
            assert q.question_date == "2023-06-02T09:30:00Z"  # session 3; session 4 has a date, no turns
            assert runner.question_time(q) == dt.datetime(2023, 6, 2, 9, 30, tzinfo=dt.timezone.utc)


def test_query_context(locomo: Path) -> None:
    assert all(q.context == () for q in load_locomo(locomo).queries)
    evalset = load_locomo(locomo, query_context=3)
    sessions = {s: [d.text for d in evalset.corpora["conv-a"] if d.session_id == f"conv-a:session_{s}"]
                for s in (1, 2, 3)}
    evidence_sessions = {"conv-a:q0": {1}, "conv-a:q1": {1, 2}, "conv-a:q2": {3}}
    for q in evalset.queries:
        if q.corpus_id != "conv-a":
            continue
        assert len(q.context) == 3
        # consecutive turns, in order, of one session that holds none of the evidence
        homes = [s for s, texts in sessions.items()
                 if any(texts[i:i + 3] == list(q.context) for i in range(len(texts) - 2))]
        assert homes and not set(homes) & evidence_sessions[q.id], (q.id, q.context)
    # q1's evidence is in sessions 1 and 2: its turns come from session 3
    assert next(q for q in evalset.queries if q.id == "conv-a:q1").context[0].startswith(("Ana: session 3",
                                                                                           "Ben: session 3"))
    # The same draw on every load and at both granularities (seeded by the question id alone).
    again = load_locomo(locomo, query_context=3, granularity="session")
    assert [q.context for q in again.queries] == [q.context for q in evalset.queries]
    # Both conversations hold the same turns; their question ids differ, and so may the draw, but
    # each is still a valid window.
    assert all(len(q.context) == 3 for q in evalset.queries)


def test_query_context_longer_than_every_other_session(locomo: Path) -> None:
    q1 = next(q for q in load_locomo(locomo, query_context=5).queries if q.id == "conv-a:q1")
    assert len(q1.context) == 4  # only session 3 (four turns) is free of its evidence: given whole
    q0 = next(q for q in load_locomo(locomo, query_context=6).queries if q.id == "conv-a:q0")
    assert len(q0.context) == 6 and q0.context[0] == "Ana: session 2 line 1 about topic2x1"  # only session 2 has 6


def test_mode_errors(locomo: Path) -> None:
    with pytest.raises(ValueError, match="granularity"):
        load_locomo(locomo, granularity="utterance")
    with pytest.raises(ValueError, match="whole number >= 0"):
        load_locomo(locomo, query_context=-1)
    with pytest.raises(ValueError, match="tuple"):
        EvalQuery(id="q", text="t", gold=frozenset({"d"}), category=None, corpus_id="c",
                  context=["a"])  # type: ignore[arg-type]


def test_store_keys_differ_between_granularities(locomo: Path) -> None:
    config = IngestConfig()
    keys = {g: runner.store_key(load_locomo(locomo, granularity=g).corpora["conv-a"], config, ["episodic"])
            for g in ("turn", "session")}
    assert keys["turn"] != keys["session"]
    same = runner.store_key(load_locomo(locomo, query_context=2).corpora["conv-a"], config, ["episodic"])
    assert same == keys["turn"]  # the turns before a question are the query's, not the store's


def test_cli_refuses_what_it_cannot_run(locomo: Path, tmp_path: Path, capsys) -> None:
    from helix_ray.cli import main

    assert main(["eval", "beir", "--data", str(tmp_path), "--query-context", "2"]) == 2
    assert "only LoCoMo" in capsys.readouterr().err
    assert main(["eval", "beir", "--data", str(tmp_path), "--granularity", "session"]) == 2
    assert main(["eval", "locomo", "--data", str(locomo), "--systems", "bm25+ctx",
                 "--workdir", str(tmp_path / "stores")]) == 2
    assert "+ctx" in capsys.readouterr().err
    assert main(["eval", "locomo", "--data", str(locomo), "--haystack", "2", "--granularity", "turn"]) == 2
    assert "--haystack" in capsys.readouterr().err
    assert not (tmp_path / "stores").exists()  # refused before any store is built


# --------------------------------------------------------------------------- runner


@dataclasses.dataclass
class Item:
    id: str
    rank: int
    parent: str | None = None


class FakeRecaller:
    """Records what each recall was given; answers chunks of documents out of order."""

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.calls: list[dict[str, Any]] = []
        self.generation = SimpleNamespace(columns=SimpleNamespace(ids=np.asarray([i.id for i in items], dtype=object)))

    def recall(self, query: str, **kwargs: Any) -> Any:
        self.calls.append({"query": query, **kwargs})
        return SimpleNamespace(items=list(self.items))


def _query(context: tuple[str, ...] = ("Ana: hi", "Ben: hello")) -> EvalQuery:
    return EvalQuery(id="conv-a:q0", text="What is the cat called?", gold=frozenset({"doc-1"}), category="4",
                     corpus_id="conv-a", question_date="2023-06-02T09:30:00Z", context=context)


def test_helix_and_helix_ctx_get_the_turns_differently() -> None:
    q = _query()
    plain, ctx = FakeRecaller([Item("m1", 1)]), FakeRecaller([Item("m1", 1)])
    runner._system("helix")(plain, runner.asked("helix", q), 10)
    runner._system("helix+ctx")(ctx, runner.asked("helix+ctx", q), 10)
    now = dt.datetime(2023, 6, 2, 9, 30, tzinfo=dt.timezone.utc)
    assert plain.calls[0]["query"] == "Ana: hi\nBen: hello\nWhat is the cat called?"
    assert "context" not in plain.calls[0] and plain.calls[0]["now"] == now
    assert ctx.calls[0]["query"] == "What is the cat called?"
    assert ctx.calls[0]["context"] == ["Ana: hi", "Ben: hello"] and ctx.calls[0]["now"] == now
    # Baselines read the joined string too.
    assert runner.asked("bm25", q).text == plain.calls[0]["query"]
    # Without turns, nothing changes and no context is passed.
    bare = _query(context=())
    assert runner.asked("helix", bare) is bare
    runner._system("helix+ctx")(ctx, runner.asked("helix+ctx", bare), 10)
    assert "context" not in ctx.calls[1] and ctx.calls[1]["query"] == bare.text
    # No question date: recall keeps its own clock.
    runner._system("helix")(plain, dataclasses.replace(bare, question_date=None), 10)
    assert plain.calls[-1]["now"] is None


def test_ctx_suffix_names() -> None:
    assert runner.base_system("helix-no-graph+ctx") == "helix-no-graph"
    assert runner._system("helix-no-graph+ctx") is runner.SYSTEMS["helix-no-graph"]
    for bad in ("bm25+ctx", "rrf+ctx", "nope+ctx", "helix+ctx+ctx"):
        with pytest.raises(ValueError, match="allowed"):
            runner._system(bad)


def test_a_helix_system_with_settings_runs_recall_with_them_on_helixs_store() -> None:
    name = "helix@rank.reweigh_silent=true@late.weight=0.5+ctx"
    assert runner.base_system(name) == "helix"
    assert runner.settings_of(name) == {"rank": {"reweigh_silent": True}, "late": {"weight": 0.5}}
    recaller = FakeRecaller([Item("m1", 1)])
    runner._system(name)(recaller, runner.asked(name, _query()), 10)
    config = recaller.calls[0]["config"]
    assert config.rank.reweigh_silent is True and config.late.weight == 0.5
    assert recaller.calls[0]["context"] == ["Ana: hi", "Ben: hello"]
    assert runner._system("helix")(recaller, _query(), 10) and recaller.calls[1]["config"] is None
    with pytest.raises(ValueError, match="not valid.*reweigh_silnt"):
        runner._system("helix@rank.reweigh_silnt=true")
    with pytest.raises(ValueError, match="<section>.<key>=<value>"):
        runner._system("helix@rank.reweigh_silent")
    with pytest.raises(ValueError, match="change the system 'helix' only"):
        runner._system("helix-no-graph@rank.reweigh_silent=true")


def test_a_system_with_settings_is_compared_with_the_same_system_without_them() -> None:
    one = [{"ndcg@10": 1.0, "recall@10": 1.0}, {"ndcg@10": 0.0, "recall@10": 0.0}]
    rows = {"bm25": one, "helix": one, "helix+ctx": one, "helix@rank.intent_boost=0.2": one,
            "helix@rank.intent_boost=0.2+ctx": one, "helix-no-graph": one}
    against = {name: set(bases) for name, bases in runner.compare(rows).items()}
    # Any other Helix system (a stage off, a store built otherwise, context) against helix.
    assert against == {"helix": {"bm25"}, "helix+ctx": {"bm25", "helix"}, "helix-no-graph": {"bm25", "helix"},
                       "helix@rank.intent_boost=0.2": {"bm25", "helix"},
                       "helix@rank.intent_boost=0.2+ctx": {"bm25", "helix+ctx"}}
    assert set(runner.compare({"bm25": one, "helix-no-graph": one})["helix-no-graph"]) == {"bm25"}


def test_recall_items_count_as_their_documents() -> None:
    items = [Item("c2", 2, parent="doc-a"), Item("c1", 1, parent="doc-b"), Item("m9", 3),
             Item("c3", 4, parent="doc-b"), Item("c4", 5, parent="doc-c")]
    recaller = FakeRecaller(items)
    assert runner._system("helix")(recaller, _query(), 3) == ["doc-b", "doc-a", "m9"]
    assert runner._system("helix")(recaller, _query(), 10) == ["doc-b", "doc-a", "m9", "doc-c"]
    # Items without a parent attribute (a recall result without chunks) are their own documents.
    assert runner._item_documents([SimpleNamespace(id="x", rank=2), SimpleNamespace(id="y", rank=1)]) == ["y", "x"]


def test_rows_count_as_their_documents() -> None:
    ids = np.asarray(["doc-a#chunk1", "doc-a#chunk2", "m3", "doc-b#chunk1"], dtype=object)
    chunked = SimpleNamespace(columns=SimpleNamespace(ids=ids))
    assert runner._row_documents(chunked, [1, 2, 0, 3]) == ["doc-a", "m3", "doc-b"]
    assert runner._wide(chunked, 10) == runner.CHUNK_OVERFETCH * 10
    plain = SimpleNamespace(columns=SimpleNamespace(ids=np.asarray(["c1", "c2", "m3", "c4"], dtype=object)))
    assert runner._row_documents(plain, [1, 0, 1]) == ["c2", "c1"]
    assert runner._wide(plain, 10) == 10


def test_evaluate_routes_queries_and_reports_categories(locomo: Path, tmp_path: Path, monkeypatch) -> None:
    """evaluate() with the stores faked: which string each system gets, and per-category rows."""
    import helix_ray.recall.pipeline as pipeline

    evalset = load_locomo(locomo, granularity="session", query_context=2)
    seen: dict[str, list[str]] = {}

    def baseline(recaller: Any, q: EvalQuery, k: int) -> list[str]:
        seen.setdefault("bm25", []).append(q.text)
        return sorted(q.gold) + ["conv-a:session_1"]  # a repeat is dropped before scoring

    recallers: list[FakeRecaller] = []

    class Recaller(FakeRecaller):
        """Answers two chunks of the user's session 3."""

        def __init__(self, generation: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__([])
            recallers.append(self)

        def recall(self, query: str, **kwargs: Any) -> Any:
            parent = f"{kwargs['user']}:session_3"
            self.items = [Item("chunk-2", 2, parent=parent), Item("chunk-1", 1, parent=parent)]
            return super().recall(query, **kwargs)

    monkeypatch.setattr(runner, "store_for", lambda corpus_id, *a, **k: tmp_path / corpus_id)
    monkeypatch.setattr(runner.Generation, "open_current", staticmethod(lambda store: SimpleNamespace(store=store)))
    monkeypatch.setattr(runner, "get_embedder", lambda *a, **k: None)
    monkeypatch.setattr(runner, "encoder_threads", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "Recaller", Recaller)
    systems = {"bm25": baseline, "helix": runner._system("helix"), "helix+ctx": runner._system("helix+ctx")}
    report = runner.evaluate(evalset, systems=systems, workdir=tmp_path, show_progress=False)

    assert seen["bm25"] == [runner.query_string(q) for q in evalset.queries]
    calls = [c for r in recallers for c in r.calls]
    assert len(calls) == 2 * len(evalset.queries)
    assert sum("context" in c for c in calls) == len(evalset.queries)
    assert report.systems["bm25"]["recall@10"] == 1.0
    per = report.systems["helix"]["per_category"]
    assert set(per) == {"1", "2", "4"}
    assert per["2"]["recall@10"] == 1.0  # q2's gold is session 3: both chunks count once, at rank 1
    assert per["4"]["recall@10"] == 0.0
    assert report.systems["helix"]["mrr@10"] == pytest.approx(1 / 3, abs=1e-4)  # rounded to four places
    assert set(report.comparisons) == {"helix", "helix+ctx"}
    table = runner.format_table(report)
    assert "recall@10 by category" in table and "2 temporal (2)" in table and "4 single-hop (2)" in table


def test_cli_end_to_end_on_sessions_with_context(locomo: Path, tmp_path: Path, capsys) -> None:
    """Real stores (local ingest, the shipped models) of the small file at session granularity,
    each question after two turns; helix+ctx too once recall takes ``context``."""
    import inspect

    from helix_ray.cli import main
    from helix_ray.recall.pipeline import Recaller

    systems = "bm25,dense,rrf,helix"
    if "context" in inspect.signature(Recaller.recall).parameters:
        systems += ",helix+ctx"
    out = tmp_path / "report.json"
    assert main(["eval", "locomo", "--data", str(locomo), "--granularity", "session", "--query-context", "2",
                 "--systems", systems, "--workdir", str(tmp_path / "stores"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recall@10 by category" in printed and "1 multi-hop (2)" in printed
    report = json.loads(out.read_text())
    assert report["options"]["granularity"] == "session" and report["options"]["query_context"] == 2
    assert report["queries"] == 6
    for name in systems.split(","):
        assert set(report["systems"][name]["per_category"]) == {"1", "2", "4"}
        assert 0 <= report["systems"][name]["recall@10"] <= 1
    # Three sessions per store: every system finds every gold session in its top ten.
    assert report["systems"]["bm25"]["recall@10"] == 1.0
    assert report["systems"]["helix"]["recall@10"] == 1.0
