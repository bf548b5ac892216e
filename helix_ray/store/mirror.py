"""A store's mirror: its current generation, delta snapshot and the small files serving
replicas read, at a ``pyarrow.fs`` URI (a local folder, ``s3://``, ``gs://``, ``hdfs://``),
so replicas on hosts that do not see the store folder can serve it.

The mirror has the store's layout, minus the database and the inbox::

    URI/CURRENT                      the mirror's current generation (replaced last)
    URI/generations/<NNNNNN>/        the current generation and the one before it
    URI/delta/CURRENT, <N>.json, seg-*.arrow    the live delta snapshot and its segments
    URI/serve-settings.json, query_adapter.npz, delta/ACCESSES.jsonl

:func:`push` (run where the store is: an ingest, the server's Writer) makes the mirror
hold the store's current state. Every file of a generation goes up before its manifest,
and the manifest before the mirror's ``CURRENT``: a reader of the mirror never sees a
``CURRENT`` naming an incomplete generation. A file the mirror's previous generation
holds with the same name, size and CRC-32 (unchanged token segments, and most files of a
generation that a compaction folded, which a store hard-links from one generation to the
next) is copied at the mirror, not uploaded: hard-linked where the mirror is a local (or
mounted) folder. Delta
segments are immutable and uniquely named, so each goes up once.

:func:`pull` (run on a serving host) makes a local folder, the cache, a copy of the
mirror that :class:`helix_ray.store.generation.Generation` and the delta readers open as
they open a store: a generation is downloaded into ``generations/<NNNNNN>.partial/``,
every file's size and CRC-32 checked against its manifest, renamed into place and only
then named by the cache's ``CURRENT``. An interrupted or damaged download never becomes
current; a generation the cache already holds whole is not downloaded again; files that
the cache's previous generation holds unchanged are hard-linked from it.

Object stores have no atomic folder rename: the mirror's ``CURRENT`` (one object,
replaced whole) is what makes a generation visible there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from helix_ray.errors import GenerationDamaged, InvalidArgument, StoreError
from helix_ray.store.generation import current_generation_number, generations_dir
from helix_ray.store.integrity import MANIFEST, check_manifest, file_problem
from helix_ray.store.pointer import file_identity, read_int, write_bytes_atomic, write_text_atomic
from helix_ray.store.publish import _rename_durably, fsync_path, set_current

log = logging.getLogger(__name__)

#: Small files of a store that recall replicas read, by path under the store: the live
#: settings, the query adapter and the recent recall hits. Each is replaced whole when it
#: changes. Not ``keys.json``: only the ingress reads it, and it stays on the store's node.
SMALL_FILES = ("serve-settings.json", "query_adapter.npz", "delta/ACCESSES.jsonl")
DELTA = "delta"
#: Delta snapshots kept at the mirror and in a cache: the current one and the one before
#: (a pull that read ``CURRENT`` just before a push still finds its manifest).
KEEP_SNAPSHOTS = 2
#: Written in the store by a forget, removed by the first complete push after it: while
#: it is there every push keeps no older generation or snapshot at the mirror (a forget
#: whose push failed, or run without the mirror, left the user's data in those).
FORGET_PENDING = "mirror-forget-pending"
#: A store pushed to a mirror at least once holds this file (the URIs it was pushed to):
#: only such a store's forgets mark the mirror as holding a forgotten user's data.
MIRRORED = "mirrored.json"
_PARTIAL = ".partial"
_CHUNK = 1 << 20

ALLOWED = ("a mirror is an absolute folder path, a file:// URI, or an s3://, gs:// or hdfs:// URI "
           "that this pyarrow can open")
FIX = "Pass e.g. --mirror /mnt/shared/helix-mirror or --mirror s3://bucket/helix/atlas."


# ----------------------------------------------------------------------------- the mirror


@dataclass
class Mirror:
    """A mirror at ``uri``: ``fs`` and ``root`` from :func:`open_mirror`. It remembers
    which small files it last pushed or pulled (by their stat), so an unchanged one is
    not sent again; use one object per direction."""

    uri: str
    fs: pafs.FileSystem
    root: str
    _sent: dict[str, tuple[Any, ...] | None] = field(default_factory=dict)

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    def read(self, rel: str) -> bytes | None:
        """The bytes of the mirror's file ``rel``; None when it is not there."""
        try:
            with self.fs.open_input_stream(self.path(rel)) as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def read_int(self, rel: str) -> int | None:
        """The number the mirror's pointer file ``rel`` holds; None when it is missing or
        empty. Raises :class:`StoreError` when it holds anything else."""
        data = self.read(rel)
        text = data.decode(errors="replace").strip() if data else ""
        try:
            return int(text) if text else None
        except ValueError:
            raise StoreError(f"The mirror's {self.path(rel)} ({self.uri}) holds {text[:40]!r}, not a generation or "
                             "snapshot number (it was changed by hand or by another program). Delete that file "
                             "and push the store to the mirror again (`helix serve --mirror URI` pushes first)."
                             ) from None

    def listing(self, rel: str, *, recursive: bool = False) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive)
        return self.fs.get_file_info(selector)

    def upload(self, local: Path, rel: str) -> None:
        self.fs.create_dir(self.path(rel).rsplit("/", 1)[0], recursive=True)
        root = _local_root(self)
        if root is not None:  # a file left there may be linked to another generation's: never write into it
            (root / rel).unlink(missing_ok=True)
        with open(local, "rb") as src, self.fs.open_output_stream(self.path(rel)) as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)

    def replace(self, rel: str, data: bytes) -> None:
        """Write ``data`` as ``rel`` whole: aside, then moved over it (one object
        replaced on an object store, a rename on a local folder)."""
        parent, name = self.path(rel).rsplit("/", 1)
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:8]}"
        with self.fs.open_output_stream(tmp) as dst:
            dst.write(data)
        self.fs.move(tmp, self.path(rel))

    def download(self, rel: str, local: Path) -> int:
        """Copy the mirror's ``rel`` to ``local`` (its folder made); returns the bytes."""
        local.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with self.fs.open_input_stream(self.path(rel)) as src, open(local, "wb") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                size += len(chunk)
        return size


def open_mirror(uri: str) -> Mirror:
    """The mirror at ``uri``: an absolute folder path, ``file://``, ``s3://``, ``gs://``
    or ``hdfs://`` (whatever :meth:`pyarrow.fs.FileSystem.from_uri` opens here). Raises
    :class:`InvalidArgument` saying what was received and what is allowed."""
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidArgument("mirror", uri, ALLOWED, FIX)
    if "://" not in uri and not os.path.isabs(uri):
        raise InvalidArgument("mirror", uri, "a local folder must be given by its absolute path "
                              "(a relative one names another folder on every host)",
                              f"Pass --mirror {os.path.abspath(uri)} if that is the folder meant.")
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgument("mirror", uri, f"{ALLOWED} (pyarrow says: {reason})", FIX) from None
    return Mirror(uri, fs, root)


def _local_root(mirror: Mirror) -> Path | None:
    return Path(mirror.root).resolve() if isinstance(mirror.fs, pafs.LocalFileSystem) else None


# ----------------------------------------------------------------------------- push


@dataclass
class PushReport:
    """What one :func:`push` did: the generation the mirror now serves, its files
    uploaded and copied at the mirror (0 and 0: it held it already), the delta snapshot
    it now holds (0: none), the delta segments and small files sent."""

    generation: int
    uploaded: int = 0
    copied: int = 0
    delta_version: int = 0
    segments: int = 0
    small_files: list[str] = field(default_factory=list)


def push(store: Path, mirror: Mirror, *, history: bool = True) -> PushReport:
    """Make ``mirror`` hold ``store``'s current generation, delta snapshot and small
    files (see the module docstring for the order). Keeps the mirror's previous
    generation and delta snapshot and deletes older ones once ``CURRENT`` moved;
    ``history=False`` (after a user is forgotten, and while :data:`FORGET_PENDING` is in
    the store) keeps only the current ones."""
    store = Path(store)
    pending = (store / FORGET_PENDING).exists()
    history = history and not pending
    if _local_root(mirror) == store.resolve():
        raise InvalidArgument("mirror", mirror.uri, "a mirror is another folder than the store it mirrors", FIX)
    number = current_generation_number(store)
    if number is None:
        raise StoreError(f"Store {store} has no published generation (no CURRENT): nothing to push to "
                         f"{mirror.uri}. Run `helix ingest` first.")
    report = PushReport(number)
    held = mirror.read_int("CURRENT")
    if held is not None and held > number:
        raise StoreError(f"The mirror {mirror.uri} serves generation {held}, newer than store {store}'s "
                         f"{number}: it mirrors another store. Give each store a mirror URI of its own.")
    if held != number:
        report.uploaded, report.copied = _push_generation(store, mirror, number, held)
        mirror.replace("CURRENT", f"{number}\n".encode())
        log.info("mirror %s serves generation %d (%d files uploaded, %d copied)", mirror.uri, number,
                 report.uploaded, report.copied)
    if held != number or not history:
        _prune_mirror(mirror, keep={number, held} if history else {number})
    report.delta_version, report.segments = _push_delta(store, mirror, KEEP_SNAPSHOTS if history else 1)
    report.small_files = _push_small(store, mirror)
    _remember_mirror(store, mirror)
    if pending:
        (store / FORGET_PENDING).unlink(missing_ok=True)
    return report


def _remember_mirror(store: Path, mirror: Mirror) -> None:
    path = store / MIRRORED
    try:
        known = list(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        known = []
    if mirror.uri not in known:
        write_text_atomic(path, json.dumps([*known, mirror.uri]) + "\n")


def mark_forgotten(store: Path) -> bool:
    """Record in ``store``, if it was ever pushed to a mirror (:data:`MIRRORED`), that a
    user was forgotten: pushes keep no history at a mirror until one of them completes
    (:data:`FORGET_PENDING`). Returns whether it was recorded."""
    if not (Path(store) / MIRRORED).exists():
        return False
    write_text_atomic(Path(store) / FORGET_PENDING, "a user was forgotten since the last complete push\n")
    return True


def forget_pending(store: Path) -> bool:
    """Whether a mirror of ``store`` may still hold a forgotten user's data."""
    return (Path(store) / FORGET_PENDING).exists()


def _manifest_files(data: bytes | None) -> dict[str, dict[str, Any]]:
    try:
        return dict(json.loads(data).get("files") or {}) if data else {}
    except (ValueError, AttributeError):
        return {}


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return bool(a and b and "crc32" in a and a.get("bytes") == b.get("bytes") and a.get("crc32") == b.get("crc32"))


def _push_generation(store: Path, mirror: Mirror, number: int, held: int | None) -> tuple[int, int]:
    """Every file of generation ``number`` to the mirror, its manifest last; returns
    (uploaded, copied at the mirror from generation ``held``)."""
    folder = generations_dir(store) / f"{number:06d}"
    rel = f"generations/{number:06d}"
    records = _manifest_files((folder / MANIFEST).read_bytes())
    before = f"generations/{held:06d}" if held is not None else None
    previous = _manifest_files(mirror.read(f"{before}/{MANIFEST}")) if before else {}
    uploaded = copied = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(folder).as_posix()
        if before and _same(records.get(name), previous.get(name)):
            if not _link_at(mirror, f"{before}/{name}", f"{rel}/{name}"):
                mirror.fs.create_dir(mirror.path(f"{rel}/{name}").rsplit("/", 1)[0], recursive=True)
                mirror.fs.copy_file(mirror.path(f"{before}/{name}"), mirror.path(f"{rel}/{name}"))
            copied += 1
        else:
            mirror.upload(path, f"{rel}/{name}")
            uploaded += 1
    mirror.upload(folder / MANIFEST, f"{rel}/{MANIFEST}")
    return uploaded, copied


def _link_at(mirror: Mirror, source: str, target: str) -> bool:
    """Hard-link the mirror's ``source`` as ``target`` where the mirror is a local folder
    (a generation's files are never changed in place: a fold's generation is mostly its
    parent's files); False where it is not, or where the folder takes no links."""
    root = _local_root(mirror)
    if root is None:
        return False
    (root / target).parent.mkdir(parents=True, exist_ok=True)
    try:
        (root / target).unlink(missing_ok=True)  # left by a push that stopped half-way
        os.link(root / source, root / target)
    except OSError:
        return False
    return True


def _prune_mirror(mirror: Mirror, keep: set[int | None]) -> None:
    for entry in mirror.listing("generations"):
        if entry.type == pafs.FileType.Directory and entry.base_name.isdigit() and int(entry.base_name) not in keep:
            mirror.fs.delete_dir(entry.path)


def _snapshot_name(folder_has: Any, version: int) -> str:
    """The file of delta snapshot ``version``: its manifest, or a format-1 whole table."""
    name = f"{version:010d}.json"
    return name if folder_has(name) else f"{version:010d}.arrow"


def _listed_segments(data: bytes | None) -> list[str]:
    try:
        return list(json.loads(data).get("segments", [])) if data else []
    except (ValueError, AttributeError):
        return []


def _push_delta(store: Path, mirror: Mirror, keep: int) -> tuple[int, int]:
    """The store's live delta snapshot: its new segments, its manifest, then
    ``delta/CURRENT``; the mirror then keeps the newest ``keep`` snapshots. Returns (the
    version the mirror holds, segments uploaded)."""
    folder = Path(store) / DELTA
    version = read_int(folder / "CURRENT")
    if version is None:
        return 0, 0
    snapshot = _snapshot_name(lambda n: (folder / n).is_file(), version)
    held = mirror.read_int(f"{DELTA}/CURRENT") == version
    if held and keep >= KEEP_SNAPSHOTS:
        return version, 0
    present = {e.base_name: e.size for e in mirror.listing(DELTA)}
    sent = 0
    if not held:
        data = (folder / snapshot).read_bytes()
        for name in _listed_segments(data) if snapshot.endswith(".json") else []:
            if present.get(name) != (folder / name).stat().st_size:
                mirror.upload(folder / name, f"{DELTA}/{name}")
                sent += 1
        mirror.replace(f"{DELTA}/{snapshot}", data)
        mirror.replace(f"{DELTA}/CURRENT", f"{version}\n".encode())
    _prune_mirror_delta(mirror, set(present) | {snapshot}, keep)
    return version, sent


def _prune_mirror_delta(mirror: Mirror, names: set[str], keep: int) -> None:
    """Keep the newest ``keep`` snapshots at the mirror and the segments they list;
    ``names`` are the files of its ``delta/``."""
    snapshots = sorted((n for n in names if n.split(".")[0].isdigit()), key=lambda n: int(n.split(".")[0]))
    kept = snapshots[-keep:]
    listed = {seg for n in kept if n.endswith(".json") for seg in _listed_segments(mirror.read(f"{DELTA}/{n}"))}
    for name in names:
        if (name in snapshots and name not in kept) or (name.startswith("seg-") and name not in listed):
            mirror.fs.delete_file(mirror.path(f"{DELTA}/{name}"))


def _stat_key(path: Path) -> tuple[Any, ...] | None:
    try:
        return file_identity(path)
    except FileNotFoundError:
        return None


def _push_small(store: Path, mirror: Mirror) -> list[str]:
    """Each of :data:`SMALL_FILES` that changed since this object last pushed it (one
    the store no longer has is deleted at the mirror); returns their names."""
    changed = []
    for rel in SMALL_FILES:
        key = _stat_key(Path(store) / rel)
        if rel in mirror._sent and mirror._sent[rel] == key:
            continue
        if key is None:
            if mirror.info(rel).type == pafs.FileType.File:
                mirror.fs.delete_file(mirror.path(rel))
                changed.append(rel)
        else:
            mirror.replace(rel, (Path(store) / rel).read_bytes())
            changed.append(rel)
        mirror._sent[rel] = key
    return changed


# ----------------------------------------------------------------------------- pull


@dataclass
class PullReport:
    """What one :func:`pull` did: the generation the cache now names, the files it
    downloaded and hard-linked from the cache's previous generation (0 and 0: it held
    it already), the delta snapshot it holds (0: none), and whether anything changed."""

    generation: int
    downloaded: int = 0
    linked: int = 0
    delta_version: int = 0
    changed: bool = False


def pull(mirror: Mirror, cache: Path) -> PullReport:
    """Make ``cache`` a read-only copy of the mirror's current generation, delta snapshot
    and small files (the module docstring gives the order and the checks). Keeps the
    cache's previous generation (a replica may still read it) and deletes older ones.
    Raises :class:`GenerationDamaged` when a downloaded file differs from its manifest,
    and :class:`StoreError` when the mirror holds no generation; the cache's ``CURRENT``
    then stays where it was."""
    cache = Path(cache)
    number = mirror.read_int("CURRENT")
    if number is None:
        raise StoreError(f"The mirror {mirror.uri} holds no generation yet (no CURRENT). Publish one to it "
                         "first: `helix ingest SOURCE --store DIR --mirror URI`.")
    generations_dir(cache).mkdir(parents=True, exist_ok=True)
    report = PullReport(number)
    local = current_generation_number(cache)
    if local != number:
        if not (generations_dir(cache) / f"{number:06d}" / MANIFEST).is_file():
            report.downloaded, report.linked = _pull_generation(mirror, cache, number, local)
        set_current(cache, number)
        report.changed = True
    version = _pull_delta(mirror, cache)
    report.delta_version = version or 0
    report.changed |= version is not None
    # Every pull, not only one that took something new: a pull between a forget's two
    # pushes takes the new generation or snapshot while the mirror still lists the old.
    _prune_cache(mirror, cache, number, local)
    _prune_cache_delta(cache / DELTA, {e.base_name for e in mirror.listing(DELTA)})
    report.changed |= bool(_pull_small(mirror, cache))
    return report


def _pull_generation(mirror: Mirror, cache: Path, number: int, local: int | None) -> tuple[int, int]:
    """Generation ``number`` into ``generations/<NNNNNN>.partial/``, checked, then renamed
    into place; returns (downloaded, hard-linked from generation ``local``)."""
    rel = f"generations/{number:06d}"
    raw = mirror.read(f"{rel}/{MANIFEST}")
    if raw is None:
        raise StoreError(f"The mirror {mirror.uri} names generation {number} in CURRENT, but {rel}/{MANIFEST} "
                         "is not there (a newer push pruned it, or the mirror was changed by hand). The next pull "
                         "takes the mirror's new CURRENT; push again from the store if this persists.")
    manifest = json.loads(raw)
    records: dict[str, Any] = manifest.get("files") or {
        e.path[len(mirror.path(rel)) + 1:]: None for e in mirror.listing(rel, recursive=True)
        if e.type == pafs.FileType.File and e.base_name != MANIFEST}
    before = generations_dir(cache) / f"{local:06d}" if local is not None else None
    previous = _manifest_files((before / MANIFEST).read_bytes()) if before and (before / MANIFEST).is_file() else {}
    partial = generations_dir(cache) / f"{number:06d}{_PARTIAL}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    downloaded = linked = 0
    try:
        problems = []
        for name, record in sorted(records.items()):
            target = partial / name
            if before is not None and _same(record, previous.get(name)):
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(before / name, target)
                    linked += 1
                    continue
                except OSError:  # the previous generation lost the file (pruned meanwhile): download it
                    pass
            mirror.download(f"{rel}/{name}", target)
            downloaded += 1
            problem = file_problem(target, record, checksum=True) if record else None
            if problem:
                problems.append(f"{name} {problem}")
        if problems:
            raise GenerationDamaged(
                f"Generation {number} downloaded from the mirror {mirror.uri} differs from its manifest: "
                f"{'; '.join(problems)}. The cache {cache} keeps generation {local} and the next pull downloads "
                "it again; if it persists, the mirror's copy is damaged: push the store to it again.",
                tuple(problems))
        (partial / MANIFEST).write_bytes(raw)
        check_manifest(partial, manifest)
        _rename_durably(partial, generations_dir(cache) / f"{number:06d}")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return downloaded, linked


def _prune_cache(mirror: Mirror, cache: Path, number: int, local: int | None) -> None:
    """Keep generation ``number``, the one the cache served before it (``local``: its
    replicas may still read it) and the mirror's previous one; delete the others. When
    the mirror holds ``number`` alone (its history dropped: a user was forgotten), keep
    nothing else either."""
    held = {int(e.base_name) for e in mirror.listing("generations") if e.base_name.isdigit()}
    keep: set[int | None] = {number}
    if held - {number}:
        keep |= held | {local}
    for path in generations_dir(cache).iterdir():
        if path.name.isdigit() and int(path.name) not in keep:
            shutil.rmtree(path, ignore_errors=True)


def _pull_delta(mirror: Mirror, cache: Path) -> int | None:
    """The mirror's live delta snapshot into ``cache/delta``: segments not there yet,
    the manifest, then ``delta/CURRENT`` replaced. Returns its version when it was new."""
    version = mirror.read_int(f"{DELTA}/CURRENT")
    folder = cache / DELTA
    if version is None or read_int(folder / "CURRENT") == version:
        return None
    sizes = {e.base_name: e.size for e in mirror.listing(DELTA)}
    snapshot = _snapshot_name(lambda n: n in sizes, version)
    data = mirror.read(f"{DELTA}/{snapshot}")
    if data is None:
        raise StoreError(f"Delta snapshot {version} left the mirror {mirror.uri} during the pull; "
                         "the next pull takes the newer one.")
    folder.mkdir(parents=True, exist_ok=True)
    for name in _listed_segments(data) if snapshot.endswith(".json") else []:
        if (folder / name).is_file():
            continue  # segments never change once written
        tmp = folder / f".tmp-{uuid.uuid4().hex[:12]}.arrow"
        try:
            got = mirror.download(f"{DELTA}/{name}", tmp)
            if got != sizes.get(name):
                raise StoreError(f"Delta segment {name} at the mirror {mirror.uri} read {got} bytes of "
                                 f"{sizes.get(name)}; the next pull tries again.")
            fsync_path(tmp)
            os.replace(tmp, folder / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    write_bytes_atomic(folder / snapshot, data)
    write_text_atomic(folder / "CURRENT", f"{version}\n")
    return version


def _prune_cache_delta(folder: Path, at_mirror: set[str]) -> None:
    """Keep the cache's current snapshot and, of the newest :data:`KEEP_SNAPSHOTS`, those
    the mirror still has, and the segments they list."""
    if not folder.is_dir():
        return
    version = read_int(folder / "CURRENT")
    current = _snapshot_name(lambda n: (folder / n).is_file(), version) if version is not None else None
    snapshots = sorted((p for p in folder.iterdir() if p.stem.isdigit()), key=lambda p: int(p.stem))
    kept = [p for p in snapshots[-KEEP_SNAPSHOTS:] if p.name in at_mirror or p.name == current]
    listed = {seg for p in kept if p.suffix == ".json" for seg in _listed_segments(p.read_bytes())}
    for path in folder.iterdir():
        if (path in snapshots and path not in kept) or (path.name.startswith("seg-") and path.name not in listed):
            path.unlink(missing_ok=True)


def _pull_small(mirror: Mirror, cache: Path) -> list[str]:
    """Each of :data:`SMALL_FILES` the mirror changed since this object last pulled it,
    replaced whole in ``cache`` (removed when the mirror no longer has it)."""
    changed = []
    for rel in SMALL_FILES:
        info = mirror.info(rel)
        key = (info.size, info.mtime_ns) if info.type == pafs.FileType.File else None
        if rel in mirror._sent and mirror._sent[rel] == key:
            continue
        target = cache / rel
        data = mirror.read(rel) if key is not None else None
        if data is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        mirror._sent[rel] = key
        changed.append(rel)
    return changed




# ----------------------------------------------------------------------------- a serving host's cache


def default_cache(uri: str) -> Path:
    """Where a host keeps its copy of the mirror at ``uri`` unless told: under its
    temporary folder, one folder per URI."""
    return Path(tempfile.gettempdir()) / "helix-mirror" / hashlib.sha1(uri.encode()).hexdigest()[:16]


class CacheSync:
    """Keeps a host's cache of a mirror current: one :func:`pull` when it starts (errors
    raised: a replica must not start on nothing), then one every ``interval_s`` seconds
    in a daemon thread (errors logged; the cache keeps what it has). One per (URI,
    cache) in a process, shared by every shell of a replica; the processes of one host
    that share a cache take turns by a lock file, so one downloads and the others find
    the generation there."""

    _started: dict[tuple[str, Path], CacheSync] = {}
    _guard = threading.Lock()

    def __init__(self, uri: str, cache: Path, interval_s: float):
        self.mirror = open_mirror(uri)
        self.cache = cache
        self.interval_s = interval_s
        self.last: PullReport | None = None
        self.stopped = threading.Event()
        self.sync_once()
        threading.Thread(target=self._run, name=f"helix-mirror-sync-{cache.name}", daemon=True).start()

    @classmethod
    def start(cls, uri: str, cache: str | Path | None = None, interval_s: float = 0.5) -> CacheSync:
        folder = Path(cache) if cache else default_cache(uri)
        with cls._guard:
            sync = cls._started.get((uri, folder))
            if sync is None:
                sync = cls._started[(uri, folder)] = cls(uri, folder, interval_s)
            return sync

    def sync_once(self) -> PullReport:
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.cache / ".pull.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.last = pull(self.mirror, self.cache)
        return self.last

    def stop(self) -> None:
        """No further syncs (the cache stays as it is)."""
        self.stopped.set()
        with self._guard:
            if self._started.get((self.mirror.uri, self.cache)) is self:
                self._started.pop((self.mirror.uri, self.cache))

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.sync_once()
            except Exception:  # noqa: BLE001 - the mirror away or mid-push: serve what the cache holds
                log.exception("could not sync %s from the mirror %s; still serving generation %s", self.cache,
                              self.mirror.uri, current_generation_number(self.cache))


__all__ = ["MIRRORED", "Mirror", "open_mirror", "push", "pull", "PushReport", "PullReport", "SMALL_FILES", "CacheSync",
           "default_cache"]
