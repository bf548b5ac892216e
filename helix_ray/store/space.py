"""What a write that met a full disk says: :func:`disk_full` turns ENOSPC into a
:class:`helix_ray.errors.DiskFull` naming the filesystem, what is free, about how much
the write needs and what can be freed, and which generation keeps serving."""

from __future__ import annotations

import shutil
from pathlib import Path

from helix_ray.errors import DiskFull
from helix_ray.store.generation import current_generation_number, generations_dir


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is not there)."""
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{max(n, 1) / 1024:.0f} KiB"


def disk_full(store: Path, doing: str, need_bytes: int | None = None) -> DiskFull:
    """The error for ``store``'s filesystem filling up while ``doing`` (e.g. "ingesting").
    ``need_bytes``: about what the write needs; by default the size of the current
    generation, as a new one is written whole next to it."""
    store = Path(store)
    current = current_generation_number(store)
    if need_bytes is None:
        need_bytes = folder_bytes(generations_dir(store) / f"{current:06d}") if current else 0
    try:
        free = shutil.disk_usage(store if store.exists() else store.parent).free
    except OSError:
        free = 0
    spare = [p for p in generations_dir(store).iterdir() if p.name.isdigit() and int(p.name) != current] \
        if generations_dir(store).is_dir() else []
    freeable = [f"the {len(spare)} generation folders under {generations_dir(store)} other than the current one "
                f"({_size(sum(folder_bytes(p) for p in spare))})"] if spare else []
    folded = store / "inbox" / "folded"
    if folded.is_dir() and any(folded.iterdir()):
        freeable.append(f"the compaction inputs kept in {folded} ({_size(folder_bytes(folded))})")
    serving = f"generation {current} stays current and keeps serving" if current else "no generation was published"
    return DiskFull(
        f"No space left on the filesystem of store {store} while {doing}: {_size(free)} free, and this write needs "
        f"about {_size(need_bytes)}. Nothing half-written was made current: {serving}. Free space on that "
        f"filesystem{' (' + ' and '.join(freeable) + ' can go)' if freeable else ''}, or move the store to a larger "
        "one, then write again.")
