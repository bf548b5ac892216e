"""Stage 1: embed the query with the model the store was built with.

The float vector is kept: the dense leg rescores its first-pass survivors with it, and
ranking and MMR use it for cosine similarity.
"""

from __future__ import annotations

import numpy as np

from helix_ray.embedder import Embedder


def embed_query(embedder: Embedder, query: str) -> np.ndarray:
    """Unit-length float32 vector (dim,)."""
    return embed_queries(embedder, [query])[0]


def embed_queries(embedder: Embedder, queries: list[str]) -> np.ndarray:
    """Unit-length float32 vectors (n, dim), one batch through the encoder."""
    vectors = embedder.embed_queries(queries).astype(np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.divide(vectors, norms, out=vectors, where=norms > 0)
