"""The two quantised forms of the embeddings a generation keeps beside the float32
vectors: int8 for the HNSW graph, sign bits for the first-pass Hamming scan."""

from __future__ import annotations

import numpy as np


def quantize_int8(vectors: np.ndarray) -> np.ndarray:
    """Per-vector symmetric int8: v / max|v| × 127, rounded. Cosine is scale-free, so the
    per-vector scale is dropped."""
    vectors = np.asarray(vectors)
    if not vectors.size:
        return np.zeros(vectors.shape, np.int8)
    peak = np.maximum(vectors.max(axis=-1, keepdims=True), -vectors.min(axis=-1, keepdims=True))
    peak[peak == 0] = 1.0
    scaled = np.divide(vectors, peak, dtype=np.result_type(vectors, np.float32))  # one temporary, then in place
    scaled *= 127.0
    return np.rint(scaled, out=scaled).astype(np.int8)


def binary_codes(vectors: np.ndarray) -> np.ndarray:
    """The sign bit of each dimension (> 0), packed 8 to a byte along the last axis:
    ``(N, dim)`` vectors give ``(N, dim / 8)`` uint8 codes, one vector ``(dim / 8,)``."""
    return np.packbits(vectors > 0, axis=-1)
