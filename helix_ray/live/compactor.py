"""When the Writer compacts: :class:`Compactor`, a background thread that folds a
:class:`~helix_ray.live.writer.WriterCore`'s delta into the next generation
(:mod:`helix_ray.live.compaction` says how) once enough time has passed or enough
writes are pending, and backs off after a failure. The same thread pushes the store
to its mirror again after a push that failed (:meth:`WriterCore.retry_mirror`), so the
mirror catches up even when no further change comes. The Writer deployment runs one,
and so does the shared state of the :class:`helix_ray.Memory` objects open on a store.

The thread runs at a lower CPU priority than the process (:func:`lower_priority`), and
so do the threads a compaction starts: a recall that arrives during a compaction gets
the cores first, and the compaction takes what recall leaves. A compaction someone
waits for (``Memory.compact``, ``helix compact``, ``POST /v1/admin/compact``) runs in
that caller's thread, at its priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from helix_ray.live.writer import MirrorBehind

log = logging.getLogger(__name__)

#: After a compaction that lost a write-write conflict in DuckDB, the next try (seconds).
COMPACT_RETRY_S = 5.0
#: After any other failed compaction: COMPACT_RETRY_S × 2^failures, at most this (seconds).
COMPACT_BACKOFF_MAX_S = 300.0
#: How often the compactor looks at the pending writes (seconds).
COMPACT_TICK_S = 1.0
#: After a failed push to the mirror, the next try: MIRROR_RETRY_S × 2^(failures − 1)
#: seconds after the last one, at most MIRROR_BACKOFF_MAX_S.
MIRROR_RETRY_S = 5.0
MIRROR_BACKOFF_MAX_S = 300.0
#: How much nicer than its process the compactor's thread runs (Linux nice values, 19
#: at most): 19, the lowest priority a thread can take without a privilege. A compaction
#: runs in the cycles recall leaves, and gets ~1.5 % of a core that a nice-0 recall
#: thread keeps busy (CFS weights 15 and 1024; docs/benchmarks.md, "Recall during a
#: compaction").
COMPACT_NICE = 19


def lower_priority(increment: int) -> int | None:
    """Make the calling thread ``increment`` nicer than it is (at most 19), and every
    thread it starts from now on (Linux threads inherit their creator's nice value);
    return the nice value it now has, or None where a thread's priority cannot be set
    apart from its process's (not Linux) or the call was refused. Raising a nice value
    needs no privilege; this thread cannot lower it again."""
    if increment <= 0 or sys.platform != "linux":
        return None
    tid = threading.get_native_id()
    try:
        value = min(os.getpriority(os.PRIO_PROCESS, tid) + increment, 19)
        os.setpriority(os.PRIO_PROCESS, tid, value)  # on Linux PRIO_PROCESS with a thread id: that thread
    except OSError as exc:
        log.warning("could not lower the compactor thread's priority (%s); it runs at the process's", exc)
        return None
    return value


def mirror_retry_due(behind: MirrorBehind, now: float) -> bool:
    """Whether a mirror behind since a failed push is due another push at ``now``
    (``time.monotonic()`` seconds)."""
    wait = min(MIRROR_RETRY_S * 2 ** (behind.failures - 1), MIRROR_BACKOFF_MAX_S)
    return now - behind.last_try >= wait


class Compactor:
    """Background compaction of a :class:`~helix_ray.live.writer.WriterCore`'s delta:
    every ``interval_s`` seconds when anything is pending, or as soon as ``max_pending``
    entries are. A failed compaction leaves the writes in the delta and is tried again
    later. ``compact`` makes one compaction and returns its report (default:
    ``core.compact``; an open ``Memory``'s store also flushes its recall hits first and
    swaps every open ``Memory`` to what it published). ``nice``: how much nicer than the
    process the thread runs (:func:`lower_priority`; 0 keeps the process's priority)."""

    def __init__(self, core: Any, *, interval_s: float, max_pending: int,
                 compact: Callable[[], dict[str, Any]] | None = None, name: str = "helix-compactor",
                 nice: int = COMPACT_NICE):
        self.core = core
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.nice = nice
        self.compact = compact or core.compact
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """No compaction starts after this; one running goes on to its end (``timeout_s``:
        how long to wait for it here)."""
        self.stop_event.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout_s)

    def _run(self) -> None:
        lower_priority(self.nice)
        last = time.monotonic()
        failures, retry_at = 0, 0.0
        while not self.stop_event.wait(COMPACT_TICK_S):
            now = time.monotonic()
            behind = self.core.mirror_behind
            if behind is not None and mirror_retry_due(behind, now):
                self.core.retry_mirror()  # a failure is logged and recorded by the core
            if now < retry_at:
                continue
            due = now - last >= self.interval_s
            todo = self.core.compactable()
            if todo >= self.max_pending or (due and (todo or self.core.open_tombstones())):
                soon = False
                try:
                    self.compact()
                    failures, retry_at = 0, 0.0
                except Exception as exc:  # noqa: BLE001 - the writes stay in the delta; try again later
                    import duckdb

                    # A DELETE wrote a row the pipeline was writing (it runs outside the
                    # writer's lock): not a lasting fault, so again in a few seconds.
                    # Anything else waits longer after each failure (a full disk, a record
                    # the pipeline cannot take), also when the pending writes are past
                    # max_pending (not a try, and a copy of them all, every tick).
                    soon = isinstance(exc, duckdb.TransactionException)
                    failures += 1
                    wait = COMPACT_RETRY_S if soon else min(COMPACT_RETRY_S * 2 ** failures, COMPACT_BACKOFF_MAX_S)
                    retry_at = time.monotonic() + wait
                    log.exception("background compaction failed (%d in a row); the delta keeps serving the "
                                  "writes; next try in %.0f s", failures, wait)
                last = time.monotonic() - (max(0.0, self.interval_s - COMPACT_RETRY_S) if soon else 0.0)
