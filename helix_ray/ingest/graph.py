"""Stage 7b: the typed memory graph, built at ingest, stored as CSR arrays.

Nodes are the memories (rows 0..N-1) followed by entity nodes (one per tenant and
entity key, plus one per session). Edges, all symmetric and all within one tenant:

========== ======================================================== ==============
type       links                                                    weight
========== ======================================================== ==============
mention    memory ↔ entity it mentions (entities with a df too      1 / √df
           high for their tenant link nothing: see GraphBuildConfig)
same_session memory ↔ its session node (a hub, not a clique)         0.5
temporal   memory ↔ its neighbours in session order (± window)       1.0
semantic   memory ↔ its k nearest memories with cosine ≥ threshold   cosine
========== ======================================================== ==============
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from helix_ray.config import GraphBuildConfig
from helix_ray.index.csr import EDGE_TYPES, CSRGraph
from helix_ray.store.generation import ENTITY_SCHEMA

MENTION, SAME_SESSION, TEMPORAL, SEMANTIC = (EDGE_TYPES.index(t) for t in EDGE_TYPES)
_PRIORITY = {TEMPORAL: 0, MENTION: 1, SEMANTIC: 2, SAME_SESSION: 3}
_PRIORITY_OF = np.array([_PRIORITY[t] for t in range(len(EDGE_TYPES))], np.int8)  # edge type → its priority


def build_graph(
    *,
    users: Sequence[str],
    sessions: Sequence[str | None],
    order_keys: Sequence[Any],
    entity_lists: Sequence[Sequence[str]] | pa.Array | pa.ChunkedArray,
    knn: dict[str, tuple[np.ndarray, np.ndarray]] | None,
    partitions: dict[str, tuple[int, int]],
    config: GraphBuildConfig,
) -> tuple[CSRGraph, pa.Table]:
    """Build the graph.

    ``order_keys`` orders memories within a session (any comparable per row: ingest
    gives (created_at, metadata turn); ties keep row order);
    ``knn[user] = (neighbour_rows, similarities)``, each (n_user, k) with -1 padding,
    rows relative to nothing (global row ids).
    """
    n = len(users)
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    wts: list[np.ndarray] = []
    typ: list[np.ndarray] = []

    def add(a: np.ndarray, b: np.ndarray, w: np.ndarray, t: int) -> None:
        if len(a):
            src.append(a.astype(np.int32)); dst.append(b.astype(np.int32))  # node numbers: int32, as the CSR's
            wts.append(w.astype(np.float32)); typ.append(np.full(len(a), t, np.int8))

    # Entity nodes: (user, key) with their document frequency inside the tenant.
    entity_rows, m_src, m_dst, m_w = _mentions(users, entity_lists, partitions, n, config)
    add(m_src, m_dst, m_w, MENTION)

    # Sessions: a hub node each, and temporal neighbours in session order.
    by_session: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row, (user, session) in enumerate(zip(users, sessions)):
        if session:
            by_session[(user, session)].append(row)
    s_src, s_dst, t_src, t_dst = [], [], [], []
    for (user, session), rows in sorted(by_session.items()):
        if len(rows) < 2:
            continue
        node = n + len(entity_rows)
        entity_rows.append({"node": node, "user": user, "key": f"session:{session}", "df": len(rows)})
        rows = sorted(rows, key=lambda r: (order_keys[r], r))
        s_src.extend(rows); s_dst.extend([node] * len(rows))
        for offset in range(1, config.temporal_window + 1):
            t_src.extend(rows[:-offset]); t_dst.extend(rows[offset:])
    add(np.array(s_src), np.array(s_dst), np.full(len(s_src), 0.5), SAME_SESSION)
    add(np.array(t_src), np.array(t_dst), np.ones(len(t_src)), TEMPORAL)

    # Semantic kNN.
    for user, (neighbours, sims) in (knn or {}).items():
        start, end = partitions[user]
        row_ids = np.repeat(np.arange(start, end), neighbours.shape[1])
        flat_n, flat_s = neighbours.reshape(-1), sims.reshape(-1)
        keep = (flat_n >= 0) & (flat_n != row_ids) & (flat_s >= config.knn_min_similarity)
        add(row_ids[keep], flat_n[keep], flat_s[keep], SEMANTIC)

    num_nodes = n + len(entity_rows)
    graph = _to_csr(src, dst, wts, typ, num_nodes)
    entities = pa.Table.from_pylist(entity_rows, schema=ENTITY_SCHEMA)
    return graph, entities


def _mentions(users: Sequence[str], entity_lists: Sequence[Sequence[str]] | pa.Array | pa.ChunkedArray,
              partitions: dict[str, tuple[int, int]], n: int, config: GraphBuildConfig):
    """The entity nodes, numbered from ``n`` in (user, key) order: the keys a tenant's
    memories mention at least twice and at most its hub limit. Returns their rows and
    the mention edges (memory row, entity node, 1 / √df). ``entity_lists``: a list of
    keys per row, or the same as an Arrow list array (what ingest holds). Vectorised:
    per-key loops and numbering the (row, key) pairs in Python dominate a compaction of
    a large store (docs/benchmarks.md)."""
    import pyarrow.compute as pc

    lists = entity_lists if isinstance(entity_lists, (pa.Array, pa.ChunkedArray)) \
        else pa.array(list(entity_lists), pa.list_(pa.string()))
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    flat = pc.list_flatten(lists)
    src = np.asarray(pc.list_parent_indices(lists), np.int64)
    tenants, row_tenant = tenant_codes(users)
    encoded = pc.dictionary_encode(flat)
    words = encoded.dictionary.to_pylist()
    word = np.asarray(encoded.indices, np.int64)
    # A (tenant, key) pair as one number, then numbered densely in (tenant, key) order.
    by_rank = np.argsort(np.array(words, dtype=object), kind="stable")  # rank → word
    word_rank = np.empty(len(words), np.int64)
    word_rank[by_rank] = np.arange(len(words))
    width = max(len(words), 1)
    pair = row_tenant[src] * width + word_rank[word]
    pairs, key_id = np.unique(pair, return_inverse=True)
    key_id = key_id.reshape(-1).astype(np.int64)
    if len(src):  # a memory mentioning a key twice counts once
        both = np.sort(src * len(pairs) + key_id)  # a sort of one int64 key: far cheaper than np.unique's hash path
        both = both[np.r_[True, both[1:] != both[:-1]]]
        src, key_id = both // len(pairs), both % len(pairs)
    df = np.bincount(key_id, minlength=len(pairs))
    pair_tenant, pair_rank = pairs // width, pairs % width
    size = np.array([partitions[u][1] - partitions[u][0] for u in tenants], np.float64)
    cap = np.maximum(config.min_entity_df_cap, config.max_entity_df * size)[pair_tenant] if len(pairs) else df
    # A singleton links nothing; a hub would link everything.
    kept = np.flatnonzero((df >= 2) & (df <= cap))  # pairs are in (tenant, key) order already
    node_of = np.full(len(pairs), -1, np.int64)
    node_of[kept] = n + np.arange(len(kept))
    entity_rows = [{"node": n + j, "user": tenants[t], "key": words[by_rank[r]], "df": int(d)}
                   for j, (t, r, d) in enumerate(zip(pair_tenant[kept].tolist(), pair_rank[kept].tolist(),
                                                     df[kept].tolist()))]
    keep = node_of[key_id] >= 0
    src, key_id = src[keep], key_id[keep]
    return entity_rows, src, node_of[key_id], 1.0 / np.sqrt(df[key_id].astype(np.float64))


def tenant_codes(users: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The tenants in sorted order, and each row's tenant as its position there."""
    tenants = sorted(set(users))
    code = {u: i for i, u in enumerate(tenants)}
    return tenants, np.fromiter((code[u] for u in users), np.int64, count=len(users))


def _to_csr(src, dst, wts, typ, num_nodes: int, block: int = 1 << 18) -> CSRGraph:
    if not src:
        return CSRGraph(np.zeros(num_nodes + 1, np.int64), np.zeros(0, np.int32),
                        np.zeros(0, np.float32), np.zeros(0, np.int8))
    # Each edge goes both ways, and an ordered pair keeps one edge: the highest-priority
    # type, the first given among equals (each edge as given, then each reversed). Done
    # ``block`` source nodes at a time: a block's edges are sorted by one int64 key
    # (source, b, priority) stably, what np.lexsort((priority, b, source)) gives in less time. The priorities
    # come from an array lookup, not a per-edge dict.get (docs/benchmarks.md). Only the
    # edges given and the result are ever whole (a million memories: ~25 million
    # directed edges), never a sort of all of them.
    a = np.concatenate(src, dtype=np.int32, casting="same_kind")
    src.clear()
    b = np.concatenate(dst, dtype=np.int32, casting="same_kind")
    dst.clear()
    w = np.concatenate(wts, dtype=np.float32, casting="same_kind")
    wts.clear()
    t = np.concatenate(typ)
    typ.clear()
    priority = len(_PRIORITY_OF)
    indptr = np.zeros(num_nodes + 1, np.int64)
    indices, weights, types = [], [], []
    for lo in range(0, num_nodes, block):
        hi = min(lo + block, num_nodes)
        given = np.flatnonzero((a >= lo) & (a < hi))
        reversed_ = np.flatnonzero((b >= lo) & (b < hi))
        edge = np.concatenate([given, reversed_])  # each edge's place in what was given
        if not len(edge):
            continue
        row = np.concatenate([a[given], b[reversed_]]).astype(np.int64) - lo
        key = row * num_nodes
        key += np.concatenate([b[given], a[reversed_]])
        del row
        key *= priority
        key += _PRIORITY_OF[t[edge]]
        order = np.argsort(key, kind="stable")
        key = key[order]
        key //= priority  # the pair (row, b)
        first = np.r_[True, key[1:] != key[:-1]]
        pair, edge = key[first], edge[order[first]]
        del key, order, first
        row = pair // num_nodes
        indptr[lo + 1:hi + 1] = np.bincount(row, minlength=hi - lo)
        indices.append((pair - row * num_nodes).astype(np.int32))
        weights.append(w[edge])
        types.append(t[edge])
    del a, b, w, t
    np.cumsum(indptr, out=indptr)
    return CSRGraph(indptr, np.concatenate(indices), np.concatenate(weights), np.concatenate(types))


def edges_tables(graph: CSRGraph, node_names: Sequence[str], block: int = 1 << 20) -> Iterator[pa.Table]:
    """The graph as rows (src < dst only), for the DuckDB ``edges`` table, about ``block``
    edges at a time (whole source nodes per table), so that only one block's names are
    ever held as strings (a million memories: ~10 million edges). The names are taken in
    Arrow, not as a Python string per edge."""
    names = pa.array(node_names, pa.string())
    type_names = pa.array(EDGE_TYPES, pa.string())
    indptr = np.asarray(graph.indptr)
    first = 0
    while first < graph.num_nodes:
        last = int(np.searchsorted(indptr, indptr[first] + block, side="right")) - 1  # at most num_nodes
        last = max(last, first + 1)  # a node with more than ``block`` edges is one table
        lo, hi = int(indptr[first]), int(indptr[last])
        rows = np.repeat(np.arange(first, last, dtype=np.int64), np.diff(indptr[first:last + 1]))
        indices = np.asarray(graph.indices[lo:hi])
        keep = rows < indices
        if keep.any():
            yield pa.table({
                "src": names.take(pa.array(rows[keep])),
                "dst": names.take(pa.array(indices[keep].astype(np.int64))),
                "type": type_names.take(pa.array(np.asarray(graph.types[lo:hi])[keep].astype(np.int64))),
                "weight": pa.array(np.asarray(graph.weights[lo:hi])[keep], pa.float32()),
            })
        first = last
