"""Small files of a store: re-read only when they changed (:class:`Pointer`: store
pointers such as ``CURRENT``, the live settings, the query adapter; shared by Serve's
replicas and :class:`helix_ray.Memory`), and replaced whole (:func:`write_text_atomic`); and
the identity of a file (:func:`file_identity`) that keys what is built from one."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` whole: written aside, fsynced, renamed in (a reader
    sees the old file or the new one, never a part); the aside file goes if that fails."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    """``path``'s (device, inode, size, mtime): the same for every hard link of one file,
    another once the file is replaced by rename or changed. Raises FileNotFoundError."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_int(path: Path) -> int | None:
    """The number a pointer file such as ``CURRENT`` holds; None when it is missing or empty."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


class Pointer:
    """A small file read only when it changed: one ``stat`` per call otherwise.

    ``CURRENT`` files are replaced by rename, so a new inode (or mtime) means new
    contents."""

    def __init__(self, path: Path, parse: Callable[[Path], Any]):
        self.path = path
        self.parse = parse
        self._key: tuple[int, int, int, int] | None = None
        self._value: Any = None
        self.version = 0  # bumped every time the contents are read again

    def read(self) -> Any:
        try:
            key = file_identity(self.path)
        except FileNotFoundError:
            if self._key is not None or self.version == 0:
                self._key, self._value = None, self.parse(self.path)
                self.version += 1
            return self._value
        if key != self._key:
            self._value = self.parse(self.path)
            self._key = key
            self.version += 1
        return self._value
