"""Evaluation harness: benchmark loaders and ranking metrics (pure Python + numpy).

One loader module per benchmark (``locomo``, ``beir``, ``longmemeval``; ``repo`` for
questions about a repository's code and history), each returning the records of
``datasets``; ``metrics`` scores a ranking; ``runner`` builds the stores and runs the
systems side by side.

Typical use::

    from helix_ray.eval import load_locomo, LOCOMO_TUNE, evaluate_ranking, summarise

    evalset = load_locomo("locomo10.json", conversations=LOCOMO_TUNE)
    rows = []
    for q in evalset.queries:
        ranked = my_search(evalset.corpora[q.corpus_id], q.text)  # ids, best first
        rows.append({"category": q.category, **evaluate_ranking(ranked, q.gold, ks=(5, 10))})
    report = summarise(rows)
"""

from helix_ray.eval.beir import load_beir
from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet
from helix_ray.eval.locomo import (
    LOCOMO_CONVERSATIONS,
    LOCOMO_HELDOUT,
    LOCOMO_TUNE,
    load_locomo,
    normalise_locomo_evidence,
    parse_locomo_datetime,
)
from helix_ray.eval.longmemeval import load_longmemeval, parse_longmemeval_datetime
from helix_ray.eval.metrics import (
    evaluate_ranking,
    hit_at_k,
    mean,
    mrr_at_k,
    ndcg_at_k,
    recall_all_at_k,
    recall_any_at_k,
    recall_at_k,
    summarise,
)
from helix_ray.eval.repo import load_repo

__all__ = [
    "LOCOMO_CONVERSATIONS",
    "LOCOMO_HELDOUT",
    "LOCOMO_TUNE",
    "EvalDoc",
    "EvalQuery",
    "EvalSet",
    "evaluate_ranking",
    "hit_at_k",
    "load_beir",
    "load_locomo",
    "load_longmemeval",
    "load_repo",
    "mean",
    "mrr_at_k",
    "ndcg_at_k",
    "normalise_locomo_evidence",
    "parse_locomo_datetime",
    "parse_longmemeval_datetime",
    "recall_all_at_k",
    "recall_any_at_k",
    "recall_at_k",
    "summarise",
]
