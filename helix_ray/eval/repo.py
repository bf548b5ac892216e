"""A repository as a benchmark: its code and its history, and questions a developer asks.

:func:`load_repo` reads a pristine copy of a repository at one commit into one corpus:
a document per Python function, method and class (:mod:`helix_ray.ingest.code`) and
one per commit reachable from it (:mod:`helix_ray.ingest.git`), each with the memory
type and metadata its reader gives. The questions are a JSON-lines file, one object a
line::

    {"id": "q01", "query": "where are API keys checked?", "kind": "code",
     "gold": ["helix_ray/store/keys.py::KeyStore.record_for", "commit:<40-hex sha>"]}

A gold item is ``<path from the repository's top>::<symbol>`` (a function ``func``, a
method ``Class.method``, a class ``Class``, as the code reader names them) or
``commit:<sha>``. ``kind`` ("code" or "history") is the query's category, so the
runner's per-category tables split the two. ``tests/fixtures/repo_questions.jsonl``
holds such questions about Helix itself at commit ``6bbb424``.

The copy is a local clone checked out at the commit, in a folder named ``helix`` under
``workdir``, made once and reused: the working tree of the repository itself moves, the
copy does not. Document ids are those ``helix ingest --format code|git --user
helix-repo`` gives the copy (``code:helix-repo/helix:...``, ``git:helix-repo/helix:...``),
whatever the source folder is called.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from helix_ray.eval.datasets import EvalDoc, EvalQuery, EvalSet, _read_jsonl, _require_file
from helix_ray.ingest import code as code_reader
from helix_ray.ingest import git as git_reader
from helix_ray.ingest.repo_ids import code_id, commit_id, default_repo_name

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_COMMIT", "REPO_CORPUS", "gold_id", "load_repo", "pristine_copy", "read_questions",
           "repo_documents", "snippets_as_code"]

#: The commit ``tests/fixtures/repo_questions.jsonl`` was written against.
DEFAULT_COMMIT = "6bbb424"
#: The one corpus (and store) of a repository evaluation, and its user.
REPO_CORPUS = "helix-repo"
#: The copy's folder name: the readers name their ids after it.
COPY_NAME = "helix"
KINDS = ("code", "history")
_COMMIT = "commit:"

# Variables that would make git act on another repository than the one named.
_REPO_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_COMMON_DIR", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
             "GIT_ALTERNATE_OBJECT_DIRECTORIES")


def helix_checkout() -> Path:
    """The repository this copy of Helix was loaded from (the folder above ``helix_ray``)."""
    return Path(__file__).resolve().parents[2]


def load_repo(questions: str | os.PathLike[str], *, repo: str | os.PathLike[str] | None = None,
              commit: str = DEFAULT_COMMIT, workdir: str | os.PathLike[str]) -> EvalSet:
    """The questions of ``questions`` over ``repo`` (default: this Helix checkout) at
    ``commit``: one corpus, :data:`REPO_CORPUS`, of its code and its commits.

    The copy is made under ``workdir`` (:func:`pristine_copy`). Raises ValueError naming
    the question when a gold item is not a document of the corpus (a symbol the code
    reader does not name so, a commit not reachable from ``commit``)."""
    asked = read_questions(questions)
    copy = pristine_copy(repo if repo is not None else helix_checkout(), commit, workdir)
    docs = repo_documents(copy, commit)
    known = {d.id for d in docs}
    queries = []
    for row in asked:
        gold = {item: gold_id(item, copy.name, REPO_CORPUS) for item in row["gold"]}
        missing = [item for item, doc_id in gold.items() if doc_id not in known]
        if missing:
            raise ValueError(
                f"Question {row['id']!r} ({row['query']!r}) has gold {missing} that is not in the corpus of "
                f"{copy} at {commit} (looked for {[gold[m] for m in missing]}). A code item must name a "
                "function, method or class the code reader yields there (path from the repository's top, "
                "'Class.method' for a method); a commit must be reachable from that commit. Fix the item "
                "in the questions file, or pass the --commit the questions were written against.")
        queries.append(EvalQuery(id=row["id"], text=row["query"], gold=frozenset(gold.values()), category=row["kind"],
                                 corpus_id=REPO_CORPUS))
    log.info("repo %s at %s: %d documents, %d questions", copy, commit, len(docs), len(queries))
    return EvalSet(name="repo", corpora={REPO_CORPUS: docs}, queries=queries)


def read_questions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The question rows of a JSON-lines file, each checked: a unique string ``id``, a
    non-empty ``query``, ``kind`` one of :data:`KINDS`, and ``gold`` a non-empty list of
    ``path::symbol`` or ``commit:<sha>`` strings."""
    expected = "repository questions {id, query, gold, kind}"
    source = _require_file(path, expected)
    rows = _read_jsonl(source, expected)
    seen: set[str] = set()
    for n, row in enumerate(rows, start=1):
        where = f"question {n} of {str(source)!r}"
        qid, query, kind, gold = row.get("id"), row.get("query"), row.get("kind"), row.get("gold")
        if not isinstance(qid, str) or not qid or qid in seen:
            raise ValueError(f"Got id {qid!r} in {where}; each question needs a string id no other question has.")
        seen.add(qid)
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"Got query {query!r} in {where} ({qid!r}); it must be the question's text.")
        if kind not in KINDS:
            raise ValueError(f"Got kind {kind!r} in {where} ({qid!r}); it must be one of {', '.join(KINDS)}.")
        if (not isinstance(gold, list) or not gold
                or not all(isinstance(g, str) and (g.startswith(_COMMIT) or "::" in g) for g in gold)):
            raise ValueError(f"Got gold {gold!r} in {where} ({qid!r}); it must be a non-empty list of "
                             "'<path>::<symbol>' and 'commit:<sha>' strings.")
    return rows


def gold_id(item: str, name: str, user: str = REPO_CORPUS) -> str:
    """The document id of a gold item in repository ``name``'s corpus of ``user``:
    ``path::symbol`` → ``code:<user>/<name>:path::symbol``, ``commit:<sha>`` →
    ``git:<user>/<name>:<sha[:12]>``."""
    if item.startswith(_COMMIT):
        return commit_id(user, name, item[len(_COMMIT):])
    path, _, symbol = item.partition("::")
    return code_id(user, name, path, symbol)


def pristine_copy(repo: str | os.PathLike[str], commit: str, workdir: str | os.PathLike[str]) -> Path:
    """A clone of ``repo`` checked out at ``commit``, in ``workdir/repo-<sha[:12]>/helix``:
    made once (cloned aside, then renamed into place) and reused while its HEAD is that
    commit."""
    sha = _commit_of(Path(repo), commit)
    home = Path(workdir) / f"repo-{sha[:12]}"
    copy = home / COPY_NAME
    if copy.exists():
        head = _git(copy, "rev-parse", "HEAD")
        if head.returncode != 0 or head.stdout.strip() != sha:
            raise ValueError(f"Found {str(copy)!r}, which is not a checkout of {sha}; it is Helix's copy of {repo} "
                             "at that commit. Delete that folder and run again.")
        return copy
    home.mkdir(parents=True, exist_ok=True)
    aside = home / f".{COPY_NAME}-{uuid.uuid4().hex[:8]}"
    for args in (("clone", "--quiet", "--local", "--no-checkout", str(Path(repo).resolve()), str(aside)),
                 ("-C", str(aside), "checkout", "--quiet", sha)):
        done = subprocess.run(["git", *args], capture_output=True, text=True, env=_git_env(), check=False)
        if done.returncode != 0:
            raise ValueError(f"Could not copy {str(repo)!r} at {commit} into {str(aside)!r}: git {args[0]} said "
                             f"{done.stderr.strip()[:300]!r}. Check that git can clone that folder.")
    os.rename(aside, copy)
    return copy


def repo_documents(copy: Path, commit: str) -> list[EvalDoc]:
    """The code (every memory the code reader yields from the files of the tree: a
    function, method, class or module) and the commits reachable from ``commit``, as
    documents; an id read twice is kept at its first reading, a file the reader could
    not read is left out."""
    info = code_reader.repo_identity(copy)
    paths, skipped = code_reader.tree_files(copy, info)
    records: list[dict[str, Any]] = []
    for rel in paths:
        records.extend(code_reader.read_code_file(copy / rel, rel=rel, info=info, user=REPO_CORPUS))
    records.extend(git_reader.read_git(copy, user=REPO_CORPUS, rev=commit))
    unread = [r for r in records if "_reject" in r]  # a file the reader could not parse: ingest would quarantine it
    docs: dict[str, EvalDoc] = {}
    for r in records:
        if "_reject" in r or r["id"] in docs:
            continue
        docs[r["id"]] = EvalDoc(id=r["id"], text=r["text"], created_at=r.get("created_at"), type=r.get("type"),
                                metadata=r.get("metadata"))
    if len(docs) + len(unread) < len(records):
        log.warning("repo %s: %d records repeat an earlier id (kept the first)", copy,
                    len(records) - len(unread) - len(docs))
    if unread or skipped:
        log.info("repo %s: %d files not read as code, %d that could not be read", copy, len(skipped), len(unread))
    return list(docs.values())


def _commit_of(repo: Path, commit: str) -> str:
    """The full sha ``commit`` names in ``repo``; ValueError saying what to do otherwise."""
    if not isinstance(commit, str) or not commit or commit.startswith("-"):
        raise ValueError(f"Got commit {commit!r}; it must name a commit (a sha, tag or branch).")
    done = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if done.returncode != 0 or not done.stdout.strip():
        raise ValueError(f"Got commit {commit!r}, which {str(repo)!r} does not hold (or that folder is no git "
                         "repository). Pass --repo a clone of the repository the questions are about, with its "
                         "history.")
    return done.stdout.strip()


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, env=_git_env(),
                          check=False)


def _git_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _REPO_ENV}


def snippets_as_code(evalset: EvalSet, workdir: Path) -> EvalSet:
    """``evalset`` with each document read as a Python file by the code reader (what
    ``helix ingest --format code`` stores: a header line naming the file and the
    qualified symbol, type ``code``, the names it calls in its metadata, linked in the
    graph by them), one memory per document: a corpus of snippets (CoSQA) evaluated as a
    source tree would hold them. Each snippet is written to ``workdir`` as ``s<id>.py``."""
    folder = Path(workdir) / f"{evalset.name}-as-code"
    folder.mkdir(parents=True, exist_ok=True)
    info = code_reader.RepoInfo(name=default_repo_name(evalset.name), toplevel=folder)
    corpora: dict[str, list[EvalDoc]] = {}
    for corpus_id, docs in evalset.corpora.items():
        out = corpora.setdefault(corpus_id, [])
        for doc in docs:
            path = folder / f"s{doc.id}.py"
            path.write_text(doc.text, encoding="utf-8")
            records = [r for r in code_reader.read_code_file(path, rel=path.name, info=info, user=corpus_id)
                       if "_reject" not in r]
            body = [r for r in records if r["metadata"]["code"]["symbol"] != "<module>"] or records
            if not body:  # nothing the reader takes: the snippet as it is
                out.append(doc)
                continue
            names = sorted({n for r in body for n in r["metadata"]["code"].get("names") or ()})
            meta = {"code": {**body[0]["metadata"]["code"], "names": names}}
            out.append(EvalDoc(doc.id, "\n".join(r["text"] for r in body), doc.created_at, type="code", metadata=meta))
    return EvalSet(f"{evalset.name}-as-code", corpora, evalset.queries)
