"""Stage 1b (optional): a learned linear map from query vectors to memory vectors.

A general-purpose encoder puts a question and the memory that answers it further apart
when they are written differently — a web question and a Python function (CoSQA), a
vague "where do we parse the config" and the code that does. Given a few hundred
labelled pairs (a query and the memory it should find), :func:`fit` learns ``W`` such
that ``unit(q W)`` lands near the memories: ridge regression of the gold memories'
vectors on the query vectors, shrunk toward the identity (``W = I`` for ``ridge → ∞``):

    W = (QᵀQ + λI)⁻¹ (QᵀD + λI)

It is closed form (no training loop), cannot leave
the embedding space, and costs one 384×384 product per query. ``λ`` is chosen by
cross-validation on the pairs themselves (:func:`choose_ridge`). The store keeps it
beside its generations (``query_adapter.npz``); recall applies it to the dense leg,
ranking and diversity, while the skip-retrieval router keeps the raw vector (its
prototypes live in the encoder's space). Its effect on quality: docs/quality.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from helix_ray.errors import InvalidArgument, StoreError
from helix_ray.store.pointer import Pointer

ADAPTER_FILE = "query_adapter.npz"
RIDGE_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


@dataclasses.dataclass(frozen=True)
class QueryAdapter:
    matrix: np.ndarray  # (dim, dim) float32
    embedder: str
    ridge: float
    pairs: int
    created_at: str = ""
    #: The users whose queries it was fitted on (None: not recorded, an older file).
    users: tuple[str, ...] | None = None

    def apply(self, vector: np.ndarray) -> np.ndarray:
        """``unit(vector @ W)`` for one vector or a matrix of row vectors."""
        out = np.asarray(vector, np.float32) @ self.matrix
        norm = np.linalg.norm(out, axis=-1, keepdims=True)
        return (out / np.maximum(norm, 1e-12)).astype(np.float32)

    def save(self, store: str | Path) -> Path:
        """Write ``store/query_adapter.npz`` atomically (temporary file, fsync, rename)."""
        path = Path(store) / ADAPTER_FILE
        tmp = path.with_name(f".{ADAPTER_FILE}.{os.getpid()}.tmp")
        meta = {"embedder": self.embedder, "ridge": self.ridge, "pairs": self.pairs,
                "created_at": self.created_at or dt.datetime.now(dt.timezone.utc).isoformat(),
                "users": None if self.users is None else list(self.users)}
        with open(tmp, "wb") as fh:
            np.savez(fh, matrix=self.matrix.astype(np.float32), meta=np.array(json.dumps(meta)))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path


def load(store: str | Path, *, expect_embedder: str, expect_dim: int) -> QueryAdapter | None:
    """The store's adapter, or None when it has none. Refuses one made for another
    encoder or dimension (its map would be meaningless here)."""
    path = Path(store) / ADAPTER_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            matrix = np.asarray(data["matrix"], np.float32)
            meta = json.loads(str(data["meta"]))
    except (OSError, KeyError, ValueError) as exc:
        raise StoreError(f"Could not read the query adapter {path}: {exc}. Fit it again with "
                         "`helix adapt --store DIR --pairs FILE`, or delete the file.") from exc
    if meta.get("embedder") != expect_embedder or matrix.shape != (expect_dim, expect_dim):
        raise StoreError(
            f"The query adapter {path} was fitted for embedder {meta.get('embedder')!r} with "
            f"{matrix.shape[0]}-d vectors; this store's embedder is {expect_embedder!r} ({expect_dim}-d). "
            "Fit it again with `helix adapt --store DIR --pairs FILE`, or delete the file."
        )
    users = meta.get("users")
    return QueryAdapter(matrix, meta["embedder"], float(meta["ridge"]), int(meta["pairs"]), meta.get("created_at", ""),
                        None if users is None else tuple(users))


def forget_user(store: str | Path, user: str) -> bool:
    """Remove the store's adapter if it was fitted on ``user``'s queries, or on those of
    users it does not record (a file written before it did); True if it was removed.
    A fitted map cannot unlearn one user's pairs: fit it again on what feedback is left
    (`helix adapt --from-feedback`)."""
    path = Path(store) / ADAPTER_FILE
    if not path.is_file():
        return False
    try:
        with np.load(path) as data:
            users = json.loads(str(data["meta"])).get("users")
    except (OSError, KeyError, ValueError):
        users = None
    if users is not None and user not in users:
        return False
    path.unlink()
    return True


def watch(store: str | Path, embedder: str) -> Pointer:
    """The store's adapter as a :class:`Pointer`: ``read()`` loads it again only when
    `helix adapt` replaced or removed the file (one ``stat`` otherwise); None without one."""
    from helix_ray.embedder import DIM  # loads config (pydantic): this module does not

    return Pointer(Path(store) / ADAPTER_FILE, lambda path: load(path.parent, expect_embedder=embedder, expect_dim=DIM))


def fit(queries: np.ndarray, targets: np.ndarray, ridge: float) -> np.ndarray:
    """``W`` minimising ``‖Q W − D‖² + λ‖W − I‖²`` (rows: unit query vectors ``Q`` and
    the unit vectors ``D`` of the memories they should find)."""
    if ridge <= 0:
        raise InvalidArgument("ridge", ridge, "it must be > 0 (0 would fit the pairs exactly and nothing else)")
    q = np.asarray(queries, np.float64)
    d = np.asarray(targets, np.float64)
    eye = np.eye(q.shape[1])
    return np.linalg.solve(q.T @ q + ridge * eye, q.T @ d + ridge * eye).astype(np.float32)


def reciprocal_ranks(queries: np.ndarray, gold: Sequence[Sequence[int]], pools: Sequence[np.ndarray],
                     depth: int = 10) -> np.ndarray:
    """Reciprocal rank of each query's best gold row among its pool of memory vectors
    (0 past ``depth``): ``gold[i]`` are positions in ``pools[i]``. A non-gold row that
    ties the best gold row counts as ranked above it."""
    out = np.zeros(len(queries))
    for i, (q, rows) in enumerate(zip(queries, gold)):
        scores = pools[i] @ q
        local = np.asarray(rows)
        best = scores[local].max()
        others = np.ones(len(scores), bool)
        others[local] = False
        rank = int((scores[others] >= best).sum()) + 1
        out[i] = 1.0 / rank if rank <= depth else 0.0
    return out


def choose_ridge(queries: np.ndarray, targets: np.ndarray, gold: Sequence[Sequence[int]],
                 pools: Sequence[np.ndarray], *, folds: int = 5,
                 grid: Sequence[float] = RIDGE_GRID,
                 groups: Sequence[int] | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """The ``λ`` of ``grid`` with the best cross-validated MRR@10 (``folds`` folds of the
    queries — distinct queries: merge repeated ones first —, fit on the others, score
    each held-out query against its memories), and each query's reciprocal rank per
    setting, ``"identity"`` being the raw vectors. ``groups``: one fold per group
    instead (leave-one-store-out: does the map carry to a store it never saw?)."""
    n = len(queries)
    if groups is not None:
        fold_of = np.unique(np.asarray(groups), return_inverse=True)[1]
        folds = int(fold_of.max()) + 1
    else:
        folds = max(2, min(folds, n))
        fold_of = np.arange(n) % folds
    ranks = {"identity": reciprocal_ranks(queries, gold, pools)}
    for ridge in grid:
        rr = np.zeros(n)
        for f in range(folds):
            train, held = fold_of != f, np.flatnonzero(fold_of == f)
            w = fit(queries[train], targets[train], ridge)
            mapped = queries[held] @ w
            mapped /= np.maximum(np.linalg.norm(mapped, axis=1, keepdims=True), 1e-12)
            picked = [int(i) for i in held]
            rr[held] = reciprocal_ranks(mapped, [gold[i] for i in picked], [pools[i] for i in picked])
        ranks[f"ridge={ridge:g}"] = rr
    best = max(grid, key=lambda r: ranks[f"ridge={r:g}"].mean())
    return best, ranks


class _Memories:
    """A generation's memories of each user as the adapter scores them: the vectors of
    the user's rows, then those of the rows its segments hold (online writes folded in
    since the base), and where an id's vector is among them. An id a segment holds is
    found there (its base row, if any, is an older version); one the generation deletes
    is not found."""

    def __init__(self, generation: Any):
        self.generation = generation
        self.pools: dict[str, np.ndarray] = {}
        self.segments: dict[str, tuple[dict[str, int], np.ndarray]] = {}  # user → (id → position, vectors)
        rows = generation.segment_rows()
        if rows is not None and rows.num_rows:
            dim = rows.schema.field("vector").type.list_size
            vectors = rows.column("vector").combine_chunks().flatten().to_numpy().reshape(-1, dim)
            by_user: dict[str, list[int]] = {}
            for i, user in enumerate(rows.column("user").to_pylist()):
                by_user.setdefault(user, []).append(i)
            ids = rows.column("id").to_pylist()
            for user, at in by_user.items():
                self.segments[user] = ({ids[i]: n for n, i in enumerate(at)}, vectors[at])

    def of(self, user: str, memory_ids: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The user's pool of vectors, and the positions in it of those of ``memory_ids``
        the generation holds for the user."""
        generation = self.generation
        span = generation.partitions.get(user) or (0, 0)
        found, seg_vectors = self.segments.get(user, ({}, None))
        if user not in self.pools:
            base = np.asarray(generation.vectors[span[0]:span[1]], np.float32)
            self.pools[user] = base if seg_vectors is None else np.concatenate([base, seg_vectors])
        rows, dead = generation.columns.id_to_row, generation.dead
        positions = set()
        for memory_id in memory_ids:
            if memory_id in found:
                positions.add(span[1] - span[0] + found[memory_id])
            elif memory_id in rows and memory_id not in dead and span[0] <= rows[memory_id] < span[1]:
                positions.add(rows[memory_id] - span[0])
        return self.pools[user], sorted(positions)


MIN_PAIRS = 20
MAX_FEEDBACK_IDS = 100
MAX_FEEDBACK_QUERY_CHARS = 4000


def check_feedback(query: Any, memory_ids: Any) -> tuple[str, list[str]]:
    """A feedback record as given by a caller (Python or HTTP): a non-empty query and a
    non-empty list of memory ids, the memories that answered it (bounded: a recall
    returns tens of memories, not thousands)."""
    if not isinstance(query, str) or not query.strip() or len(query) > MAX_FEEDBACK_QUERY_CHARS:
        raise InvalidArgument("query", query if not isinstance(query, str) else query[:80],
                              f"give the query text the memories answered (a non-empty string of at most "
                              f"{MAX_FEEDBACK_QUERY_CHARS} characters)")
    if isinstance(memory_ids, str):
        memory_ids = [memory_ids]
    if (not isinstance(memory_ids, (list, tuple)) or not memory_ids or len(memory_ids) > MAX_FEEDBACK_IDS
            or not all(isinstance(m, str) and m for m in memory_ids)):
        raise InvalidArgument("memory_ids", memory_ids if not isinstance(memory_ids, (list, tuple))
                              else list(memory_ids)[:5],
                              f"give the ids of the recalled memories that helped (a non-empty list of at most "
                              f"{MAX_FEEDBACK_IDS} strings)")
    return query.strip(), sorted(set(memory_ids))


def fit_pairs(generation, embedder, pairs: Sequence[dict], *, ridge: float | None = None,
              folds: int = 5) -> tuple[QueryAdapter, dict]:
    """Fit an adapter for ``generation`` from labelled pairs ``{"query", "user",
    "memory_ids"}`` (the memories the query should find). The same query of the same
    user given twice counts once, with both lines' memories (folds must not hold it on
    both sides); ids the generation does not hold for that user are skipped and counted.
    ``ridge`` None: chosen by :func:`choose_ridge`.

    Returns the adapter and a report: queries used, pairs and ids skipped, λ, the
    cross-validated MRR@10 of the raw and adapted vectors (same folds), and ``improves``:
    whether the adapted MRR@10 beats the raw one by more than twice the standard error
    of the per-query differences (a margin for having picked the best of several λ)."""
    return fit_pairs_across([(generation, pairs)], embedder, ridge=ridge, folds=folds)


def require_feedback(pairs: Sequence[dict], users: Sequence[str] | None, *, how: str) -> None:
    """Say so, and how to record some, when the store holds no feedback (of ``users``)
    to fit on, rather than report "0 usable queries of 0 pairs"."""
    if pairs:
        return
    if users is not None and not users:
        raise InvalidArgument("users", [], "it names no user", "Leave users out to fit on every user's feedback.")
    who = ("user " if len(users or []) == 1 else "users ") + ", ".join(map(repr, users)) if users else "any user"
    raise InvalidArgument("users", list(users) if users else None,
                          f"the store records no feedback of {who}, and an adapter is fitted on labelled queries",
                          f"Record some with {how} (a query and the ids of the memories that answered it), "
                          "then adapt again.")


def fit_store(store: str | Path, pairs: Sequence[dict], *, embedder=None, ridge: float | None = None,
              force: bool = False) -> dict:
    """`helix adapt`: fit the adapter of ``store``'s current generation on ``pairs`` and
    save it there when cross-validation shows a gain (or ``force``). Returns the fit's
    report with ``saved`` (and ``path``)."""
    # The embedder loads config (pydantic), the generation the index layer: this module needs neither.
    from helix_ray.embedder import DIM, get_embedder
    from helix_ray.store.generation import Generation

    embedder = embedder or get_embedder()
    generation = Generation.open_current(Path(store), expect_embedder=embedder.name, expect_dim=DIM)
    fitted, report = fit_pairs(generation, embedder, pairs, ridge=ridge)
    report["saved"] = bool(report["improves"] or force)
    if report["saved"]:
        report["path"] = str(fitted.save(store))
    return report


def fit_pairs_across(parts: Sequence[tuple[Any, Sequence[dict]]], embedder, *, ridge: float | None = None,
                     folds: int = 5) -> tuple[QueryAdapter, dict]:
    """:func:`fit_pairs` over several generations built with the same encoder, each
    with its own labelled pairs (one map for a kind of query across stores, e.g.
    questions about conversations); each query is scored against its own store, and
    cross-validation leaves one store out at a time."""
    used: list[tuple[str, np.ndarray, list[int]]] = []  # (query, the user's memory vectors, gold positions)
    n_pairs, skipped_pairs, skipped_ids = 0, 0, 0
    users: set[str] = set()
    part_of: list[int] = []
    for part, (generation, pairs) in enumerate(parts):
        n_pairs += len(pairs)
        grouped: dict[tuple[str, str], list[str]] = {}
        for pair in pairs:
            grouped.setdefault((str(pair["user"]), str(pair["query"])), []).extend(pair["memory_ids"])
        memories = _Memories(generation)
        for (user, query), ids in grouped.items():
            pool, gold = memories.of(user, ids)
            skipped_ids += len(set(ids)) - len(gold)
            if gold:
                used.append((query, pool, gold))
                users.add(user)
                part_of.append(part)
            else:
                skipped_pairs += 1
    if len(used) < MIN_PAIRS:
        raise InvalidArgument(
            "pairs", f"{len(used)} usable queries of {n_pairs} pairs",
            f"an adapter needs at least {MIN_PAIRS} distinct queries whose memory ids the store's current "
            "generation holds for that user; give more labelled queries")
    # One query per call, as recall embeds it (the int8 model's activations are
    # quantized per batch: a batch of queries would give slightly other vectors).
    queries = np.stack([embedder.embed_queries([q])[0] for q, _, _ in used]).astype(np.float32)
    queries /= np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
    targets = np.stack([pool[gold].mean(axis=0) for _, pool, gold in used])
    targets /= np.maximum(np.linalg.norm(targets, axis=1, keepdims=True), 1e-12)
    pools = [pool for _, pool, _ in used]
    golds = [g for _, _, g in used]
    # Several stores: leave one store out, so the estimate is for a store the map never saw.
    chosen, ranks = choose_ridge(queries, targets, golds, pools, folds=folds,
                                 grid=RIDGE_GRID if ridge is None else (ridge,),
                                 groups=part_of if len(set(part_of)) > 1 else None)
    gain = ranks[f"ridge={chosen:g}"] - ranks["identity"]
    stderr = float(gain.std(ddof=1) / np.sqrt(len(gain))) if len(gain) > 1 else float("inf")
    adapter = QueryAdapter(fit(queries, targets, chosen), embedder.name, chosen, len(used), users=tuple(sorted(users)))
    report = {"queries": len(used), "pairs": n_pairs, "skipped_queries": skipped_pairs,
              "skipped_ids": skipped_ids, "ridge": chosen,
              "cv_mrr@10": {k: round(float(v.mean()), 4) for k, v in ranks.items()},
              "cv_gain": round(float(gain.mean()), 4), "cv_gain_stderr": round(stderr, 4),
              "improves": bool(gain.mean() > 2 * stderr)}
    return adapter, report
