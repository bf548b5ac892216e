"""Benchmark stores of derived memories, built without embedding every text.

``base_set`` embeds a few distinct synthetic memories (``scripts/synthetic.py``, the
count is ``bench_recall.py --base``) for real with the store's embedder (length-sorted
batches: same vectors, less padding). Every benchmark memory is then
*derived* from one base memory — its text is ``synthetic.derive_text`` of the base text
(new numbers, one to three words swapped for the session's identifiers, sometimes a
sentence dropped or added) and its vector is the base vector plus Gaussian noise
N(0, σ²) per dimension, renormalised. ``scripts/bench_recall.py`` reports the resulting
nearest-neighbour cosine distribution next to the base set's own.

With late interaction on (the default ``IngestConfig``), ``base_tokens`` also encodes the
base texts' ColBERT token vectors for real (``helix_ray.token_encoder``, length-sorted
batches, cached in ``work`` like the vectors), and each derived memory gets a copy of its
base memory's tokens. That is an approximation: the derived text differs from the base
text in a few words and numbers, whose tokens it does not have, so its MaxSim scores are
those of the base text (the store's size and token count, and so the cost of reading and
scoring them, are those of real tokens).

The generation is then assembled and published with the ingest pipeline's own functions
— ``helix_ray.ingest.assemble.assemble`` (the rows as ``new_row_table`` makes them) and
``helix_ray.store.publish.publish``, called directly — with
rows validated by ``helix_ray.ingest.normalize.normalise_one``, doc2query expansions,
entities and token counts from ``helix_ray.ingest.stages`` (Expand, Annotate) and MinHash
signatures from ``helix_ray.ingest.dedup``: so BM25, HNSW (tenants ≥
``IngestConfig.hnsw_min_rows``), the graph (semantic kNN, sessions, entities) and MinHash
are the real thing. Skipped: read/validate on Ray, dedup, the DuckDB record (recall does
not read it). ``bench_recall.py`` builds HNSW with ``hnsw_threads=0`` by default (all
cores; non-deterministic insertion order), for build speed.
"""

from __future__ import annotations

import datetime as dt
import functools
import gc
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from bench_ingest import rss_mib
from synthetic import Corpus, derive_text


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- base set


def base_texts(count: int, seed: int) -> tuple[list[str], list[str | None], str]:
    """``count`` distinct synthetic memories (texts, types) and a digest of the texts."""
    corpus = Corpus(int(count * 1.05) + 100, seed=seed + 7919)  # a different seed than the stores
    texts, types, seen = [], [], set()
    for row in corpus.rows():
        if row["text"] not in seen:
            seen.add(row["text"])
            texts.append(row["text"])
            types.append(row.get("type"))
            if len(texts) == count:
                break
    return texts, types, hashlib.sha1("\x1e".join(texts).encode()).hexdigest()[:16]


def base_set(count: int, seed: int, work: Path) -> tuple[list[str], list[str | None], np.ndarray, dict[str, Any]]:
    """``count`` distinct synthetic memories and their real embeddings (cached in ``work``)."""
    from helix_ray.config import IngestConfig
    from helix_ray.embedder import get_embedder, iter_batches

    cache = work / f"base-seed{seed}-{count}.npz"
    texts, types, digest = base_texts(count, seed)
    if cache.is_file():
        data = np.load(cache)
        if str(data["digest"]) == digest:
            log(f"base set: {count} vectors from cache {cache}")
            return texts, types, data["vectors"], {"embed_s": float(data["embed_s"]), "cached": True}
    config = IngestConfig().embedder
    embedder = get_embedder(config)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    vectors = np.empty((len(texts), embedder.dim), np.float32)
    log(f"base set: embedding {count} texts (length-sorted batches of {config.batch_size}) ...")
    t0 = time.perf_counter()
    done = 0
    for chunk in iter_batches(order, 1024):
        vectors[chunk] = embedder.embed_passages([texts[i] for i in chunk])
        done += len(chunk)
        if done % 4096 < 1024:
            log(f"  {done}/{count} ({done / (time.perf_counter() - t0):.0f}/s)")
    embed_s = time.perf_counter() - t0
    np.savez(cache, vectors=vectors, digest=digest, embed_s=embed_s)
    return texts, types, vectors, {"embed_s": round(embed_s, 1), "cached": False,
                                   "per_s": round(count / embed_s, 1)}


def base_tokens(texts: list[str], seed: int, work: Path) -> tuple[Any, dict[str, Any]]:
    """The late-interaction token vectors of ``texts`` (the base set), encoded with the
    default ingest config's token encoder and quantized as ingest stores them: one
    ``PassageTokens`` block, passage ``i`` for ``texts[i]``. Cached in ``work`` under the
    texts' digest, the encoder's name and the late-interaction config, so another
    encoder or passage cut encodes again."""
    from helix_ray.config import IngestConfig
    from helix_ray.embedder import iter_batches
    from helix_ray.token_encoder import NAME, PassageTokens, get_token_encoder, quantize_tokens

    late = IngestConfig().late_interaction
    key = "|".join([hashlib.sha1("\x1e".join(texts).encode()).hexdigest()[:16], NAME, late.model_dump_json()])
    cache = work / f"base-tokens-seed{seed}-{len(texts)}.npz"
    if cache.is_file():
        data = np.load(cache)
        if str(data["key"]) == key:
            block = PassageTokens(data["tokens"], data["scales"], data["offsets"])
            log(f"base set: tokens of {len(texts)} texts from cache {cache}")
            return block, {"encode_s": float(data["encode_s"]), "cached": True, **token_counts(block)}
    encoder = get_token_encoder(late.max_tokens, pool_factor=late.pool_factor)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    codes: list[np.ndarray] = [np.empty(0)] * len(texts)
    scales: list[np.ndarray] = [np.empty(0)] * len(texts)
    log(f"base set: encoding the tokens of {len(texts)} texts ({NAME}, length-sorted batches of "
        f"{encoder.batch_size}) ...")
    t0 = time.perf_counter()
    done = 0
    for chunk in iter_batches(order, 1024):
        for i, vectors in zip(chunk, encoder.encode_passages([texts[i] for i in chunk])):
            codes[i], scales[i] = quantize_tokens(vectors)  # per token, as ingest's to_blobs
        done += len(chunk)
        log(f"  {done}/{len(texts)} ({done / (time.perf_counter() - t0):.0f}/s)")
    encode_s = time.perf_counter() - t0
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum([len(s) for s in scales], out=offsets[1:])
    block = PassageTokens(np.concatenate(codes), np.concatenate(scales), offsets)
    np.savez(cache, tokens=block.tokens, scales=block.scales, offsets=block.offsets, key=key, encode_s=encode_s)
    return block, {"encode_s": round(encode_s, 1), "cached": False, "per_s": round(len(texts) / encode_s, 1),
                   **token_counts(block)}


def token_counts(block: Any) -> dict[str, Any]:
    """Tokens in all, per passage (median) and their dimension."""
    lengths = np.diff(block.offsets)
    return {"tokens": int(block.offsets[-1]), "tokens_per_memory_p50": float(np.median(lengths)),
            "dim": int(block.tokens.shape[1])}


def top1_cosine(vectors: np.ndarray, sample: np.ndarray, block: int = 65536) -> np.ndarray:
    """Exact top-1 cosine of ``vectors[sample]`` against all other rows (unit vectors)."""
    queries = vectors[sample]
    best = np.full(len(sample), -2.0, np.float32)
    for lo in range(0, len(vectors), block):
        sims = queries @ vectors[lo : lo + block].T
        own = (sample >= lo) & (sample < lo + block)
        sims[np.flatnonzero(own), sample[own] - lo] = -2.0
        best = np.maximum(best, sims.max(axis=1))
    return best


def dist(values: np.ndarray) -> dict[str, float]:
    return {f"p{p}": round(float(np.percentile(values, p)), 4) for p in (5, 25, 50, 75, 95)} | {
        "mean": round(float(np.mean(values)), 4)}


# ----------------------------------------------------------------------------- profiling hooks


class StepTimer:
    """Wraps module functions to add up the time spent in each (no code edits needed)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, name: str, label: str | None = None) -> None:
        original = getattr(module, name)
        label = label or name

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(module, name, timed)
        self._undo.append((module, name, original))

    def restore(self) -> None:
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo.clear()


class _NoPreviousStore:
    """Stands in for the DuckDB writer in ``_assemble``: a fresh store has no old rows,
    so the only call, ``expansions_for([])``, returns nothing."""

    def expansions_for(self, ids: list[str]) -> dict[str, list[str]]:
        return {}


class DerivedTokens:
    """Stands in for the derived rows' ``PassageTokens`` in ``assemble``: row ``k`` has
    base passage ``base_of[k]``'s tokens. ``take`` makes the block, so publish's gather
    in tenant order is the one copy of every row's tokens rather than a second one
    (a copy is the size of ``late/``, which ``build_store`` reports)."""

    def __init__(self, base: Any, base_of: np.ndarray):
        self.base, self.base_of = base, base_of

    def __len__(self) -> int:
        return len(self.base_of)

    def take(self, rows: np.ndarray) -> Any:
        return self.base.take(self.base_of[rows])


# ----------------------------------------------------------------------------- build


def derived_rows(n: int, *, users: int | None, base_texts: list[str], base_types: list[str | None],
                 base_of: np.ndarray, seed: int, config: Any) -> list[dict[str, Any]]:
    """``n`` validated rows, each the text of base memory ``base_of[k]`` derived for its session."""
    from helix_ray.ingest.normalize import normalise_one

    corpus = Corpus(n, seed=seed, users=users)
    rng = random.Random(f"derive-{seed}")
    default_time = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    todo: list[dict[str, Any]] = []
    for k, (raw, writer) in enumerate(corpus.skeleton()):
        b = int(base_of[k])
        topic = writer.t
        words = topic.functions + topic.paths + topic.classes + [topic.service, topic.env, topic.config_key]
        raw["text"] = derive_text(rng, base_texts[b], words)
        if base_types[b] is not None:
            raw["type"] = base_types[b]
        row = normalise_one(raw, config.validation, default_time=default_time)
        row["seq"] = k
        todo.append(row)
    return todo


def derived_vectors(base_vectors: np.ndarray, base_of: np.ndarray, nrng: np.random.Generator,
                    sigma: float) -> np.ndarray:
    """The base vector of each row plus N(0, sigma^2) noise per dimension, renormalised."""
    from helix_ray.embedder import DIM

    n = len(base_of)
    vectors = np.empty((n, DIM), np.float32)
    for lo in range(0, n, 65536):
        hi = min(n, lo + 65536)
        v = base_vectors[base_of[lo:hi]] + nrng.standard_normal((hi - lo, DIM), dtype=np.float32) * np.float32(sigma)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        vectors[lo:hi] = v
    return vectors


def minhash(todo: list[dict[str, Any]], config: Any) -> np.ndarray:
    """MinHash signatures of the rows' texts, in chunks."""
    from helix_ray.ingest import dedup

    n = len(todo)
    texts = [r["text"] for r in todo]
    return np.concatenate([dedup.signatures(texts[lo : lo + 20000], num_perm=config.dedup.num_perm,
                                            shingle=config.dedup.shingle) for lo in range(0, n, 20000)])


def annotated_columns(todo: list[dict[str, Any]], vectors: np.ndarray, config: Any) -> dict[str, Any]:
    """The new columns ``assemble`` takes, as ingest's ``collect`` gives them: vectors,
    doc2query expansions (Arrow strings), entities (Arrow lists), both chunked arrays,
    token counts, BM25 terms."""
    from helix_ray.index.bm25 import TermsOfWords
    from helix_ray.ingest import stages
    from helix_ray.ingest.carry import MENTIONS_TYPE
    from helix_ray.ingest.run import BATCH

    n = len(todo)
    expand, annotate = stages.Expand(config.doc2query), stages.Annotate(config)
    expansions, ents, n_tokens = [], [], []
    terms = TermsOfWords(n)
    for lo in range(0, n, BATCH):
        chunk = todo[lo : lo + BATCH]
        batch = {"seq": np.array([r["seq"] for r in chunk], dtype=object),
                 "text": np.array([r["text"] for r in chunk], dtype=object),
                 "type": np.array([r["type"] for r in chunk], dtype=object)}
        batch = annotate(expand(batch))
        expansions.extend(str(x) for x in batch["expansions"])
        ents.append(pa.array([json.loads(str(x)) for x in batch["entities"]], MENTIONS_TYPE))
        n_tokens.append(np.asarray(batch["n_tokens"], np.int32))
        terms.add(np.arange(lo, lo + len(chunk)), batch["words"])
    return {"vector": vectors, "expansions": pa.chunked_array([pa.array(expansions, pa.string())]),
            "entities": pa.chunked_array(ents, MENTIONS_TYPE),
            "n_tokens": np.concatenate(n_tokens), "terms": terms}


def build_timer() -> StepTimer:
    """A StepTimer on the functions assemble and publish spend their time in."""
    from helix_ray.ingest import assemble as assemble_mod
    from helix_ray.ingest import carry as carry_mod
    from helix_ray.ingest import dense as dense_mod
    from helix_ray.ingest import graph as graph_mod
    from helix_ray.store import publish as publish_mod

    timer = StepTimer()
    timer.wrap(carry_mod, "exact_knn", "exact_knn (small tenants)")
    timer.wrap(graph_mod, "build_graph")
    timer.wrap(graph_mod, "_to_csr", "build_graph: _to_csr")
    timer.wrap(dense_mod, "build_hnsw")  # as the assembly's index units import it
    timer.wrap(dense_mod, "search_block", "HNSW kNN searches")
    timer.wrap(dense_mod, "quantize_int8")
    timer.wrap(publish_mod, "build_hnsw", "publish: build_hnsw")
    timer.wrap(publish_mod, "quantize_int8", "publish: quantize_int8")
    timer.wrap(publish_mod, "build_bm25", "publish: build_bm25")
    timer.wrap(publish_mod, "fsync_path", "publish: fsync")
    timer.wrap(publish_mod, "_write_late", "publish: write late/")
    return timer


def profile_of(timer: StepTimer, assemble_s: float, publish_s: float) -> dict[str, float]:
    """The timer's seconds per hook, plus what assemble and publish spent outside them."""
    hooks = {k: round(v, 2) for k, v in timer.seconds.items()}
    inner = sum(v for k, v in timer.seconds.items() if not k.startswith("publish") and k != "build_graph: _to_csr")
    # the knn search over each HNSW index is inside _assemble but not in a function of its own
    hooks["assemble: rest (sort/take, HNSW kNN search, node names)"] = round(assemble_s - inner, 2)
    hooks["publish: rest (write files)"] = round(
        publish_s - sum(v for k, v in timer.seconds.items() if k.startswith("publish")), 2)
    return hooks


def build_store(n: int, store: Path, *, users: int | None, base_texts: list[str], base_types: list[str | None],
                base_vectors: np.ndarray, sigma: float, seed: int, hnsw_threads: int,
                base_tokens: Any = None) -> dict[str, Any]:
    """Derive ``n`` memories from the base set and publish them as one generation in
    ``store``. With ``base_tokens`` (the base set's ``PassageTokens``) late interaction
    is on, as in the default ``IngestConfig``, and each memory has its base memory's
    tokens; without, the generation has no ``late/``."""
    from helix_ray.config import IngestConfig, LateInteractionConfig
    from helix_ray.ingest.assemble import NextRows, assemble, new_row_table
    from helix_ray.ingest.dense import work_folder
    from helix_ray.schema import GENERATION_SCHEMA
    from helix_ray.store.publish import publish

    config = IngestConfig(hnsw_threads=hnsw_threads,
                          late_interaction=LateInteractionConfig(enabled=base_tokens is not None))
    steps: dict[str, float] = {}

    def step(name: str, t0: float) -> float:
        steps[name] = round(time.perf_counter() - t0, 2)
        log(f"  {name}: {steps[name]:.1f}s (RSS {rss_mib()[0]:,.0f} MiB)")
        return time.perf_counter()

    t = time.perf_counter()
    nrng = np.random.default_rng(seed)
    base_of = nrng.integers(0, len(base_texts), n)
    todo = derived_rows(n, users=users, base_texts=base_texts, base_types=base_types, base_of=base_of, seed=seed,
                        config=config)
    t = step("rows (generate + normalise)", t)
    vectors = derived_vectors(base_vectors, base_of, nrng, sigma)
    t = step("vectors (base + noise)", t)
    sigs = minhash(todo, config)
    t = step("minhash", t)
    new_cols = annotated_columns(todo, vectors, config)
    t = step("expand + annotate (doc2query, entities, tokens)", t)
    if base_tokens is not None:  # todo[k]'s tokens as row k, where ingest's collect() puts them
        new_cols["late"] = DerivedTokens(base_tokens, base_of)

    table = new_row_table(todo)  # the rows as an ingest holds them from dedup on
    todo.clear()
    t = step("rows as columns (new_row_table)", t)

    timer = build_timer()
    try:
        t0 = time.perf_counter()
        rows = NextRows(None, GENERATION_SCHEMA.empty_table(), np.zeros(0, np.int64), np.zeros(0, np.int64), table,
                        new_cols, sigs, np.arange(n))
        del table
        with work_folder(store) as work:  # the HNSW index files, until publish moves them in
            data = assemble(rows, _NoPreviousStore(), config, work=work)
            assemble_s = time.perf_counter() - t0
            t = step("assemble (helix_ray.ingest.assemble.assemble)", t)
            del todo, new_cols, vectors, sigs
            gc.collect()
            t0 = time.perf_counter()
            number = publish(
                store, data, hnsw_connectivity=config.hnsw_connectivity,
                hnsw_expansion_add=config.hnsw_expansion_add, dense_indexes=data.extra.pop("_dense_indexes", None),
                hnsw_min_rows=config.hnsw_min_rows, hnsw_threads=config.hnsw_threads,
            )
            publish_s = time.perf_counter() - t0
        t = step("publish (helix_ray.store.publish.publish)", t)
    finally:
        timer.restore()
    hooks = profile_of(timer, assemble_s, publish_s)
    folder = store / "generations" / f"{number:06d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    del data
    gc.collect()
    late = None
    if "late" in manifest:
        late = {"bytes": sum(p.stat().st_size for p in (folder / "late").rglob("*") if p.is_file()),
                "tokens": manifest["late"]["tokens"], "dim": manifest["late"]["dim"]}
    return {"steps_s": steps, "profile_s": hooks, "build_s": round(sum(steps.values()), 1), "late": late,
            "peak_rss_mib": round(rss_mib()[1], 0), "counts": manifest["counts"],
            "partitions": len(manifest["partitions"]),
            "hnsw_partitions": sum(1 for p in manifest["partitions"] if p["dense"]),
            "largest_tenant": max(p["end"] - p["start"] for p in manifest["partitions"]),
            "store_bytes": sum(p.stat().st_size for p in store.rglob("*") if p.is_file())}
