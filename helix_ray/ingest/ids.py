"""The ids ingest derives for records that bring none, and whose memories they name.

A store's ids are one space across its users and each memory is one user's, so every
id a reader derives names its user: two users who ingest the same source each get
memories of their own, and neither's ingest is refused as the other's ``id_conflict``.

- a record of JSONL, Parquet or a chat transcript without an id: the first 20 hex
  digits of :func:`helix_ray.schema.content_hash`, which hashes the user with the text;
- a Markdown section: ``md:<user>/<path>#<slug>`` (:func:`markdown_id`);
- code and commits: ``code:<user>/<repo>:<path>::<symbol>`` and
  ``git:<user>/<repo>:<sha12>`` (:mod:`helix_ray.ingest.repo_ids`);
- a LoCoMo turn: ``<sample_id>:<dia_id>``, the conversation's ``sample_id`` being its user.

An id a record gives is kept as given. ``<user>`` is the user as given, with ``%``,
``/``, ``:`` and control characters written ``%XX`` (:func:`user_part`), so that
``md:<user>/`` reads back one way only.

Stores made before Markdown ids named their user hold ``md:<path>#<slug>``: reading
the file again gives the same section as ``md:<user>/<path>#<slug>``, and the older
one (:func:`legacy_markdown_id`), when it is that user's, is deleted
(:func:`helix_ray.ingest.run.renamed`) so that the section is not recalled twice.
"""

from __future__ import annotations

import re

__all__ = ["MARKDOWN_PREFIX", "SECTION_KEY", "legacy_markdown_id", "markdown_id", "user_part"]

MARKDOWN_PREFIX = "md:"
#: The raw-record key a Markdown section's ``<path>#<slug>`` travels under from the
#: reader (:func:`helix_ray.ingest.sources.read_markdown`) to validation
#: (:func:`helix_ray.ingest.normalize.normalise_one`), which makes it the section's id
#: once the record's user is settled: the front matter's, else ``--user``.
SECTION_KEY = "_md_section"
_ESCAPED = re.compile(r"[%/:\x00-\x1f\x7f-\x9f]")


def user_part(user: str) -> str:
    """``user`` as written in an id: ``%``, ``/``, ``:`` and control characters as ``%XX``."""
    return _ESCAPED.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8")), user)


def markdown_id(user: str, section: str) -> str:
    """``md:<user>/<path>#<slug>``: ``user``'s memory of the Markdown section
    ``section`` (``<path>#<slug>``, the file's path from the folder ingested, or its
    name when the file itself is)."""
    return f"{MARKDOWN_PREFIX}{user_part(user)}/{section}"


def legacy_markdown_id(memory_id: str, user: str) -> str | None:
    """The id that the Markdown section ``memory_id`` (of ``user``, as :func:`markdown_id`
    gives it) had in a store made before those ids named their user, ``md:<path>#<slug>``;
    None for an id that is not ``user``'s Markdown id."""
    prefix = markdown_id(user, "")
    return MARKDOWN_PREFIX + memory_id[len(prefix):] if memory_id.startswith(prefix) else None
