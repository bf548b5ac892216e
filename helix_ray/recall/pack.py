"""Stage 8: token-budgeted packing in lost-in-the-middle order.

Items arrive ranked (best first). Packing fills greedily, in rank order, with every
item that still fits the budget (an item that does not fit is skipped and smaller ones
after it may still fit), then orders the packed items so the strongest sit at the
edges of the context, where models attend best (Liu et al. 2023, "Lost in the Middle"):
rank 1 first, rank 2 last, rank 3 second, rank 4 second to last, …

Token counts use :mod:`helix_ray.tokens` (``cl100k_base``, shipped offline). The budget
is never exceeded: an item larger than the whole budget, when nothing else has been
packed, is cut at a token boundary and marked ``truncated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from helix_ray.tokens import ENCODING, encoding


@dataclass(frozen=True)
class PackItem:
    row: int
    text: str
    n_tokens: int


@dataclass(frozen=True)
class Packed:
    row: int
    text: str
    n_tokens: int
    rank: int  # 1-based rank before reordering
    truncated: bool


def litm_order(n: int) -> list[int]:
    """Positions (0-based ranks) in lost-in-the-middle order: 0, 2, 4, …, 5, 3, 1."""
    front = list(range(0, n, 2))
    back = list(range(1, n, 2))[::-1]
    return front + back


def pack(
    items: Sequence[PackItem],
    budget: int,
    *,
    separator_tokens: int = 0,
    encoding_name: str = ENCODING,
) -> list[Packed]:
    """Greedy fill within ``budget`` tokens, then lost-in-the-middle order.

    Each packed item costs ``n_tokens + separator_tokens``. Returns items in final order.
    """
    if budget <= 0:
        raise ValueError(f"Got budget={budget}; it must be a positive number of tokens.")
    chosen: list[Packed] = []
    used = 0
    for rank, item in enumerate(items, start=1):
        cost = item.n_tokens + separator_tokens
        if used + cost <= budget:
            chosen.append(Packed(item.row, item.text, item.n_tokens, rank, False))
            used += cost
        elif not chosen and item.n_tokens + separator_tokens > budget:
            room = budget - separator_tokens
            if room <= 0:
                break
            enc = encoding(encoding_name)
            tokens = enc.encode(item.text, disallowed_special=())[:room]
            # A cut can end inside a multi-byte character: drop the partial bytes (so
            # the text stays a prefix of the memory), then trim until it re-encodes
            # within the room.
            text = enc.decode_bytes(tokens).decode("utf-8", errors="ignore")
            while len(enc.encode(text, disallowed_special=())) > room:
                tokens = tokens[:-1]
                text = enc.decode_bytes(tokens).decode("utf-8", errors="ignore")
            n = len(enc.encode(text, disallowed_special=()))
            chosen.append(Packed(item.row, text, n, rank, True))
            used += n + separator_tokens
    return [chosen[i] for i in litm_order(len(chosen))]
