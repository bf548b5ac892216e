"""One name, one folder: the names a user's ids give their document sets and repositories.

A Markdown section's id names its document set (``md:<user>/<docs>/<path>#<slug>``) and
a code or commit memory's id its repository (``code:<user>/<repo>:...``,
``git:<user>/<repo>:...``); by default the folder's name does
(:func:`helix_ray.ingest.ids.default_doc_name`,
:func:`helix_ray.ingest.repo_ids.default_repo_name`). Two folders of one name would
share ids: the second's ``README.md`` would replace the first's memories of it.

- Within one run, two folders under one name are refused (:func:`one_folder_per_name`).
- Across runs, the store remembers which folder each of a user's names was read from
  (its database's ``source_names``). A name taken by default from a folder other than
  the one it names is refused before anything is written (:func:`check_names`); a name
  the caller gave (``--doc-name``, ``--repo-name``) is taken at their word, and names
  the new folder from then on (the folder moved, or the caller means to replace it).
  What a run read is recorded with its other records (:func:`helix_ray.ingest.run._stages`).

Markdown and repositories are two kinds of names: a document set and a repository may
share a name. A repository read as code and as commits is one repository (``repo``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.repo_ids import RepoScope
from helix_ray.store.db import StoreDB

__all__ = ["SourceName", "check_names", "one_folder_per_name", "source_names"]


@dataclasses.dataclass(frozen=True)
class _Kind:
    flag: str  # the argument that names a folder of this kind
    option: str  # the same, as the CLI spells it
    what: str  # what a folder of this kind is, in messages


_KINDS = {"markdown": _Kind("doc_name", "--doc-name", "folder of documents"),
          "repo": _Kind("repo_name", "--repo-name", "repository")}


@dataclasses.dataclass(frozen=True)
class SourceName:
    """``user``'s name ``name`` for ``folder`` (absolute and resolved; a repository's top
    folder), of ``kind`` ``markdown`` (a document set) or ``repo``; ``given``: the caller
    gave the name, rather than the folder's name being taken. ``user`` is ``""`` for
    Markdown read without a user (its files' front matter names theirs)."""

    user: str
    kind: str
    name: str
    folder: str
    given: bool

    @property
    def key(self) -> tuple[str, str, str]:
        return self.user, self.kind, self.name

    @property
    def of_kind(self) -> _Kind:
        return _KINDS[self.kind]


def source_names(items: Sequence[dict[str, Any]], scopes: Sequence[RepoScope], *, user: str | None,
                 doc_name_given: bool, repo_name_given: bool) -> list[SourceName]:
    """The names one run's read tasks (``items``: :func:`helix_ray.ingest.sources.source_items`'
    tasks, Markdown's of ``user``) and repositories (``scopes``) give folders, once each."""
    found: dict[tuple[str, str, str, str], SourceName] = {}
    for item in items:
        if item["format"] == "markdown":
            path = Path(item["path"])  # resolved by source_items
            named = SourceName(user or "", "markdown", json.loads(item["options"])["name"],
                               str(path if path.is_dir() else path.parent), doc_name_given)
            found.setdefault((*named.key, named.folder), named)
    for scope in scopes:
        named = SourceName(scope.user, "repo", scope.repo, str(Path(scope.toplevel).resolve()), repo_name_given)
        found.setdefault((*named.key, named.folder), named)
    return list(found.values())


def one_folder_per_name(names: Sequence[SourceName]) -> None:
    """Two folders read in one run under one name would share ids: refused."""
    seen: dict[tuple[str, str, str], str] = {}
    for named in names:
        other = seen.setdefault(named.key, named.folder)
        if other != named.folder:
            kind = named.of_kind
            raise InvalidArgument(kind.flag, named.name, f"one name names one {kind.what}, and {other} and "
                                  f"{named.folder} are two", f"Ingest them one at a time, each with its own "
                                  f"{kind.option}.")


def check_names(db: StoreDB, names: Sequence[SourceName]) -> list[SourceName]:
    """Of ``names`` (one run's, :func:`one_folder_per_name` passed), those the store is to
    record: new, or given now to another folder than the one recorded. A name taken by
    default that the store records for another folder of the same user is refused, so
    that the memories read from that folder are not replaced by this one's."""
    recorded = db.source_folders([named.key for named in names])
    changed = []
    for named in names:
        before = recorded.get(named.key)
        if before == named.folder:
            continue
        if before is not None and not named.given:
            flag = named.of_kind.option
            whose = f"user {named.user}" if named.user else "Markdown read without --user"
            raise InvalidArgument(
                named.of_kind.flag, named.name,
                f"that name, taken by default from the folder's, already names {before} in this store for "
                f"{whose} (the name is part of its memories' ids, so {named.folder} read under it would replace "
                "them)",
                f"To keep {named.folder} apart, give it its own {flag}; if {before} moved to {named.folder}, "
                f"pass {flag} {named.name} to read it under the old name.")
        changed.append(named)
    return changed
