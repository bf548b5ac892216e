#!/usr/bin/env python
"""Make ``helix_ray/token_projection.npy``: the late-interaction encoder's 384 → 64
projection.

The shipped ColBERT file is the BERT backbone without ColBERT's own final projection, so
Helix supplies one: the top 64 right-singular vectors of a sample of the backbone's
(unit) token vectors, uncentred, so that a dot product in 64 dimensions keeps as much of
the 384-dimensional one as any linear map to 64 can. The text is this repository's own
(README, docs, Python sources and the git log: prose, code and commit messages, no
benchmark data), so the file can be made again from a checkout alone.

    .venv/bin/python scripts/fit_token_projection.py [--passages 2500] [--out helix_ray/token_projection.npy]

Prints the passages and tokens used and the share of the tokens' energy the kept
directions hold. A new file changes ingest's fingerprint: stores are re-encoded on
their next ingest.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def repository_passages(root: Path, chars: int = 1200) -> list[str]:
    """Paragraph runs of at most ``chars`` characters from the repository's prose and
    code, and every commit message longer than a subject."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "helix_ray").rglob("*.py"))]
    out: list[str] = []
    for f in files:
        buf = ""
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            if buf and len(buf) + len(para) > chars:
                out.append(buf)
                buf = ""
            buf += para + "\n\n"
        if buf.strip():
            out.append(buf)
    log = subprocess.run(["git", "-C", str(root), "log", "--format=%s%n%n%b%x00"], capture_output=True,
                         text=True, check=True).stdout
    out += [m.strip() for m in log.split("\0") if len(m.strip()) > 40]
    return out


def main() -> int:
    from helix_ray.token_encoder import BACKBONE_DIM, DIM, PROJECTION_FILE, TokenEncoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=2500, help="passages sampled (seeded) from the repository")
    ap.add_argument("--out", default=str(PROJECTION_FILE))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    texts = repository_passages(ROOT)
    random.Random(args.seed).shuffle(texts)
    texts = texts[: args.passages]
    encoder = TokenEncoder(max_tokens=300)  # the backbone's own vectors: no pooling, no projection
    hidden = []
    for lo in range(0, len(texts), 64):
        hidden.extend(encoder.backbone_passages(texts[lo : lo + 64]))
    tokens = np.concatenate(hidden)
    _, singular, vt = np.linalg.svd(tokens, full_matrices=False)
    energy = np.cumsum(singular**2) / np.sum(singular**2)
    matrix = vt[:DIM].T.astype(np.float32)
    assert matrix.shape == (BACKBONE_DIM, DIM)
    np.save(args.out, matrix)
    print(json.dumps({"passages": len(texts), "tokens": len(tokens), "dim": DIM,
                      "energy_kept": round(float(energy[DIM - 1]), 4), "out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
