"""The ids of code and commit memories: whose they are and which repository they are of.

A code memory is ``code:<user>/<repo>:<path>::<symbol>``, a commit
``git:<user>/<repo>:<sha12>``. A store's ids are one space across its users and each
memory is one user's, so an id a reader derives names its user, as the derived ids of
other memories do (:mod:`helix_ray.ingest.ids`): two users who ingest the same
repository each get memories of their own, and one user's two repositories whose
folders share a name are kept apart by giving them two names (``--repo-name``).

``<repo>`` is the name given, or by default the top folder's (:func:`default_repo_name`);
:func:`check_repo_name` says what a name may hold. ``<user>`` is the user as given, with
``%``, ``/``, ``:`` and control characters written ``%XX``
(:func:`helix_ray.ingest.ids.user_part`, as in every id that names its user), so that
``<user>/<repo>:`` reads back one way only.

Stores made before ids named their user hold ``code:<folder>:<path>::<symbol>`` and
``git:<folder>:<sha12>``. A :class:`RepoScope` names both forms, so that reading a
repository again replaces its user's memories of the older form with the same memories
under their ids of today (:func:`helix_ray.ingest.run.renamed`) instead of keeping both.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.ids import MAX_NAME_CHARS, check_name, user_part

__all__ = ["MAX_REPO_NAME_CHARS", "RepoScope", "check_repo_name", "check_user", "code_id", "commit_id",
           "default_repo_name", "legacy_code_name", "repo_prefix"]

MAX_REPO_NAME_CHARS = MAX_NAME_CHARS
_NOT_IN_NAME = re.compile(r"[^\w.-]+")
#: A commit is named by the first 12 hex digits of its sha.
SHA_DIGITS = 12


def check_repo_name(name: object, flag: str = "repo_name") -> str:
    """``name`` when it can name a repository in ids; else InvalidArgument naming ``flag``."""
    return check_name(name, flag, what="a repository name",
                      ids="code:<user>/<name>:<path>::<symbol>, git:<user>/<name>:<sha>",
                      fix="Pass a name such as shop or billing-api; leave it out to name the repository after its "
                      "folder.")


def default_repo_name(folder_name: str) -> str:
    """The name a repository gets from its top folder's name: the folder's name, with
    each run of characters :func:`check_repo_name` does not allow written ``_``."""
    name = _NOT_IN_NAME.sub("_", folder_name).strip("_")[:MAX_REPO_NAME_CHARS]
    return name or "root"


def check_user(user: str | None) -> str:
    """``user`` when there is one; code and commits are one user's memories, and their
    ids name that user."""
    if not isinstance(user, str) or not user:
        raise InvalidArgument("user", user, "code and commit memories are one user's, whom their ids name "
                              "(code:<user>/<repo>:...)", "Pass --user NAME (in Python: "
                              "IngestConfig.validation.default_user).")
    return user


def repo_prefix(kind: str, user: str, repo: str) -> str:
    """``<kind>:<user>/<repo>:``, the start of every id of ``user``'s memories of ``repo``
    (``kind``: ``code`` or ``git``)."""
    return f"{kind}:{user_part(check_user(user))}/{check_repo_name(repo, 'name')}:"


def code_id(user: str, repo: str, rel: str, symbol: str) -> str:
    """``code:<user>/<repo>:<path>::<symbol>``."""
    return f"{repo_prefix('code', user, repo)}{rel}::{symbol}"


def commit_id(user: str, repo: str, sha: str) -> str:
    """``git:<user>/<repo>:<sha12>``."""
    return f"{repo_prefix('git', user, repo)}{sha[:SHA_DIGITS]}"


def legacy_code_name(toplevel: Path) -> str:
    """The name code ids had for the tree at ``toplevel`` before they named their user
    (commit ids had the folder's name as it is: :func:`helix_ray.ingest.git.locate`)."""
    return toplevel.name.replace(":", "_") or "root"


@dataclasses.dataclass(frozen=True)
class RepoScope:
    """What one read of a repository (its tree, or its commits) gives: the stored
    memories it replaces are found from it.

    ``user``'s memories of the repository named ``repo`` (read from its top folder
    ``toplevel``), of ``kind`` ``code`` or ``git``: every id the read gives starts with
    :attr:`prefix` (``code:<user>/<repo>:``), and the same memories had ids starting with
    ``legacy`` (``code:<folder>:``) in a store made before ids named their user.
    ``whole``, for a tree: the part the read covers whole (``""`` all of it, ``"lib/"`` a
    folder, ``"lib/x.py::"`` one file), whose stored memories the read no longer finds
    were removed from it, except those of the ``unread`` files (paths from the top:
    present, but skipped this time); None for commits: a read of some commits says
    nothing of the others."""

    kind: str
    user: str
    repo: str
    legacy: str
    toplevel: str
    whole: str | None = None
    unread: tuple[str, ...] = ()

    @functools.cached_property
    def prefix(self) -> str:
        return repo_prefix(self.kind, self.user, self.repo)

    def covered(self) -> tuple[str, ...]:
        """The id prefixes of what the read covers whole, in both forms (none for commits)."""
        return () if self.whole is None else (self.prefix + self.whole, self.legacy + self.whole)

    def kept(self, files: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The id prefixes, in both forms, of the unread files and of ``files`` (paths
        from the top): their stored memories stay."""
        return tuple(p + rel + "::" for rel in (*self.unread, *files) for p in (self.prefix, self.legacy))

    def current(self, legacy_id: str) -> str:
        """The id of today of the memory stored as ``legacy_id`` (which starts with ``legacy``)."""
        return self.prefix + legacy_id[len(self.legacy):]
