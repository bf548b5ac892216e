"""Source readers and format detection."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.sources import detect_format, parse_locomo_date, read_source, source_items
from tests.helpers import LOCOMO, REPO, SAMPLE, write_jsonl

MINI_LOCOMO = REPO / "tests" / "fixtures" / "eval" / "mini_locomo.json"


def test_detects_each_format(tmp_path):
    assert detect_format(SAMPLE / "memories.jsonl") == "jsonl"
    assert detect_format(SAMPLE / "transcript.jsonl") == "transcript"
    assert detect_format(SAMPLE / "notes") == "markdown"
    assert detect_format(MINI_LOCOMO) == "locomo"
    pq.write_table(pa.table({"text": ["a"], "user": ["u"]}), tmp_path / "m.parquet")
    assert detect_format(tmp_path / "m.parquet") == "parquet"
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InvalidArgument, match="--format"):
        detect_format(tmp_path / "x.csv")


def test_markdown_one_memory_per_section_with_front_matter():
    rows = list(read_source(SAMPLE / "notes"))
    assert len(rows) == 30
    assert all(r["user"] == "dana" and r["project"] == "atlas" for r in rows)
    first = rows[0]
    assert "id" not in first and "#" in first["_md_section"]  # the id names the user, which validation settles
    assert first["source"].startswith("markdown:")
    assert first["metadata"]["section"] in first["text"]


def test_a_markdown_heading_inside_fenced_code_is_code(tmp_path):
    """A ``## comment`` line in a shell block (or ``# title`` in one before the title) is
    no heading: the section keeps its whole block, fences closed."""
    note = ("```sh\n# not the title\n```\n# Scripts\n\nHow we build.\n\n## Build script\n\n```bash\n#!/bin/bash\n"
            "## build everything\nmake all\n## then package\nmake dist\n```\n\n~~~\n## tilde fenced\n~~~\n\n"
            "## Release\n\nTag it.\n")
    (tmp_path / "scripts.md").write_text(note)
    rows = list(read_source(tmp_path / "scripts.md"))
    assert [r["metadata"]["section"] for r in rows] == ["Scripts", "Build script", "Release"]
    assert rows[0]["text"].startswith("```sh\n# not the title\n```") and "How we build." in rows[0]["text"]
    build = rows[1]["text"]
    assert "## build everything" in build and "## then package\nmake dist\n```" in build and "## tilde fenced" in build
    unclosed = tmp_path / "unclosed.md"
    unclosed.write_text("# Notes\n\n## Setup\n\n```\n## not a section\n")
    assert [r["metadata"]["section"] for r in read_source(unclosed)] == ["Setup"]


def test_a_markdown_section_is_dated_by_its_heading_else_by_its_file(tmp_path):
    """A section whose heading names a day (with its year) is of that day, at noon UTC;
    the others take the front matter's created_at or date (a day alone, at its noon UTC),
    else the day the file's title or name states, else the file's own modification time
    (not its folder's). A day after the file was saved is a deadline, not when it was written."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "log.md").write_text("# Journal\n\n## 2024-05-03 Switched to Postgres\n\nMoved the queue.\n\n"
                                  "## Deploy notes\n\nDeploy with make.\n\n## 3 May 2024: rollback\n\nRolled back.\n")
    (notes / "2024-06-10-standup.md").write_text("# Standup\n\n## Alice\n\nAuth.\n")
    (notes / "daily.md").write_text("# Daily note, June 11, 2024\n\n## Bob\n\nBilling.\n")
    (notes / "post.md").write_text("---\ndate: 2023-01-02\n---\n# Post 2022-12-30\n\n## Intro\n\nHello.\n"
                                   "\n## 2023-01-05 follow-up\n\nMore.\n")
    (notes / "given.md").write_text("---\ncreated_at: 2022-03-04T09:00:00Z\ndate: 2023-01-02\n---\n## A\n\nx\n")
    (notes / "quoted.md").write_text("---\ndate: \"2023-02-03\"\n---\n## B\n\ny\n")
    (notes / "notes-2024-07-08.md").write_text("## C\n\nz\n")
    (notes / "plan.md").write_text("# Plan\n\n## Due 2999-06-01\n\nShip it.\n")  # a deadline, not a day written
    import os
    os.utime(notes / "log.md", (1_750_000_000, 1_750_000_000))  # 2025-06-15T15:06:40Z, after its days
    os.utime(notes, (1_600_000_000, 1_600_000_000))
    rows = {(r["metadata"]["file"], r["metadata"]["section"]): r for r in read_source(notes)}
    dated = {key: r["created_at"] for key, r in rows.items()}
    assert dated == {
        ("log.md", "2024-05-03 Switched to Postgres"): "2024-05-03T12:00:00+00:00",
        ("log.md", "Deploy notes"): "2025-06-15T15:06:40+00:00",
        ("log.md", "3 May 2024: rollback"): "2024-05-03T12:00:00+00:00",
        ("2024-06-10-standup.md", "Alice"): "2024-06-10T12:00:00+00:00",
        ("daily.md", "Bob"): "2024-06-11T12:00:00+00:00",
        ("post.md", "Intro"): "2023-01-02T12:00:00+00:00",
        ("post.md", "2023-01-05 follow-up"): "2023-01-05T12:00:00+00:00",
        ("given.md", "A"): "2022-03-04T09:00:00+00:00",
        ("quoted.md", "B"): "2023-02-03T12:00:00+00:00",
        ("notes-2024-07-08.md", "C"): "2024-07-08T12:00:00+00:00",
        ("plan.md", "Due 2999-06-01"): dt.datetime.fromtimestamp((notes / "plan.md").stat().st_mtime,
                                                                 tz=dt.timezone.utc).isoformat(),
    }
    assert rows[("post.md", "Intro")]["date"] == "2023-01-02"  # kept: validation moves it into metadata
    assert {key: r["metadata"]["dated"] for key, r in rows.items()} == {
        ("log.md", "2024-05-03 Switched to Postgres"): "heading", ("log.md", "Deploy notes"): "saved",
        ("log.md", "3 May 2024: rollback"): "heading", ("2024-06-10-standup.md", "Alice"): "file name",
        ("daily.md", "Bob"): "title", ("post.md", "Intro"): "front matter", ("post.md", "2023-01-05 follow-up"): "heading",
        ("given.md", "A"): "front matter", ("quoted.md", "B"): "front matter", ("notes-2024-07-08.md", "C"): "file name",
        ("plan.md", "Due 2999-06-01"): "saved",
    }


def test_transcript_turns_become_episodic_with_speaker():
    rows = list(read_source(SAMPLE / "transcript.jsonl"))
    assert len(rows) == 50
    assert all(r["type"] == "episodic" and r["session_id"] for r in rows)
    assert rows[0]["text"].startswith(rows[0]["metadata"]["speaker"] + ": ")
    assert rows[0]["created_at"].startswith("2025-")


def test_a_folder_is_read_whole_and_names_what_it_does_not_read(tmp_path):
    """A folder source reads its Markdown sections and each JSONL, JSON or Parquet file in
    it as a source of its own (memories, or chat turns); a .json that holds no memories
    lands in quarantine whole, saying why; hidden folders and a store inside it are not
    read. With --format markdown only the Markdown is read, and each data file is
    quarantined saying how to read it."""
    from helix_ray.ingest.run import ingest
    from helix_ray.store.generation import Generation

    folder = tmp_path / "project"
    (folder / "deep").mkdir(parents=True)
    (folder / "note.md").write_text("---\nuser: dana\n---\n# Atlas\n## Queue\nWe use NATS.\n", encoding="utf-8")
    write_jsonl(folder / "deep" / "more.jsonl", [{"id": "more-1", "text": "Deploys freeze on Fridays.",
                                                   "user": "dana"}])
    write_jsonl(folder / "chat.jsonl", [{"session_id": "s1", "speaker": "dana", "text": "Let us shard by tenant.",
                                         "timestamp": "2025-03-01T10:00:00Z", "user": "dana"}])
    pq.write_table(pa.table({"id": ["pq-1"], "text": ["Backups run at 02:00 UTC."], "user": ["dana"]}),
                   folder / "deep" / "facts.parquet")
    (folder / "package.json").write_text(json.dumps({"name": "atlas", "version": "1.0.0"}, indent=2))
    (folder / "pretty.json").write_text(json.dumps([{"text": "Staging resets nightly.", "user": "dana"}], indent=2))
    (folder / "one.json").write_text(json.dumps({"text": "Oncall rotates weekly.", "user": "dana"}, indent=2))
    (folder / "gone.md").symlink_to(folder / "nowhere.md")  # a broken link: passed over
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD.md").write_text("# not a note\n## x\ny\n")
    (folder / "store" / "inbox").mkdir(parents=True)  # a store kept in the folder: its files are not notes
    (folder / "store" / "helix.duckdb").write_bytes(b"")
    write_jsonl(folder / "store" / "inbox" / "serve-1.jsonl", [{"text": "a write of the store", "user": "dana"}])
    (folder / "image.png").write_bytes(b"\x89PNG")  # not memories: not named
    report = ingest([folder], tmp_path / "store", runner="local", show_progress=False)
    assert report.published and report.quarantine_reasons == {"not_read": 1}, report
    texts = Generation.open_current(tmp_path / "store").memories.column("text").to_pylist()
    assert len(texts) == 6 and {"Deploys freeze on Fridays.", "Backups run at 02:00 UTC.", "Staging resets nightly.",
                                "Oncall rotates weekly.", "dana: Let us shard by tenant."} < set(texts), texts
    (unread,) = [r for item in source_items(folder, "auto")[0]
                 for r in read_source(item["path"], item["format"], **json.loads(item["options"])) if "_reject" in r]
    assert unread["_source"] == str(folder / "package.json") and "(a configuration file?)" in unread["_reject"]

    only_markdown = [r for r in read_source(folder, "markdown") if "_reject" in r]
    assert sorted(r["_source"] for r in only_markdown) == [str(folder / f) for f in (
        "chat.jsonl", "deep/facts.parquet", "deep/more.jsonl", "one.json", "package.json", "pretty.json")]
    assert all("leave --format out to read the whole folder" in r["_reject"] for r in only_markdown)
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / ".hidden" / "a.md").write_text("# A\n## B\nc\n")
    with pytest.raises(InvalidArgument, match="holds none"):
        detect_format(empty)


def test_a_folder_reads_markdown_whatever_the_suffix_case(tmp_path):
    """README.MD and notes.markdown were passed over in silence (``rglob("*.md")``)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "README.MD").write_text("# Readme\n## Setup\nRun make setup.\n", encoding="utf-8")
    (folder / "notes.markdown").write_text("# Notes\n## Queue\nWe use NATS.\n", encoding="utf-8")
    assert detect_format(folder) == "markdown"
    assert sorted(r["_md_section"] for r in read_source(folder)) == ["docs/README.MD#setup",
                                                                   "docs/notes.markdown#queue"]


def test_markdown_sections_keep_distinct_ids(tmp_path):
    """Repeated headings, headings that differ only in punctuation or are not ASCII, and
    an id in the front matter: every section stays its own memory."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("---\nuser: dana\nid: fixed\n---\n# Lang\n## Notes\none\n## Notes\ntwo\n"
                                 "## C++\nthree\n## C\nfour\n## 日本語\nfive\n## 設定\nsix\n## Notes\nseven\n"
                                 "## Notes-2\neight\n", encoding="utf-8")
    (folder / "title-only.md").write_text("# Just a title\n", encoding="utf-8")
    rows = list(read_source(folder, "markdown"))
    good = [r for r in rows if "_reject" not in r]
    assert [r["text"].split("\n")[-1] for r in good] == ["one", "two", "three", "four", "five", "six", "seven",
                                                         "eight"]
    assert len({r["_md_section"] for r in good}) == 8 and not any("id" in r for r in good)
    assert good[0]["_md_section"] == "notes/a.md#notes" and good[2]["_md_section"] == "notes/a.md#c"
    assert [r for r in rows if "_reject" in r][0]["_code"] == "empty_text"  # the title-only file, said so
    assert rows == list(read_source(folder, "markdown"))  # the same ids on every read


def test_malformed_metadata_is_quarantined_not_raised(tmp_path):
    from helix_ray.config import ValidationConfig
    from helix_ray.ingest.normalize import normalise

    transcript = tmp_path / "chat.jsonl"
    transcript.write_text('{"session_id": "s", "speaker": "dana", "text": "hi", "metadata": "abc"}\n'
                          '{"session_id": "s", "speaker": "lee", "text": "hello"}\n')
    notes = tmp_path / "n.md"
    notes.write_text("---\nuser: dana\nmetadata: hello\n---\n## A\nbody\n")
    raws = list(read_source(transcript, "transcript")) + list(read_source(notes, "markdown"))
    rows, quarantined = normalise(raws, ValidationConfig(default_user="dana"),
                                  default_time=__import__("datetime").datetime(2025, 1, 1))
    assert [r["text"] for r in rows] == ["lee: hello"]
    assert sorted(q["reason"].split(":")[0] for q in quarantined) == ["wrong_type", "wrong_type"]
    assert any("body" in q["raw"] for q in quarantined)  # the whole file kept


def test_a_jsonl_file_whose_first_line_is_an_array_is_read_line_by_line(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('[1, 2]\n{"text": "ok", "user": "u"}\n')
    rows = list(read_source(path, "jsonl"))
    assert rows[0]["_code"] == "wrong_type" and rows[1]["text"] == "ok"
    array = tmp_path / "many.json"
    array.write_text('[{"text": "a", "user": "u"}, {"text": "b", "user": "u"}]')
    assert [r["text"] for r in read_source(array, "jsonl")] == ["a", "b"]


def test_bad_lines_are_tagged_not_raised(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "ok", "user": "u"}\n{not json}\n{"text": "caf\xe9", "user": "u"}\n[1, 2]\n'
                     b'{"text": "tab\there", "user": "u"}\n')
    rows = list(read_source(path, "jsonl"))
    assert len(rows) == 5
    assert rows[4]["_code"] == "bad_json" and "(Invalid control character at column 14)" in rows[4]["_reject"]
    assert "_reject" not in rows[0]
    assert rows[1]["_code"] == "bad_json" and rows[1]["_position"] == "line 2"
    assert rows[2]["_code"] == "invalid_utf8" and "caf" in rows[2]["_raw"]
    assert rows[3]["_code"] == "wrong_type"


def test_parquet_rows(tmp_path):
    pq.write_table(pa.table({"text": ["a fact", "another"], "user": ["u", "v"]}), tmp_path / "m.parquet")
    rows = list(read_source(tmp_path / "m.parquet"))
    assert [r["user"] for r in rows] == ["u", "v"] and rows[1]["_position"] == "row 1"


def test_locomo_fixture_keeps_dia_ids_users_and_session_dates():
    rows = list(read_source(MINI_LOCOMO))
    users = {r["user"] for r in rows}
    data = json.loads(MINI_LOCOMO.read_text())
    assert users == {s["sample_id"] for s in data}
    first = rows[0]
    assert first["id"] == f"{data[0]['sample_id']}:D1:1"
    assert first["session_id"] == f"{data[0]['sample_id']}:session_1"
    assert first["created_at"] == "2023-05-08T13:56:00+00:00"
    assert first["type"] == "episodic" and first["metadata"]["dia_id"] == "D1:1"
    captioned = [r for r in rows if "[image:" in r["text"]]
    assert captioned, "blip captions are kept in the text"


def test_a_malformed_locomo_conversation_is_quarantined_and_the_rest_read(tmp_path):
    """A conversation without its sample_id, a session with an unreadable date and a turn
    without its dia_id each become one quarantined record saying what is missing; the
    file's other turns are read (a missing key does not abort the whole ingest)."""
    data = json.loads(MINI_LOCOMO.read_text())
    good = data[0]
    conv = dict(good["conversation"])
    conv["session_1_date_time"] = "yesterday"
    broken_turns = [dict(t) for t in good["conversation"]["session_2"]]
    del broken_turns[0]["dia_id"]
    conv["session_2"] = broken_turns
    source = tmp_path / "locomo.json"
    source.write_text(json.dumps([{"conversation": good["conversation"]}, {**good, "conversation": conv}]))
    rows = list(read_source(source, "locomo"))
    bad = [r for r in rows if "_reject" in r]
    assert [r["_position"] for r in bad] == ["conversation 0", f"{good['sample_id']} session_1",
                                             f"{good['sample_id']} session_2 turn 0"]
    assert "sample_id" in bad[0]["_reject"] and "yesterday" in bad[1]["_reject"] and "dia_id" in bad[2]["_reject"]
    read = [r for r in rows if "_reject" not in r]
    assert len(read) == len(broken_turns) - 1 + sum(len(conv[k]) for k in conv if k.startswith("session_")
                                                    and k[8:].isdigit() and k not in ("session_1", "session_2"))


def test_locomo_date_parser():
    assert parse_locomo_date("10:37 am on 27 June, 2023") == "2023-06-27T10:37:00+00:00"


@pytest.mark.skipif(not LOCOMO.exists(), reason="set HELIX_DATA to the folder holding locomo/locomo10.json")
def test_real_locomo_loads_all_turns():
    rows = list(read_source(LOCOMO))
    assert len(rows) == 5882
    assert len({r["user"] for r in rows}) == 10
    assert "conv-26:D1:3" in {r["id"] for r in rows}


def test_missing_source_says_so(tmp_path):
    with pytest.raises(InvalidArgument, match="existing file"):
        list(read_source(tmp_path / "nope.jsonl"))


def test_write_jsonl_helper_roundtrip(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "user": "u"}])
    assert list(read_source(path))[0]["text"] == "x"


def test_a_json_file_of_one_object_over_several_lines_is_one_record(tmp_path):
    """Protects: a pretty-printed .json read line by line, a bad_json for each line. One
    object is one record (a memory, or a package.json quarantined once for its missing
    text); lines of objects under a .json name are still read as lines."""
    note = tmp_path / "note.json"
    note.write_text(json.dumps({"text": "We moved the queue to NATS.", "user": "dana"}, indent=2))
    (row,) = read_source(note)
    assert (row["text"], row["_position"]) == ("We moved the queue to NATS.", "the whole file")
    package = tmp_path / "package.json"
    package.write_text(json.dumps({"name": "atlas", "version": "1.0.0", "scripts": {"test": "jest"}}, indent=2))
    (row,) = read_source(package)
    assert row["name"] == "atlas" and "_reject" not in row
    lines = write_jsonl(tmp_path / "lines.json", [{"text": "one", "user": "u"}, {"text": "two", "user": "u"}])
    assert [r["text"] for r in read_source(lines)] == ["one", "two"]
