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

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import ipc

from helix_ray.config import GraphBuildConfig
from helix_ray.index.csr import EDGE_TYPES, SESSION_EDGE_WEIGHT, SESSION_KEY, CSRGraph, load_csr, save_csr
from helix_ray.store.generation import ENTITY_SCHEMA
from helix_ray.store.publish import save_arrow

MENTION, SAME_SESSION, TEMPORAL, SEMANTIC = (EDGE_TYPES.index(t) for t in EDGE_TYPES)
_PRIORITY = {TEMPORAL: 0, MENTION: 1, SEMANTIC: 2, SAME_SESSION: 3}
_PRIORITY_OF = np.array([_PRIORITY[t] for t in range(len(EDGE_TYPES))], np.int8)  # edge type → its priority


def build_graph(
    *,
    users: Sequence[str] | pa.Array | pa.ChunkedArray,
    sessions: Sequence[str | None] | pa.Array | pa.ChunkedArray,
    order_keys: Sequence[np.ndarray],
    entity_lists: Sequence[Sequence[str]] | pa.Array | pa.ChunkedArray,
    knn: dict[str, tuple[np.ndarray, np.ndarray]] | None,
    partitions: dict[str, tuple[int, int]],
    config: GraphBuildConfig,
    tenant_rows: tuple[list[str], np.ndarray] | None = None,
) -> tuple[CSRGraph, pa.Table]:
    """Build the graph.

    ``tenant_rows``: :func:`tenant_codes` of ``users`` when the caller has them already
    (ingest found them to sort the rows), so the column is not read again.

    ``order_keys`` order memories within a session: arrays of one number per row,
    compared in turn (ingest gives created_at, then the metadata turn); ties keep row
    order. A row with no session (None or empty) joins none.
    ``knn[user] = (neighbour_rows, similarities)``, each (n_user, k) with -1 padding,
    rows relative to nothing (global row ids).

    Works on arrays: no Python object per edge, nor per row beyond the ``users`` given
    (at a million memories such lists and dicts would outweigh the edges themselves).
    """
    n = len(users)
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    wts: list[np.ndarray] = []
    typ: list[np.ndarray] = []

    def add(a: np.ndarray, b: np.ndarray, w: float | np.ndarray, t: int) -> None:
        if len(a):
            src.append(a.astype(np.int32)); dst.append(b.astype(np.int32))  # node numbers: int32, as the CSR's
            wts.append(np.broadcast_to(np.asarray(w, np.float32), a.shape).copy())
            typ.append(np.full(len(a), t, np.int8))

    tenants, row_tenant = tenant_rows if tenant_rows is not None else tenant_codes(users)
    # Entity nodes: (user, key) with their document frequency inside the tenant.
    entity_table, m_src, m_dst, m_w = _mentions(tenants, row_tenant, entity_lists, partitions, n, config)
    add(m_src, m_dst, m_w, MENTION)

    # Sessions: a hub node each, and temporal neighbours in session order.
    session_table, members, hub, t_src, t_dst = _sessions(tenants, row_tenant, sessions, order_keys,
                                                           n + entity_table.num_rows, config.temporal_window)
    add(members, hub, SESSION_EDGE_WEIGHT, SAME_SESSION)
    add(t_src, t_dst, 1.0, TEMPORAL)
    del members, hub, t_src, t_dst

    # Semantic kNN.
    for user, (neighbours, sims) in (knn or {}).items():
        start, end = partitions[user]
        row_ids = np.repeat(np.arange(start, end, dtype=np.int32), neighbours.shape[1])
        flat_n, flat_s = neighbours.reshape(-1), sims.reshape(-1)
        keep = (flat_n >= 0) & (flat_n != row_ids) & (flat_s >= config.knn_min_similarity)
        add(row_ids[keep], flat_n[keep], flat_s[keep], SEMANTIC)
        del row_ids, keep

    entities = pa.concat_tables([entity_table, session_table])
    graph = _to_csr(src, dst, wts, typ, n + entities.num_rows)
    return graph, entities


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """What :func:`build_graph_files` reads: the sorted rows (Arrow IPC, with ``user``
    and ``session_id``), each row's entity keys (Arrow IPC, one ``entities`` column of
    :data:`helix_ray.ingest.carry.MENTIONS_TYPE`), and the rows' nearest neighbours and
    similarities (``.npy``, (N, width)), or None for no semantic edges."""

    rows: Path
    mentions: Path
    knn: tuple[Path, Path] | None


def build_graph_files(inputs: GraphInputs, out: Path, *, order_keys: Sequence[np.ndarray],
                      partitions: dict[str, tuple[int, int]], tenant_rows: tuple[list[str], np.ndarray],
                      config: GraphBuildConfig) -> Path:
    """:func:`build_graph` as a unit of work over files: the graph's CSR arrays and its
    entity nodes written into the folder ``out`` (:func:`load_graph_files` maps them),
    which is returned. An ingest runs it as a task on its node, so the driver never holds
    the edges (at a million memories ~25 million directed ones, and the parts they are
    joined from). A tenant's semantic edges are its rows' first ``min(width, rows)``
    neighbours, none for a tenant of one memory."""
    rows = _mapped(inputs.rows)
    knn = None
    if inputs.knn is not None:
        neighbours, sims = (np.load(path, mmap_mode="r") for path in inputs.knn)
        width = neighbours.shape[1]
        knn = {user: (neighbours[start:end, :k], sims[start:end, :k]) for user, (start, end) in partitions.items()
               if (k := min(width, end - start)) > 1}
    graph, entities = build_graph(users=rows.column("user"), sessions=rows.column("session_id"),
                                  entity_lists=_mapped(inputs.mentions).column("entities"), knn=knn,
                                  order_keys=order_keys, partitions=partitions, config=config,
                                  tenant_rows=tenant_rows)
    save_csr(out, graph)
    save_arrow(out / "entities.arrow", entities)
    return out


def load_graph_files(folder: Path) -> tuple[CSRGraph, pa.Table]:
    """The graph and entity nodes :func:`build_graph_files` wrote into ``folder``,
    memory-mapped."""
    return load_csr(folder), _mapped(folder / "entities.arrow")


def _mapped(path: Path) -> pa.Table:
    return ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def _entity_table(first_node: int, users: pa.Array, keys: pa.Array, df: np.ndarray) -> pa.Table:
    return pa.table({"node": pa.array(first_node + np.arange(len(df), dtype=np.int64)), "user": users,
                     "key": keys, "df": pa.array(df.astype(np.int32))}, schema=ENTITY_SCHEMA)


def _dictionary(values: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """``values`` (strings, nulls allowed) dictionary-encoded: the distinct strings, each
    value's index among them (−1 for null), and each distinct string's rank in sorted
    order (so that numbering by rank is numbering in string order)."""
    import pyarrow.compute as pc

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    encoded = pc.dictionary_encode(values)
    words = encoded.dictionary
    index = np.asarray(encoded.indices.fill_null(-1), np.int64)
    rank = np.empty(len(words), np.int64)
    rank[np.asarray(pc.sort_indices(words), np.int64)] = np.arange(len(words))
    return words, index, rank


def _sessions(tenants: list[str], row_tenant: np.ndarray, sessions: Sequence[str | None] | pa.Array | pa.ChunkedArray,
              order_keys: Sequence[np.ndarray], first_node: int, window: int):
    """The session nodes, numbered from ``first_node`` in (user, session) order: one per
    session of at least two memories within a tenant. Returns their rows, each member
    row with its session's node, and the temporal edges (each member to the ones up to
    ``window`` places later in session order)."""
    import pyarrow.compute as pc

    values = sessions if isinstance(sessions, (pa.Array, pa.ChunkedArray)) else pa.array(list(sessions), pa.string())
    values = pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)  # "" is no session
    words, word, rank = _dictionary(values)
    rows = np.flatnonzero(word >= 0)
    keys = [np.asarray(k)[rows] for k in reversed(order_keys)]
    order = rows[np.lexsort([rows, *keys, rank[word[rows]], row_tenant[rows]])]  # lexsort: last key first
    session = row_tenant[order] * max(len(words), 1) + rank[word[order]]  # a (tenant, session) pair as one number
    start = np.flatnonzero(np.r_[True, session[1:] != session[:-1]])
    size = np.diff(np.r_[start, len(order)])
    kept = size >= 2
    group = np.repeat(np.cumsum(kept) - 1, size)  # each member's session number among those kept
    member = np.repeat(kept, size)
    hub = first_node + group[member]
    t_src, t_dst = [order[:0]], [order[:0]]
    for offset in range(1, min(window, len(order)) + 1):
        same = session[offset:] == session[:-offset]
        t_src.append(order[:-offset][same])
        t_dst.append(order[offset:][same])
    heads = order[start[kept]]
    table = _entity_table(first_node, pa.array(tenants, pa.string()).take(pa.array(row_tenant[heads])),
                          pc.binary_join_element_wise(SESSION_KEY, words.take(pa.array(word[heads])), ""),
                          size[kept])
    return table, order[member], hub, np.concatenate(t_src), np.concatenate(t_dst)


def _mentions(tenants: list[str], row_tenant: np.ndarray,
              entity_lists: Sequence[Sequence[str]] | pa.Array | pa.ChunkedArray,
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
    src = np.asarray(pc.list_parent_indices(lists), np.int64)
    words, word, word_rank = _dictionary(pc.list_flatten(lists))
    src, word = src[word >= 0], word[word >= 0]  # a null key names nothing
    # A (tenant, key) pair as one number, then numbered densely in (tenant, key) order.
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
    by_rank = np.empty(len(words), np.int64)  # rank → word
    by_rank[word_rank] = np.arange(len(words))
    table = _entity_table(n, pa.array(tenants, pa.string()).take(pa.array(pair_tenant[kept])),
                          words.take(pa.array(by_rank[pair_rank[kept]])), df[kept])
    keep = node_of[key_id] >= 0
    src, key_id = src[keep], key_id[keep]
    return table, src, node_of[key_id], 1.0 / np.sqrt(df[key_id].astype(np.float64))


def tenant_codes(users: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """The tenants in sorted order, and each row's tenant as its position there (an
    Arrow column is read as one: no Python string per row)."""
    column = users if isinstance(users, (pa.Array, pa.ChunkedArray)) else pa.array(list(users), pa.string())
    tenants = sorted(pc.unique(column).to_pylist())
    at = pc.index_in(column, value_set=pa.array(tenants, column.type))
    return tenants, at.to_numpy(zero_copy_only=False).astype(np.int64)


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
    # directed edges), never a sort of all of them, nor two copies of either.
    a, b, w, t = _joined(src, np.int32), _joined(dst, np.int32), _joined(wts, np.float32), _joined(typ, np.int8)
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
    return CSRGraph(indptr, _joined(indices, np.int32), _joined(weights, np.float32), _joined(types, np.int8))


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """``parts`` concatenated, each let go of as soon as it is copied (``parts`` ends
    empty): the parts and the result are never both whole."""
    out: np.ndarray = np.empty(sum(len(p) for p in parts), dtype)
    end = len(out)
    while parts:  # from the last part back, popping each once copied
        part = parts.pop()
        out[end - len(part):end] = part
        end -= len(part)
    return out


def edges_tables(graph: CSRGraph, node_names: Sequence[str] | pa.Array, block: int = 1 << 20) -> Iterator[pa.Table]:
    """The graph as rows (``src``, ``dst``, ``type``, ``weight``; src < dst only), to read
    or export a generation's graph, which lives only in its CSR files. About ``block``
    edges at a time (whole source nodes per table), so that only one block's names are
    ever held as strings (a million memories: ~10 million edges). The names are taken in
    Arrow, not as a Python string per edge: ``node_names`` are the memory ids, then
    ``user|key`` of each entity node."""
    names = node_names if isinstance(node_names, pa.Array) else pa.array(node_names, pa.string())
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
