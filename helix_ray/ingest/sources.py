"""Stage 1: read sources into raw records.

A raw record is a plain dict as the source gave it, plus ``_source`` (path) and
``_position`` (``line 3``, ``row 3``; for Markdown the file's name and the section,
``notes/ops.md, section 'Deploy'``) so a rejected record can be traced. Nothing is
validated here: bad rows travel on to :mod:`helix_ray.ingest.normalize`, which
quarantines them with a reason. Only an unreadable *file* raises.

Formats:

- ``jsonl``: one memory object per line (fields of :data:`helix_ray.schema.MEMORY_SCHEMA`).
- ``parquet``: one memory per row, same columns.
- ``markdown``: a ``.md`` file or a folder of them; optional YAML front matter gives
  defaults (user, project, created_at, type...); each ``##`` section is one memory,
  dated by the day its heading names, else as its file (:func:`_file_time`;
  ``metadata.dated`` says which),
  ``md:<user>/<docs>/<path>#<slug>``, ``<docs>`` naming the folder read
  (:mod:`helix_ray.ingest.ids`). A folder given without ``--format`` is read whole: its
  Markdown so, and each JSONL, JSON or Parquet file in it as a source of its own, its
  format detected (:func:`folder_items`). Hidden folders and files (``.git``, ``.venv``)
  and Helix stores inside it are not read.
- ``transcript``: JSONL (or a JSON list) of chat turns ``{session_id, speaker|role,
  text, timestamp, user?, project?}``; each turn is one episodic memory.
- ``locomo``: the LoCoMo benchmark file; each conversation's ``sample_id`` is the user,
  each turn one episodic memory with id ``<sample_id>:<dia_id>``.
- ``code``: a source tree (or one file): one ``code`` memory per Python function, method
  and class, blocks of other languages (:mod:`helix_ray.ingest.code`). Read one file per
  task: :func:`source_items` lists the tree.
- ``git``: a repository's commits, one memory each (:mod:`helix_ray.ingest.git`).

``code`` and ``git`` records are one user's, named in their ids with the repository
(``code:<user>/<repo>:...``, :mod:`helix_ray.ingest.repo_ids`): they need the user
before they are read.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.chunk_parse import fenced_spans
from helix_ray.ingest.ids import SECTION_KEY, check_doc_name, default_doc_name, user_part
from helix_ray.ingest.repo_ids import RepoScope, check_repo_name, check_user, default_repo_name, legacy_code_name
from helix_ray.schema import DATED, FILE_SAVED
from helix_ray.when import stated_day

FORMATS = ("auto", "jsonl", "parquet", "markdown", "transcript", "locomo", "code", "git")
#: Options of the formats that take some (``helix ingest --since/--max``).
GIT_OPTIONS = ("since", "max_commits", "user", "name")
#: The formats whose records are one user's memories of one repository.
REPO_FORMATS = ("code", "git")
#: Files of JSON records (memories, chat turns, LoCoMo), told apart by their first record.
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
#: Files that hold memories in a format other than Markdown.
DATA_SUFFIXES = (*JSON_SUFFIXES, ".parquet")
MARKDOWN_SUFFIXES = (".md", ".markdown")
RawRecord = dict[str, Any]


def detect_format(path: Path) -> str:
    """Guess a source's format from its name and, for JSON, its first record; a folder
    of memories (Markdown, JSONL, JSON or Parquet files) is ``markdown``, which
    :func:`source_items` reads whole."""
    if path.is_dir():
        if any(_files(path, MARKDOWN_SUFFIXES + DATA_SUFFIXES)):
            return "markdown"
        raise InvalidArgument(
            "source", str(path), "a folder source must hold Markdown (.md, .markdown), JSONL, JSON or Parquet "
            "files outside hidden folders; it holds none",
            "For a source tree pass --format code, for its commits --format git.",
        )
    suffix = path.suffix.lower()
    if suffix in MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix == ".parquet":
        return "parquet"
    if suffix in JSON_SUFFIXES:
        return _json_format(_first_json_value(path))
    raise InvalidArgument(
        "source", str(path),
        "allowed formats are .jsonl/.json (memories or transcript turns), .parquet, .md "
        "or a folder of .md files, and the LoCoMo JSON",
        "Pass --format to say which.",
    )


def _json_format(first: Any) -> str:
    """The format of a JSON source whose first record is ``first``."""
    if isinstance(first, dict) and "conversation" in first and "sample_id" in first:
        return "locomo"
    if isinstance(first, dict) and ("speaker" in first or "role" in first) and "type" not in first:
        return "transcript"
    return "jsonl"


def _first_json_value(path: Path) -> Any:
    with path.open("rb") as fh:
        head = fh.read(1 << 20).decode("utf-8", errors="replace").lstrip()
    if head.startswith("["):
        # A JSON array: decode just its first element.
        try:
            value, _ = json.JSONDecoder().raw_decode(head[1:].lstrip())
            return value
        except json.JSONDecodeError:
            return None
    line = head.split("\n", 1)[0]
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        pass
    try:  # one object over several lines (a pretty-printed .json)
        value, _ = json.JSONDecoder().raw_decode(head)
        return value
    except json.JSONDecodeError:
        return None


def _checked(path: str | Path, fmt: str) -> tuple[Path, str]:
    """``path`` as a Path that exists, and ``fmt`` a format, detected if ``auto``."""
    path = Path(path)
    if not path.exists():
        raise InvalidArgument("source", str(path), "it must be an existing file or folder")
    if fmt not in FORMATS:
        raise InvalidArgument("format", fmt, f"allowed formats are {', '.join(FORMATS)}")
    return path, detect_format(path) if fmt == "auto" else fmt


def source_items(path: str | Path, fmt: str, *, user: str | None = None, repo_name: str | None = None,
                 since: str | None = None, max_commits: int | None = None, doc_name: str | None = None,
                 ) -> tuple[list[dict[str, Any]], RepoScope | None]:
    """The read tasks of one source, ``{"path", "format", "options"}`` each: one per file
    of a source tree (so Ray Data reads a tree's files in parallel, not the driver in a
    loop), one for any other source; and for a tree or a history, what the read gives
    (:class:`~helix_ray.ingest.repo_ids.RepoScope`).

    ``user`` (required for ``code`` and ``git``: their ids name it) owns the memories of a
    tree or a history, which ``repo_name`` names in their ids (default: the repository's
    folder); ``since`` and ``max_commits`` pick commits. ``doc_name`` names a Markdown
    source's document set in its ids (default: its folder's name). A task's options travel as JSON
    text (Ray Data would merge the tasks' dicts into one Arrow struct, filling absent keys
    with nulls): :func:`read_source` takes them decoded."""
    whole_folder = fmt == "auto"
    path, fmt = _checked(path, fmt)
    commits_only = [flag for flag, value in (("--since", since), ("--max", max_commits)) if value is not None]
    if commits_only and fmt != "git":
        raise InvalidArgument("format", fmt, f"{', '.join(commits_only)} apply to --format git only",
                              "Drop them, or pass --format git.")
    if repo_name is not None and fmt not in REPO_FORMATS:
        raise InvalidArgument("format", fmt, "--repo-name applies to --format code and --format git only",
                              "Drop it, or pass --format code or git.")
    if doc_name is not None and fmt != "markdown":
        raise InvalidArgument("format", fmt, "--doc-name applies to --format markdown only",
                              "Drop it, or pass --format markdown.")
    if fmt == "markdown":
        name = default_doc_name(path) if doc_name is None else check_doc_name(doc_name)
        if path.is_dir() and whole_folder:
            return folder_items(path, name), None
        return [{"path": str(path.resolve()), "format": fmt, "options": json.dumps({"name": name})}], None
    if fmt not in REPO_FORMATS:
        return [{"path": str(path.resolve()), "format": fmt, "options": "{}"}], None
    if repo_name is not None:
        check_repo_name(repo_name)
    user = check_user(user)  # their ids name the user: none is an error here, before anything is read
    if fmt == "git":
        from helix_ray.ingest import git

        toplevel, folder = git.locate(path)
        given = {k: v for k, v in (("since", since), ("max_commits", max_commits), ("name", repo_name))
                 if v is not None}
        scope = RepoScope("git", user, repo_name or default_repo_name(folder), f"git:{folder}:", str(toplevel))
        return [{"path": str(path.resolve()), "format": fmt, "options": json.dumps({**given, "user": user})}], scope
    from helix_ray.ingest import code

    info = code.repo_identity(path, repo_name)
    files, skipped = code.tree_files(path, info)
    if not files:
        reasons = sorted({reason for _, reason in skipped})
        raise InvalidArgument("source", str(path), "a --format code source must hold source files Helix reads "
                              f"(Python, JavaScript, Go, Rust...); it holds none"
                              + (f": {len(skipped)} files skipped ({'; '.join(reasons[:5])})" if skipped else ""),
                              "Pass the folder of the code, or --format markdown for documents.")
    scope = RepoScope("code", user, info.name, f"code:{legacy_code_name(info.toplevel)}:", str(info.toplevel),
                      _tree_part(path, info), tuple(rel for rel, _ in skipped))
    return [{"path": str(info.toplevel / rel), "format": "code",
             "options": json.dumps({"rel": rel, "info": _plain(info), "user": user})} for rel in files], scope


def folder_items(folder: Path, name: str) -> list[dict[str, Any]]:
    """The read tasks of a folder read whole: one for its Markdown (documents ``name``),
    when it holds some, and one for each data file, in the format it is detected as. A
    ``.json`` file whose first value is no memory, chat turn or LoCoMo conversation (a
    ``package.json``) is not read: its task quarantines it whole, saying so."""
    items = []
    if any(_files(folder, MARKDOWN_SUFFIXES)):
        items.append({"path": str(folder.resolve()), "format": "markdown",
                      "options": json.dumps({"name": name, "data_files": "read"})})
    for file in sorted(_files(folder, DATA_SUFFIXES)):
        first = _first_json_value(file) if file.suffix.lower() in JSON_SUFFIXES else None
        fmt = "parquet" if file.suffix.lower() == ".parquet" else _json_format(first)
        options = {}
        # a .json whose first value has no text: a configuration file, not memories
        if fmt == "jsonl" and file.suffix.lower() == ".json" and not (isinstance(first, dict) and "text" in first):
            options["unread"] = (f"a folder source reads a .json file whose first value is a memory (with \"text\"), "
                                 f"a chat turn or a LoCoMo conversation; this one's is not (a configuration file?): "
                                 f"pass it as a source of its own (helix ingest {file} ...) if it holds memories")
        items.append({"path": str(file.resolve()), "format": fmt, "options": json.dumps(options)})
    return items


def _plain(info: Any) -> dict[str, Any]:
    """A :class:`~helix_ray.ingest.code.RepoInfo` as JSON-able values, to travel in a task."""
    return {**dataclasses.asdict(info), "toplevel": str(info.toplevel)}


def _tree_part(path: Path, info: Any) -> str:
    """The part of the tree a read of ``path`` covers whole, as the ids under it go on
    after ``code:<user>/<repo>:``: ``<folder>/``, ``""`` for the top, or the one file's
    ``<file>::``."""
    rel = path.resolve().relative_to(info.toplevel).as_posix()
    if path.is_file():
        return f"{rel}::"
    return "" if rel == "." else rel + "/"


def read_source(path: str | Path, fmt: str = "auto", **options: Any) -> Iterator[RawRecord]:
    """Yield the raw records of one source (``options``: one of :func:`source_items`' tasks;
    ``unread``: why a folder's file is not read, quarantined whole)."""
    path, fmt = _checked(path, fmt)
    unread = options.pop("unread", None)
    if unread is not None:
        yield _bad(path, f"{path.name}, whole file", "not_read", unread, "")
        return
    if fmt == "code":
        yield from read_code(path, **options)
        return
    if fmt == "git":
        from helix_ray.ingest import git

        yield from git.read_git(path, **{k: v for k, v in options.items() if k in GIT_OPTIONS})
        return
    if fmt == "markdown":
        yield from read_markdown(path, **options)
        return
    reader = {
        "jsonl": read_jsonl,
        "parquet": read_parquet,
        "transcript": read_transcript,
        "locomo": read_locomo,
    }[fmt]
    yield from reader(path)


def read_code(path: Path, *, user: str, rel: str | None = None, info: dict[str, Any] | None = None,
              name: str | None = None) -> Iterator[RawRecord]:
    """``user``'s memories of one file of a tree (``rel`` and ``info`` given: a task of
    :func:`source_items`), or of every file of the tree at ``path`` (``name``: the
    repository's name in ids, by default its folder's)."""
    from helix_ray.ingest import code

    if rel is not None and info is not None:
        info_read = code.RepoInfo(**{**info, "toplevel": Path(info["toplevel"])})
        yield from code.read_code_file(path, rel=rel, info=info_read, user=user)
        return
    found = code.repo_identity(path, name)
    files, _skipped = code.tree_files(path, found)
    for file in files:
        yield from code.read_code_file(found.toplevel / file, rel=file, info=found, user=user)


def read_jsonl(path: Path) -> Iterator[RawRecord]:
    """One JSON object per line; a ``.json`` file holding one JSON array, or one object
    over several lines (one record), is accepted too."""
    with path.open("rb") as fh:
        text_head = fh.read(64).lstrip()
    if text_head.startswith(b"{") and path.suffix.lower() == ".json" and not _first_line_parses(path):
        try:  # one pretty-printed object is one record, not a bad_json per line
            whole = json.loads(path.read_bytes().decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError:
            whole = None  # not one object either: read as lines, each bad line quarantined
        if isinstance(whole, dict):
            yield _tag(whole, path, "the whole file")
            return
    if text_head.startswith(b"[") and path.suffix.lower() == ".json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError as exc:
            raise InvalidArgument("source", str(path), f"a .json source must hold one JSON array of records; it does "
                                  f"not parse ({_json_error(exc)} at line {exc.lineno}, column {exc.colno})",
                                  "Fix the file, or write one record per line as .jsonl.") from None
        if not isinstance(rows, list):
            rows = [rows]
        for i, row in enumerate(rows):
            yield _tag(row, path, f"item {i}")
        return
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _bad(path, f"line {lineno}", "invalid_utf8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})", raw)
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield _bad(path, f"line {lineno}", "bad_json",
                           f"not valid JSON ({_json_error(exc)} at column {exc.colno})", line)
                continue
            yield _tag(row, path, f"line {lineno}")


def _first_line_parses(path: Path) -> bool:
    """Whether the first non-blank line of ``path`` is JSON on its own: lines of records,
    not one object over several lines."""
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    json.loads(raw)
                    return True
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return False
    return False


def _json_error(exc: json.JSONDecodeError) -> str:
    """What the JSON parser says is wrong, without its dangling "at" ("Invalid control
    character at"): the caller says where."""
    return exc.msg.removesuffix(" at")


def read_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist()):
        yield _tag(row, path, f"row {i}")


_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*\n", re.S)
_SECTION = re.compile(r"^##\s+(.+?)\s*$", re.M)
_TITLE = re.compile(r"^#\s+(.+?)\s*$", re.M)


def _files(folder: Path, suffixes: Sequence[str]) -> Iterator[Path]:
    """A folder's files with one of ``suffixes``, whatever their case (``README.MD``,
    ``notes.markdown``), outside hidden folders (``.git``, ``.venv``, ``.helix``) and
    Helix stores, whose files are no one's notes (a store's inbox holds JSONL)."""
    from helix_ray.store.db import DB_FILE

    for top, folders, files in os.walk(folder):
        if top != str(folder) and DB_FILE in files:
            folders.clear()
            continue
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        for file in sorted(files):
            path = Path(top, file)
            if not file.startswith(".") and path.suffix.lower() in suffixes and path.is_file():  # not a broken link
                yield path


def read_markdown(path: Path, *, name: str | None = None, data_files: str = "quarantine") -> Iterator[RawRecord]:
    """Each ``##`` section of each file is one memory; text before the first ``##``
    (below a ``#`` title) is one memory too when it has content. A section brings no id
    but its ``<docs>/<path>#<slug>`` (:data:`~helix_ray.ingest.ids.SECTION_KEY`;
    ``<docs>``: ``name``, by default the folder's, escaped as in ids): its id,
    ``md:<user>/<docs>/<path>#<slug>``, names its user, which validation settles.
    ``data_files``: ``read`` when tasks of their own read a folder's data files
    (:func:`folder_items`), else each is quarantined whole, saying how to read it."""
    docs = user_part(default_doc_name(path) if name is None else name)
    files = sorted(_files(path, MARKDOWN_SUFFIXES)) if path.is_dir() else [path]
    if path.is_dir() and data_files != "read":  # memories the folder holds that --format markdown does not read
        for other in sorted(_files(path, DATA_SUFFIXES)):
            yield _bad(other, f"{other.relative_to(path)}, whole file", "not_read", "--format markdown reads only a "
                       f"folder's Markdown (.md, .markdown) files, not this {other.suffix} file: leave --format out "
                       f"to read the whole folder, or pass it as a source of its own (helix ingest {other} ...)", "")
    for file in files:
        # Positions name the file too: a folder source's sections would read alike otherwise.
        rel = file.name if not path.is_dir() else str(file.relative_to(path))
        raw = file.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield _bad(file, f"{rel}, whole file", "invalid_utf8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})",
                       raw)
            continue
        defaults: dict[str, Any] = {}
        match = _FRONT_MATTER.match(text)
        if match:
            import yaml

            try:
                loaded = yaml.safe_load(match.group(1)) or {}
            except yaml.YAMLError as exc:
                yield _bad(file, f"{rel}, front matter", "bad_json", f"front matter is not valid YAML ({exc})",
                           match.group(1))
                continue
            if not isinstance(loaded, dict) or not isinstance(loaded.get("metadata", {}), dict):
                yield _bad(file, f"{rel}, front matter", "wrong_type", "front matter must be a YAML mapping "
                           "(key: value), and its metadata, if any, a mapping too", text)
                continue
            # An id names one memory: it cannot be every section's default.
            defaults = {k: (v.isoformat() if isinstance(v, (dt.date, dt.datetime)) else v) for k, v in loaded.items()
                        if k != "id"}
            # created_at, or a blog's or a notes app's `date:` (which stays in metadata too)
            when_written = _front_matter_time(loaded.get("created_at"))
            if when_written is None and loaded.get("created_at") is None:
                when_written = _front_matter_time(loaded.get("date"))
            if when_written is not None:
                defaults["created_at"] = when_written
            text = text[match.end():]
        fences = fenced_spans(text)

        def outside(match: re.Match[str]) -> bool:  # a "## build" line in a shell block is no heading
            return not any(a <= match.start() < b for a, b in fences)

        title_match = next(filter(outside, _TITLE.finditer(text)), None)
        title = title_match.group(1) if title_match else file.stem
        saved = dt.datetime.fromtimestamp(file.stat().st_mtime, tz=dt.timezone.utc)
        dated, how = _file_time(file, saved, defaults.get("created_at"), title_match.group(1) if title_match else None)
        heads = list(filter(outside, _SECTION.finditer(text)))
        pieces: list[tuple[str, str]] = []
        preamble = text[: heads[0].start()] if heads else text
        if title_match is not None and title_match.start() < len(preamble):
            preamble = preamble[:title_match.start()] + preamble[title_match.end():]
        preamble = preamble.strip()
        if preamble:
            pieces.append((title, preamble))
        for i, head in enumerate(heads):
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            pieces.append((head.group(1), text[head.end():end].strip()))
        if not pieces:
            yield _bad(file, f"{rel}, whole file", "empty_text", "the file has no text outside its title: nothing to "
                       "remember (write the memory under the title or under ## headings)", text[:200])
        taken: set[str] = set()
        for heading, body in pieces:
            slug = _slug(heading, taken)
            taken.add(slug)
            record = dict(defaults)
            day = _written_on(stated_day(heading), saved) if heading != title else None
            record["created_at"] = _noon(day) if day is not None else dated
            record.setdefault("source", f"markdown:{rel}")
            record["text"] = f"{title} — {heading}\n{body}" if heading != title else body
            if not body:
                record["text"] = ""
            record["metadata"] = {**(record.get("metadata") or {}), "file": rel, "section": heading,
                                  DATED: "heading" if day is not None else how}
            record[SECTION_KEY] = f"{docs}/{rel}#{slug}"
            yield _tag(record, file, f"{rel}, section '{heading}'")


def _front_matter_time(value: Any) -> str | None:
    """A front matter time as ISO 8601: a YAML timestamp as it is, a day (YAML's, or a
    string naming one) at its noon UTC (:func:`_noon`), a string Python reads as a
    time ("2024-05-03 10:00") as that time; None for anything else, which validation
    then judges as given."""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.date):
        return _noon(value)
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.strip()).isoformat() if ":" in value else _noon(
            dt.date.fromisoformat(value.strip()))
    except ValueError:
        day = stated_day(value)
        return _noon(day) if day is not None else None


#: A name's word joined to the date after it (``notes-2024-05-03``, ``journal.2024-05-03``).
_JOINED_DATE = re.compile(r"(?<=[A-Za-z])[-_.](?=\d{4}-\d)")


def _file_time(file: Path, saved: dt.datetime, given: Any, title: str | None) -> tuple[Any, str]:
    """When a Markdown file's sections were written, unless a section's heading names its
    own day, and where that was read (``metadata.dated``): the front matter's
    ``created_at`` (or ``date``), else the day its ``#`` title or its name states
    (``# Standup 3 May 2024``, ``2024-05-03.md``), else ``saved``, the file's
    modification time."""
    if given is not None:
        return given, "front matter"
    day = _written_on(stated_day(title), saved) if title is not None else None
    if day is not None:
        return _noon(day), "title"
    day = _written_on(stated_day(_JOINED_DATE.sub(" ", file.stem)), saved)
    if day is not None:
        return _noon(day), "file name"
    return saved.isoformat(), FILE_SAVED


def _written_on(day: dt.date | None, saved: dt.datetime) -> dt.date | None:
    """``day``, when it can be the day a text was written: not after the day its file was
    last saved (a day around the world's zones allowed). A later day is a plan or a
    deadline ("## Due 2024-06-01"), not when the section was written."""
    return day if day is not None and day <= saved.date() + dt.timedelta(days=1) else None


def _noon(day: dt.date) -> str:
    """A day named without a time of day, as a moment: its noon UTC, which falls on that
    calendar day in every zone from UTC−11 to UTC+11 (a question's window is read in the
    asker's zone)."""
    return dt.datetime.combine(day, dt.time(12), tzinfo=dt.timezone.utc).isoformat()


def _slug(heading: str, taken: set[str]) -> str:
    """A section's id part, unique among ``taken`` (the file's earlier sections):
    lower-case ASCII words joined by '-' (``rollback-prod``); when that is empty (a
    heading in Japanese) or already taken (a repeated heading, or C++ after C), a short
    hash of the heading is added, so the id does not depend on the sections before it;
    a heading repeated word for word gets -2, -3… on top."""
    base = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")[:60]
    if base and base not in taken:
        return base
    hashed = "-".join(p for p in (base, hashlib.sha1(heading.encode("utf-8")).hexdigest()[:8]) if p)
    slug, n = hashed, 1
    while slug in taken:
        n += 1
        slug = f"{hashed}-{n}"
    return slug


def read_transcript(path: Path) -> Iterator[RawRecord]:
    """Chat turns → episodic memories, ``"<speaker>: <text>"``."""
    for row in read_jsonl(path):
        if "_reject" in row or not isinstance(row, dict):
            yield row
            continue
        speaker = row.pop("speaker", None) or row.get("role")
        role = row.pop("role", None)
        text = row.get("text")
        if isinstance(text, str) and speaker and text.strip():
            row["text"] = f"{speaker}: {text}"
        if "timestamp" in row and "created_at" not in row:
            row["created_at"] = row.pop("timestamp")
        row.setdefault("type", "episodic")
        row.setdefault("source", "transcript")
        meta = row.get("metadata") or {}
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                pass
        if not isinstance(meta, dict):  # normalise quarantines it, saying why
            yield row
            continue
        row["metadata"] = {**meta, **{k: v for k, v in (("speaker", speaker), ("role", role)) if v}}
        yield row


_LOCOMO_DATE = "%I:%M %p on %d %B, %Y"


def parse_locomo_date(value: str) -> str:
    """``"1:56 pm on 8 May, 2023"`` → ``"2023-05-08T13:56:00+00:00"``."""
    parsed = dt.datetime.strptime(value.strip().replace("am", "AM").replace("pm", "PM"), _LOCOMO_DATE)
    return parsed.replace(tzinfo=dt.timezone.utc).isoformat()


def read_locomo(path: Path) -> Iterator[RawRecord]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise InvalidArgument("source", str(path), "a LoCoMo file is a JSON list of conversations")
    # A malformed conversation, session or turn is quarantined as one record with what it
    # lacks, and the rest of the file is read: one bad key must not abort the whole ingest.
    for i, sample in enumerate(data):
        conv = sample.get("conversation") if isinstance(sample, dict) else None
        user = sample.get("sample_id") if isinstance(sample, dict) else None
        if not isinstance(user, str) or not user or not isinstance(conv, dict):
            yield _bad(path, f"conversation {i}", "wrong_type", "a LoCoMo conversation is an object with a "
                       "'sample_id' (text) and a 'conversation' object (session_1, session_1_date_time, ...)",
                       sample)
            continue
        n = 1
        while f"session_{n}" in conv:
            session, when = conv[f"session_{n}"], conv.get(f"session_{n}_date_time")
            try:
                date = parse_locomo_date(str(when))
            except ValueError:
                yield _bad(path, f"{user} session_{n}", "bad_time", f"session_{n}_date_time={when!r} is not a "
                           "LoCoMo date like '1:56 pm on 8 May, 2023'", session)
                n += 1
                continue
            session_id = f"{user}:session_{n}"
            for turn_no, turn in enumerate(session if isinstance(session, list) else [session]):
                if not isinstance(turn, dict) or not turn.get("dia_id") or not turn.get("speaker"):
                    yield _bad(path, f"{user} session_{n} turn {turn_no}", "wrong_type", "a LoCoMo turn is an "
                               "object with 'dia_id', 'speaker' and 'text'", turn)
                    continue
                text = f"{turn['speaker']}: {turn.get('text', '')}"
                if turn.get("blip_caption"):
                    text += f" [image: {turn['blip_caption']}]"
                yield _tag(
                    {
                        "id": f"{user}:{turn['dia_id']}",
                        "text": text,
                        "type": "episodic",
                        "user": user,
                        "session_id": session_id,
                        "created_at": date,
                        "source": "locomo",
                        "metadata": {"dia_id": turn["dia_id"], "speaker": turn["speaker"], "turn": turn_no},
                    },
                    path,
                    f"{user} {turn['dia_id']}",
                )
            n += 1


def _tag(row: Any, path: Path, position: str) -> RawRecord:
    if not isinstance(row, dict):
        return _bad(path, position, "wrong_type", f"expected a JSON object, got {type(row).__name__}", row)
    row = dict(row)
    row["_source"] = str(path)
    row["_position"] = position
    return row


def _bad(path: Path, position: str, code: str, reason: str, raw: Any) -> RawRecord:
    """A record the reader itself could not parse: normalise quarantines it as is."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="backslashreplace")
    return {"_source": str(path), "_position": position, "_code": code, "_reject": reason, "_raw": str(raw)}
