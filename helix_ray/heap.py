"""Give the memory a dropped generation, a finished compaction or an ingest step freed
back to the operating system.

A generation's open state (Arrow tables, columns, small arrays) lives on the C heap,
and so do a compaction's vectors and index builds. When a serving process drops a
generation, glibc keeps most of the freed pages in its arenas for later allocations, so
the process's anonymous memory stays a few MiB higher after every swap; after a
compaction the Writer would keep 100–160 MiB (at 10^5 memories), and an ingest driver
~1.5 KB per memory of what its steps let go. ``malloc_trim(0)``
returns the free pages at the top of each arena and the free whole pages inside them.
Elsewhere (macOS, musl) there is no such call and nothing is done. Arrow's buffers come
from its own pool (mimalloc by default), which keeps the pages of freed buffers as well,
in an ingest driver more than the Arrow data it holds live; a trim asks that pool to
release them too.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import threading
from typing import Any, Callable

import pyarrow as pa

log = logging.getLogger(__name__)

#: Seconds between dropping a generation and trimming: requests that started on it
#: hold it until they return, and only then is its memory free.
TRIM_DELAY_S = 5.0


@functools.cache
def _malloc_trim() -> Callable[[int], Any] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError, TypeError):  # no glibc: macOS, musl, Windows
        return None


def trim_heap() -> bool:
    """Arrow's pool releases its unused pages, then ``malloc_trim(0)``: True when glibc
    gave memory back, False otherwise (never raises)."""
    try:
        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - as below
        log.debug("releasing Arrow's unused memory failed", exc_info=True)
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        return bool(trim(0))
    except Exception:  # noqa: BLE001 - giving memory back is never worth failing a swap
        log.debug("malloc_trim failed", exc_info=True)
        return False


def trim_heap_later(delay_s: float = TRIM_DELAY_S) -> None:
    """Run :func:`trim_heap` once, ``delay_s`` seconds from now, off the event loop: in the
    loop's executor when called on a running loop, else in a timer thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        timer = threading.Timer(delay_s, trim_heap)
        timer.daemon = True
        timer.start()
        return
    loop.call_later(delay_s, loop.run_in_executor, None, trim_heap)


__all__ = ["TRIM_DELAY_S", "trim_heap", "trim_heap_later"]
