"""A small file re-read only when it changed: store pointers (``CURRENT``), the live
settings, the query adapter. Shared by Serve's replicas and :class:`helix_ray.Memory`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


class Pointer:
    """A small file read only when it changed: one ``stat`` per call otherwise.

    ``CURRENT`` files are replaced by rename, so a new inode (or mtime) means new
    contents."""

    def __init__(self, path: Path, parse: Callable[[Path], Any]):
        self.path = path
        self.parse = parse
        self._key: tuple[int, int, int] | None = None
        self._value: Any = None
        self.version = 0  # bumped every time the contents are read again

    def read(self) -> Any:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._key is not None or self.version == 0:
                self._key, self._value = None, self.parse(self.path)
                self.version += 1
            return self._value
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._value = self.parse(self.path)
            self._key = key
            self.version += 1
        return self._value
