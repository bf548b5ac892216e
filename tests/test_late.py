"""Late interaction: the token encoder (the real shipped model), MaxSim against a naive
reference, the token store in a generation, reuse across incremental ingests, and the
stage inside recall."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helix_ray.config import IngestConfig, load_config
from helix_ray.errors import ManifestMismatch
from helix_ray.memory import Memory
from helix_ray.recall import late
from helix_ray.store.generation import Generation
from helix_ray.token_encoder import (
    BACKBONE_DIM,
    BACKBONE_NAME,
    DIM,
    QUERY_TOKENS,
    PassageTokens,
    ProjectedTokens,
    from_blobs,
    get_token_encoder,
    pool,
    project,
    quantize_tokens,
    to_blobs,
)
from helix_ray.ingest.run import ingest
from tests.helpers import memory, single_file_tokens, write_jsonl

NATS = "We chose NATS JetStream over Kafka for the event bus because it is one binary."
CI = "The CI pipeline runs pytest against a real Postgres container."


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def naive_maxsim(query: np.ndarray, passages: list[np.ndarray], rows: list[int]) -> list[float]:
    """Mean over query tokens of the best cosine, one (dequantised) passage at a time."""
    out = []
    for r in rows:
        if r >= len(passages) or len(passages[r]) == 0:
            out.append(np.nan)
            continue
        codes, scales = quantize_tokens(passages[r])
        tokens = codes.astype(np.float64) * scales[:, None]
        out.append(float(np.mean([max(q @ t for t in tokens) for q in query.astype(np.float64)])))
    return out


@pytest.mark.parametrize("rows", [[0], [2, 0, 1], [1, 1, 3, 0], [4, 0], [5, 6]])
def test_maxsim_matches_a_naive_loop(rows):
    rng = np.random.default_rng(7)
    passages = [unit_rows(rng, n) for n in (3, 1, 7, 0, 2)]  # passage 3 has no tokens
    query = unit_rows(rng, QUERY_TOKENS)
    store = from_blobs(*to_blobs(passages))
    got = late.maxsim(query, store, np.array(rows))
    np.testing.assert_allclose(got, naive_maxsim(query, passages, rows), rtol=0, atol=1e-5)


def test_blend_estimates_a_missing_late_score_from_the_pool_offset():
    cosine = np.array([0.2, 0.5, 0.9, 0.4])
    scores = np.array([0.6, np.nan, 1.0, 0.6])  # late − cosine: .4, .1, .2 → median .2
    # Row 1 has no tokens (an online write): its late score is estimated as .5 + .2.
    np.testing.assert_allclose(late.blend(cosine, scores, 0.75),
                               [0.25 * 0.2 + 0.75 * 0.6, 0.25 * 0.5 + 0.75 * 0.7, 0.25 * 0.9 + 0.75 * 1.0,
                                0.25 * 0.4 + 0.75 * 0.6])
    np.testing.assert_array_equal(late.blend(cosine, scores, 0.0), cosine)
    np.testing.assert_array_equal(late.blend(cosine, None, 0.75), cosine)
    np.testing.assert_array_equal(late.blend(cosine, np.full(4, np.nan), 0.75), cosine)


def test_passage_tokens_take_and_concat():
    rng = np.random.default_rng(3)
    a = from_blobs(*to_blobs([unit_rows(rng, n) for n in (2, 0, 3)]))
    b = from_blobs(*to_blobs([unit_rows(rng, 4)]))
    both = PassageTokens.concat([a, b])
    assert len(both) == 4 and both.offsets.tolist() == [0, 2, 2, 5, 9]
    picked = both.take(np.array([3, 0, 1]))
    assert picked.offsets.tolist() == [0, 4, 6, 6]
    np.testing.assert_array_equal(picked.tokens[:4], b.tokens)
    np.testing.assert_array_equal(picked.tokens[4:6], a.tokens[:2])
    # One non-empty part is returned as it is (ingest joins gigabytes of new tokens to
    # no old ones); none gives an empty block.
    assert PassageTokens.concat([a, PassageTokens.concat([])]) is a
    assert len(PassageTokens.concat([])) == 0 and PassageTokens.concat([]).offsets.tolist() == [0]


def test_quantized_tokens_keep_cosines():
    rng = np.random.default_rng(11)
    x = unit_rows(rng, 50)
    codes, scales = quantize_tokens(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    np.testing.assert_allclose(codes * scales[:, None], x, atol=np.abs(x).max() / 127)


# --------------------------------------------------------------------------- the real model


def test_encoder_shapes_and_conventions():
    enc = get_token_encoder()
    q = enc.encode_query("why did we choose NATS for the event bus?")
    assert q.shape == (QUERY_TOKENS, DIM) and q.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-5)
    tokens = enc.encode_passages([NATS, "!!! ...", ""])
    # [CLS], the passage marker and [SEP] stay; punctuation-only pieces are dropped.
    assert [len(t) for t in tokens] == [len(enc._pieces([NATS])[0]) - 1 + 3, 3, 3]


def test_encoder_prefers_the_matching_passage_with_pinned_scores():
    enc = get_token_encoder()
    store = from_blobs(*to_blobs(enc.encode_passages([NATS, CI])))
    scores = late.maxsim(enc.encode_query("why did we choose NATS for the event bus?"), store, np.array([0, 1]))
    assert scores[0] > scores[1] + 0.05
    # Canonical values of this model on this pair (int8 ONNX; tolerance for onnxruntime builds).
    np.testing.assert_allclose(scores, [0.9276, 0.8678], atol=0.01)


def test_pooling_halves_a_passages_tokens_and_keeps_its_best_match():
    long_text = " ".join([NATS, CI, "Dana prefers tabs over spaces in the Go services."])
    plain = get_token_encoder().encode_passages([long_text])[0]
    pooled = get_token_encoder(pool_factor=2).encode_passages([long_text])[0]
    assert pooled.shape == (-(-len(plain) // 2), DIM)
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-5)
    query = get_token_encoder().encode_query("why did we choose NATS for the event bus?")
    full, half = (late.maxsim(query, from_blobs(*to_blobs([t])), np.array([0]))[0] for t in (plain, pooled))
    assert abs(full - half) < 0.05


def test_pool_groups_near_copies_and_keeps_distinct_rows_apart():
    rng = np.random.default_rng(0)
    centres = unit_rows(rng, 3)
    rows = np.repeat(centres, 2, axis=0) + rng.normal(scale=1e-3, size=(6, DIM)).astype(np.float32)
    pooled = pool(rows, 2)
    assert pooled.shape == (3, DIM)
    np.testing.assert_allclose(np.abs(pooled @ centres.T).max(axis=1), 1.0, atol=1e-3)
    assert pool(rows[:2], 2) is not None and len(pool(rows[:2], 2)) == 2  # two rows stay as they are
    assert len(pool(rows, 1)) == 6


def test_backbone_tokens_of_an_older_store_are_projected_as_they_are_read():
    rng = np.random.default_rng(1)
    backbone = [rng.normal(size=(n, BACKBONE_DIM)).astype(np.float32) for n in (3, 5)]
    backbone = [x / np.linalg.norm(x, axis=1, keepdims=True) for x in backbone]
    codes, scales = zip(*(quantize_tokens(x) for x in backbone))
    stored = PassageTokens(np.concatenate(codes), np.concatenate(scales), np.array([0, 3, 8]))
    read = ProjectedTokens(stored)
    known, block = read.lookup(np.array([1, 7]))
    assert list(known) == [0] and block.tokens.shape == (5, DIM)
    np.testing.assert_allclose(block.tokens * block.scales[:, None], project(backbone[1]), atol=0.02)
    # a write-ahead log entry of backbone codes decodes to the same projected block
    mixed = from_blobs([codes[1].tobytes(), quantize_tokens(project(backbone[0]))[0].tobytes()],
                       [scales[1].tobytes(), quantize_tokens(project(backbone[0]))[1].tobytes()])
    assert list(mixed.offsets) == [0, 5, 8] and mixed.tokens.shape == (8, DIM)
    np.testing.assert_array_equal(mixed.take(np.array([0])).tokens, block.tokens)
    with pytest.raises(ValueError, match=f"expected {DIM} or {BACKBONE_DIM} bytes per token"):
        from_blobs([b"\x01" * 50], [np.ones(1, np.float32).tobytes()])


# --------------------------------------------------------------------------- the store


def test_ingest_stores_tokens_and_reuses_them(tmp_path):
    encoder = get_token_encoder(pool_factor=IngestConfig().late_interaction.pool_factor)  # as ingest's
    facts = [NATS, CI, "Dana prefers tabs over spaces in the Go services.",
             "The gateway listens on port 8443 in production."]
    first = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(facts[:3])])
    second = write_jsonl(tmp_path / "b.jsonl", [memory(10, facts[3])])
    store = tmp_path / "store"
    before = encoder.calls
    ingest([first], store, runner="local", show_progress=False)
    assert encoder.calls - before == 3
    g1 = Generation.open_current(store)
    assert g1.manifest["late"]["tokens"] == int(g1.late.length.sum()) and len(g1.late) == 3
    old = {mid: np.array(g1.late.take(np.array([i])).tokens) for i, mid in enumerate(g1.memories.column("id").to_pylist())}

    before = encoder.calls
    ingest([first, second], store, runner="local", show_progress=False)
    assert encoder.calls - before == 1, "old memories' tokens must be reused, not encoded again"
    g2 = Generation.open_current(store)
    assert len(g2.late) == 4
    for i, mid in enumerate(g2.memories.column("id").to_pylist()):
        if mid in old:
            np.testing.assert_array_equal(g2.late.take(np.array([i])).tokens, old[mid])


def test_a_store_built_without_tokens_gets_them_on_the_next_ingest(tmp_path):
    off = load_config(IngestConfig, overrides={"late_interaction": {"enabled": False}})
    first = write_jsonl(tmp_path / "a.jsonl", [memory(0, NATS), memory(1, CI)])
    store = tmp_path / "store"
    ingest([first], store, config=off, runner="local", show_progress=False)
    g1 = Generation.open_current(store)
    assert g1.late is None and "late" not in g1.manifest
    with Memory(store, record_access=False) as mem:
        result = mem.recall("why NATS?", user="dana", explain=True)
    assert "late" not in result.flags and result.explain["late_maxsim"].null_count() == len(result.explain)

    second = write_jsonl(tmp_path / "b.jsonl", [memory(2, "Dana prefers tabs over spaces.")])
    ingest([first, second], store, runner="local", show_progress=False)
    g2 = Generation.open_current(store)
    assert len(g2.late) == 3 and np.all(g2.late.length > 0)


def test_a_reader_refuses_tokens_of_another_encoder(tmp_path):
    from helix_ray.store.integrity import seal

    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(0, NATS)])], store, runner="local", show_progress=False)
    path = Generation.open_current(store).path / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["late"]["encoder"] = "some-other-colbert"
    path.write_text(json.dumps(seal(manifest)))  # as that encoder's Helix would have written it
    with pytest.raises(ManifestMismatch, match="some-other-colbert"):
        _ = Generation.open_current(store).late


def test_a_store_with_backbone_tokens_still_recalls_with_late_interaction(tmp_path):
    """A generation written when Helix stored the backbone's 384-d tokens: its manifest
    names the backbone, and its tokens are projected as recall reads them."""
    store = tmp_path / "store"
    ingest([write_jsonl(tmp_path / "a.jsonl", [memory(0, NATS), memory(1, CI)])], store, runner="local",
           show_progress=False)
    gen = Generation.open_current(store)
    texts = gen.memories.column("text").to_pylist()
    backbone = get_token_encoder().backbone_passages(texts)
    codes, scales = zip(*(quantize_tokens(x) for x in backbone))
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in backbone])])
    single_file_tokens(gen.path, np.concatenate(codes), np.concatenate(scales), offsets, encoder=BACKBONE_NAME,
                       dim=BACKBONE_DIM)
    assert isinstance(Generation.open_current(store).late, ProjectedTokens)
    with Memory(store, record_access=False) as mem:
        result = mem.recall("why did we choose NATS for the event bus?", user="dana", explain=True)
    assert result.flags["late"] >= 1 and result.explain["late_maxsim"].null_count() == 0
    assert result.items[0].text == NATS


# --------------------------------------------------------------------------- inside recall


def test_recall_scores_every_candidate_and_the_stage_can_be_switched_off(tenant_memory):
    query = "which database did billing move to?"
    on = tenant_memory.recall(query, user="alice", explain=True)
    table = on.explain
    assert on.flags["late"] == len(table) and table["late_maxsim"].null_count() == 0
    assert "late" in on.timings_ms
    assert table["late_maxsim"].min() > -1.0 and table["late_maxsim"].max() <= 1.0
    off = tenant_memory.recall(query, user="alice", explain=True, disabled=frozenset({"late"}))
    assert "late" not in off.flags and off.explain["late_maxsim"].null_count() == len(off.explain)
    # Same candidates, other scores: the stage changes ranking only through the blend.
    assert set(table["id"]) == set(off.explain["id"])
    assert table.sort("id")["score"].to_list() != off.explain.sort("id")["score"].to_list()


def test_late_weight_one_ranks_by_maxsim_alone(tenant_memory):
    """With late.weight 1 and the similarity blend at 1, similarity is min-max(MaxSim)."""
    from helix_ray.config import RetrievalConfig

    cfg = load_config(RetrievalConfig, overrides={"late": {"weight": 1.0}, "rank": {"similarity_blend": 1.0}})
    table = tenant_memory.recall("restart the gateway pods", user="bob", config=cfg, explain=True).explain
    maxsim = np.array(table["late_maxsim"].to_list())
    expected = (maxsim - maxsim.min()) / (maxsim.max() - maxsim.min())
    np.testing.assert_allclose(table["similarity"].to_numpy(), expected, atol=1e-9)


def test_overlapped_query_tokens_give_the_same_answer_as_inline_ones(tenant_memory):
    """With a second core the query's tokens are encoded on another thread while the
    sentence vector and the legs run; the answer must not change, only when they are
    computed. The plan carries the running encoding until the late stage waits for it,
    and a plan sent across a hop (pickled) carries the tokens themselves."""
    import pickle

    recaller = tenant_memory.recaller
    query = "which database did billing move to?"
    original = recaller._overlap_tokens
    recaller._overlap_tokens = False
    inline_plan = recaller.plan(query, user="alice")
    assert inline_plan.pending_tokens is None and inline_plan.query_tokens is not None
    inline = recaller.recall(query, user="alice", explain=True)
    recaller._overlap_tokens = True
    try:
        plan = recaller.plan(query, user="alice")
        assert plan.pending_tokens is not None and plan.query_tokens is None
        sent = pickle.loads(pickle.dumps(plan))
        assert sent.pending_tokens is None and plan.pending_tokens is None
        # The same tokens up to float rounding: ONNX Runtime's sums depend on how many
        # threads the encoder gets, which depends on how busy the host is (threads.py).
        np.testing.assert_allclose(sent.query_tokens, inline_plan.query_tokens, rtol=0, atol=1e-4)
        assert "embed_tokens" in sent.timings_ms
        overlapped = recaller.recall(query, user="alice", explain=True)
    finally:
        recaller._overlap_tokens = original
    assert [i.id for i in overlapped.items] == [i.id for i in inline.items]
    assert overlapped.explain.sort("id")["score"].to_list() == inline.explain.sort("id")["score"].to_list()
    assert overlapped.flags["late"] == inline.flags["late"] > 0
    assert overlapped.timings_ms["embed_tokens"] > 0 and "embed_tokens" not in inline.timings_ms


def test_recall_runs_blas_on_one_thread_and_gives_the_caller_its_setting_back(tenant_memory):
    """Inside recall numpy's BLAS has one thread (its idle workers would spin on the
    core the token encoder needs); after it, the caller's setting is back, also when
    the calls nest."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from helix_ray.recall import pipeline

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    seen: list[set[int]] = []
    original = pipeline.late.maxsim

    def watched(*args, **kwargs):
        seen.append(blas_threads())
        return original(*args, **kwargs)

    with threadpool_limits(limits=2, user_api="blas"):  # the caller's own setting, whatever the host
        assert blas_threads() == {2}
        pipeline.late.maxsim = watched  # observes the setting inside the late stage, changes nothing
        try:
            tenant_memory.recall("which database did billing move to?", user="alice")
        finally:
            pipeline.late.maxsim = original
        assert seen == [{1}] and blas_threads() == {2}
        with pipeline._blas_on_caller:
            with pipeline._blas_on_caller:
                assert blas_threads() == {1}
            assert blas_threads() == {1}
        assert blas_threads() == {2}


def test_overlapping_recalls_on_two_threads_leave_the_blas_setting_as_they_found_it():
    """Recall A sets the limit; recall B starts on another thread while A runs, runs
    under it, and ends after A. B must not restore the limit it found (one thread) as
    if it were the caller's setting: afterwards BLAS has the threads it had before, and
    no thread keeps threadpoolctl's control (a limit set on a new thread works)."""
    import threading

    from threadpoolctl import ThreadpoolController, threadpool_info, threadpool_limits

    from helix_ray.recall.threads import blas_on_caller as _blas_on_caller

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    np.ones((64, 64)) @ np.ones((64, 64))  # numpy's BLAS loaded

    def set_two() -> None:  # on a thread that then ends: the setting stays, nobody holds control
        ThreadpoolController().limit(limits=2, user_api="blas")

    setter = threading.Thread(target=set_two)
    setter.start()
    setter.join(30)
    assert blas_threads() == {2}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def recall_a() -> None:
        with _blas_on_caller:
            a_in.set()
            assert b_in.wait(30)
            seen["a"] = blas_threads()
        a_out.set()

    def recall_b() -> None:
        assert a_in.wait(30)
        with _blas_on_caller:
            b_in.set()
            assert a_out.wait(30)
            seen["b"] = blas_threads()  # A's limit is gone: B runs with the caller's setting

    threads = [threading.Thread(target=recall_a), threading.Thread(target=recall_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert seen == {"a": {1}, "b": {2}}
    assert blas_threads() == {2}
    done: list[set[int]] = []

    def other() -> None:
        with threadpool_limits(limits=1, user_api="blas"):
            done.append(blas_threads())

    worker = threading.Thread(target=other)
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and done == [{1}] and blas_threads() == {2}


def test_memory_splits_the_cores_between_the_two_query_encoders_when_tokens_overlap(tenant_memory):
    from helix_ray.config import RetrievalConfig
    from helix_ray.recall.threads import encoder_threads
    from helix_ray.runtime import usable_cores

    generation = tenant_memory.recaller.generation
    assert generation.late is not None
    if usable_cores() > 1:  # half the cores each (one each on this 2-core host)
        assert encoder_threads(generation) == usable_cores() // 2 == tenant_memory.recaller._threads
        assert tenant_memory.recaller._overlap_tokens
    else:
        assert encoder_threads(generation) is None
    off = load_config(RetrievalConfig, overrides={"late": {"enabled": False}})
    assert encoder_threads(generation, off) is None and encoder_threads(None) is None
    # With onnxruntime's default threads (every core each) the two would spin against each other.
    from helix_ray.embedder import get_embedder
    from helix_ray.recall.pipeline import Recaller

    assert not Recaller(generation, get_embedder(), threads=None)._overlap_tokens


def test_tokens_are_not_encoded_for_nothing(tenant_memory):
    """A user with no memories gets no token encoding; a plan whose tokens no stage will
    read drops them (the encoding would take the second core from the next query)."""
    recaller = tenant_memory.recaller
    nobody = recaller.plan("which database did billing move to?", user="nobody-here")
    assert nobody.pending_tokens is None and nobody.query_tokens is None
    import threading

    from helix_ray.recall.threads import token_pool as _token_pool

    pool, release = _token_pool(), threading.Event()
    blockers = [pool.submit(release.wait, 30) for _ in range(pool._max_workers)]  # every worker busy
    original = recaller._overlap_tokens
    recaller._overlap_tokens = True
    try:
        plan = recaller.plan("which database did billing move to?", user="alice")
        pending = plan.pending_tokens
        assert pending is not None and not pending.running()  # queued behind the blockers
        plan.drop_tokens()
        assert pending.cancelled() and plan.pending_tokens is None and plan.tokens() is None
        # A plan whose finish finds no candidate (no leg ran) drops its queued encoding.
        empty = recaller.plan("which database did billing move to?", user="alice")
        queued = empty.pending_tokens
        assert queued is not None and not queued.running()
        assert recaller.finish(empty, None, None).items == []
        assert queued.cancelled()
    finally:
        recaller._overlap_tokens = original
        release.set()
    assert all(b.result(30) for b in blockers)
