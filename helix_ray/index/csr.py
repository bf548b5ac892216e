"""The memory graph as a symmetric CSR adjacency, saved as ``graph/{indptr,indices,
weights,types}.npy`` and memory-mapped on load."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The edge types, in the order of the codes stored in :attr:`CSRGraph.types`.
EDGE_TYPES = ("mention", "same_session", "temporal", "semantic")
#: The weight of a same_session edge (a memory and its session's node).
SESSION_EDGE_WEIGHT = 0.5
#: How a session's node is keyed among the entity nodes: ``session:<session id>``.
SESSION_KEY = "session:"


@dataclass
class CSRGraph:
    """Symmetric weighted adjacency; nodes 0..N-1 are memories, N.. are entities."""

    indptr: np.ndarray  # int64 (nodes + 1)
    indices: np.ndarray  # int32
    weights: np.ndarray  # float32
    types: np.ndarray  # int8 index into EDGE_TYPES

    @property
    def num_nodes(self) -> int:
        return len(self.indptr) - 1

    def to_scipy(self):
        from scipy.sparse import csr_matrix

        n = self.num_nodes
        return csr_matrix((self.weights, self.indices, self.indptr), shape=(n, n))
