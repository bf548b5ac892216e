"""Checksums of a generation: recorded in its manifest at publish, verified when it opens
and by ``helix doctor``.

The manifest's ``files`` maps every file of the generation but the manifest itself (its
path under the generation folder, ``/``-separated) to its size and CRC-32::

    "files": {"vectors.f16.npy": {"bytes": 15360128, "crc32": "9a0c1f3e"}, ...}

and ``manifest_crc32`` is the CRC-32 of the manifest's canonical body (every other key,
sorted, compact JSON), so damage to the manifest itself is caught too.

CRC-32 (:func:`zlib.crc32`) because the damage to catch is accidental: a copy cut short,
a flipped bit, a failing disk; not a forgery. It is among the fastest checksums in the
standard library (docs/operations.md gives the measured rates). What is checked when:

- every open (``verify="open"``): the manifest's checksum, every file's size, and the
  CRC-32 of the smallest files up to :data:`OPEN_HASH_BYTES` in all. A generation of
  10^6 memories is gigabytes: hashing all of it at every replica's open would cost far
  more than the open, while sizes catch every truncated file for one ``stat`` each.
  A file that matched its record once is not hashed again by the same process while it
  is the same file (:func:`~helix_ray.store.pointer.file_identity`): a generation that a
  compaction folded links its parent's files, which the fold and then the swap open;
- ``verify="full"`` and ``helix doctor``: every file's CRC-32.

A generation written before checksums were recorded has neither key and opens as before.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from helix_ray.errors import GenerationDamaged
from helix_ray.store.pointer import file_identity

MANIFEST = "manifest.json"
#: The manifest key holding the CRC-32 of the rest of the manifest.
MANIFEST_CHECKSUM = "manifest_crc32"
#: At every open, files are hashed smallest first while their sizes add up to at most this.
OPEN_HASH_BYTES = 64 << 20
_CHUNK = 1 << 20
#: (file identity, CRC-32) of the files an open found matching their record, newest last.
_MATCHED: "OrderedDict[tuple[Any, ...], None]" = OrderedDict()
_MATCHED_KEPT = 4096
_MATCHED_LOCK = threading.Lock()

#: What to do with a damaged store.
RESTORE = ("Restore the store folder from a backup, or rebuild it from your sources into a new folder "
           "(`helix ingest SOURCE... --store NEW_DIR`)")
#: What to do with a damaged generation. Not "point CURRENT back": the next ingest rolls
#: forward to the newest generation the database records.
REBUILD = f"{RESTORE}: an ingest into this store would carry the damaged files over."


def file_crc32(path: Path) -> str:
    """The CRC-32 of the file at ``path``, as 8 hex digits."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def record_files(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: size and CRC-32 of every file under ``folder`` but the
    manifest, by path relative to ``folder``. ``known`` holds records that stand for
    files of the same size without reading them: files hard-linked from an earlier
    generation, whose manifest recorded them when they were written (re-reading
    gigabytes of unchanged tokens at every publish would cost what linking saves)."""
    known = known or {}
    files = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name == MANIFEST:
            continue
        name, size = path.relative_to(folder).as_posix(), path.stat().st_size
        record = known.get(name)
        if record is None or record.get("bytes") != size or "crc32" not in record:
            record = {"bytes": size, "crc32": file_crc32(path)}
        files[name] = {"bytes": size, "crc32": record["crc32"]}
    return files


def _canonical_crc32(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x}"


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with :data:`MANIFEST_CHECKSUM` set over the rest of it."""
    return {**manifest, MANIFEST_CHECKSUM: _canonical_crc32(manifest)}


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the generation in ``folder``, parsed. Raises
    :class:`GenerationDamaged` naming the file when it is missing, unreadable, not JSON
    or not an object."""
    path = folder / MANIFEST
    if not path.is_file():
        raise damaged(folder, [f"{MANIFEST} is missing"])
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise damaged(folder, [f"{MANIFEST} does not read ({exc})"]) from None
    except UnicodeDecodeError as exc:
        raise damaged(folder, [f"{MANIFEST} is not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    except json.JSONDecodeError as exc:
        raise damaged(folder, [f"{MANIFEST} is not valid JSON ({exc})"]) from None
    if not isinstance(manifest, dict):
        raise damaged(folder, [f"{MANIFEST} holds a JSON {type(manifest).__name__}, not an object"])
    return manifest


def check_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Raise :class:`GenerationDamaged` when ``manifest`` (of the generation in
    ``folder``) records a checksum of itself that its body no longer has."""
    recorded = manifest.get(MANIFEST_CHECKSUM)
    found = _canonical_crc32(manifest)
    if recorded is not None and recorded != found:
        raise damaged(folder, [f"{MANIFEST} has CRC-32 {found}; it records {recorded} for itself"])


def file_problem(path: Path, recorded: dict[str, Any], *, checksum: bool, once: bool = False) -> str | None:
    """What differs between the file at ``path`` and its manifest record (size, and
    with ``checksum`` its CRC-32), in words; None when nothing does. ``once``: a file
    this process found matching the same CRC-32 before, unchanged since, is not hashed
    again (an open's check; ``helix doctor`` reads every byte)."""
    try:
        identity = file_identity(path)
    except FileNotFoundError:
        return "is missing"
    size = identity[2]
    if size != recorded["bytes"]:
        return f"has {size} bytes; the manifest records {recorded['bytes']}"
    if checksum:
        key = (identity, recorded["crc32"])
        if once:
            with _MATCHED_LOCK:
                if key in _MATCHED:
                    return None
        found = file_crc32(path)
        if found != recorded["crc32"]:
            return f"has CRC-32 {found}; the manifest records {recorded['crc32']}"
        if once:
            with _MATCHED_LOCK:
                _MATCHED[key] = None
                while len(_MATCHED) > _MATCHED_KEPT:
                    _MATCHED.popitem(last=False)
    return None


def to_hash_at_open(files: dict[str, dict[str, Any]], budget: int | None = None) -> set[str]:
    """The files an open hashes: the smallest first, while their sizes add up to at most
    ``budget`` (default :data:`OPEN_HASH_BYTES`)."""
    budget = OPEN_HASH_BYTES if budget is None else budget
    chosen: set[str] = set()
    total = 0
    for name, record in sorted(files.items(), key=lambda item: (item[1]["bytes"], item[0])):
        if total + record["bytes"] > budget:
            break
        chosen.add(name)
        total += record["bytes"]
    return chosen


def verify_files(folder: Path, manifest: dict[str, Any], *, full: bool) -> None:
    """Check the files of the generation in ``folder`` against ``manifest``'s ``files``:
    every size, and the CRC-32 of every file (``full``) or of those
    :func:`to_hash_at_open` picks. Raises :class:`GenerationDamaged` listing each file
    that differs. A manifest without ``files`` (an older generation) checks nothing."""
    files = manifest.get("files")
    if not files:
        return
    hashed = set(files) if full else to_hash_at_open(files)
    problems = []
    for name, record in files.items():
        problem = file_problem(folder / name, record, checksum=name in hashed, once=not full)
        if problem:
            problems.append(f"{name} {problem}")
    if problems:
        raise damaged(folder, problems)


def damaged(folder: Path, problems: list[str]) -> GenerationDamaged:
    """The error for generation ``folder`` (``STORE/generations/NNNNNN``) with these problems."""
    if not folder.name.isdigit():  # not in a store's generations/: name the folder itself
        listed = tuple(f"{folder}/{p}" for p in problems)
        return GenerationDamaged(f"The generation in {folder} is damaged: {'; '.join(listed)}. {REBUILD}", listed)
    store = folder.parent.parent
    listed = tuple(f"generations/{folder.name}/{p}" for p in problems)
    return GenerationDamaged(f"Generation {int(folder.name)} of {store} is damaged: {'; '.join(listed)}. "
                             f"`helix doctor --store {store}` checks every file. {REBUILD}", listed)
