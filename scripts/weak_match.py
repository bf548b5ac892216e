#!/usr/bin/env python
"""Where ``dense.weak_match_below`` falls: how close the closest candidate is to a question
whose answer the store holds, and to one it holds nothing on.

For each tuning split (LoCoMo's tuning conversations, SciFact train, CoSQA dev), on the
stores ``helix eval`` builds (``--workdir``, reused), it reads the cosine that
``flags.match`` reports (the closest candidate's, with the question's sentence vector) for:

- ``answerable``: the split's own questions, as they are;
- ``gold removed``: the same questions as if their gold documents were not stored (the
  closest candidate that is no gold document or chunk of one; a candidate's cosine
  does not depend on the others, so this is what a store without the gold would give,
  up to which candidates the legs would have brought instead);
- ``other domain``: 300 questions of each other split, asked against this split's stores.

A question ``flags.match`` is not read for (BM25 decisive, so the dense list is not
fused) is left out: it is never flagged.

It prints, per split, the ROC AUC of answerable against each kind of unanswerable, and
the share of each whose cosine is below the configured threshold (and ``--thresholds``).

    .venv/bin/python scripts/weak_match.py --data $DATA --workdir .helix/eval-stores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helix_ray.config import IngestConfig, RetrievalConfig  # noqa: E402
from helix_ray.embedder import get_embedder  # noqa: E402
from helix_ray.eval import LOCOMO_TUNE, load_beir, load_locomo  # noqa: E402
from helix_ray.eval.runner import EVAL_BUDGET, question_time, store_for  # noqa: E402
from helix_ray.recall.pipeline import Recaller  # noqa: E402
from helix_ray.recall.threads import encoder_threads  # noqa: E402
from helix_ray.schema import parent_of  # noqa: E402
from helix_ray.store.generation import Generation  # noqa: E402

SPLITS = ("locomo", "scifact", "cosqa")
FOREIGN = 300  # questions of each other split, per split


def load(name: str, data: Path) -> Any:
    if name == "locomo":
        return load_locomo(data / "locomo" / "locomo10.json", conversations=LOCOMO_TUNE)
    if name == "scifact":
        return load_beir(data / "scifact", split="train")
    return load_beir(data / "cosqa", split="dev")


def similarities(name: str, data: Path, workdir: Path, config: RetrievalConfig) -> dict[str, list[float]]:
    """The closest candidate's cosine per question, by kind."""
    evalset = load(name, data)
    rng = random.Random(sum(map(ord, name)))
    foreign = []
    for other in SPLITS:
        if other != name:
            questions = list(load(other, data).queries)
            rng.shuffle(questions)
            foreign += questions[:FOREIGN]
    by_corpus: dict[str, list[Any]] = {}
    for q in evalset.queries:
        by_corpus.setdefault(q.corpus_id, []).append(q)
    corpora = sorted(by_corpus)
    out: dict[str, list[float]] = {"answerable": [], "gold removed": [], "other domain": []}
    ingest = IngestConfig()
    for n, corpus in enumerate(corpora):
        store = store_for(corpus, evalset.corpora[corpus], workdir, ingest)
        gen = Generation.open_current(store)
        threads = encoder_threads(gen, None)
        recaller = Recaller(gen, get_embedder(ingest.embedder, threads), config, adapter=None, threads=threads)
        asked = [(q, True) for q in by_corpus[corpus]] + [(q, False) for q in foreign[n::len(corpora)]]
        present = question_time(by_corpus[corpus][0])  # the conversation's present (LoCoMo), else None
        for q, own in asked:
            result = recaller.recall(q.text, user=corpus, budget_tokens=EVAL_BUDGET, k=10,
                                     disabled=frozenset({"router"}), now=(question_time(q) if own else present),
                                     explain=True)
            match = result.flags.get("match")
            if match is None or result.explain is None:
                continue
            if not own:
                out["other domain"].append(match["cosine"])
                continue
            out["answerable"].append(match["cosine"])
            table = result.explain
            gold = set(q.gold)
            rest = [c for c, i in zip(table["cosine"].to_list(), table["id"].to_list()) if (parent_of(i) or i) not in gold]
            if rest:
                out["gold removed"].append(float(np.max(rest)))
        print(f"{name}: {corpus} done ({n + 1}/{len(corpora)})", file=sys.stderr, flush=True)
    return out


def auc(pos: list[float], neg: list[float]) -> float:
    """P(an answerable question's similarity is above an unanswerable one's), ties half."""
    p, q = np.asarray(pos), np.asarray(neg)
    if not len(p) or not len(q):
        return float("nan")
    return float(((p[:, None] > q[None, :]).sum() + 0.5 * (p[:, None] == q[None, :]).sum()) / (len(p) * len(q)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="the folder holding locomo/, scifact/ and cosqa/")
    ap.add_argument("--workdir", type=Path, default=Path(".helix/eval-stores"), help="helix eval's stores")
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--thresholds", default="", help="more thresholds to report, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="write the similarities here")
    args = ap.parse_args()
    config = RetrievalConfig()
    shipped = config.dense.weak_match_below
    thresholds = sorted({shipped, *(float(t) for t in args.thresholds.split(",") if t)})
    found = {name: similarities(name, args.data, args.workdir, config) for name in args.splits.split(",")}
    print(f"| split | questions (answerable / gold removed / other domain) | AUC vs gold removed | AUC vs other "
          f"domain | " + " | ".join(f"below {t:.2f}: answerable / gold removed / other domain" for t in thresholds)
          + " |")
    print("|---|---|---:|---:|" + "---|" * len(thresholds))
    for name, kinds in found.items():
        a, g, o = kinds["answerable"], kinds["gold removed"], kinds["other domain"]
        shares = [" / ".join(f"{np.mean(np.asarray(x) < t):.1%}" for x in (a, g, o)) for t in thresholds]
        print(f"| {name} | {len(a)} / {len(g)} / {len(o)} | {auc(a, g):.3f} | {auc(a, o):.3f} | "
              + " | ".join(shares) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(found))


if __name__ == "__main__":
    main()
