"""The served store's file of recent recall hits, ``delta/ACCESSES.jsonl``.

The Writer records every recall hit in the ``access_log`` table; the next compaction or
ingest folds them into ``last_accessed_at`` and ``access_count``. Until then the
replicas read the hits from this file (the latest per id), so recency moves for served
recalls as it does for an open ``Memory``. The Writer appends to it and rewrites it
(:class:`helix_ray.live.writer.WriterCore`); a replica tails it (:class:`AccessTail`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from helix_ray.store.pointer import write_text_atomic


def accesses_path(store: Path) -> Path:
    """Recall hits the current generation has not folded yet, as JSON lines of
    ``{memory id: epoch µs}``: appended a batch per line, so a replica reads only what
    was added since it last looked (:class:`AccessTail`); rewritten whole (a new file,
    by rename) after a start or a compaction, or once it grows past
    :data:`helix_ray.live.writer.ACCESSES_REWRITE_BYTES`. The latest time per id wins."""
    return Path(store) / "delta" / "ACCESSES.jsonl"


def merge_accesses(into: dict[str, int], lines: bytes) -> dict[str, int]:
    """``into`` with the hits of complete JSON lines ``lines`` (the latest per id); a
    line that does not parse (a writer that crashed mid-line) is skipped."""
    for line in lines.splitlines():
        try:
            batch = json.loads(line)
        except ValueError:
            continue
        if not isinstance(batch, dict):
            continue
        for memory_id, micros in batch.items():
            if isinstance(micros, int) and micros > into.get(memory_id, 0):
                into[memory_id] = micros
    return into


def read_accesses(store: Path) -> dict[str, int]:
    """The whole access file of ``store``, as the replicas see it."""
    try:
        return merge_accesses({}, accesses_path(store).read_bytes())
    except FileNotFoundError:
        return {}


def append_accesses(path: Path, fresh: dict[str, int]) -> None:
    """Append the hits ``fresh`` to the access file ``path`` as one line."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(fresh, separators=(",", ":")) + "\n")


def rewrite_accesses(path: Path, accessed: dict[str, int]) -> None:
    """Replace the access file ``path`` with one line of every hit in ``accessed``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(accessed, separators=(",", ":")) + "\n")
    (path.parent / "ACCESSES.json").unlink(missing_ok=True)  # the one-object file of earlier versions


class AccessTail:
    """A replica's view of the access file: each :meth:`read` costs one ``stat`` when
    nothing changed, and the appended lines only when the Writer added some (a whole
    new file after a rewrite). The dict it returns is replaced, never changed, once a
    rewrite shows (a request may still hold the one before)."""

    def __init__(self, path: Path):
        self.path = path
        self._inode: int | None = None
        self._offset = 0
        self.accessed: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._inode, self._offset, self.accessed = None, 0, {}
            return self.accessed
        if st.st_ino == self._inode and st.st_size == self._offset:
            return self.accessed
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())  # the file opened, should it have been replaced since the stat
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset, self.accessed = st.st_ino, 0, {}
                fh.seek(self._offset)
                chunk = fh.read(st.st_size - self._offset)
        except FileNotFoundError:
            return self.accessed
        complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        merge_accesses(self.accessed, chunk[:complete])
        self._offset += complete
        return self.accessed
