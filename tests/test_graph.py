"""Stage 7b's entity nodes and mention edges, counted by hand on a small tenant pair."""

import numpy as np
import pyarrow as pa
import pytest

from helix_ray.config import GraphBuildConfig
from helix_ray.ingest import graph as graph_module
from helix_ray.ingest.graph import MENTION, SEMANTIC, build_graph, tenant_codes


@pytest.mark.parametrize("as_arrow,codes_given", [(False, False), (True, False), (True, True)],
                         ids=["lists", "arrow", "tenant-codes-given"])
def test_entity_nodes_count_each_memory_once_per_tenant_and_skip_singletons_and_hubs(as_arrow, codes_given,
                                                                                     monkeypatch):
    users = ["bob", "bob", "bob", "ann", "ann", "ann", "ann"]
    lists = [["redis", "redis", "kafka"],  # bob: redis twice in one memory counts once
             ["redis"], ["zeta"],           # bob: zeta once, a singleton
             ["kafka", "hub"], ["kafka", "hub"], ["hub"], ["hub"]]  # ann: hub in 4 of 4
    config = GraphBuildConfig(knn=0, temporal_window=0, min_entity_df_cap=3, max_entity_df=0.5)
    codes = tenant_codes(users) if codes_given else None
    if codes_given:  # the codes given are used, the users column not read for them again
        monkeypatch.setattr(graph_module, "tenant_codes", lambda users: pytest.fail("tenant codes read again"))
    graph, entities = build_graph(
        users=users, sessions=[None] * 7, order_keys=[np.zeros(7)],
        entity_lists=pa.array(lists, pa.list_(pa.string())) if as_arrow else lists, knn=None,
        partitions={"bob": (0, 3), "ann": (3, 7)}, config=config, tenant_rows=codes)
    # (user, key) order; bob's kafka is mentioned once in bob's tenant (ann's do not count)
    assert entities.to_pylist() == [
        {"node": 7, "user": "ann", "key": "kafka", "df": 2},
        {"node": 8, "user": "bob", "key": "redis", "df": 2},
    ]  # ann's hub: df 4 > max(3, 0.5 · 4); zeta and bob's kafka: df 1
    edges = {(row, int(graph.indices[i]), round(float(graph.weights[i]), 4))
             for row in range(7) for i in range(graph.indptr[row], graph.indptr[row + 1])
             if graph.types[i] == MENTION}
    w = round(1 / np.sqrt(2), 4)
    assert edges == {(3, 7, w), (4, 7, w), (0, 8, w), (1, 8, w)}
    assert graph.num_nodes == 9


@pytest.mark.parametrize("as_arrow", [False, True], ids=["lists", "arrow"])
def test_session_hubs_and_temporal_edges_follow_session_order_within_each_tenant(as_arrow):
    from helix_ray.ingest.graph import SAME_SESSION, TEMPORAL

    users = ["ann"] * 5 + ["bob"] * 4
    sessions = ["s1", "s1", None, "s1", "s2", "s1", "", "s1", "s1"]  # None and "": no session
    created = np.array([3, 1, 0, 1, 0, 5, 0, 5, 2])
    turns = np.array([0, 2, 0, 1, 0, 0, 0, 0, 0])
    config = GraphBuildConfig(knn=0, temporal_window=2)
    graph, entities = build_graph(
        users=users, sessions=pa.array(sessions) if as_arrow else sessions, order_keys=[created, turns],
        entity_lists=[[]] * 9, knn=None, partitions={"ann": (0, 5), "bob": (5, 9)}, config=config)
    # ann's s1 in order (created, turn, row): 3, 1, 0; bob's s1: 8, then 5 and 7 (a tie: row order);
    # the same name in two tenants is two sessions, and ann's s2 (one memory) none
    assert entities.to_pylist() == [
        {"node": 9, "user": "ann", "key": "session:s1", "df": 3},
        {"node": 10, "user": "bob", "key": "session:s1", "df": 3},
    ]
    edges = {(row, int(graph.indices[i]), int(graph.types[i]))
             for row in range(graph.num_nodes) for i in range(graph.indptr[row], graph.indptr[row + 1])}
    temporal = {(3, 1), (1, 0), (3, 0), (8, 5), (5, 7), (8, 7)}  # neighbours one and two places on
    hubs = {(3, 9), (1, 9), (0, 9), (8, 10), (5, 10), (7, 10)}
    assert edges == {(a, b, TEMPORAL) for a, b in temporal} | {(b, a, TEMPORAL) for a, b in temporal} \
        | {(a, b, SAME_SESSION) for a, b in hubs} | {(b, a, SAME_SESSION) for a, b in hubs}


@pytest.mark.parametrize("block", [1, 7, 1 << 18])
def test_edges_are_symmetric_and_a_pair_keeps_its_highest_priority_type(block):
    """Whatever the range of source nodes sorted at a time."""
    from helix_ray.ingest.graph import SAME_SESSION, SEMANTIC, TEMPORAL, _to_csr

    rng = np.random.default_rng(3)
    n = 40
    src, dst, wts, typ = [], [], [], []
    for t in (MENTION, SAME_SESSION, TEMPORAL, SEMANTIC):
        a, b = rng.integers(0, n, 300), rng.integers(0, n, 300)
        src.append(a); dst.append(b); wts.append(rng.random(300).astype(np.float32)); typ.append(np.full(300, t, np.int8))
    rank = {TEMPORAL: 0, MENTION: 1, SEMANTIC: 2, SAME_SESSION: 3}
    best: dict[tuple[int, int], tuple[int, int, float]] = {}  # (a, b) → (rank, arrival, weight): the first best
    arrival = 0
    for half in (0, 1):  # each edge as given, then reversed: in that order
        for a, b, w, t in zip(src, dst, wts, typ):
            for x, y, ww, tt in zip(a.tolist(), b.tolist(), w.tolist(), t.tolist()):
                key = (x, y) if half == 0 else (y, x)
                seen = best.get(key)
                if seen is None or rank[tt] < seen[0]:
                    best[key] = (rank[tt], arrival, ww)
                arrival += 1
    graph = _to_csr(list(src), list(dst), list(wts), list(typ), n, block=block)
    got = {(row, int(graph.indices[i])): (int(graph.types[i]), float(graph.weights[i]))
           for row in range(n) for i in range(graph.indptr[row], graph.indptr[row + 1])}
    rank_type = {r: t for t, r in rank.items()}
    assert got == {k: (rank_type[r], w) for k, (r, _, w) in best.items()}
    assert all(got[(b, a)][0] == t for (a, b), (t, _) in got.items())  # symmetric, one type a pair
    assert graph.indices.dtype == np.int32 and (np.diff(graph.indices[graph.indptr[0]:graph.indptr[1]]) > 0).all()


@pytest.mark.parametrize("block", [1, 7, 50, 1 << 20])
def test_edges_tables_give_each_undirected_edge_once_whatever_the_block(block):
    from helix_ray.index.csr import EDGE_TYPES
    from helix_ray.ingest.graph import SEMANTIC, _to_csr, edges_tables

    rng = np.random.default_rng(5)
    n = 30
    a, b = rng.integers(0, n, 200), rng.integers(0, n, 200)
    hub = np.arange(1, n)  # node 0 links every other node: more edges than a small block
    graph = _to_csr([a, np.zeros(n - 1, np.int64)], [b, hub], [rng.random(200).astype(np.float32), np.ones(n - 1, np.float32)],
                    [np.full(200, SEMANTIC, np.int8), np.full(n - 1, MENTION, np.int8)], n)
    names = [f"m{i}" for i in range(n)]
    tables = list(edges_tables(graph, names, block=block))
    got = pa.concat_tables(tables).to_pylist()
    want = sorted((names[row], names[int(graph.indices[i])], EDGE_TYPES[int(graph.types[i])], float(graph.weights[i]))
                  for row in range(n) for i in range(graph.indptr[row], graph.indptr[row + 1])
                  if row < graph.indices[i])
    assert sorted((r["src"], r["dst"], r["type"], r["weight"]) for r in got) == want
    assert len(want) > 0 and all(r["src"] != r["dst"] for r in got)
    # Whole source nodes per table: a source's edges are never split across two tables.
    sources = [set(t.column("src").to_pylist()) for t in tables]
    assert sum(len(s) for s in sources) == len(set().union(*sources))
    if block == 1:
        assert len(tables) > 1


def test_tenants_and_their_row_ranges_read_from_an_arrow_column_as_from_a_list():
    """tenant_codes and partitions_of take the sorted rows' user column as Arrow (any
    chunks) as they take a list; an ungrouped column is refused."""
    from helix_ray.ingest.graph import tenant_codes
    from helix_ray.store.publish import partitions_of

    users = ["bo", "bo", "al", "al", "al", "cy"]
    for given in (users, pa.array(users), pa.chunked_array([users[:3], users[3:4], [], users[4:]])):
        tenants, codes = tenant_codes(given)
        assert tenants == ["al", "bo", "cy"] and codes.tolist() == [1, 1, 0, 0, 0, 2]
        assert [(p["user"], p["start"], p["end"], p["dense"]) for p in partitions_of(given)] == [
            ("bo", 0, 2, "dense/p0.usearch"), ("al", 2, 5, "dense/p1.usearch"), ("cy", 5, 6, "dense/p2.usearch")]
    assert partitions_of(pa.chunked_array([], pa.string())) == [] and tenant_codes([])[1].tolist() == []
    with pytest.raises(ValueError, match="grouped by user"):
        partitions_of(pa.chunked_array([["al", "bo"], ["al"]]))


def test_the_graph_built_from_files_is_the_one_built_from_the_columns(tmp_path):
    """Ingest builds the graph in a unit of work from the files its sorted rows, their
    mentions and kNN lists are in, and maps what it writes: the same edges and entity
    nodes as from the columns, each tenant's semantic edges its rows' first
    min(width, rows) neighbours."""
    from pyarrow import ipc

    from helix_ray.ingest.graph import GraphInputs, build_graph_files, load_graph_files

    users = ["ann"] * 4 + ["bob"] * 5 + ["cy"]
    sessions = ["s1", "s1", None, "s2", "s1", "s1", "s1", "", "s2", "s1"]
    lists = [["kafka"], ["kafka", "redis"], ["redis"], [], ["redis"], ["redis"], ["zeta"], ["zeta"], [], ["kafka"]]
    created, turns = np.arange(10)[::-1].copy(), np.zeros(10, np.int64)
    rng = np.random.default_rng(3)
    neighbours, sims = np.full((10, 4), -1, np.int64), np.zeros((10, 4), np.float32)
    parts = {"ann": (0, 4), "bob": (4, 9), "cy": (9, 10)}
    for start, end in parts.values():
        for row in range(start, end):
            others = rng.permutation(np.arange(start, end))[:4]
            neighbours[row, :len(others)], sims[row, :len(others)] = others, rng.uniform(0.5, 1, len(others))
    rows = tmp_path / "rows.arrow"
    for path, table in ((rows, pa.table({"user": users, "session_id": sessions, "text": ["t"] * 10})),
                        (tmp_path / "mentions.arrow", pa.table({"entities": pa.array(lists, pa.list_(pa.string()))}))):
        with ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    np.save(tmp_path / "n.npy", neighbours)
    np.save(tmp_path / "s.npy", sims)
    config = GraphBuildConfig(knn=3, temporal_window=1, knn_min_similarity=0.0)
    codes = tenant_codes(users)
    out = build_graph_files(GraphInputs(rows, tmp_path / "mentions.arrow", (tmp_path / "n.npy", tmp_path / "s.npy")),
                            tmp_path / "graph", order_keys=[created, turns], partitions=parts, tenant_rows=codes,
                            config=config)
    graph, entities = load_graph_files(out)
    knn = {u: (neighbours[s:e, :min(4, e - s)], sims[s:e, :min(4, e - s)]) for u, (s, e) in parts.items() if e - s > 1}
    want, want_entities = build_graph(users=users, sessions=sessions, order_keys=[created, turns], entity_lists=lists,
                                      knn=knn, partitions=parts, config=config)
    assert isinstance(graph.indices, np.memmap) and entities.equals(want_entities) and entities.num_rows >= 3
    for name in ("indptr", "indices", "weights", "types"):
        np.testing.assert_array_equal(getattr(graph, name), getattr(want, name))
    assert (np.asarray(graph.types) == SEMANTIC).sum() > 0
