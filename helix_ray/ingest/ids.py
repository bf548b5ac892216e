"""The ids ingest derives for records that bring none, and whose memories they name.

A store's ids are one space across its users and each memory is one user's, so every
id a reader derives names its user: two users who ingest the same source each get
memories of their own, and neither's ingest is refused as the other's ``id_conflict``.

- a record of JSONL, Parquet or a chat transcript without an id: the first 20 hex
  digits of :func:`helix_ray.schema.content_hash`, which hashes the user with the text;
- a Markdown section: ``md:<user>/<docs>/<path>#<slug>`` (:func:`markdown_id`), where
  ``<docs>`` names the document set, the folder ingested (:func:`default_doc_name`) or
  the name given (``--doc-name``, :func:`check_doc_name`), and ``<path>`` is the file's
  path in it: one user's two folders that each hold a ``README.md`` are two memories;
- code and commits: ``code:<user>/<repo>:<path>::<symbol>`` and
  ``git:<user>/<repo>:<sha12>`` (:mod:`helix_ray.ingest.repo_ids`);
- a LoCoMo turn: ``<sample_id>:<dia_id>``, the conversation's ``sample_id`` being its user.

An id a record gives is kept as given (a Markdown front matter's ``id`` names no
section: it is not read as one). ``<user>`` is the user as given, and ``<docs>`` the
name, with ``%``, ``/``, ``:`` and control characters written ``%XX``
(:func:`user_part`), so that ``md:<user>/<docs>/`` reads back one way only.

Stores made before Markdown ids named their document set hold
``md:<user>/<path>#<slug>``, and those made before they named their user
``md:<path>#<slug>``: reading the file again gives the same section under its id of
today, and the older one (:func:`legacy_markdown_ids`), when it is that user's and was
read from the same file, is deleted (:func:`helix_ray.ingest.run.renamed`) so that the
section is not recalled twice.
"""

from __future__ import annotations

import re
from pathlib import Path

from helix_ray.errors import InvalidArgument

__all__ = ["MARKDOWN_PREFIX", "MAX_NAME_CHARS", "SECTION_KEY", "check_doc_name", "check_name", "default_doc_name",
           "legacy_markdown_ids", "markdown_id", "user_part"]

MARKDOWN_PREFIX = "md:"
#: The raw-record key a Markdown section's ``<docs>/<path>#<slug>`` travels under from
#: the reader (:func:`helix_ray.ingest.sources.read_markdown`) to validation
#: (:func:`helix_ray.ingest.normalize.normalise_one`), which makes it the section's id
#: once the record's user is settled: the front matter's, else ``--user``.
SECTION_KEY = "_md_section"
#: The longest name a caller gives a repository or a document set (``--repo-name``, ``--doc-name``).
MAX_NAME_CHARS = 100
_NAME = re.compile(r"[\w.-]{1,%d}" % MAX_NAME_CHARS)
_ESCAPED = re.compile(r"[%/:\x00-\x1f\x7f-\x9f]")


def user_part(user: str) -> str:
    """``user`` as written in an id: ``%``, ``/``, ``:`` and control characters as ``%XX``."""
    return _ESCAPED.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8")), user)


def check_name(name: object, flag: str, *, what: str, ids: str, fix: str) -> str:
    """``name`` when a caller can give it to name ``what`` (``a repository name``) in the
    ids ``ids`` (their forms); else InvalidArgument naming ``flag``, with ``fix``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(flag, name, f"{what} is 1 to {MAX_NAME_CHARS} characters, each a letter, digit, '.', "
                              f"'_' or '-' (it is part of every id: {ids})", fix)
    return name


def check_doc_name(name: object, flag: str = "doc_name") -> str:
    """``name`` when it can name a document set in ids; else InvalidArgument naming ``flag``."""
    return check_name(name, flag, what="a document set's name", ids="md:<user>/<name>/<path>#<slug>",
                      fix="Pass a name such as handbook or api-docs; leave it out to name the documents after "
                      "their folder.")


def default_doc_name(source: Path) -> str:
    """The name the Markdown of ``source`` is read under when none is given: the folder
    ingested, or for one file the folder it is in (``root`` for the file system's top)."""
    source = source.resolve()
    return (source if source.is_dir() else source.parent).name or "root"


def markdown_id(user: str, section: str) -> str:
    """``md:<user>/<docs>/<path>#<slug>``: ``user``'s memory of the Markdown section
    ``section`` (``<docs>/<path>#<slug>``: the document set's name as
    :func:`user_part` writes it, then the file's path from the folder ingested, or its
    name when the file itself is)."""
    return f"{MARKDOWN_PREFIX}{user_part(user)}/{section}"


def legacy_markdown_ids(memory_id: str, user: str, file: str) -> tuple[str, ...]:
    """The ids that the Markdown section ``memory_id`` of ``user`` (as :func:`markdown_id`
    gives it), read from ``file`` (its path in its document set), had in stores made
    before: ``md:<user>/<path>#<slug>``, and before ids named their user
    ``md:<path>#<slug>``; none for an id that is not ``user``'s section of ``file``."""
    prefix = markdown_id(user, "")
    docs, _, rest = memory_id[len(prefix):].partition("/") if memory_id.startswith(prefix) else ("", "", "")
    if not docs or not rest.startswith(file + "#"):
        return ()
    return prefix + rest, MARKDOWN_PREFIX + rest
