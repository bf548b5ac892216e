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


class ExtraEdges:
    """Edges beside a stored graph's, symmetric (each given both ways): the session edges
    of a Serve replica's online writes, which no generation holds yet
    (:class:`helix_ray.live.views.JoinedGeneration`). Kept sorted by source node."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, weights: np.ndarray):
        order = np.argsort(src, kind="stable")
        self.src = np.asarray(src, np.int64)[order]
        self.dst = np.asarray(dst, np.int64)[order]
        self.weights = np.asarray(weights, np.float64)[order]

    def __len__(self) -> int:
        return len(self.src)

    def edges_of(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(index into ``nodes`` of the source, the other end, the weight) of every edge of ``nodes``."""
        first = np.searchsorted(self.src, nodes, side="left")
        owner, at = _spans(first, np.searchsorted(self.src, nodes, side="right") - first)
        return owner, self.dst[at], self.weights[at]

    def degree(self, nodes: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.src, nodes, side="right") - np.searchsorted(self.src, nodes, side="left")


def _edges_of(indptr, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index into ``nodes`` of the source, CSR position) of every edge of ``nodes``."""
    starts = np.asarray(indptr[nodes], dtype=np.int64)
    return _spans(starts, np.asarray(indptr[nodes + 1], dtype=np.int64) - starts)


def _spans(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of its span, position) of every position in the spans ``starts[i]`` to
    ``starts[i] + lengths[i]``, span by span, without a Python loop."""
    owner = np.repeat(np.arange(len(starts)), lengths)
    positions = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
    return owner, positions


def neighbourhood(indptr, indices, seeds: np.ndarray, max_hops: int, max_nodes: int,
                  max_degree: int | None = None,
                  extra: ExtraEdges | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """BFS from ``seeds`` (at most ``max_nodes`` of them): (nodes, hop of each, depth at
    which the node cap cut the search, 0 if it did not). Seeds come first, then each hop
    in discovery order. Vectorised per hop: no Python loop over edges. ``extra``: edges
    beside the CSR's, walked as its own.

    A reached node with more than ``max_degree`` edges (a hub: an entity named by
    thousands of memories) is left out: like a term with a tiny IDF it links everything
    and says little, and gathering its edges would dominate the cost."""
    seeds = np.asarray(seeds, dtype=np.int64)
    _, first = np.unique(seeds[:max_nodes], return_index=True)
    nodes = [seeds[np.sort(first)]]
    hops = [np.zeros(len(nodes[0]), np.int64)]
    visited = np.sort(nodes[0])
    frontier = nodes[0]
    count = len(frontier)
    for depth in range(1, max_hops + 1):
        if len(frontier) == 0:
            break
        _, positions = _edges_of(indptr, frontier)
        reached = np.asarray(indices[positions], dtype=np.int64)
        if extra is not None and len(extra):
            reached = np.concatenate([reached, extra.edges_of(frontier)[1]])
        if len(reached) == 0:
            break
        uniq, first = np.unique(reached, return_index=True)
        fresh = uniq[~np.isin(uniq, visited, assume_unique=True)]
        if max_degree is not None and len(fresh):
            degree = np.asarray(indptr[fresh + 1], dtype=np.int64) - np.asarray(indptr[fresh], dtype=np.int64)
            if extra is not None and len(extra):
                degree = degree + extra.degree(fresh)
            fresh = fresh[degree <= max_degree]
        fresh = reached[np.sort(first[np.isin(uniq, fresh, assume_unique=True)])]  # discovery order
        room = max_nodes - count
        if len(fresh) > room:
            fresh = fresh[:room]
            nodes.append(fresh); hops.append(np.full(len(fresh), depth, np.int64))
            return np.concatenate(nodes), np.concatenate(hops), depth
        nodes.append(fresh); hops.append(np.full(len(fresh), depth, np.int64))
        count += len(fresh)
        visited = np.union1d(visited, fresh)
        frontier = fresh
    return np.concatenate(nodes), np.concatenate(hops), 0


#: Widest id range :func:`positions_in` builds a table over whatever the look-ups (int32: 8 MiB).
_TABLE_IDS = 1 << 21


def positions_in(nodes: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The index in ``nodes`` (distinct node ids) of each of ``ids``, −1 where it is none
    of them. A table over the ids' range when that range is small next to the look-ups:
    one read per id, where a binary search into ``nodes`` costs ~log2(len(nodes)) cache
    misses for each of the subgraph's ~10^5 edge ends."""
    if len(ids) == 0 or len(nodes) == 0:
        return np.full(len(ids), -1, np.int64)
    lo = min(int(nodes.min()), int(ids.min()))
    span = max(int(nodes.max()), int(ids.max())) + 1 - lo
    if span <= max(_TABLE_IDS, 64 * len(ids)):
        table = np.full(span, -1, np.int32)
        table[nodes - lo] = np.arange(len(nodes), dtype=np.int32)
        return table[ids - lo].astype(np.int64)
    order = np.argsort(nodes, kind="stable")
    slot = np.minimum(np.searchsorted(nodes[order], ids), len(nodes) - 1)
    return np.where(nodes[order][slot] == ids, order[slot], -1)


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
        iterations: int, tolerance: float, max_degree: int | None = None) -> Expansion:
    indptr, indices, weights = graph.indptr, graph.indices, graph.weights
    extra = getattr(graph, "extra", None)  # a replica's online writes: edges no generation holds yet
    seeds = seeds[:max_nodes]
    seed_weights = seed_weights[:max_nodes]
    nodes, hops, cut_at = neighbourhood(indptr, indices, seeds, max_hops, max_nodes, max_degree, extra)
    if cut_at == 1:  # even the first hop overflows: a hub; PPR on a clipped star misleads
        return Expansion(nodes, 1.0 / (1.0 + hops), "bfs", len(nodes))
    # The induced subgraph: every edge of the chosen nodes whose other end was chosen too.
    owner, edge_pos = _edges_of(indptr, nodes)
    reached = np.asarray(indices[edge_pos], dtype=np.int64)
    slot = positions_in(nodes, reached)
    inside = slot >= 0
    n = len(nodes)
    source, target = owner[inside], slot[inside]
    edge_weight = np.asarray(weights[edge_pos[inside]], dtype=np.float64)
    if extra is not None and len(extra):
        more_owner, more_reached, more_weight = extra.edges_of(nodes)
        more_slot = positions_in(nodes, more_reached)
        kept = more_slot >= 0
        source = np.concatenate([source, more_owner[kept]])
        target = np.concatenate([target, more_slot[kept]])
        edge_weight = np.concatenate([edge_weight, more_weight[kept]])
    degree = np.bincount(source, weights=edge_weight, minlength=n).astype(np.float64)  # int64 when empty
    inv = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    # Pᵀ built at once from the edge list (one COO→CSR pass; duplicates add up).
    transition_t = csr_matrix((edge_weight * inv[source], (target, source)), shape=(n, n))
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
