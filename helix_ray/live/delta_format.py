"""The delta's files: the segment format and the snapshots' manifests.

The single writer publishes a new snapshot of the delta (:mod:`helix_ray.live.delta`)
every time it changes. A snapshot is a small manifest over immutable segment files, so a
write costs a file of its own entries, not a copy of every pending one:

================================ ==============================================
``delta/CURRENT``                the live snapshot's version (atomically replaced)
``delta/<NNNNNNNNNN>.json``      snapshot ``N``: its segment files, the entries of those
                                 segments it no longer holds (``dead``: replaced, deleted,
                                 dropped after compaction), the entries a generation
                                 folded (``folded``) and the tombstones
``delta/seg-<seq>-<tag>.arrow``  :data:`delta_schema` rows, written once and never changed
                                 (one per write batch; small ones merged as they pile up)
================================ ==============================================

Format 1 (one whole table per snapshot, ``<NNNNNNNNNN>.arrow``) is read too.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.ipc as ipc

from helix_ray.errors import StoreError
from helix_ray.store.pointer import file_identity
from helix_ray.store.publish import fsync_path

DELTA_DIR = "delta"
FORMAT = "helix-delta"
FORMAT_VERSION = 2  # a manifest over segment files; 1: one whole table per snapshot (read too)
NOT_FOLDED = -1
#: Segments holding fewer live entries than this are "small"; once there are
#: :data:`MERGE_SMALL_AT` of them the writer merges them into one (a write then costs a
#: file of its own entries, and a snapshot lists a few dozen files, not one per write).
SMALL_SEGMENT = 64
MERGE_SMALL_AT = 16


def delta_schema(dim: int, num_perm: int) -> pa.Schema:
    return pa.schema([
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("user", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("lexical", pa.string(), nullable=False),  # text + doc2query expansions
        pa.field("type", pa.string(), nullable=False),
        pa.field("project", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("created_at", pa.int64(), nullable=False),  # microseconds since the epoch, UTC
        pa.field("salience", pa.float32(), nullable=False),
        pa.field("confidence", pa.float32(), nullable=False),
        pa.field("pinned", pa.bool_(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False),
        pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
        pa.field("minhash", pa.list_(pa.uint32(), num_perm), nullable=False),
        pa.field("folded_into", pa.int64(), nullable=False),  # NOT_FOLDED, or the generation holding it
        # Late-interaction tokens (token_encoder.to_blobs); null when the writer encodes none.
        pa.field("late_codes", pa.binary()),
        pa.field("late_scales", pa.binary()),
        # The validated record as the writer logged it (JSON), and the fingerprint of the ingest
        # settings its outputs were computed under: what a generation's segment needs for the
        # next ingest to fold its rows in (null in files of earlier versions).
        pa.field("record", pa.string()),
        pa.field("computed_by", pa.string()),
    ])


@dataclass(frozen=True)
class Tombstone:
    """A deleted id. It hides the id's generation row in every generation below
    ``applies_below`` (None: every generation, until a compaction drops the row)."""

    id: str
    user: str
    applies_below: int | None = None

    def applies_to(self, generation: int | None) -> bool:
        return self.applies_below is None or generation is None or generation < self.applies_below


# ----------------------------------------------------------------------------- files


def delta_dir(store: Path) -> Path:
    return Path(store) / DELTA_DIR


def current_delta_version(store: Path) -> int:
    """The live snapshot's version; 0 when the store has none (an empty delta)."""
    pointer = delta_dir(store) / "CURRENT"
    try:
        return int(pointer.read_text().strip() or 0)
    except FileNotFoundError:
        return 0


def _write_arrow(path: Path, table: pa.Table) -> None:
    """``table`` as an Arrow IPC file at ``path``: written aside, fsynced, renamed in."""
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:12]}.arrow")
    with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    fsync_path(tmp)
    os.replace(tmp, path)


def write_segment(store: Path, table: pa.Table) -> str:
    """A new immutable segment file of :func:`delta_schema` rows; returns its name. It
    is not part of any snapshot until a manifest lists it (:func:`publish_manifest`)."""
    folder = delta_dir(store)
    folder.mkdir(parents=True, exist_ok=True)
    first = int(table.column("seq")[0].as_py()) if table.num_rows else 0
    name = f"seg-{first:012d}-{uuid.uuid4().hex[:8]}.arrow"
    _write_arrow(folder / name, table)
    return name


def publish_manifest(store: Path, version: int, segments: Sequence[str], *, dead: Iterable[int] = (),
                     folded: Mapping[int, int] | None = None, tombstones: Iterable[Tombstone] = (),
                     keep: int = 4) -> Path:
    """Make snapshot ``version`` current: its manifest (written, fsynced, renamed), then
    ``CURRENT``. Snapshots beyond the newest ``keep`` are removed, and the segment files
    none of the kept ones lists: a replica that still maps one keeps its pages (POSIX
    unlink semantics), and one that lags further re-reads ``CURRENT``."""
    folder = delta_dir(store)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": version,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "segments": list(segments), "dead": sorted(int(s) for s in dead),
            "folded": sorted([int(s), int(g)] for s, g in (folded or {}).items()),
            "tombstones": [[t.id, t.user, t.applies_below] for t in tombstones]}
    final = folder / f"{version:010d}.json"
    tmp = folder / f".tmp-{uuid.uuid4().hex[:12]}.json"
    tmp.write_text(json.dumps(meta, separators=(",", ":")))
    fsync_path(tmp)
    os.replace(tmp, final)
    pointer = folder / f".CURRENT.{uuid.uuid4().hex[:8]}"
    pointer.write_text(f"{version}\n")
    fsync_path(pointer)
    os.replace(pointer, folder / "CURRENT")
    fsync_path(folder)
    _prune(folder, keep)
    return final


#: Segment lists of the manifests this process has read while pruning, by path and
#: file identity (a store deleted and made again at the same path has new files): a
#: manifest never changes once written, so each is parsed once, not on every publish.
_LISTED: dict[tuple[Path, int, int, int, int], list[str]] = {}
#: A temporary file older than this (seconds) is left over from a writer that crashed.
_STALE_TMP_S = 300.0


def drop_history(store: Path) -> None:
    """Delete every snapshot but the newest, and the segments only those listed: after
    a user is forgotten, older snapshots would still list their writes."""
    _prune(delta_dir(store), keep=1)


def _prune(folder: Path, keep: int) -> None:
    snapshots = sorted((p for p in folder.iterdir() if p.stem.isdigit() and p.suffix in (".json", ".arrow")),
                       key=lambda p: int(p.stem))
    kept = set(sorted({int(p.stem) for p in snapshots})[-keep:])
    for old in snapshots:
        if int(old.stem) not in kept:
            old.unlink(missing_ok=True)
    listed: set[str] = set()
    for version in kept:
        path = folder / f"{version:010d}.json"
        try:
            key = (path, *file_identity(path))
        except FileNotFoundError:  # a format-1 snapshot lists none
            continue
        if key not in _LISTED:
            _LISTED[key] = json.loads(path.read_text()).get("segments", [])
        listed.update(_LISTED[key])
    for key in [k for k in _LISTED if k[0].parent == folder and int(k[0].stem) not in kept]:
        del _LISTED[key]
    now = dt.datetime.now().timestamp()
    for path in folder.iterdir():
        if path.name.startswith("seg-") and path.name not in listed:
            path.unlink(missing_ok=True)
        elif path.name.startswith((".tmp-", ".CURRENT.")):
            try:
                if now - path.stat().st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass


def check_format(meta: Mapping[str, Any], path: Path) -> None:
    if meta.get("format") != FORMAT or meta.get("format_version") not in (1, FORMAT_VERSION):
        raise StoreError(
            f"Cannot read delta snapshot {path}: found format {meta.get('format')!r} version "
            f"{meta.get('format_version')!r}; this Helix reads {FORMAT!r} versions 1 and {FORMAT_VERSION}."
        )


def entry_columns(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Column lists for :func:`delta_schema` from the writer's entry dicts."""
    names = delta_schema(1, 1).names
    return {name: [r[name] for r in records] for name in names}
