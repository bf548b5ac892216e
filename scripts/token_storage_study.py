#!/usr/bin/env python
"""How much of late interaction's quality each way of storing fewer token bytes keeps.

``helix eval`` with extra systems ``tok-<variant>``: Helix whose candidates' stored token
vectors are transformed at scoring time, as a store written that way would hold them,
then scored by the same MaxSim; each is paired query by query against ``helix``. The
stores must hold the ColBERT backbone's own 384-d tokens, so the checkout given as
``--tree`` is one whose ingest wrote them (commit f08909d or earlier); its eval stores
are reused. A variant is parts joined by ``+``, applied in order:

- ``projD``: this checkout's shipped projection (``helix_ray/token_projection.npy``),
  its first D directions, to query and passage tokens, renormalised;
- ``pcaD``: the same with a projection fitted to the store's own tokens (uncentred SVD);
- ``poolF``: token pooling, ⌈n / F⌉ Ward clusters per passage, mean, renormalised;
- ``i4`` / ``bin``: 4-bit codes with a per-token scale / the signs alone (1 bit);
- ``capN``: the first N tokens of a passage.

    git worktree add /tmp/helix-384 f08909d
    .venv/bin/python scripts/token_storage_study.py --tree /tmp/helix-384 --variants proj96,proj64,pool2,pool2+proj96 \\
        eval beir --data $DATA/scifact --split train --systems helix,tok-proj96,tok-proj64,tok-pool2,tok-pool2+proj96
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

PROJECTION = Path(__file__).resolve().parent.parent / "helix_ray" / "token_projection.npy"
_state = threading.local()
_fitted: dict[tuple[int, int], np.ndarray] = {}
_pooled: dict[tuple[int, int, int], np.ndarray] = {}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-12)


def _fit(passages: Any, dim: int) -> np.ndarray:
    key = (id(passages.tokens), dim)
    if key not in _fitted:
        n = len(passages.tokens)
        rows = np.sort(np.random.default_rng(0).choice(n, size=min(n, 60000), replace=False))
        x = np.asarray(passages.tokens[rows], np.float32) * np.asarray(passages.scales[rows])[:, None]
        _fitted[key] = np.linalg.svd(x, full_matrices=False)[2][:dim].T.astype(np.float32)
    return _fitted[key]


def _pool(x: np.ndarray, factor: int) -> np.ndarray:
    from scipy.cluster.hierarchy import fcluster, linkage

    if len(x) <= 2:
        return x
    labels = fcluster(linkage(x, method="ward"), t=math.ceil(len(x) / factor), criterion="maxclust")
    return _unit(np.stack([x[labels == c].mean(axis=0) for c in np.unique(labels)]))


def _scaled(x: np.ndarray, levels: int) -> np.ndarray:
    scale = np.abs(x).max(axis=1, keepdims=True) / levels
    scale[scale == 0] = 1
    return np.clip(np.rint(x / scale), -levels, levels) * scale


def transform(variant: str, query: np.ndarray, block: Any, rows: np.ndarray, passages: Any):
    """(query tokens, per-passage token matrices) as ``variant`` stores and reads them."""
    tokens = np.asarray(block.tokens, np.float32) * np.asarray(block.scales)[:, None]
    per = [tokens[block.offsets[i]:block.offsets[i + 1]] for i in range(len(block.offsets) - 1)]
    q = np.asarray(query, np.float32)
    for part in variant.split("+"):
        if part.startswith(("proj", "pca")):
            dim = int(part.lstrip("projca"))
            matrix = np.load(PROJECTION)[:, :dim] if part.startswith("proj") else _fit(passages, dim)
            per = [_unit(x @ matrix) if len(x) else np.zeros((0, dim), np.float32) for x in per]
            q = _unit(q @ matrix)
        elif part.startswith("pool"):
            factor = int(part[4:])
            for i, r in enumerate(rows):
                key = (id(passages.tokens), int(r), factor)
                if key not in _pooled:
                    _pooled[key] = _pool(per[i], factor)
                per[i] = _pooled[key]
        elif part.startswith("cap"):
            per = [x[: int(part[3:])] for x in per]
        elif part == "i4":
            per = [_scaled(x, 7) if len(x) else x for x in per]
        elif part == "bin":
            per = [np.where(x >= 0, 1.0, -1.0).astype(np.float32) / math.sqrt(x.shape[1]) for x in per]
        else:
            raise SystemExit(f"Got the variant part {part!r}; expected projD, pcaD, poolF, capN, i4 or bin.")
    return q, per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--tree", required=True, help="a Helix checkout whose stores hold 384-d backbone tokens")
    ap.add_argument("--variants", required=True, help="comma-separated variants (see the module docstring)")
    args, rest = ap.parse_known_args()
    sys.path.insert(0, args.tree)
    from helix_ray.eval import runner
    from helix_ray.recall import late
    from helix_ray.token_encoder import PassageTokens

    original = late.maxsim

    class Fixed:  # what lookup() returns, already transformed
        def __init__(self, known: np.ndarray, block: Any):
            self.known, self.block = known, block

        def lookup(self, rows: np.ndarray):
            return self.known, self.block

    def maxsim(query_tokens: np.ndarray, passages: Any, rows: np.ndarray) -> np.ndarray:
        variant = getattr(_state, "variant", None)
        rows = np.asarray(rows, np.int64)
        known, block = passages.lookup(rows)
        if not variant or not len(known):
            return original(query_tokens, passages, rows)
        q, per = transform(variant, query_tokens, block, rows[known], passages)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in per])]).astype(np.int64)
        flat = np.concatenate(per) if offsets[-1] else np.zeros((0, q.shape[1]), np.float32)
        return original(q, Fixed(known, PassageTokens(flat, np.ones(len(flat), np.float32), offsets)), rows)

    late.maxsim = maxsim
    helix = runner.helix()

    def system(variant: str):
        def run(recaller: Any, q: Any, k: int) -> list[str]:
            _state.variant = variant
            try:
                return helix(recaller, q, k)
            finally:
                _state.variant = None
        return run

    for variant in filter(None, args.variants.split(",")):
        runner.SYSTEMS[f"tok-{variant}"] = system(variant)
    runner.BASELINES = ("helix",)
    from helix_ray.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    raise SystemExit(main())
