"""The two quantised forms of the embeddings a generation keeps beside the float32
vectors: int8 for the HNSW graph, sign bits for the first-pass Hamming scan."""

from __future__ import annotations

import numpy as np


def quantize_int8(vectors: np.ndarray, block: int = 65536) -> np.ndarray:
    """Per-vector symmetric int8: v / max|v| × 127, rounded. Cosine is scale-free, so the
    per-vector scale is dropped. Rows go ``block`` at a time, so the float temporary is
    one block's, not the whole matrix's (a million vectors: 1.5 GB)."""
    vectors = np.asarray(vectors)
    out = np.empty(vectors.shape, np.int8)
    if vectors.ndim < 2:
        return _int8_rows(vectors, out)
    for lo in range(0, len(vectors), block):
        _int8_rows(vectors[lo:lo + block], out[lo:lo + block])
    return out


def _int8_rows(vectors: np.ndarray, out: np.ndarray) -> np.ndarray:
    if not vectors.size:
        return out
    peak = np.maximum(vectors.max(axis=-1, keepdims=True), -vectors.min(axis=-1, keepdims=True))
    peak[peak == 0] = 1.0
    scaled = np.divide(vectors, peak, dtype=np.result_type(vectors, np.float32))  # one temporary, then in place
    scaled *= 127.0
    np.rint(scaled, out=scaled)
    out[...] = scaled
    return out


def binary_codes(vectors: np.ndarray) -> np.ndarray:
    """The sign bit of each dimension (> 0), packed 8 to a byte along the last axis:
    ``(N, dim)`` vectors give ``(N, dim / 8)`` uint8 codes, one vector ``(dim / 8,)``."""
    return np.packbits(vectors > 0, axis=-1)
