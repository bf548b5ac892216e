"""Warming: paying a store's first-question costs before the first question comes.

An agent's first ``recall`` of a session would otherwise pay for everything that is made
on first use: loading the two ONNX encoders and their first run, the router's reference
embeddings, the BM25 index and the per-row columns, and the page faults of every
memory-mapped file the query touches. :func:`warm_recaller` asks one real question of
the largest tenant, through every stage; :func:`read_through` then reads a generation's
files once so the OS page cache holds every tenant's pages, as on a serving host in
steady state. Both are what ``Memory`` runs in the background when it opens a store,
what a ``helix mcp`` server runs at start and what a Serve replica runs before it
reports healthy.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any, Iterable

from helix_ray.store.generation import VECTOR_FILES
from helix_ray.store.pointer import file_identity

log = logging.getLogger(__name__)

#: The question the warm-up asks: ordinary words, so both legs and every stage run.
WARM_QUERY = "what did we decide about the design, and why?"

_CHUNK = 1 << 24  # bytes per read: large sequential reads, and a small buffer


def largest_tenant(generation: Any) -> str | None:
    """The user with the most rows in ``generation`` (None: no rows)."""
    if generation is None or not generation.partitions:
        return None
    user, (start, end) = max(generation.partitions.items(), key=lambda item: item[1][1] - item[1][0])
    return user if end > start else None


def warm_recaller(recaller: Any, user: str | None = None) -> bool:
    """Ask :data:`WARM_QUERY` of ``user`` (default: the largest tenant) through every
    stage of ``recaller``; False when there is nobody to ask for. A failure is logged,
    never raised: the first real question then pays what was not warmed."""
    user = user or largest_tenant(recaller.generation)
    if user is None:
        return False
    try:
        recaller.recall(WARM_QUERY, user=user)
    except Exception:  # noqa: BLE001 - warming is an optimisation; recall reports its own errors
        log.warning("warming the store for %r failed; the first recall pays the start-up cost", user, exc_info=True)
        return False
    return True


#: What each serving role reads of a generation (top-level names; "all": the whole
#: query path). ``knn/`` and ``mentions.arrow`` are read by the next ingest only.
ROLE_FILES: dict[str, tuple[str, ...]] = {
    "dense": (*VECTOR_FILES, "binary.npy", "dense"),
    "bm25": ("bm25",),
    "ranker": ("memories.arrow", *VECTOR_FILES, "minhash.npy", "graph", "entities.arrow", "late"),
}
ROLE_FILES["all"] = tuple(dict.fromkeys(name for names in ROLE_FILES.values() for name in names))


#: The files :func:`read_through` read with ``once``, as (device, inode, size, mtime):
#: forgotten all at once when it holds this many.
_READ: set[tuple[int, int, int, int]] = set()
_READ_MAX = 65_536


def read_through(folder: str | Path, names: Iterable[str] | None = None, *, once: bool = False) -> int:
    """Read the files under ``folder`` (only the top-level ``names``, if given) once, so
    the OS page cache holds them; returns the bytes read. Files that vanish meanwhile (a
    pruned generation) are skipped. ``once``: so are the files this process read with
    ``once`` before (the same inode): a generation that a compaction folded holds its
    parent's files, hard-linked, so a replica that swaps to it does not read them again."""
    folder = Path(folder)
    roots = [folder] if names is None else [folder / name for name in names]
    total = 0
    # An anonymous mapping, unmapped on return. A bytearray would be a malloc of 16 MiB:
    # once glibc has freed one block that large it serves the next from the heap of the
    # calling thread and keeps it there after the free, so each generation a replica
    # opened (in an executor thread) left 16 MiB in its heap.
    with mmap.mmap(-1, _CHUNK) as buffer:
        for root in roots:
            paths = sorted(root.rglob("*")) if root.is_dir() else [root]
            for path in paths:
                try:
                    key = None
                    if once:
                        key = file_identity(path)
                        if key in _READ:
                            continue
                    with open(path, "rb", buffering=0) as fh:
                        while n := fh.readinto(buffer):
                            total += n
                except (IsADirectoryError, FileNotFoundError, PermissionError):
                    continue
                if key is not None:
                    if len(_READ) >= _READ_MAX:
                        _READ.clear()
                    _READ.add(key)
    return total
