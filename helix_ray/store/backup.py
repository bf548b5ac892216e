"""Backing a store up into a folder, and restoring one from it.

A backup is a folder holding what a store needs to serve again, and
``backup-manifest.json``: every file with its size and SHA-256, the Helix version, the
generation and the time. :func:`restore` checks all of it before writing anything.

What it copies: ``CURRENT`` and the current generation's folder (immutable: hard links
where the backup is on the same file system, copies otherwise), the DuckDB database,
and every other file the store holds — the online writes' log lives in the database
(``serve_log``), their ingest-ready copies in ``inbox/``, the served delta in
``delta/``, and ``keys.json``, ``query_adapter.npz``, ``serve-settings.json`` at the
top. Older generations (kept for a rollback) and temporary or lock files are left out.

Consistency: the database is opened read-only for the whole backup. DuckDB lets a file
have one writing process or many readers, so while the backup holds it no ingest,
``Memory`` or ``helix serve`` can write — and every writer of the generations, the
delta and the inbox holds the database. The database itself is copied with DuckDB's
``COPY FROM DATABASE`` into a fresh file (committed rows only, including a write-ahead
log's, in a checkpointed file), never by copying bytes another process might be
changing. A served store cannot be opened at all by a second process, so a backup of
one is refused with the way out: stop the server (its writes are durable in the
database), back up, start it again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from helix_ray.errors import StoreError
from helix_ray.store.db import DB_FILE, copy_database, sql_path
from helix_ray.store.generation import current_generation_number, generations_dir
from helix_ray.store.late import link_or_copy

MANIFEST = "backup-manifest.json"
FORMAT = "helix-backup"
FORMAT_VERSION = 1


def backup(store: str | Path, out: str | Path) -> dict[str, Any]:
    """Copy ``store`` into the new (absent or empty) folder ``out``; return the manifest
    written there. Refuses a store another process writes (a ``helix serve``)."""
    import duckdb

    from helix_ray import __version__

    store, out = Path(store), Path(out)
    if not (store / DB_FILE).is_file():
        raise FileNotFoundError(f"Store {store} holds no {DB_FILE}: it is not a Helix store; check --store.")
    _require_empty(out, "backup into")
    staging = _staging(out)
    con = duckdb.connect()
    try:
        try:  # held until the end: no other process writes the store meanwhile
            con.execute(f"ATTACH {sql_path(store / DB_FILE)} AS source (READ_ONLY)")
        except duckdb.IOException as exc:
            raise StoreError(
                f"Cannot back up {store}: another process holds its database ({exc}). A `helix serve` or an "
                "ingest is writing it, and DuckDB then lets no other process open it, even to read. Stop the "
                "server (its writes are durable in the database) or wait for the ingest, back up, then start "
                "it again.") from None
        number = current_generation_number(store)
        for path in _store_files(store, number):
            target = staging / path.relative_to(store)
            target.parent.mkdir(parents=True, exist_ok=True)
            # A generation's files never change: linked; a link to a file changed in place
            # would change the backup with it, so the rest is copied.
            (link_or_copy if path.is_relative_to(generations_dir(store)) else shutil.copy2)(path, target)
        copy_database(con, "source", staging / DB_FILE)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "helix_version": __version__,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "store": str(store.resolve()), "generation": number, "files": _inventory(staging),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(staging, out)  # an empty folder is replaced too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        con.close()
    return manifest


def restore(backup_dir: str | Path, store: str | Path) -> dict[str, Any]:
    """Restore the backup in ``backup_dir`` into the new (absent or empty) folder
    ``store``, after checking every file against the backup's manifest; return it."""
    backup_dir, store = Path(backup_dir), Path(store)
    manifest = read_manifest(backup_dir)
    _require_empty(store, "restore into")
    staging = _staging(store)
    try:
        for entry in manifest["files"]:
            target = staging / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(backup_dir / entry["path"], target)
        os.replace(staging, store)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def read_manifest(backup_dir: Path) -> dict[str, Any]:
    """The backup's manifest, once every file it lists is there with its size and
    SHA-256; StoreError naming what differs otherwise."""
    path = backup_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{backup_dir} holds no {MANIFEST}: it is not a Helix backup. Give the folder "
                                "`helix backup --store DIR OUT` wrote (its OUT).")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path} is not valid JSON ({exc}); the backup is damaged.") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(
            f"{path} is format {manifest.get('format')!r} version {manifest.get('format_version')!r} "
            f"(Helix {manifest.get('helix_version')}); this Helix restores {FORMAT!r} version {FORMAT_VERSION}. "
            "Restore it with the Helix version that wrote it.")
    problems = []
    for entry in manifest["files"]:
        file = backup_dir / entry["path"]
        if not file.is_file():
            problems.append(f"{entry['path']} is missing")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['path']} has {file.stat().st_size} bytes, not {entry['bytes']}")
        elif _sha256(file) != entry["sha256"]:
            problems.append(f"{entry['path']} does not match its SHA-256")
    if problems:
        raise StoreError(f"Backup {backup_dir} is damaged: {'; '.join(problems[:5])}"
                         f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. Nothing was restored; "
                         "restore from another backup.")
    return manifest


def _store_files(store: Path, generation: int | None) -> Iterator[Path]:
    """The files a backup copies (the database apart): every regular file of ``store``
    but temporary and lock files (their names start with a dot), the database's own
    files, and the generation folders other than ``generation``."""
    current = f"{generation:06d}" if generation is not None else None
    for root, folders, files in os.walk(store):
        here = Path(root)
        folders[:] = sorted(f for f in folders if not f.startswith(".")
                            and (here != generations_dir(store) or f == current))
        for name in sorted(files):
            if name.startswith(".") or (here == store and name.startswith(DB_FILE)):
                continue
            yield here / name


def _inventory(folder: Path) -> list[dict[str, Any]]:
    return [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.rglob("*")) if p.is_file()]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_empty(folder: Path, what: str) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise StoreError(f"Cannot {what} {folder}: it exists and is not an empty folder. Give a new "
                              "folder (it is created), or empty this one first.")


def _staging(folder: Path) -> Path:
    """A new folder beside ``folder``, renamed to it once complete."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging
