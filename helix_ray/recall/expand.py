"""Stage 5: graph expansion with Personalized PageRank over the ingest-time graph.

PPR (Haveliwala 2002; as used for memory graphs by HippoRAG): p = (1 − α)·s + α·Pᵀp,
with s the seed distribution (fused scores of the top-k), P the row-normalised
adjacency and α the damping. It runs on a bounded subgraph — the seeds' neighbourhood
up to ``max_hops`` hops, at most ``max_nodes`` nodes — so its cost does not grow with
the whole graph. Edges leaving the subgraph are dropped and mass at a node with no
edge left returns to the seeds. When even the first hop overflows ``max_nodes`` (a hub),
a bounded BFS scores nodes by 1 / (1 + hops) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix


@dataclass(frozen=True)
class Expansion:
    nodes: np.ndarray  # int64 node ids (memories are < num_memories)
    scores: np.ndarray  # float64 proximity (PPR mass, or BFS 1/(1+hops))
    method: str  # "ppr" | "bfs"
    subgraph_nodes: int


def neighbourhood(indptr, indices, seeds: np.ndarray, max_hops: int, max_nodes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """BFS from ``seeds`` (at most ``max_nodes`` of them): (nodes, hop of each, depth at
    which the node cap cut the search, 0 if it did not). Seeds come first."""
    hop = {int(s): 0 for s in seeds[:max_nodes]}
    frontier = list(hop)
    truncated = 0
    for depth in range(1, max_hops + 1):
        nxt = []
        for node in frontier:
            for nb in indices[indptr[node]:indptr[node + 1]]:
                nb = int(nb)
                if nb not in hop:
                    if len(hop) >= max_nodes:
                        truncated = depth
                        break
                    hop[nb] = depth
                    nxt.append(nb)
            if truncated:
                break
        frontier = nxt
        if truncated or not frontier:
            break
    nodes = np.fromiter(hop.keys(), dtype=np.int64, count=len(hop))
    hops = np.fromiter(hop.values(), dtype=np.int64, count=len(hop))
    return nodes, hops, truncated


def ppr_dense(adjacency: np.ndarray, seed: np.ndarray, damping: float, iterations: int = 1000, tol: float = 1e-12) -> np.ndarray:
    """Reference power iteration on a dense adjacency matrix (tests compare to it)."""
    degree = adjacency.sum(axis=1)
    transition = np.divide(adjacency, degree[:, None], out=np.zeros_like(adjacency, dtype=float), where=degree[:, None] > 0)
    s = seed / seed.sum()
    p = s.copy()
    for _ in range(iterations):
        dangling = p[degree == 0].sum()
        new = (1 - damping) * s + damping * (transition.T @ p + dangling * s)
        if np.abs(new - p).sum() < tol:
            return new
        p = new
    return p


def ppr(graph, seeds: np.ndarray, seed_weights: np.ndarray, *, damping: float, max_hops: int, max_nodes: int,
        iterations: int, tolerance: float) -> Expansion:
    indptr, indices, weights = graph.indptr, graph.indices, graph.weights
    seeds = seeds[:max_nodes]
    seed_weights = seed_weights[:max_nodes]
    nodes, hops, cut_at = neighbourhood(indptr, indices, seeds, max_hops, max_nodes)
    if cut_at == 1:  # even the first hop overflows: a hub; PPR on a clipped star misleads
        return Expansion(nodes, 1.0 / (1.0 + hops), "bfs", len(nodes))
    local = {int(n): i for i, n in enumerate(nodes)}
    rows, cols, vals = [], [], []
    for i, node in enumerate(nodes):
        lo, hi = indptr[node], indptr[node + 1]
        for nb, w in zip(indices[lo:hi], weights[lo:hi]):
            j = local.get(int(nb))
            if j is not None:
                rows.append(i); cols.append(j); vals.append(float(w))
    n = len(nodes)
    adjacency = csr_matrix((vals, (rows, cols)), shape=(n, n))
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    inv = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    transition_t = (adjacency.multiply(inv[:, None])).T.tocsr()
    s = np.zeros(n)
    s[: len(seeds)] = seed_weights / seed_weights.sum()
    p = s.copy()
    dangling_mask = degree == 0
    for _ in range(iterations):
        new = (1 - damping) * s + damping * (transition_t @ p + p[dangling_mask].sum() * s)
        if np.abs(new - p).sum() < tolerance:
            p = new
            break
        p = new
    return Expansion(nodes, p, "ppr", n)
