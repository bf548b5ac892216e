"""Segmented token storage (:mod:`helix_ray.store.late`): a publish links the previous
generation's segments and writes only the new rows' tokens; the merge rule; generations
of the single-file layout carried over; checksums and ``helix doctor`` over linked files."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from helix_ray.ingest.run import ingest
from helix_ray.store import late as late_store
from helix_ray.store.doctor import check_store
from helix_ray.store.generation import Generation
from helix_ray.store.integrity import record_files, verify_files
from helix_ray.store.late import SegmentedTokens, TokenRows, segment_file, write_late
from helix_ray.token_encoder import (
    BACKBONE_DIM,
    BACKBONE_NAME,
    DIM,
    from_blobs,
    get_token_encoder,
    quantize_tokens,
    to_blobs,
)
from tests.helpers import memory, single_file_tokens, write_jsonl

FACTS = ["We chose NATS JetStream over Kafka for the event bus because it is one binary.",
         "The CI pipeline runs pytest against a real Postgres container.",
         "Dana prefers tabs over spaces in the Go services.",
         "The gateway listens on port 8443 in production.",
         "Billing moved from MySQL to Postgres in March.",
         "The nightly batch warms the gecko cache before six."]


def passages(seed: int, lengths: list[int]):
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(size=(n, DIM)).astype(np.float32) for n in lengths]
    return from_blobs(*to_blobs([v / np.linalg.norm(v, axis=1, keepdims=True) for v in vectors]))


def publish_tokens(folder, rows: TokenRows, **kw) -> SegmentedTokens:
    """``rows`` written as generation ``folder`` (named by its number) would hold them."""
    folder.mkdir()
    info, linked = write_late(folder, rows, f"g{int(folder.name):06d}", **kw)
    return SegmentedTokens.open(folder, info, record_files(folder, known=linked))


def tokens_of(late, rows) -> list[bytes]:
    return [late.take(np.array([r])).tokens.tobytes() + late.take(np.array([r])).scales.tobytes() for r in rows]


def inode(path) -> int:
    return os.stat(path).st_ino


# --------------------------------------------------------------------------- the files, without ingest


def test_a_publish_links_old_segments_and_writes_only_new_rows(tmp_path):
    first = passages(1, [3, 5, 2])
    g1 = publish_tokens(tmp_path / "000001", TokenRows.of(first))
    extra = passages(2, [4])
    # rows of the next generation: old 2, the new one, old 0, old 1 (a new sort order)
    rows = TokenRows(g1, np.array([2, -1, 0, 1]), extra, np.array([-1, 0, -1, -1]))
    g2 = publish_tokens(tmp_path / "000002", rows)
    assert [s.name for s in g2.segments] == ["g000001", "g000002"]
    assert [s.tokens for s in g2.segments] == [10, 4]  # the new segment holds the new row only
    for kind in ("tokens", "scales"):
        assert inode(tmp_path / "000002" / segment_file("g000001", kind)) == \
            inode(tmp_path / "000001" / segment_file("g000001", kind))
    assert tokens_of(g2, [0, 1, 2, 3]) == tokens_of(first, [2]) + tokens_of(extra, [0]) + tokens_of(first, [0, 1])
    known, block = g2.lookup(np.array([7, 1, 0]))  # row 7 is not there: an online write's
    assert known.tolist() == [1, 2] and block.offsets.tolist() == [0, 4, 6]
    none = g2.take(np.zeros(0, np.int64))  # an online write's candidates only
    assert len(none) == 0 and none.tokens.shape == (0, DIM)


def test_more_dead_tokens_than_live_rewrites_the_live_ones(tmp_path):
    first = passages(3, [6, 1, 5])
    g1 = publish_tokens(tmp_path / "000001", TokenRows.of(first))
    # rows 0 and 2 deleted: 11 of 12 tokens dead
    g2 = publish_tokens(tmp_path / "000002", TokenRows(g1, np.array([1]), passages(4, []), np.array([-1])))
    assert [s.name for s in g2.segments] == ["g000002"] and g2.segments[0].tokens == 1
    assert not (tmp_path / "000002" / segment_file("g000001", "tokens")).exists()
    assert tokens_of(g2, [0]) == tokens_of(first, [1])
    # half dead is not more than half: the segment stays linked
    g3 = publish_tokens(tmp_path / "000003", TokenRows(g1, np.array([0]), passages(5, []), np.array([-1])))
    assert [s.name for s in g2.segments] == ["g000002"] and [s.name for s in g3.segments] == ["g000001"]


def test_past_the_segment_cap_the_smallest_merge(tmp_path, monkeypatch):
    monkeypatch.setattr(late_store, "_GATHER_ROWS", 2)  # a merge gathers rows chunk by chunk
    base = passages(6, [20, 20])
    expected = tokens_of(base, [0, 1])
    late = publish_tokens(tmp_path / "000001", TokenRows.of(base))
    for number in range(2, 7):
        new = passages(number * 10, [number])
        n = len(late)
        rows = TokenRows(late, np.append(np.arange(n), -1), new, np.append(np.full(n, -1), 0))
        late = publish_tokens(tmp_path / f"{number:06d}", rows, max_segments=4)
        expected += tokens_of(new, [0])
        assert len(late.segments) <= 4
        assert tokens_of(late, range(len(late))) == expected
    # at g5 the three smallest merged with the new row; g1 (40 tokens) is never among them
    assert [(s.name, s.tokens) for s in late.segments] == [("g000001", 40), ("g000005", 14), ("g000006", 6)]


# --------------------------------------------------------------------------- real stores


@pytest.fixture(scope="module")
def encoder():
    from helix_ray.config import IngestConfig

    return get_token_encoder(pool_factor=IngestConfig().late_interaction.pool_factor)  # ingest's, loaded once


def by_id(generation: Generation) -> dict[str, bytes]:
    ids = generation.memories.column("id").to_pylist()
    return dict(zip(ids, tokens_of(generation.late, range(len(ids)))))


def test_a_one_memory_ingest_links_the_segment_and_survives_its_deletion(tmp_path, encoder):
    first = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:3])])
    second = write_jsonl(tmp_path / "b.jsonl", [memory(10, FACTS[3])])
    store = tmp_path / "store"
    ingest([first], store, runner="local", show_progress=False)
    g1 = Generation.open_current(store)
    before = by_id(g1)
    ingest([first, second], store, runner="local", show_progress=False)
    g2 = Generation.open_current(store)
    assert [s["name"] for s in g2.manifest["late"]["segments"]] == ["g000001", f"g{g2.number:06d}"]
    for kind in ("tokens", "scales"):
        assert inode(g2.path / segment_file("g000001", kind)) == inode(g1.path / segment_file("g000001", kind))
    new_row = g2.memories.column("id").to_pylist().index("m010")
    assert g2.manifest["late"]["segments"][1]["tokens"] == int(g2.late.length[new_row])  # only the new memory's
    after = by_id(g2)
    assert {i: after[i] for i in before} == before

    shutil.rmtree(g1.path)  # the older generation gone: the newer one's links hold the bytes
    g2 = Generation(g2.path, verify="full")
    assert by_id(g2) == after
    assert [c.found for c in check_store(store) if not c.ok] == []


def test_replacing_most_memories_rewrites_the_tokens(tmp_path, encoder):
    store = tmp_path / "store"
    source = tmp_path / "a.jsonl"
    ingest([write_jsonl(source, [memory(i, t) for i, t in enumerate(FACTS[:4])])], store, runner="local",
           show_progress=False)
    kept = by_id(Generation.open_current(store))["m000"]
    changed = [memory(0, FACTS[0])] + [memory(i, FACTS[i + 2] + " Updated.") for i in (1, 2, 3)]
    ingest([write_jsonl(source, changed)], store, runner="local", show_progress=False)
    g2 = Generation.open_current(store)
    assert [s["name"] for s in g2.manifest["late"]["segments"]] == [f"g{g2.number:06d}"]
    assert "dead" in g2.manifest["late"]["merged"]
    assert by_id(g2)["m000"] == kept and len(g2.late) == 4
    verify_files(g2.path, g2.manifest, full=True)


def test_many_small_ingests_keep_the_segments_capped(tmp_path, encoder, monkeypatch):
    monkeypatch.setattr(late_store, "MAX_SEGMENTS", 2)
    store = tmp_path / "store"
    sources = [write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0]), memory(1, FACTS[1])])]
    ingest(sources, store, runner="local", show_progress=False)
    seen = by_id(Generation.open_current(store))
    merged = []
    for i in (2, 3, 4):
        sources.append(write_jsonl(tmp_path / f"s{i}.jsonl", [memory(i, FACTS[i])]))
        ingest(sources, store, runner="local", show_progress=False)
        generation = Generation.open_current(store)
        assert len(generation.manifest["late"]["segments"]) <= 2
        now = by_id(generation)
        assert {k: now[k] for k in seen} == seen
        seen = now
        merged.append("merged" in generation.manifest["late"])
    assert merged == [False, True, False]  # the third segment merged with the others


def test_a_single_file_generation_is_carried(tmp_path, encoder):
    """A generation of the layout before segments: 64-d tokens are linked in as a
    segment of the generation that wrote them; 384-d backbone ones are projected."""
    store = tmp_path / "store"
    first = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:3])])
    ingest([first], store, runner="local", show_progress=False)
    g1 = Generation.open_current(store)
    block = g1.late.take(np.arange(len(g1.late)))
    single_file_tokens(g1.path, block.tokens, block.scales, block.offsets)
    g1 = Generation.open_current(store)
    before = by_id(g1)
    ingest([first, write_jsonl(tmp_path / "b.jsonl", [memory(10, FACTS[3])])], store, runner="local",
           show_progress=False)
    g2 = Generation.open_current(store)
    assert inode(g2.path / segment_file("g000001", "tokens")) == inode(g1.path / "late" / "tokens.npy")
    assert {i: by_id(g2)[i] for i in before} == before
    verify_files(g2.path, g2.manifest, full=True)

    texts = g2.memories.column("text").to_pylist()
    backbone = [quantize_tokens(x) for x in encoder.backbone_passages(texts)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for _, s in backbone])])
    single_file_tokens(g2.path, np.concatenate([c for c, _ in backbone]), np.concatenate([s for _, s in backbone]),
                       offsets, encoder=BACKBONE_NAME, dim=BACKBONE_DIM)
    g2 = Generation.open_current(store)
    projected = {i: g2.late.take(np.array([r])) for r, i in enumerate(g2.memories.column("id").to_pylist())}
    ingest([first, write_jsonl(tmp_path / "b.jsonl", [memory(10, FACTS[3]), memory(11, FACTS[4])])], store,
           runner="local", show_progress=False)
    g3 = Generation.open_current(store)
    assert [s["name"] for s in g3.manifest["late"]["segments"]] == [f"g{g3.number:06d}"]  # written, 64-d
    rows = {i: r for r, i in enumerate(g3.memories.column("id").to_pylist())}
    for i, block in projected.items():  # as projected when read (float rounding aside)
        stored = g3.late.take(np.array([rows[i]]))
        np.testing.assert_allclose(stored.tokens * stored.scales[:, None], block.tokens * block.scales[:, None],
                                   atol=0.01)


def test_a_filesystem_without_links_gets_copies(tmp_path, encoder, monkeypatch):
    def refuse(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(late_store.os, "link", refuse)
    first = write_jsonl(tmp_path / "a.jsonl", [memory(0, FACTS[0]), memory(1, FACTS[1])])
    store = tmp_path / "store"
    ingest([first], store, runner="local", show_progress=False)
    before = by_id(Generation.open_current(store))
    ingest([first, write_jsonl(tmp_path / "b.jsonl", [memory(2, FACTS[2])])], store, runner="local",
           show_progress=False)
    g2 = Generation.open_current(store)
    copied = g2.path / segment_file("g000001", "tokens")
    assert copied.is_file() and os.stat(copied).st_nlink == 1
    assert {i: by_id(g2)[i] for i in before} == before
    verify_files(g2.path, g2.manifest, full=True)


def test_a_forgotten_users_tokens_leave_the_segments(tmp_path, encoder):
    """Their one memory is a small part of the segment (no merge for dead tokens), yet
    the segment is not linked: its other rows are rewritten without their tokens."""
    from helix_ray.store import erase
    from helix_ray.store.db import StoreDB

    store = tmp_path / "store"
    source = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:5])]
                         + [memory(9, FACTS[5], user="erin")])
    ingest([source], store, runner="local", show_progress=False)
    g1 = Generation.open_current(store)
    before = by_id(g1)
    with StoreDB(store) as db:
        erase.forget_user(store, "erin", db=db)
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(FACTS[:5])])], store,
           runner="local", show_progress=False)
    g2 = Generation.open_current(store)
    late = g2.manifest["late"]
    assert [s["name"] for s in late["segments"]] == [f"g{g2.number:06d}"] and "forgotten" in late["merged"]
    assert sum(s["tokens"] for s in late["segments"]) == late["tokens"]  # no dead token left
    assert by_id(g2) == {i: t for i, t in before.items() if i != "m009"}
