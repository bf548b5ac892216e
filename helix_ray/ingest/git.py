"""Read a repository's commit history into raw memory records, one per commit.

``read_git(repo)`` reads the history with one ``git log`` (``subprocess``, no shell,
standard library only) and streams its output: a commit is parsed and yielded as soon
as its bytes have arrived, so a long history is never held in memory as a whole. Each
commit becomes::

    {"id": "git:<user>/<name>:<sha[:12]>", "type": "decision" | "episodic",
     "text": "<subject>\\n\\n<body>\\n\\nFiles: a.py (+3 -1), logo.png (binary), ...",
     "user": "<user>", "source": "git:<name>",
     "created_at": "<author date, ISO 8601 with its offset>", "session_id": None,
     "metadata": {"git": {"repo", "commit", "author", "files", "insertions", "deletions"}},
     "_source": "<toplevel folder>", "_position": "commit <sha[:12]>"}

``<user>`` is whose memories they are (the id names them: :mod:`helix_ray.ingest.repo_ids`),
``<name>`` the name asked for, by default that of the work tree's top folder (of a bare
repository, its folder name without ``.git``). The Files line names at most
:data:`MAX_FILES_NAMED` paths, then says how many more; ``metadata.git.files`` lists all
of them, POSIX paths relative to the top. A rename counts under its new path; a binary
file counts 0 lines. No e-mail address anywhere: the author is a name (after
``.mailmap``), ``<ann@x.org>`` in the message (``Signed-off-by: Ann <ann@x.org>``) is
removed, and any other address, in the message or as an author name, becomes
``[email]``. Bodies are kept whole; the ingest chunks long memories itself.

Merges are kept, with their subject and body and no files (``git log`` shows no diff
for a merge): a merge's message often says what a branch was for, and its changes
are already counted in the commits it merges.

``since`` is an ISO date or datetime (a time without an offset is UTC, a bare date its
midnight); as with ``git log --since``, it is compared with the *committer* date, which
a rebase or cherry-pick makes later than the author date a record carries.

Decisions
---------
:func:`is_decision` marks a commit ``decision`` when its message explains a choice, by
one deterministic rule (no model), on the subject and body together (trailer lines such
as ``Signed-off-by:`` left out), matching whole words, case-insensitively:

1. a *reason cue* makes it a decision:

   - a reason connective: *because*, *so that*, *in order to*, *that is / this is /
     which is / that's why*, *why* opening an explanation (``Why: ...``, ``why (...)``,
     a sentence starting with *Why*), *the reason is*, *for this reason*, *reason(s):*;
   - a choice word: *prefer(s/red)*, *in favour/favor of*, *chose/choose/chosen*,
     *decide(d)*, *decision*, *trade-off*/*tradeoff*, *avoid(s/ed)*;
   - a version pin: *pin(s/ned)* followed within three words by a version
     (``pin numpy to 1.26``, ``pinned ray==2.9``);

2. else a *choice cue* (*instead of*, *rather than*, *opt in/out*, *opt-in/out*) makes it
   a decision unless the message calls itself a refactor (*refactor...*, *no behaviour /
   behavior / functional change*): a refactor's "X instead of Y" names a new shape of the
   code, not a choice a reader needs the reason for;

3. anything else is ``episodic``.

Plain *why* and *reason* count only as openers because a message that mentions them
("comments say what and why") is usually about documentation. A subject alone can carry
a cue ("Use uv instead of pip"). The cues were chosen by reading this repository's own
history; what the rule misses is mostly a choice whose reason is a measurement alone
("LoCoMo ingest 75.7 -> 55.3 s"), with no cue word.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.repo_ids import SHA_DIGITS, check_repo_name, default_repo_name, repo_prefix

__all__ = ["MAX_FILES_NAMED", "is_decision", "locate", "read_git"]

#: Paths named in a commit's Files line; the rest are counted ("and 12 more").
MAX_FILES_NAMED = 30

_NOT_A_REPO = "a --format git source must be a folder inside a git repository"
_NOT_A_REPO_FIX = "Run `git -C <folder> status` to check, or pass the repository's top folder."

# Fields of one commit, in the order of _LOG_FORMAT. A record starts with \x1e; with -z,
# git ends every commit's message (and every numstat path) with \0, and a message cannot
# hold \0, so "\0\x1e" only appears where a commit starts (or in a path that begins
# with the control character \x1e).
_LOG_FORMAT = "%x1e%H%x1f%aN%x1f%aI%x1f%s%x1f%b%x1f"
_RECORD_START = b"\0\x1e"
_READ_BYTES = 1 << 16

# Variables that would make git read another repository than the one asked for.
_REPO_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_COMMON_DIR", "GIT_INDEX_FILE", "GIT_NAMESPACE",
             "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_PREFIX")

_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")
_ISO_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")

_EMAIL = r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b"
_BRACKETED_EMAIL = re.compile(r"\s*<" + _EMAIL + ">")
_BARE_EMAIL = re.compile(r"\b" + _EMAIL)
_TRAILER = re.compile(r"^[A-Za-z][A-Za-z-]*-by:.*$", re.M)

# The cues of is_decision, in the order of the module docstring's lists. A reason cue
# says why; a choice cue only names the option not taken.
_REASON_CUES = (
    r"\bbecause\b", r"\bso that\b", r"\bin order to\b",
    r"\b(?:that|this|which) is why\b", r"\bthat's why\b", r"\bwhy\s*[:(]", r"(?:^|[.!?]\s+)why\b",
    r"\bthe reasons? (?:is|are|was|were)\b", r"\bfor (?:this|that|the same) reason\b", r"\breasons?:",
    r"\bprefer(?:s|red|ring)?\b", r"\bin favou?r of\b", r"\bcho(?:se|ose|oses|osing|sen)\b",
    r"\bdecid(?:e|es|ed|ing)\b", r"\bdecisions?\b", r"\btrade-?offs?\b", r"\bavoid(?:s|ed|ing)?\b",
    r"\bpin(?:s|ned|ning)?(?:\s+\S+){0,3}?\s*(?:==|@|\bto\s+|\bat\s+|<|>=?|~=)\s*v?\d+(?:\.\d+)*",
)
_CHOICE_CUES = (r"\binstead of\b", r"\brather than\b", r"\bopt(?:s|ed)?[- ](?:in|out)\b")
_REASON = re.compile("|".join(_REASON_CUES), re.I | re.M)
_CHOICE = re.compile("|".join(_CHOICE_CUES), re.I)
_REFACTOR = re.compile(r"\brefactor|\bno (?:functional|behaviou?r(?:al)?) changes?\b|\bbehaviou?r unchanged\b", re.I)


def is_decision(subject: str, body: str) -> bool:
    """True when a commit message explains a choice (the rule in the module docstring)."""
    message = f"{subject}\n\n{_TRAILER.sub('', body)}"
    if _REASON.search(message):
        return True
    return bool(_CHOICE.search(message)) and not _REFACTOR.search(message)


def read_git(repo: Path, *, user: str, name: str | None = None, since: str | None = None,
             max_commits: int | None = None, rev: str = "HEAD") -> Iterator[dict[str, Any]]:
    """One raw memory record of ``user`` per commit reachable from ``rev``, newest first,
    as an iterator that reads ``git log`` as it goes.

    ``repo`` is any folder inside a git work tree, or a bare repository; ``name`` names it
    in the ids (default: its folder's name). ``since`` (an ISO date or datetime) keeps
    commits committed at or after it; ``max_commits`` (1 or more) stops after that many.
    The arguments are checked here, before any record is read:
    :class:`~helix_ray.errors.InvalidArgument` for a folder outside a repository (or no
    git on PATH), a ``name``, ``since`` or ``max_commits`` out of range, no ``user``, or
    a ``rev`` that names no commit."""
    since_arg = _since_argument(since)
    if max_commits is not None and (isinstance(max_commits, bool) or not isinstance(max_commits, int)
                                    or max_commits < 1):
        raise InvalidArgument("--max", max_commits, "it must be a whole number of commits, 1 or more",
                              "Leave it out to read the whole history.")
    if name is not None:
        check_repo_name(name)
    toplevel, folder = locate(Path(repo))
    name = name or default_repo_name(folder)
    id_prefix = repo_prefix("git", user, name)
    sha = _resolve(toplevel, rev)
    args = ["-c", "log.showSignature=false", "-c", "diff.relative=false", "log", "-z", "--numstat", "-M",
            "--no-color", "--no-ext-diff", "--no-textconv", "--encoding=UTF-8", f"--format={_LOG_FORMAT}"]
    if since_arg:
        args.append(f"--since={since_arg}")
    if max_commits is not None:
        args.append(f"--max-count={max_commits}")
    args += [sha, "--"]
    return (_commit_record(record, id_prefix, user, name, toplevel) for record in _stream_records(toplevel, args))


def _since_argument(since: str | None) -> str | None:
    """``since`` as the exact instant for ``git log --since`` (``@<epoch seconds> +0000``),
    or None for no bound; raises for anything that is not an ISO date (``2025-03-01``) or
    datetime (``2025-03-01T09:30:00+02:00``).

    Git is given epoch seconds because its own reading of dates is loose: a bare date gets
    the current time of day, and years before 1970 or after 2100 come out wrong."""
    if since is None:
        return None
    text = since.strip() if isinstance(since, str) else ""
    parsed: dt.datetime | None = None
    if _ISO_DATE.match(text) or _ISO_DATETIME.match(text):
        try:
            parsed = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            parsed = None
    if parsed is None:
        raise InvalidArgument("--since", since, "it must be an ISO date (2025-03-01) or datetime "
                              "(2025-03-01T09:30:00, with an offset such as +02:00 or Z; without one it is UTC)",
                              "Write the date as YYYY-MM-DD.")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    epoch = (parsed - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(seconds=1)
    return f"@{epoch} +0000" if epoch > 0 else None  # no commit is older than 1970


def _git_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _REPO_ENV}


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one short git command in ``cwd``; raises InvalidArgument when git is missing."""
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              encoding="utf-8", errors="replace", env=_git_env(), check=False)
    except FileNotFoundError:
        raise InvalidArgument("source", str(cwd), _NOT_A_REPO,
                              "git was not found on PATH: install git, then run the ingest again.") from None


def locate(repo: Path) -> tuple[Path, str]:
    """(top folder, its name) of the repository ``repo`` is in: a work tree's top, or a
    bare repository's folder (its name without ``.git``)."""
    if not repo.is_dir():
        raise InvalidArgument("source", str(repo), _NOT_A_REPO, _NOT_A_REPO_FIX)
    probe = _git(repo, "rev-parse", "--is-bare-repository", "--is-inside-work-tree", "--absolute-git-dir")
    lines = probe.stdout.split("\n")
    if probe.returncode != 0 or len(lines) < 3:
        said = probe.stderr.strip().splitlines()[:1]
        fix = _NOT_A_REPO_FIX + (f" (git said: {said[0]})" if said and "not a git repository" not in said[0] else "")
        raise InvalidArgument("source", str(repo), _NOT_A_REPO, fix)
    bare, inside_work_tree, git_dir = lines[0] == "true", lines[1] == "true", lines[2]
    if bare:
        top = Path(git_dir)
        return top, top.name[: -len(".git")] if top.name.endswith(".git") and top.name != ".git" else top.name
    if not inside_work_tree:  # e.g. the .git folder of a work tree
        raise InvalidArgument("source", str(repo), _NOT_A_REPO, _NOT_A_REPO_FIX)
    top = Path(_git(repo, "rev-parse", "--show-toplevel").stdout.strip())
    return top, top.name


def _resolve(toplevel: Path, rev: str) -> str:
    """The full sha of the commit ``rev`` names (a branch, tag, sha, ``HEAD~3``...)."""
    allowed = "it must name a commit of the repository (a branch, tag, sha or HEAD~N)"
    if not isinstance(rev, str) or not rev or rev.startswith("-"):
        raise InvalidArgument("rev", rev, allowed)
    done = _git(toplevel, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode != 0 or not done.stdout.strip():
        raise InvalidArgument("rev", rev, allowed,
                              f"Run `git -C {toplevel} log --oneline -3 {rev}` to check (a repository with "
                              "no commits yet has no HEAD).")
    return done.stdout.strip()


def _stream_records(toplevel: Path, args: list[str]) -> Iterator[bytes]:
    """Run ``git log`` and yield each commit's bytes as soon as the next one starts."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a full stderr pipe would stall git
        try:
            proc = subprocess.Popen(["git", "-C", str(toplevel), *args], stdout=subprocess.PIPE, stderr=errors,
                                    stdin=subprocess.DEVNULL, env=_git_env())
        except FileNotFoundError:
            raise InvalidArgument("source", str(toplevel), _NOT_A_REPO,
                                  "git was not found on PATH: install git, then run the ingest again.") from None
        assert proc.stdout is not None
        try:
            # A leading \0 makes the first record start like every other one.
            buffer, scan_from = bytearray(b"\0"), 0
            while chunk := proc.stdout.read(_READ_BYTES):
                buffer += chunk
                while (at := buffer.find(_RECORD_START, scan_from)) >= 0:
                    if at:  # the record with its closing \0, like the last one
                        yield bytes(buffer[: at + 1])
                    del buffer[: at + len(_RECORD_START)]
                    scan_from = 0
                scan_from = max(0, len(buffer) - len(_RECORD_START) + 1)
            if buffer.strip(b"\0"):
                yield bytes(buffer)
            if proc.wait() != 0:
                errors.seek(0)
                said = errors.read().decode("utf-8", errors="replace").strip()
                raise InvalidArgument("source", str(toplevel), f"git log failed there ({said or 'no message'})",
                                      f"Run `git -C {toplevel} log` to see why.")
        finally:
            if proc.poll() is None:  # the caller stopped early
                proc.kill()
            proc.stdout.close()
            proc.wait()


def _commit_record(record: bytes, id_prefix: str, user: str, name: str, toplevel: Path) -> dict[str, Any]:
    """One commit's raw record from its ``git log -z --numstat`` bytes (``id_prefix``:
    ``git:<user>/<name>:``)."""
    sha_b, author_b, date_b, rest = record.split(b"\x1f", 3)
    header_end = rest.index(b"\x1f\0")  # a message holds no \0: the first one ends it
    subject_b, _, body_b = rest[:header_end].partition(b"\x1f")
    sha = sha_b.decode("ascii")
    subject = _without_emails(subject_b.decode("utf-8", errors="replace").strip())
    body = _without_emails(body_b.decode("utf-8", errors="replace").strip())
    files = _numstat(rest[header_end + 2:])
    paths = [path for path, _, _ in files]
    insertions = sum(added or 0 for _, added, _ in files)
    deletions = sum(deleted or 0 for _, _, deleted in files)
    text = "\n\n".join(part for part in (subject, body, _files_line(files)) if part)
    return {
        "id": f"{id_prefix}{sha[:SHA_DIGITS]}",
        "type": "decision" if is_decision(subject, body) else "episodic",
        "text": text,
        "user": user,
        "source": f"git:{name}",
        "created_at": date_b.decode("ascii"),
        "session_id": None,
        "metadata": {"git": {"repo": name, "commit": sha, "author": _without_emails(author_b.decode("utf-8", errors="replace")),
                             "files": paths, "insertions": insertions, "deletions": deletions}},
        "_source": str(toplevel),
        "_position": f"commit {sha[:12]}",
    }


def _numstat(raw: bytes) -> list[tuple[str, int | None, int | None]]:
    """(path, lines added, lines deleted) per file; None counts for a binary file. With
    ``-z`` an entry is ``added\\tdeleted\\tpath\\0``, or for a rename ``added\\tdeleted\\t\\0
    old\\0new\\0``: the new path is kept."""
    tokens = raw.lstrip(b"\n").split(b"\0")
    files: list[tuple[str, int | None, int | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token:
            continue
        added, deleted, path = token.split(b"\t", 2)
        if not path:  # a rename or copy: the old path, then the new one
            path = tokens[i + 1] if i + 1 < len(tokens) else b""
            i += 2
        files.append((path.decode("utf-8", errors="replace"), _count(added), _count(deleted)))
    return files


def _count(value: bytes) -> int | None:
    return None if value == b"-" else int(value)


def _files_line(files: list[tuple[str, int | None, int | None]]) -> str:
    """``Files: a.py (+3 -1), logo.png (binary), and 4 more``; empty for no files."""
    if not files:
        return ""
    named = [f"{path} (binary)" if added is None else f"{path} (+{added} -{deleted})"
             for path, added, deleted in files[:MAX_FILES_NAMED]]
    more = len(files) - MAX_FILES_NAMED
    return "Files: " + ", ".join(named) + (f", and {more} more" if more > 0 else "")


def _without_emails(text: str) -> str:
    """``text`` with ``<ann@x.org>`` removed and a bare ``ann@x.org`` replaced by ``[email]``."""
    return _BARE_EMAIL.sub("[email]", _BRACKETED_EMAIL.sub("", text))
