"""Stage 1: embed the query with the model the store was built with.

The float vector is kept: the dense leg rescores its first-pass survivors with it, and
ranking and MMR use it for cosine similarity.
"""

from __future__ import annotations

import numpy as np

from helix_ray.embedder import Embedder


def embed_query(embedder: Embedder, query: str) -> np.ndarray:
    """Unit-length float32 vector (dim,)."""
    vector = embedder.embed_queries([query])[0].astype(np.float32)
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector
