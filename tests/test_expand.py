"""Graph expansion (helix_ray.recall.expand): PPR against a dense power iteration, the
bounded subgraph, and the BFS fallback for hubs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helix_ray.index.csr import CSRGraph
from helix_ray.recall import expand

TIGHT = dict(iterations=2000, tolerance=1e-14)


def csr_from_dense(adjacency: np.ndarray) -> CSRGraph:
    """A CSRGraph with the same layout ingest writes (int64 indptr, int32 indices, float32 weights)."""
    indptr, indices, weights = [0], [], []
    for row in adjacency:
        nz = np.flatnonzero(row)
        indices.extend(nz.tolist())
        weights.extend(row[nz].tolist())
        indptr.append(len(indices))
    return CSRGraph(
        np.array(indptr, np.int64), np.array(indices, np.int32), np.array(weights, np.float32),
        np.zeros(len(indices), np.int8),
    )


def symmetric(n: int, edges: list[tuple[int, int, float]]) -> np.ndarray:
    a = np.zeros((n, n))
    for i, j, w in edges:
        a[i, j] = a[j, i] = w
    return a


# Eight nodes, weighted and symmetric; node 7 has no edge at all. Weights are exact in
# float32 so the CSR copy and the dense reference see the same numbers.
#
#     0 ─1── 1 ─.5── 6 ─1── 5
#     │.5  ╱2        │.75   │1.5
#     2 ─1── 3 ─.25─ 4 ─────┘        7
EDGES = [(0, 1, 1.0), (0, 2, 0.5), (1, 2, 2.0), (2, 3, 1.0), (3, 4, 0.25), (4, 5, 1.5),
         (5, 6, 1.0), (6, 3, 0.75), (1, 6, 0.5)]
ADJ = symmetric(8, EDGES)
GRAPH = csr_from_dense(ADJ)


def dense_scores(expansion: expand.Expansion, n: int) -> np.ndarray:
    full = np.zeros(n)
    full[expansion.nodes] = expansion.scores
    return full


@pytest.mark.parametrize("damping", [0.15, 0.5, 0.85])
@pytest.mark.parametrize(
    ("seeds", "weights"),
    [
        ([0], [1.0]),
        ([0, 4], [0.7, 0.3]),
        ([5, 2, 6], [0.05, 0.03, 0.02]),  # unnormalised: ppr normalises the seed vector
        ([7], [1.0]),  # the isolated node: all mass stays on it
        ([2, 7], [0.5, 0.5]),  # one seed dangling: its mass returns to the seeds
    ],
)
def test_ppr_equals_dense_power_iteration(seeds, weights, damping):
    seeds, weights = np.array(seeds, np.int64), np.array(weights)
    result = expand.ppr(GRAPH, seeds, weights, damping=damping, max_hops=4, max_nodes=100, **TIGHT)
    seed_vector = np.zeros(8)
    seed_vector[seeds] = weights
    reference = expand.ppr_dense(ADJ, seed_vector, damping, iterations=5000, tol=1e-15)

    assert result.method == "ppr"
    np.testing.assert_allclose(dense_scores(result, 8), reference, rtol=0, atol=1e-6)
    assert result.scores.sum() == pytest.approx(1.0, abs=1e-9)
    assert result.nodes[: len(seeds)].tolist() == seeds.tolist()  # seeds come first
    assert len(set(result.nodes.tolist())) == len(result.nodes)


def test_isolated_node_is_not_reached_from_the_component():
    result = expand.ppr(GRAPH, np.array([0]), np.array([1.0]), damping=0.5, max_hops=4, max_nodes=100, **TIGHT)
    assert 7 not in result.nodes.tolist()
    assert sorted(result.nodes.tolist()) == [0, 1, 2, 3, 4, 5, 6]


def test_neighbourhood_hops_hand_computed():
    nodes, hops, truncated = expand.neighbourhood(GRAPH.indptr, GRAPH.indices, np.array([0]), 4, 100)
    assert not truncated
    hop_of = dict(zip(nodes.tolist(), hops.tolist()))
    # 0 → {1, 2} → {6 via 1, 3 via 2} → {5 via 6, 4 via 3}
    assert hop_of == {0: 0, 1: 1, 2: 1, 3: 2, 6: 2, 4: 3, 5: 3}
    # BFS order: seed, then hop 1 in CSR order, then hop 2 in discovery order.
    assert nodes.tolist() == [0, 1, 2, 6, 3, 5, 4]


def test_bounded_subgraph_drops_edges_that_leave_it():
    """With max_hops=1 the walk runs on the induced subgraph {0, 1, 2}: the edges to 3
    and 6 are dropped, so PPR equals the dense iteration over that 3×3 block."""
    result = expand.ppr(GRAPH, np.array([0]), np.array([1.0]), damping=0.5, max_hops=1, max_nodes=100, **TIGHT)
    assert result.method == "ppr"
    assert result.nodes.tolist() == [0, 1, 2]
    block = ADJ[np.ix_([0, 1, 2], [0, 1, 2])]
    reference = expand.ppr_dense(block, np.array([1.0, 0.0, 0.0]), 0.5, iterations=5000, tol=1e-15)
    np.testing.assert_allclose(result.scores, reference, rtol=0, atol=1e-6)


def random_symmetric(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    upper = np.triu((rng.random((n, n)) < density) * rng.uniform(0.1, 2.0, (n, n)), k=1)
    return (upper + upper.T).astype(np.float32).astype(np.float64)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    graph_seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 40),
    density=st.floats(0.02, 0.6),
    n_seeds=st.integers(1, 5),
    max_hops=st.integers(1, 4),
    max_nodes=st.integers(5, 30),
)
def test_subgraph_never_exceeds_max_nodes(graph_seed, n, density, n_seeds, max_hops, max_nodes):
    rng = np.random.default_rng(graph_seed)
    adjacency = random_symmetric(rng, n, density)
    graph = csr_from_dense(adjacency)
    seeds = rng.choice(n, size=min(n_seeds, n), replace=False).astype(np.int64)
    weights = rng.uniform(0.01, 1.0, len(seeds))
    result = expand.ppr(graph, seeds, weights, damping=0.5, max_hops=max_hops, max_nodes=max_nodes,
                        iterations=200, tolerance=1e-10)

    assert result.subgraph_nodes == len(result.nodes) <= max_nodes
    assert len(set(result.nodes.tolist())) == len(result.nodes)
    assert result.nodes[: len(seeds)].tolist() == seeds.tolist()
    if result.method == "ppr":
        assert result.scores.sum() == pytest.approx(1.0, abs=1e-6)
        assert (result.scores >= 0).all()
    else:
        assert set(np.round(result.scores, 12).tolist()) <= {1.0, 0.5}
    # Every node is within max_hops of a seed.
    nodes, hops, _ = expand.neighbourhood(graph.indptr, graph.indices, seeds, max_hops, 10**6)
    assert set(result.nodes.tolist()) <= set(nodes.tolist())


def test_more_seeds_than_max_nodes_still_bounded():
    chain = symmetric(30, [(i, i + 1, 1.0) for i in range(29)])
    result = expand.ppr(csr_from_dense(chain), np.arange(15), np.ones(15), damping=0.5, max_hops=2,
                        max_nodes=10, iterations=50, tolerance=1e-8)
    assert result.subgraph_nodes <= 10


def star(leaves: int) -> np.ndarray:
    return symmetric(leaves + 1, [(0, i, 1.0) for i in range(1, leaves + 1)])


def test_bfs_fallback_when_first_hop_overflows():
    """A hub whose first hop alone exceeds max_nodes: BFS scores 1 / (1 + hops)."""
    result = expand.ppr(csr_from_dense(star(30)), np.array([0]), np.array([1.0]), damping=0.5, max_hops=2,
                        max_nodes=10, iterations=50, tolerance=1e-8)
    assert result.method == "bfs"
    assert result.subgraph_nodes == 10
    assert result.nodes.tolist() == list(range(10))  # the hub, then its first 9 neighbours in CSR order
    assert result.scores.tolist() == [1.0] + [0.5] * 9


def test_overflow_at_the_second_hop_still_runs_ppr():
    # 0 ─ 1 ─ {2..29}: the first hop is one node, the second overflows max_nodes=10.
    edges = [(0, 1, 1.0)] + [(1, i, 1.0) for i in range(2, 30)]
    result = expand.ppr(csr_from_dense(symmetric(30, edges)), np.array([0]), np.array([1.0]), damping=0.5,
                        max_hops=2, max_nodes=10, iterations=200, tolerance=1e-12)
    assert result.method == "ppr"
    assert result.subgraph_nodes == 10
    assert result.scores.sum() == pytest.approx(1.0, abs=1e-9)


def test_first_hop_that_fits_exactly_is_not_a_hub():
    # Seed 0 with 9 neighbours fills max_nodes=10 exactly; each neighbour has one more leaf.
    edges = [(0, i, 1.0) for i in range(1, 10)] + [(i, i + 9, 1.0) for i in range(1, 10)]
    result = expand.ppr(csr_from_dense(symmetric(19, edges)), np.array([0]), np.array([1.0]), damping=0.5,
                        max_hops=2, max_nodes=10, iterations=200, tolerance=1e-12)
    assert result.method == "ppr"


def test_hubs_above_max_degree_are_not_entered():
    # 0 ─ 1 ─ 2, and 1 is also linked to 40 leaves: with max_degree=10 node 1 (degree 42)
    # is a hub and is left out, so 2 and the leaves are unreachable; without it all come.
    edges = [(0, 1, 1.0), (1, 2, 1.0)] + [(1, i, 1.0) for i in range(3, 43)]
    graph = csr_from_dense(symmetric(43, edges))
    nodes, _, _ = expand.neighbourhood(graph.indptr, graph.indices, np.array([0]), 3, 1000, max_degree=10)
    assert nodes.tolist() == [0]
    nodes, _, _ = expand.neighbourhood(graph.indptr, graph.indices, np.array([0]), 3, 1000)
    assert sorted(nodes.tolist()) == list(range(43))
    # A low-degree path is still followed with the guard on.
    nodes, hops, _ = expand.neighbourhood(graph.indptr, graph.indices, np.array([2]), 3, 1000, max_degree=50)
    assert nodes[:2].tolist() == [2, 1] and hops[:2].tolist() == [0, 1]


@settings(max_examples=50, deadline=None)
@given(nodes=st.lists(st.integers(0, 2_000_000), min_size=1, max_size=40, unique=True),
       picks=st.lists(st.integers(0, 10**9), max_size=60), strays=st.lists(st.integers(0, 2_000_000), max_size=60))
def test_positions_in_finds_each_id_by_table_and_by_search(nodes, picks, strays):
    """Both ways of placing the subgraph's edge ends (a table over a narrow id range, a
    binary search over a wide one) give each id's index in ``nodes``, −1 for the others."""
    node_array = np.array(nodes, np.int64)
    ids = np.array([nodes[p % len(nodes)] for p in picks] + strays, np.int64)
    expected = np.array([nodes.index(i) if i in nodes else -1 for i in ids.tolist()], np.int64)
    wide = np.append(ids, 10**12)  # a range far past the table's: the search
    assert expand.positions_in(node_array, ids).tolist() == expected.tolist()
    assert expand.positions_in(node_array, wide)[:-1].tolist() == expected.tolist()
    assert expand.positions_in(node_array, wide)[-1] == -1


@pytest.mark.parametrize("seeds", [[0], [5, 2], [7]])
def test_extra_edges_are_walked_as_the_graphs_own(seeds):
    """Edges given beside the CSR (``graph.extra``: a replica's online writes), with node
    ids far past the graph's, give the PPR scores of one graph holding them all."""
    from types import SimpleNamespace

    far = 1 << 40  # a delta row's id
    split = EDGES[:6]
    extra = [(3, far, 0.5), (far, far + 1, 2.0), (far + 1, 6, 1.0)]  # both ends past the CSR, and one each side
    ids = list(range(8)) + [far, far + 1]
    whole = symmetric(10, split + [(ids.index(a), ids.index(b), w) for a, b, w in extra])
    src = np.array([a for a, b, _ in extra] + [b for a, b, _ in extra])
    dst = np.array([b for a, b, _ in extra] + [a for a, b, _ in extra])
    weights = np.array([w for *_, w in extra] * 2)
    base = csr_from_dense(symmetric(8, split))
    padded = np.concatenate([base.indptr, np.full(2, base.indptr[-1])])  # rows past the graph: no CSR edges

    class Ptr:  # as views._PaddedIndptr: any node past the graph has none
        def __getitem__(self, node):
            return padded[np.minimum(np.asarray(node, np.int64), len(padded) - 1)]

    graph = SimpleNamespace(indptr=Ptr(), indices=base.indices, weights=base.weights,
                            extra=expand.ExtraEdges(src, dst, weights))
    result = expand.ppr(graph, np.array(seeds), np.ones(len(seeds)), damping=0.5, max_hops=6, max_nodes=100, **TIGHT)
    reference = expand.ppr_dense(whole, np.isin(np.arange(10), seeds).astype(float), 0.5, iterations=5000,
                                 tol=1e-15)
    got = np.zeros(10)
    got[[ids.index(int(n)) for n in result.nodes]] = result.scores
    np.testing.assert_allclose(got, reference, atol=1e-9)
