"""The structure-aware chunker: exact cuts on small crafted texts, and its invariants
(own spans in order covering the text, bounded overlap, no chunk over the budget) on
seeded generated ones."""

from __future__ import annotations

import ast
import base64
import inspect
import json
import random
import re
import textwrap

import pytest

from helix_ray.config import ChunkConfig
from helix_ray.ingest import chunk as chunk_module
from helix_ray.ingest import chunk_parse
from helix_ray.ingest.chunk import Chunk, detect_kind, encoder_text, lead_title, split
from helix_ray.ingest.normalize import split_long
from helix_ray.tokens import token_counter

count = token_counter()


def check_invariants(text: str, chunks: list[Chunk], max_tokens: int, overlap_tokens: int) -> None:
    """What every split must keep, whatever the text."""
    assert chunks, "split never returns an empty list"
    covered = 0
    for i, c in enumerate(chunks):
        assert c.index == i
        assert c.text == text[c.text_start:c.end], "a chunk's text is a slice of the input"
        assert c.text_start <= c.start <= c.end and (c.start < c.end or len(chunks) == 1)
        assert c.start >= covered and not text[covered:c.start].strip(), \
            f"only whitespace between own spans, got {text[covered:c.start]!r}"
        covered = c.end
        if c.text_start < c.start:  # the overlap comes from the end of the chunk before
            previous = chunks[i - 1]
            assert i > 0 and previous.start <= c.text_start < previous.end
            assert count(text[c.text_start:previous.end]) <= overlap_tokens
        assert c.n_tokens == count(c.text) <= max_tokens, (i, c.n_tokens)
    assert not text[covered:].strip(), "the text after the last chunk is whitespace only"
    if len(chunks) == 1 and count(text) <= max_tokens:
        assert chunks[0].text == text


# --------------------------------------------------------------------------- crafted documents


def sentences(topic: str, n: int) -> str:
    return " ".join(f"The {topic} step {i} checks one thing and then moves on." for i in range(n))


GUIDE = f"""# Guide

This guide explains how the service is deployed, rolled back and watched in production by the team.

## Deploy

{sentences("deploy", 3)}

### Rollback

{sentences("rollback", 3)}

## Monitoring

{sentences("monitoring", 3)}
"""


def test_headings_become_heading_paths():
    chunks = split(GUIDE, max_tokens=64, overlap_tokens=0)
    assert [c.heading_path for c in chunks] == [
        ("Guide",), ("Guide", "Deploy"), ("Guide", "Deploy", "Rollback"), ("Guide", "Monitoring")]
    assert [c.text.split("\n", 1)[0] for c in chunks] == ["# Guide", "## Deploy", "### Rollback", "## Monitoring"]
    assert chunks[2].text == "### Rollback\n\n" + sentences("rollback", 3)
    check_invariants(GUIDE, chunks, 64, 0)


def test_encoder_text_prefixes_the_heading_path():
    rollback = split(GUIDE, max_tokens=64, overlap_tokens=0)[2]
    # the chunk opens with its own heading: the path above it is enough
    assert encoder_text(rollback) == "Guide > Deploy\n" + rollback.text
    assert encoder_text(rollback, title="ops/deploy.md") == "ops/deploy.md > Guide > Deploy\n" + rollback.text
    inner = Chunk("Run make rollback.", 3, ("Guide", "Deploy", "Rollback"), 10, 28, 10)
    assert encoder_text(inner, title="Guide") == "Guide > Deploy > Rollback\nRun make rollback."
    assert encoder_text(Chunk("plain", 0, (), 0, 5, 0)) == "plain"
    long_names = Chunk("x", 0, ("A" * 100, "B", "C", "D"), 0, 1, 0)
    assert encoder_text(long_names) == "B > C > D\nx", "only the innermost three headings"
    assert encoder_text(long_names, title="T" * 80).split("\n")[0] == "T" * 80 + " > B > C > D"
    assert encoder_text(long_names, title="T" * 200).split("\n")[0] == "T" * 159 + "… > B > C > D"


def test_lead_title_reads_a_first_line_that_titles_what_follows():
    body = "We measured it twice.\nThe second run agreed."
    assert lead_title("Targeting A20 decreases glioma stem cell survival\n" + body) == (
        "Targeting A20 decreases glioma stem cell survival")
    assert lead_title("Pin uvicorn below 0.30\n\nIts 0.30 release broke streaming.") == "Pin uvicorn below 0.30"
    assert lead_title("Notes of 8 May, 2023\nWe met at noon.\nAna: that is all") == "Notes of 8 May, 2023"
    long = "A very long title " * 15
    assert lead_title(long + "\n" + body) == long[:159].rstrip() + "…"
    for text, why in [
        ("One line, nothing after it", "nothing to title"),
        ("Title\n   \n", "nothing after it but blank lines"),
        ("# Deploy\nRun make.", "a Markdown heading: the heading path names it"),
        ("Caroline: I went to the group.\nMelanie: How was it?", "a chat turn"),
        ("1:56 pm on 8 May, 2023\nCaroline: I went.\nMelanie: How was it?\nCaroline: Good.",
         "a transcript: its date line heads the first session only"),
        ("s0.py · s0.restart (function)\ndef restart(self, reset=False):\n    return self.stop()\n", "code"),
        ("We chose DuckDB because its files are\nsingle and easy to copy.", "a wrapped line of prose"),
        ("x" * 400 + "\n" + body, "too long for a title"),
    ]:
        assert lead_title(text) is None, why


def test_chunks_after_the_first_repeat_the_lead_title_unless_turned_off():
    title = "Empirical Bayesian models for analysing molecular serotyping microarrays"
    text = title + "\n" + " ".join(f"Sentence {i} reports a finding about serotype {i}." for i in range(120))
    row = {"id": "doc1", "text": text, "metadata": "{}"}
    plain = split_long(row, ChunkConfig(max_tokens=200, lead_title=False))
    titled = split_long(row, ChunkConfig(max_tokens=200))
    assert len(plain) > 1 and len(titled) >= len(plain)
    assert not any(r["text"].startswith(title) for r in plain[1:])
    assert titled[0]["text"].startswith(title + "\n")
    for r in titled[1:]:
        assert r["text"].startswith(title + "\n")
        own_from = json.loads(r["metadata"])["chunk"]["own_from"]
        assert r["text"][own_from:] and r["text"][own_from:] in text
    assert all(count(r["text"]) <= 200 for r in titled), "the title line fits inside max_tokens"
    # Code keeps its own header: a module's docstring reads as prose, but its first line is no title.
    assert not any(r["text"].startswith(title) for r in split_long({**row, "type": "code"}, ChunkConfig(max_tokens=200))[1:])
    # A Markdown section's chunks keep their file and heading, not the first line.
    md = {**row, "metadata": json.dumps({"file": "docs/guide.md", "section": "Deploy"})}
    assert all(r["text"].startswith("docs/guide.md — Deploy\n")
               for r in split_long(md, ChunkConfig(max_tokens=200))[1:])


def test_a_line_repeated_for_pages_is_one_chunk_that_says_how_often():
    """A log of one line 2,000 times is a few chunks, not 70 alike: a run of chunks of the
    same text is the first, with ``repeated``; numbering and ``of`` count what is stored,
    and the end of the text stays."""
    text = "# Log\n\n" + "\n".join(["ERROR connection refused to db-7 port 5432"] * 2000) + "\n\nThe fix: more conns."
    rows = split_long({"id": "log", "text": text, "metadata": "{}"}, ChunkConfig(max_tokens=256))
    places = [json.loads(r["metadata"])["chunk"] for r in rows]
    assert 2 < len(rows) <= 5 and len({r["text"] for r in rows}) == len(rows)
    assert [p["n"] for p in places] == list(range(1, len(rows) + 1)) and {p["of"] for p in places} == {len(rows)}
    assert [r["id"] for r in rows] == [f"log#chunk{n}" for n in range(1, len(rows) + 1)]
    assert max(p.get("repeated", 1) for p in places) > 50 and rows[-1]["text"].endswith("The fix: more conns.")


def test_heading_directly_above_a_subheading_stays_with_it():
    doc = f"# Guide\n## Deploy\n### Rollback\n\n{sentences('rollback', 6)}\n"
    chunks = split(doc, max_tokens=64, overlap_tokens=0)
    assert chunks[0].text.startswith("# Guide\n## Deploy\n### Rollback\n\nThe rollback step 0")
    assert all(not re.search(r"#\s*$", c.text) for c in chunks), "no chunk ends on a bare heading"
    assert chunks[0].heading_path == ("Guide",)
    assert chunks[1].heading_path == ("Guide", "Deploy", "Rollback")


# a blank line and a comment inside: read as prose, the block would be cut at them (the comment a heading)
FENCE = ("```python\n# compute the values\n" + "\n".join(f"value_{i} = compute({i})" for i in range(3)) + "\n\n"
         + "\n".join(f"total_{i} = value_{i} * 2" for i in range(3)) + "\n```")


@pytest.mark.parametrize("max_tokens", [82, 92, 100, 120, 150, 200])
def test_a_fenced_block_that_fits_is_never_cut(max_tokens):
    doc = f"## Setup\n\n{sentences('setup', 6)} Run this:\n\n{FENCE}\n\n{sentences('after', 6)}\n"
    assert count(FENCE) <= max_tokens - 16
    chunks = split(doc, max_tokens=max_tokens, overlap_tokens=16)
    holders = [c for c in chunks if FENCE in c.own_text]
    assert len(holders) == 1, [c.own_text for c in chunks]
    assert sum("```" in c.own_text for c in chunks) == 1, "no other chunk holds a piece of the fence"
    check_invariants(doc, chunks, max_tokens, 16)


def test_a_fence_too_long_for_one_chunk_is_cut_between_lines():
    fence = "```\n" + "\n".join(f"line_{i} = {i} * 2  # a comment" for i in range(60)) + "\n```"
    chunks = split(fence, max_tokens=80, overlap_tokens=0, kind="markdown")
    assert len(chunks) > 2
    assert all(re.fullmatch(r"(```\n)?(line_\d+ = \d+ \* 2  # a comment\n?)+(```)?", c.text) for c in chunks)
    assert chunks[0].text.startswith("```\nline_0") and chunks[-1].text.endswith("\n```")


def test_a_list_that_fits_stays_whole():
    items = "\n".join(f"- item {i}: keep the {w} settings in one place" for i, w in enumerate(
        ["cache", "queue", "auth", "billing", "search", "email"]))
    doc = f"# Notes\n\n{sentences('before', 8)} The parts:\n{items}\n\n{sentences('after', 8)}\n"
    for max_tokens in (96, 128, 160, 256):
        chunks = split(doc, max_tokens=max_tokens, overlap_tokens=16)
        holders = [c for c in chunks if items in c.own_text]
        assert len(holders) == 1 and "The parts:\n" + items in holders[0].own_text, max_tokens
        check_invariants(doc, chunks, max_tokens, 16)


def test_the_last_two_chunks_of_a_run_are_evened_out():
    text = " ".join(f"Fact {i} is stated in one short plain sentence here." for i in range(9))
    assert 100 < count(text) < 110  # eight sentences fit in 100 tokens, nine do not
    chunks = split(text, max_tokens=100, overlap_tokens=0)
    assert [c.text.count("Fact") for c in chunks] == [5, 4], "not eight and a stub of one"


def test_a_long_list_is_cut_between_items():
    items = "\n".join(f"- item {i} says something about part {i}. It has a second sentence." for i in range(40))
    chunks = split(items, max_tokens=64, overlap_tokens=0)
    assert len(chunks) > 3
    assert all(c.text.startswith("- item ") and c.text.endswith("It has a second sentence.") for c in chunks)


TRANSCRIPT = "\n".join(
    f"{['Alice', 'Bob'][i % 2]}: " + " ".join(f"Point {j} of message {i} is here." for j in range(1 + i % 4))
    for i in range(12))


def test_a_chat_transcript_splits_between_turns():
    assert detect_kind(TRANSCRIPT) == "chat"
    chunks = split(TRANSCRIPT, max_tokens=64, overlap_tokens=0)
    assert len(chunks) > 3
    turns = TRANSCRIPT.split("\n")
    for c in chunks:
        own = c.own_text.split("\n")
        assert all(line in turns for line in own), "whole turns only"
    assert "\n".join(c.own_text for c in chunks) == TRANSCRIPT
    check_invariants(TRANSCRIPT, chunks, 64, 0)


def test_a_turn_too_long_for_a_chunk_is_cut_at_sentences():
    long_turn = "Bob: " + " ".join(f"Sentence {j} of the long turn is here." for j in range(40))
    text = f"Alice: Short question here?\n{long_turn}\nAlice: Thanks, that helps.\n"
    chunks = split(text, max_tokens=64, overlap_tokens=0, kind="chat")
    # the short first turn starts the first chunk, which takes Bob's turn up to a sentence end
    assert chunks[0].text.startswith("Alice: Short question here?\nBob: Sentence 0 of the long turn is here.")
    assert all(c.text.startswith("Sentence ") for c in chunks[1:])
    assert all(c.text.endswith(".") for c in chunks)
    assert chunks[-1].text.endswith("is here.\nAlice: Thanks, that helps."), "the last short turn joins a neighbour"


def test_the_chat_format_with_dates():
    text = "\n".join(f"[2024-05-0{1 + i % 9} 10:0{i % 10}] {['ana', 'raj'][i % 2]}: reply number {i}"
                     for i in range(20))
    assert detect_kind(text) == "chat"
    chunks = split(text, max_tokens=48, overlap_tokens=0)
    assert all(c.text.startswith("[2024-05-0") for c in chunks)


def test_overlap_is_present_and_bounded():
    text = " ".join(f"Sentence number {i} says a few words about item {i}." for i in range(60))
    chunks = split(text, max_tokens=64, overlap_tokens=16)
    assert len(chunks) > 4
    for before, c in zip(chunks, chunks[1:]):
        overlap = text[c.text_start:before.end]
        assert c.text_start < c.start and before.own_text.endswith(overlap)
        assert re.fullmatch(r"Sentence number \d+ says a few words about item \d+\.", overlap), overlap
        assert count(overlap) <= 16
    check_invariants(text, chunks, 64, 16)
    without = split(text, max_tokens=64, overlap_tokens=0)
    assert all(c.text_start == c.start for c in without)


def test_overlap_falls_back_to_words_and_never_crosses_a_heading():
    long_sentence = " ".join(f"word{i}" for i in range(200)) + "."
    chunks = split(long_sentence, max_tokens=64, overlap_tokens=8)
    for before, c in zip(chunks, chunks[1:]):
        assert c.text_start < c.start and long_sentence[c.text_start - 1] == " ", "the overlap starts at a word"
    doc = f"## One\n\n{sentences('one', 8)}\n\n## Two\n\n{sentences('two', 8)}\n"
    for c in split(doc, max_tokens=64, overlap_tokens=16):
        if c.own_text.startswith("## "):
            assert c.text_start == c.start


def test_no_chunk_cut_mid_sentence_in_a_1804_token_section():
    rng = random.Random(1804)
    words = ("deploy rollback cluster replica shard index query latency budget token memory "
             "worker queue retry backoff cache tenant schema migration snapshot").split()
    body: list[str] = []
    section = ""
    while count(section) < 1790:
        body.append(" ".join(rng.choice(words) for _ in range(rng.randint(6, 30))).capitalize() + ".")
        # paragraphs of ten sentences, hard-wrapped at 80 columns as Markdown usually is: most lines end mid-sentence
        section = "## Operations\n\n" + "\n\n".join(textwrap.fill(" ".join(body[i:i + 10]), 80)
                                                     for i in range(0, len(body), 10))
    assert 1790 <= count(section) <= 1830
    chunks = split(section, max_tokens=256, overlap_tokens=32)
    assert len(chunks) >= 7
    for c in chunks:
        assert c.n_tokens <= 256
        assert c.own_text.endswith("."), c.own_text[-40:]
        assert c.own_text[0].isupper() or c.own_text.startswith("## "), c.own_text[:40]
        assert c.heading_path == ("Operations",)
    check_invariants(section, chunks, 256, 32)


def test_code_is_cut_between_definitions():
    functions = [f"def handler_{i}(event, context):\n    value = event['n'] * {i}\n    if value > {i}:\n"
                 f"        return value - {i}\n    return value\n" for i in range(12)]
    source = "import os\nimport sys\n\n\n" + "\n\n".join(functions)
    assert detect_kind(source) == "code"
    chunks = split(source, max_tokens=64, overlap_tokens=0)
    assert chunks[0].text.startswith("import os")
    assert all(c.text.startswith(("def handler_", "import")) for c in chunks)
    assert all(c.text.rstrip().endswith("return value") for c in chunks)


def test_a_base64_blob_still_chunks():
    blob = base64.b64encode(random.Random(5).randbytes(5000)).decode()
    assert count(blob) > 4000
    chunks = split(blob, max_tokens=256, overlap_tokens=32)
    assert len(chunks) > 15
    assert "".join(c.own_text for c in chunks) == blob
    check_invariants(blob, chunks, 256, 32)


def test_a_long_line_without_punctuation_is_cut_between_words():
    text = " ".join(f"w{i}x" for i in range(3000))
    chunks = split(text, max_tokens=100, overlap_tokens=0)
    assert all(re.fullmatch(r"w\d+x( w\d+x)*", c.text) for c in chunks)
    assert all(c.n_tokens > 60 for c in chunks[:-1]), "pieces are filled, not tiny"


# --------------------------------------------------------------------------- the fast path


@pytest.mark.parametrize("text", ["", "  ", "remember: staging uses port 8443", "line one\r\nline two\r\n",
                                  "🎉 déployé ✓", "\ttabbed\n\n\n", "x" * 256])
def test_a_short_text_comes_back_unchanged(text):
    chunks = split(text)
    assert chunks == [Chunk(text, 0, (), 0, len(text), 0)]
    assert chunks[0].n_tokens == count(text)


def test_a_short_text_costs_no_token_count(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a text this short must not be counted")

    monkeypatch.setattr(chunk_module.tokens, "encoding", refuse)
    assert split("Deploys go through make deploy; never push to prod by hand.")[0].start == 0
    assert split("é" * 64)[0].end == 64  # 128 bytes: within the bound too
    monkeypatch.undo()


def test_a_text_over_the_byte_bound_but_within_the_budget_is_one_chunk():
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert len(text) > 256 and count(text) <= 256
    assert split(text) == [Chunk(text, 0, (), 0, len(text), 0)]
    assert split(text)[0].n_tokens == count(text)


@pytest.mark.parametrize("text", ["😀🫠👍🏽" * 10, "\U0010ffff" * 20, "ḁ̴̢" * 30, "漢字かな交じり" * 10, "\x00\x7f" * 40])
def test_no_text_has_more_tokens_than_utf8_bytes(text):
    """The bound behind the fast path: a token is at least one byte."""
    assert count(text) <= len(text.encode("utf-8"))


# --------------------------------------------------------------------------- odd input and arguments


def test_odd_input_never_raises():
    cases = {
        "crlf": "\r\n".join(f"## Part {i}\r\n\r\n{sentences('part', 4)}" for i in range(6)),
        "tabs": "\n".join(f"\tcol{i}\tvalue {i}\tnote about it" for i in range(200)),
        "no_newline": " ".join(f"token{i}" for i in range(40_000)),  # over 200 KB on one line
        "emoji": " ".join("🚀 launch ✨ déjà vu 漢字 ok." for _ in range(300)),
        "surrogate": "broken \ud800 text. " * 200,
        "whitespace": " \n\t" * 20_000,
        "one_char_run": "=" * 50_000,
        "unclosed_fence": "intro\n\n```python\n" + "\n".join(f"x = {i}" for i in range(300)),
    }
    assert len(cases["no_newline"]) > 200_000
    for name, text in cases.items():
        chunks = split(text, max_tokens=128, overlap_tokens=16)
        check_invariants(text, chunks, 128, 16)
        if name == "whitespace":
            assert chunks == [Chunk("", 0, (), 0, 0, 0)]


def test_the_same_text_gives_the_same_chunks():
    text = generated(random.Random(3), 4000)
    assert split(text, max_tokens=100) == split(text, max_tokens=100)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "html"}, "Got kind 'html'; it must be one of 'auto', 'markdown', 'chat', 'code', 'text'"),
    ({"max_tokens": 8}, "Got max_tokens=8; it must be an int of at least 16"),
    ({"max_tokens": 64, "overlap_tokens": 40}, "Got overlap_tokens=40; it must be an int from 0 to half"),
    ({"overlap_tokens": -1}, "Got overlap_tokens=-1"),
])
def test_bad_arguments_say_what_was_received_and_allowed(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        split("some text", **kwargs)


@pytest.mark.parametrize("text, kind", [
    ("# Title\n\nSome prose here.\n\n## Part\n\nMore prose.", "markdown"),
    ("Intro.\n\n```sh\nmake\n```\n", "markdown"),
    ("- one\n- two\n- three\n", "markdown"),
    ("def f(x):\n    return x\n\nclass A:\n    pass\n", "code"),
    ("function f() {\n  return 1;\n}\nconst x = f();\n", "code"),
    ("#!/bin/sh\n# Build the image\nmake image\n# Push it\nmake push\n", "code"),
    ("user: hi\nassistant: hello, how can I help?\nuser: deploy fails\nassistant: show me the log\n", "chat"),
    ("name: api\nimage: nginx\nport: 80\nreplicas: 3\n", "text"),
    ("Just a paragraph of prose. It has two sentences.\nAnd a wrapped line.", "text"),
])
def test_detect_kind(text, kind):
    assert detect_kind(text) == kind


def test_the_parser_module_stands_alone():
    """The parsers give atoms, boundary strengths and heading paths without the chunker,
    which imports them and never the reverse."""
    atoms = chunk_parse.parse("# Guide\n\n## Deploy\n\nRun it. Then check.\n", "markdown")
    assert [atoms.text[a:b] for a, b in zip(atoms.starts, atoms.ends)] == [
        "# Guide", "## Deploy", "Run it.", "Then check."]
    assert atoms.strengths == [19, chunk_parse.GLUE, chunk_parse.GLUE, chunk_parse.SENTENCE]
    assert atoms.paths == [("Guide",), ("Guide", "Deploy"), ("Guide", "Deploy"), ("Guide", "Deploy")]
    assert atoms.headings == [True, True, False, False]
    assert [chunk_parse.heading_title(line) for line in ("## Deploy ##", "#", "#hashtag", "text")] == [
        "Deploy", "", None, None]
    imported: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(chunk_parse))):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module or ""}
    assert "helix_ray.ingest.chunk" not in imported


# --------------------------------------------------------------------------- invariants on generated texts

WORDS = ("the a deploy rollback service queue cache token memory index shard replica budget latency "
         "worker retry tenant schema naïve café 東京 🚀 über résumé").split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 40))]
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", "", ":"])


def generated(rng: random.Random, n_units: int) -> str:
    """A text mixing every structure the chunker knows, and some it must survive."""
    parts: list[str] = []
    for _ in range(n_units // 10):
        roll = rng.random()
        if roll < 0.12:
            parts.append("#" * rng.randint(1, 6) + " " + sentence(rng).rstrip(".?!:"))
        elif roll < 0.22:
            body = "\n".join("    " * rng.randint(0, 2) + f"x_{i} = f({i})" for i in range(rng.randint(1, 40)))
            parts.append(f"```py\n{body}\n```")
        elif roll < 0.34:
            items = rng.randint(1, 12)
            parts.append("\n".join(f"{rng.choice(['-', '*', '1.'])} {sentence(rng)}" for _ in range(items)))
        elif roll < 0.42:
            parts.append("\n".join(f"{rng.choice(['Ana', 'Raj'])}: {sentence(rng)}" for _ in range(rng.randint(1, 6))))
        elif roll < 0.47:
            parts.append(base64.b64encode(rng.randbytes(rng.randint(10, 3000))).decode())
        elif roll < 0.52:
            parts.append("| a | b |\n|---|---|\n" + "\n".join(f"| {i} | {sentence(rng)} |" for i in range(6)))
        elif roll < 0.56:
            parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 600))))
        else:
            parts.append(("\n" if rng.random() < 0.3 else " ").join(sentence(rng) for _ in range(rng.randint(1, 12))))
    separator = rng.choice(["\n\n", "\n", "\r\n\r\n", "\n\n\t\n"])
    return separator.join(parts)


@pytest.mark.parametrize("seed", range(12))
def test_invariants_hold_on_generated_texts(seed):
    rng = random.Random(seed)
    text = generated(rng, rng.randint(50, 600))
    max_tokens = rng.choice([16, 40, 64, 100, 256, 512])
    overlap = rng.choice([0, 4, max_tokens // 8, max_tokens // 2])
    for kind in ("auto", "markdown", "chat", "code", "text"):
        chunks = split(text, max_tokens=max_tokens, overlap_tokens=overlap, kind=kind)
        check_invariants(text, chunks, max_tokens, overlap)
        if count(text) > max_tokens and max_tokens >= 64:
            average = sum(c.n_tokens for c in chunks) / len(chunks)
            assert average >= max_tokens / 3, (kind, average)


def test_exact_counts_alone_keep_the_invariants(monkeypatch):
    """Estimates only guide the packing: with every estimate zero (all fits, no atom cut
    up front) the exact counts at the end still keep every chunk within the budget."""
    monkeypatch.setattr(chunk_module._Plan, "estimate", lambda self, lo, hi: 0)
    monkeypatch.setattr(chunk_module._Plan, "_overlapped", lambda self, a, b: 0)
    text = generated(random.Random(11), 300)
    for max_tokens, overlap in ((64, 0), (100, 16)):
        check_invariants(text, split(text, max_tokens=max_tokens, overlap_tokens=overlap), max_tokens, overlap)


def test_invariant_checker_catches_a_bad_split():
    """The checker above can fail: a chunk list that skips a sentence does not pass."""
    text = "One sentence here. Another one there."
    good = [Chunk("One sentence here.", 0, (), 0, 18, 0), Chunk("Another one there.", 1, (), 19, 37, 19)]
    check_invariants(text, good, 16, 0)
    with pytest.raises(AssertionError):
        check_invariants(text, good[:1], 16, 0)
    with pytest.raises(AssertionError):  # own spans overlap
        check_invariants(text, [good[0], Chunk("here. Another one there.", 1, (), 13, 37, 13)], 16, 2)
    with pytest.raises(AssertionError):  # an overlap longer than allowed
        check_invariants(text, [good[0], Chunk("here. Another one there.", 1, (), 19, 37, 13)], 16, 1)
    with pytest.raises(AssertionError):  # a chunk over the budget
        check_invariants(text, good, 3, 0)
