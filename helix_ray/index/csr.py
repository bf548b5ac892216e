"""The memory graph as a symmetric CSR adjacency, saved as ``graph/{indptr,indices,
weights,types}.npy`` and memory-mapped on load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The edge types, in the order of the codes stored in :attr:`CSRGraph.types`.
EDGE_TYPES = ("mention", "same_session", "temporal", "semantic")
#: The weight of a same_session edge (a memory and its session's node).
SESSION_EDGE_WEIGHT = 0.5
#: How a session's node is keyed among the entity nodes: ``session:<session id>``.
SESSION_KEY = "session:"


#: The arrays of a :class:`CSRGraph`, a ``.npy`` file each in its folder.
CSR_ARRAYS = ("indptr", "indices", "weights", "types")


def save_csr(folder: Path, graph: "CSRGraph") -> None:
    """``graph``'s arrays into ``folder`` (made if missing), a file each."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in CSR_ARRAYS:
        with open(folder / f"{name}.npy", "wb") as fh:
            np.save(fh, np.ascontiguousarray(getattr(graph, name)))


def load_csr(folder: Path) -> "CSRGraph":
    """The graph :func:`save_csr` wrote into ``folder``, memory-mapped."""
    return CSRGraph(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in CSR_ARRAYS))


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
