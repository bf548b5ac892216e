"""``helix doctor``: check a store folder and say, per check, what is wrong and how to fix it.

Each check reads; none repairs. :func:`check_store` returns one :class:`Check` per step
that applies, in this order: the folder, the DuckDB database (opened read-only, every
table read whole so DuckDB checks every block's checksum), the ``CURRENT`` pointer, the
current generation's manifest (and its own checksum), its files (the row counts the
manifest implies; the size and CRC-32 it records for each), and ``keys.json``. A store
without a generation yet (a new ``helix serve`` store) has nothing for the last three
generation checks.
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, get_args

from helix_ray.config import EmbedderConfig
from helix_ray.embedder import DIM
from helix_ray.errors import GenerationDamaged, StoreError
from helix_ray.store.db import DB_FILE
from helix_ray.store.generation import DEAD_FILE, Generation, current_generation_number, generations_dir, vector_file
from helix_ray.store.integrity import REBUILD, file_problem
from helix_ray.store.late import POINTER_FILES, segment_file


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``found`` says what was seen; ``fix``, for a problem, what to do."""

    name: str
    ok: bool
    found: str
    fix: str | None = None


def check_store(store: str | Path) -> list[Check]:
    """The checks of ``store`` that apply, in order (see the module docstring)."""
    store = Path(store)
    folder = _folder(store)
    if not folder.ok:
        return [folder]
    checks = [folder, _database(store)]
    current = _current(store)
    checks.append(current)
    if current.ok and current_generation_number(store) is not None:
        manifest, generation = _manifest(store)
        checks.append(manifest)
        if generation is not None:
            checks.append(_files(generation))
    checks.append(_keys(store))
    return checks


def _folder(store: Path) -> Check:
    if store.is_dir():
        return Check("folder", True, f"{store} is a folder")
    what = "a file, not a folder" if store.exists() else "missing"
    return Check("folder", False, f"{store} is {what}",
                 "Give the store folder (--store DIR), or create one with `helix ingest SOURCE --store DIR`.")


def _database(store: Path) -> Check:
    """The database opens read-only and holds Helix's tables."""
    import duckdb

    path = store / DB_FILE
    if not path.is_file():
        return Check("database", False, f"{DB_FILE} is missing: this is not a Helix store, or one never ingested into",
                     "Check --store, or create the store with `helix ingest SOURCE --store DIR`.")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.IOException as exc:
        return _locked(path, str(exc)) if "lock" in str(exc).lower() else _unreadable(path, str(exc))
    except duckdb.Error as exc:
        return _unreadable(path, str(exc))
    try:
        memories, quarantined = (con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]  # type: ignore[index]
                                 for t in ("memories WHERE NOT deleted", "quarantine"))
        tables = [name for (name,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        for table in tables:  # every block read, so DuckDB checks each one's checksum
            con.execute(f'SELECT sum(hash(COLUMNS(*))) FROM "{table}"').fetchall()
    except duckdb.Error as exc:
        return _unreadable(path, str(exc))
    finally:
        con.close()
    return Check("database", True, f"{DB_FILE} opens read-only and its {len(tables)} tables read whole: "
                 f"{memories} memories, {quarantined} quarantined")


def _locked(path: Path, message: str) -> Check:
    pid = re.search(r"PID (\d+)", message)
    holder = f"process {pid.group(1)}" if pid else "another process"
    return Check("database", False, f"{path.name} is held by {holder} (a running `helix serve`, an ingest or a "
                 "Memory): DuckDB then refuses every other reader, so it was not checked",
                 "Run `helix doctor` again while nothing else has the store open; the other checks below do not "
                 "need the database.")


def _unreadable(path: Path, message: str) -> Check:
    return Check("database", False, f"{path.name} does not open as a Helix database ({message.splitlines()[0]})",
                 REBUILD)


def _current(store: Path) -> Check:
    pointer = store / "CURRENT"
    if not pointer.exists():
        return Check("current", True, "no generation published yet (no CURRENT): recall finds nothing until "
                     "`helix ingest` or a server's compaction publishes one")
    try:
        number = current_generation_number(store)
    except ValueError:
        return Check("current", False, f"CURRENT holds {pointer.read_text()[:40]!r}, not a generation number",
                     _on_disk(store) + REBUILD)
    folder = generations_dir(store) / f"{number:06d}"
    if not folder.is_dir():
        return Check("current", False, f"CURRENT names generation {number}, but {folder} is missing",
                     _on_disk(store) + REBUILD)
    return Check("current", True, f"CURRENT names generation {number} ({folder.relative_to(store)})")


def _on_disk(store: Path) -> str:
    folder = generations_dir(store)
    numbers = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    return f"Generations on disk: {', '.join(map(str, numbers)) or 'none'}. "


def _manifest(store: Path) -> tuple[Check, Generation | None]:
    """The manifest is one this Helix reads, built with an embedder it knows."""
    number = current_generation_number(store)
    path = generations_dir(store) / f"{number:06d}"
    try:
        generation = Generation(path, expect_dim=DIM, verify="manifest")  # the files: one by one, below
    except GenerationDamaged as exc:
        return Check("manifest", False, "; ".join(exc.problems), REBUILD), None
    except StoreError as exc:  # ManifestMismatch: the sentence says what it found and expected
        return Check("manifest", False, str(exc), REBUILD), None
    m = generation.manifest
    name = (m.get("embedder") or {}).get("name")
    known = get_args(EmbedderConfig.model_fields["name"].annotation)
    if name not in known:
        return Check("manifest", False, f"generation {number} was embedded with {name!r}; this Helix embeds with "
                     f"{', '.join(map(repr, known))}", "Open it with the Helix that built it, or rebuild the store "
                     "with this one (`helix ingest SOURCE... --store NEW_DIR`)."), None
    return Check("manifest", True, f"format {m['format']} v{m['format_version']}, embedder {name} ({DIM} dims), "
                 f"{generation.size} memories of {len(generation.partitions)} users"
                 + (f", {m['counts'].get('segment_rows', 0)} more in {len(m['segments'])} segments"
                    if m.get("segments") else "")), generation


def _expected_files(generation: Generation) -> dict[str, int | None]:
    """Each file of ``generation`` (relative path) → the rows the manifest implies (None:
    only that it exists and reads)."""
    m, n = generation.manifest, generation.size
    entities = int(m["counts"]["entities"])
    files: dict[str, int | None] = {"memories.arrow": n, vector_file(generation.path): n, "binary.npy": n, "minhash.npy": n,
                                    "entities.arrow": entities, "graph/indptr.npy": n + entities + 1}
    files.update({f"graph/{name}.npy": None for name in ("indices", "weights", "types")})
    files.update({f"bm25/{name}": None for name in ("params.index.json", "vocab.index.json", "data.csc.index.npy",
                                                     "indices.csc.index.npy", "indptr.csc.index.npy")})
    files.update({p["dense"]: None for p in m["partitions"] if p.get("dense")})
    late = m.get("late")
    if late and "segments" in late:  # helix_ray.store.late
        files.update({f"late/{name}.npy": n for name in POINTER_FILES})
        for segment in late["segments"]:
            files.update({segment_file(segment["name"], kind): int(segment["tokens"]) for kind in ("tokens", "scales")})
    elif late:
        tokens = int(late["tokens"])
        files.update({"late/tokens.npy": tokens, "late/scales.npy": tokens, "late/offsets.npy": n + 1})
    carry = m.get("carry") or {}
    if "mentions" in carry:
        files["mentions.arrow"] = n
    if "knn" in carry:
        files.update({"knn/neighbours.npy": n, "knn/similarities.npy": n})
    if m.get("segments"):  # format 2: rows folded in since the base, and the ids dead since
        files.update({segment["file"]: int(segment["rows"]) for segment in m["segments"]})
        files[DEAD_FILE] = int(m["counts"].get("dead", 0))
    return files


def _files(generation: Generation) -> Check:
    """Every file the manifest implies exists and reads, with the rows it records, and
    every file it records has the size and CRC-32 recorded (each file is read whole)."""
    problems = []
    implied = _expected_files(generation)
    recorded = generation.manifest.get("files") or {}
    for relative in [*implied, *(name for name in recorded if name not in implied)]:
        problem = _file_problem(generation.path / relative, implied.get(relative), recorded.get(relative))
        if problem:
            problems.append(f"{relative} {problem}")
    where = f"generations/{generation.path.name}"
    if problems:
        return Check("files", False, f"{where}: " + "; ".join(problems), REBUILD)
    if not recorded:
        return Check("files", True, f"{where}: {len(implied)} files present, with the rows the manifest records; "
                     "no checksums recorded; the next ingest or compaction records them")
    return Check("files", True, f"{where}: {len(recorded)} files with the sizes and CRC-32s the manifest records; "
                 f"{len(implied)} of them with the rows it implies")


def _file_problem(path: Path, rows: int | None, recorded: dict[str, Any] | None) -> str | None:
    """What is wrong with one file, or None: missing, unreadable, other rows than the
    manifest implies, another size or CRC-32 than it records."""
    if not path.is_file():
        return "is missing"
    try:
        found = _rows(path)
    except (OSError, ValueError) as exc:  # a truncated .npy or .arrow, bad JSON
        return f"does not read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    if rows is not None and found is not None and found != rows:
        return f"has {found} rows; the manifest implies {rows}"
    return file_problem(path, recorded, checksum=True) if recorded else None


def _rows(path: Path) -> int | None:
    """The rows of a ``.npy`` or ``.arrow`` file, read from its header; a ``.json`` file
    is parsed; anything else (an HNSW index) only exists."""
    readers: dict[str, Callable[[Path], Any]] = {".npy": _npy_rows, ".arrow": _arrow_rows, ".json": _json_rows}
    reader = readers.get(path.suffix)
    return reader(path) if reader else None


def _npy_rows(path: Path) -> int:
    import numpy as np

    array = np.load(path, mmap_mode="r")
    return int(array.shape[0]) if array.ndim else 1


def _arrow_rows(path: Path) -> int:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        reader = ipc.open_file(pa.memory_map(str(path), "r"))
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except pa.ArrowInvalid as exc:
        raise ValueError(str(exc)) from None


def _json_rows(path: Path) -> None:
    json.loads(path.read_text(encoding="utf-8"))
    return None


def _keys(store: Path) -> Check:
    """``keys.json`` parses as Helix's key list and only its owner can read it."""
    path = store / "keys.json"
    if not path.exists():
        return Check("keys", True, "no keys.json: no API keys yet (`helix keys create --store DIR --user USER`)")
    try:
        keys = json.loads(path.read_text(encoding="utf-8"))["keys"]
        users = {k["user"] for k in keys if not k.get("revoked") and k["sha256"] and k["key_id"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Check("keys", False, f"keys.json is not a Helix key list ({type(exc).__name__}: {exc})",
                     "Restore it from a backup, or move it aside and create the keys again "
                     "(`helix keys create --store DIR --user USER`); the old keys then stop working.")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check("keys", False, f"keys.json has mode {mode:04o}: other accounts on this machine can read it",
                     f"`chmod 600 {path}`.")
    return Check("keys", True, f"keys.json: {len(keys)} keys, {len(users)} users with a live key, mode {mode:04o}")
