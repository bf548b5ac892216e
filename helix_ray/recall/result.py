"""What a recall returns: :class:`RecallResult` with its :class:`RecallItem` list, and
the ``explain`` table that shows, for every candidate, what each stage made of it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from helix_ray.recall import rank


@dataclass(frozen=True)
class RecallItem:
    id: str
    text: str
    type: str
    rank: int  # 1-based rank after ranking and diversity (before lost-in-the-middle order)
    score: float
    n_tokens: int
    truncated: bool
    created_at: str
    session_id: str | None
    project: str | None
    signals: dict[str, float] = field(default_factory=dict)
    parent: str | None = None  # the memory this item is a chunk of (None: a whole memory)


_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(RecallItem) if f.name != "signals")


@dataclass(frozen=True)
class RecallResult:
    query: str
    user: str
    items: list[RecallItem]  # final (packed, lost-in-the-middle) order
    total_tokens: int
    budget_tokens: int
    timings_ms: dict[str, float]
    flags: dict[str, Any]
    generation: int | None
    explain: Any = None  # polars.DataFrame when explain=True

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; a copy (the caller may add to its flags and timings).
        Written out rather than ``dataclasses.asdict``, which deep-copies field by field:
        this runs once per request in a Serve replica."""
        out: dict[str, Any] = {
            "query": self.query, "user": self.user,
            "items": [{**{name: getattr(item, name) for name in _ITEM_FIELDS}, "signals": dict(item.signals)}
                      for item in self.items],
            "total_tokens": self.total_tokens, "budget_tokens": self.budget_tokens,
            "timings_ms": dict(self.timings_ms),
            "flags": {k: list(v) if isinstance(v, (list, tuple)) else dict(v) if isinstance(v, dict) else v
                      for k, v in self.flags.items()},
            "generation": self.generation,
        }
        if self.explain is not None:
            out["explain"] = self.explain.to_dicts()
        return out

    def context(self, separator: str = "\n\n") -> str:
        """The packed memories as one string, in final order."""
        return separator.join(item.text for item in self.items)


def weak_match_note(flags: dict[str, Any]) -> str | None:
    """A recall's ``flags.match`` in words for whoever reads its memories (a person, an
    agent), when it is weak: none of them is likely about the question. None otherwise."""
    match = flags.get("match") or {}
    if not match.get("weak"):
        return None
    where = "the memories in this scope (its project, types or time) likely hold" if match.get("filtered") else \
        "the store likely holds"
    return (f"weak match: the closest memory's cosine with the question is {match['cosine']:.3f}, below "
            f"{match['below']:.3f}; {where} nothing on its topic, so do not read these memories as its answer")


def iso(micros: int) -> str:
    """An epoch-µs timestamp as ISO 8601 in UTC."""
    return dt.datetime.fromtimestamp(int(micros) / 1_000_000, tz=dt.timezone.utc).isoformat()


@dataclass
class Candidates:
    """The candidates of one recall and what each stage found about them, filled in
    stage order. Arrays and the ``dropped_by`` keys are by candidate position: the fused
    pool in fused order, then the rows graph expansion added."""

    rows: np.ndarray  # generation rows, int64
    fused_score: dict[int, float]  # row → RRF score (absent: not in a leg's list)
    list_rank: dict[str, dict[int, int]]  # leg → row → 1-based rank in that leg's list
    graph_score: dict[int, float]  # row → graph proximity (personalized PageRank)
    added: list[int]  # rows graph expansion brought in
    vectors: np.ndarray | None = None  # the rows' sentence vectors
    cosine: np.ndarray | None = None  # with the query vector
    late_scores: np.ndarray | None = None  # MaxSim, NaN without token vectors; None: stage off
    ranked: rank.Ranked | None = None
    dropped_by: dict[int, str] = field(default_factory=dict)  # position → the stage that dropped it
    bm25_score: dict[int, float] = field(default_factory=dict)  # row → raw BM25 (absent: not in its list)
    context_cosine: np.ndarray | None = None  # weighted cosine with the context turns, or None


#: Leg → the name of its fused list of the memories created in the query's time window.
WINDOW_LISTS = {"bm25": "bm25@window", "dense": "dense@window"}

EXPLAIN_COLUMNS = ("id", "origin", "dense_rank", "bm25_rank", "window_rank", "rrf_score", "cosine", "late_maxsim",
                   "graph_ppr", "similarity", "recency", "salience", "confidence", "graph", "score", "final_position",
                   "dropped_by")


def empty_explain() -> Any:
    """The explain table of a recall without candidates."""
    import polars as pl

    return pl.DataFrame({c: [] for c in EXPLAIN_COLUMNS})


def explain_table(candidates: Candidates, ids: Any, final_position: dict[int, int]) -> Any:
    """One row per candidate, best score first. ``ids``: row → memory id;
    ``final_position``: candidate position → 1-based position in the packed result."""
    import polars as pl

    c = candidates
    assert c.cosine is not None and c.ranked is not None  # filled by the late and rank stages
    rows, added, n = c.rows, set(c.added), len(c.rows)
    data = {
        "id": [str(ids[int(r)]) for r in rows],
        "origin": ["graph" if int(r) in added else "fused" for r in rows],
        "dense_rank": [c.list_rank.get("dense", {}).get(int(r)) for r in rows],
        "bm25_rank": [c.list_rank.get("bm25", {}).get(int(r)) for r in rows],
        # the best rank in the searches among the memories of the query's time window
        "window_rank": [min((c.list_rank[name][int(r)] for name in WINDOW_LISTS.values()
                             if int(r) in c.list_rank.get(name, {})), default=None) for r in rows],
        "rrf_score": [c.fused_score.get(int(r), 0.0) for r in rows],
        "cosine": [float(v) for v in c.cosine],
        "late_maxsim": [None] * n if c.late_scores is None else [None if np.isnan(v) else float(v)
                                                                 for v in c.late_scores],
        "graph_ppr": [c.graph_score.get(int(r), 0.0) for r in rows],
        **{s: [float(v) for v in c.ranked.signals[s]] for s in rank.SIGNALS},
        "score": [float(v) for v in c.ranked.scores],
        "final_position": [final_position.get(i) for i in range(n)],
        "dropped_by": [c.dropped_by.get(i) for i in range(n)],
    }
    return pl.DataFrame(data).sort("score", descending=True)
