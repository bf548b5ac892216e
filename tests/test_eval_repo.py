"""helix eval repo: questions about a repository's code and history, over a pristine copy
of it at one commit (helix_ray/eval/repo.py), and the shipped question set about Helix."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from helix_ray.config import IngestConfig
from helix_ray.eval.datasets import EvalDoc
from helix_ray.eval.repo import DEFAULT_COMMIT, REPO_CORPUS, gold_id, load_repo, pristine_copy, read_questions
from helix_ray.eval.runner import RUNNER_ONLY, store_key
from tests.helpers import REPO

QUESTIONS = REPO / "tests" / "fixtures" / "repo_questions.jsonl"


def _has_commit(commit: str) -> bool:
    done = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return done.returncode == 0


needs_history = pytest.mark.skipif(not _has_commit(DEFAULT_COMMIT),
                                   reason=f"the checkout's history does not hold {DEFAULT_COMMIT} (a shallow clone?)")


def _git(repo: Path, *args: str, when: str = "2025-01-02T03:04:05+00:00") -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=Ann", "-c", "user.email=ann@example.org", *args],
                          check=True, capture_output=True, text=True, env=env).stdout.strip()


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, str, str]:
    """A two-commit repository (any folder name): (folder, first sha, second sha)."""
    repo = tmp_path / "some-project"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "--quiet")
    (repo / "pkg" / "mod.py").write_text("def top():\n    return 1\n\n\nclass Box:\n    def open(self):\n"
                                         "        return top()\n")
    _git(repo, "add", "pkg/mod.py")
    _git(repo, "commit", "--quiet", "-m", "Add the box\n\nA box opens because top says so.")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "mod.py").write_text("def top():\n    return 2\n")
    _git(repo, "commit", "--quiet", "-am", "Drop the box", when="2025-02-02T03:04:05+00:00")
    return repo, first, _git(repo, "rev-parse", "HEAD")


def _questions(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- the shipped set


def test_the_shipped_questions_are_well_formed() -> None:
    rows = read_questions(QUESTIONS)
    assert 30 <= len(rows) <= 50
    assert len({r["id"] for r in rows}) == len(rows)
    kinds = Counter(r["kind"] for r in rows)
    assert set(kinds) == {"code", "history"} and kinds["code"] > kinds["history"] >= 10
    for r in rows:
        assert 1 <= len(r["gold"]) <= 3, r["id"]
        for g in r["gold"]:
            if g.startswith("commit:"):
                assert len(g) == len("commit:") + 40, (r["id"], g)
            else:
                path, symbol = g.split("::")
                assert path.endswith(".py") and symbol, (r["id"], g)


@needs_history
def test_every_gold_of_the_shipped_set_is_a_document_at_its_commit(tmp_path: Path) -> None:
    evalset = load_repo(QUESTIONS, repo=REPO, commit=DEFAULT_COMMIT, workdir=tmp_path)
    docs = evalset.corpora[REPO_CORPUS]
    ids = {d.id for d in docs}
    assert len(ids) == len(docs)
    assert len(evalset.queries) == len(read_questions(QUESTIONS))
    assert all(q.gold <= ids for q in evalset.queries)  # load_repo raises otherwise; said plainly here
    assert {q.category for q in evalset.queries} == {"code", "history"}
    assert {d.type for d in docs} >= {"code", "episodic"}
    # The copy is named helix whatever the checkout's folder is called.
    assert all(d.id.startswith(("code:helix-repo/helix:", "git:helix-repo/helix:")) for d in docs)


# --------------------------------------------------------------------------- loading, on a tiny repository


def test_gold_items_name_the_readers_ids() -> None:
    assert gold_id("helix_ray/store/keys.py::KeyStore.record_for", "helix") == \
        "code:helix-repo/helix:helix_ray/store/keys.py::KeyStore.record_for"
    assert gold_id("commit:" + "ab" * 20, "helix") == "git:helix-repo/helix:" + "ab" * 6
    assert gold_id("a.py::f", "shop", user="dev") == "code:dev/shop:a.py::f"  # what --user dev ingests


def test_a_tiny_repository_at_its_first_commit(tiny, tmp_path: Path) -> None:
    repo, first, second = tiny
    questions = _questions(tmp_path / "q.jsonl", [
        {"id": "a", "query": "what opens the box?", "gold": ["pkg/mod.py::Box.open"], "kind": "code"},
        {"id": "b", "query": "why does it open?", "gold": [f"commit:{first}", "pkg/mod.py::top"], "kind": "history"},
    ])
    evalset = load_repo(questions, repo=repo, commit=first[:7], workdir=tmp_path / "work")
    docs = {d.id: d for d in evalset.corpora[REPO_CORPUS]}
    assert {"code:helix-repo/helix:pkg/mod.py::top", "code:helix-repo/helix:pkg/mod.py::Box",
            "code:helix-repo/helix:pkg/mod.py::Box.open", f"git:helix-repo/helix:{first[:12]}"} <= set(docs)
    assert f"git:helix-repo/helix:{second[:12]}" not in docs  # history up to the commit asked for, not the tip
    commit = docs[f"git:helix-repo/helix:{first[:12]}"]
    assert commit.type == "decision" and commit.metadata["git"]["commit"] == first  # "because" explains a choice
    assert docs["code:helix-repo/helix:pkg/mod.py::Box.open"].type == "code"
    assert [(q.id, q.category, sorted(q.gold)) for q in evalset.queries] == [
        ("a", "code", ["code:helix-repo/helix:pkg/mod.py::Box.open"]),
        ("b", "history", ["code:helix-repo/helix:pkg/mod.py::top", f"git:helix-repo/helix:{first[:12]}"])]


def test_the_copy_is_made_once_and_left_alone_by_later_commits(tiny, tmp_path: Path) -> None:
    repo, first, _ = tiny
    copy = pristine_copy(repo, first, tmp_path / "work")
    assert copy.name == "helix" and _git(copy, "rev-parse", "HEAD") == first
    assert "class Box" in (copy / "pkg" / "mod.py").read_text()  # the file as it was then
    inode = copy.stat().st_ino
    (repo / "pkg" / "mod.py").write_text("changed in the working tree\n")
    again = pristine_copy(repo, first, tmp_path / "work")
    assert again == copy and again.stat().st_ino == inode and "class Box" in (again / "pkg" / "mod.py").read_text()
    assert [p.name for p in copy.parent.iterdir()] == ["helix"]  # nothing left aside


def test_a_gold_item_missing_from_the_corpus_names_its_question(tiny, tmp_path: Path) -> None:
    repo, first, second = tiny
    questions = _questions(tmp_path / "q.jsonl", [
        {"id": "q7", "query": "what opens the box?", "gold": ["pkg/mod.py::Box.open"], "kind": "code"}])
    with pytest.raises(ValueError, match=r"Question 'q7' .*pkg/mod.py::Box.open"):
        load_repo(questions, repo=repo, commit=second, workdir=tmp_path / "work")  # Box is gone there
    with pytest.raises(ValueError, match="does not hold"):
        load_repo(questions, repo=repo, commit="f" * 40, workdir=tmp_path / "work")


@pytest.mark.parametrize("row, said", [
    ({"id": "a", "query": "q", "gold": ["x.py::f"], "kind": "docs"}, "kind"),
    ({"id": "a", "query": "q", "gold": [], "kind": "code"}, "gold"),
    ({"id": "a", "query": "q", "gold": ["just a name"], "kind": "code"}, "gold"),
    ({"id": "a", "query": " ", "gold": ["x.py::f"], "kind": "code"}, "query"),
])
def test_malformed_questions_are_refused_with_what_is_allowed(tmp_path: Path, row: dict, said: str) -> None:
    with pytest.raises(ValueError, match=f"Got {said}"):
        read_questions(_questions(tmp_path / "q.jsonl", [row]))


def test_a_repeated_question_id_is_refused(tmp_path: Path) -> None:
    row = {"id": "a", "query": "q", "gold": ["x.py::f"], "kind": "code"}
    with pytest.raises(ValueError, match="no other question has"):
        read_questions(_questions(tmp_path / "q.jsonl", [row, row]))


def test_own_types_and_metadata_key_a_store_only_when_given() -> None:
    config = IngestConfig()
    plain = [EvalDoc("a", "text one"), EvalDoc("b", "text two")]
    typed = [EvalDoc("a", "text one", type="code"), EvalDoc("b", "text two")]
    tagged = [EvalDoc("a", "text one", metadata={"code": {"path": "x.py"}}), EvalDoc("b", "text two")]
    keys = {store_key(docs, config, ["semantic", "semantic"]) for docs in (plain, typed, tagged)}
    assert len(keys) == 3
    assert store_key(plain, config, ["semantic"] * 2) == store_key(list(plain), config, ["semantic"] * 2)


def test_the_lead_title_option_off_keys_a_store_as_before_it_existed() -> None:
    short = [EvalDoc("a", "text one")]
    long = [EvalDoc("a", "A title\n" + "word " * 600)]
    off = IngestConfig(chunk={"lead_title": False})
    assert store_key(short, off, ["semantic"]) == store_key(short, IngestConfig(), ["semantic"])
    assert store_key(long, off, ["semantic"]) != store_key(long, IngestConfig(), ["semantic"])
    # Off, the key is that of a store built before the option existed (and before
    # embedder.batch_chars, which no key holds: it moves a vector by int8 noise only).
    content = off.model_dump(mode="json", exclude=RUNNER_ONLY)  # ask_discount: no turn here that only asks
    del content["chunk"]["lead_title"], content["embedder"]["batch_chars"], content["ask_discount"]
    assert store_key(long, IngestConfig(embedder={"batch_chars": 4_000}), ["semantic"]) == \
        store_key(long, IngestConfig(), ["semantic"])
    assert store_key(long, off, ["episodic"]) == hashlib.sha1(json.dumps(
        [content, [(d.id, d.text, d.created_at, d.session_id) for d in long]]).encode()).hexdigest()[:12]


def test_turns_that_only_ask_key_a_store_apart_from_one_built_before_the_rule() -> None:
    """A turn that only asks is stored less salient (``ask_discount``): a corpus holding
    one gets a key of its own; a corpus without one, or the option off, keeps the key it had."""
    told = [EvalDoc("a", "Ann: We got a cat named Bailey.", session_id="s1", speaker="Ann")]
    asked = [*told, EvalDoc("b", "Bo: Cool! What is her name?", session_id="s1", speaker="Bo")]
    config, content = IngestConfig(), IngestConfig().model_dump(mode="json", exclude=RUNNER_ONLY)
    del content["chunk"], content["embedder"]["batch_chars"], content["ask_discount"]

    def before(docs: list[EvalDoc]) -> str:
        return hashlib.sha1(json.dumps(
            [content, [(d.id, d.text, d.created_at, d.session_id) for d in docs]]).encode()).hexdigest()[:12]

    assert store_key(told, config, ["episodic"]) == before(told)
    assert store_key(asked, config, ["episodic"] * 2) != before(asked)
    assert store_key(asked, IngestConfig(ask_discount=0), ["episodic"] * 2) == before(asked)
    # The speaker as the record gives it: a document's own metadata names it too.
    tagged = [*told, EvalDoc("b", "Bo: Cool! What is her name?", session_id="s1", metadata={"speaker": "Bo"})]
    assert store_key(tagged, config, ["episodic"] * 2) != store_key(
        tagged, IngestConfig(ask_discount=0), ["episodic"] * 2)


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
@needs_history
def test_the_baselines_and_helix_score_the_shipped_set(tmp_path: Path) -> None:
    """The whole path on Helix at its commit: about 2,500 code symbols and commits (3,000
    memories once long ones are chunked) embedded into one store, four systems scored per
    kind. A regression check: Helix finds at least as many gold items in its top 5 and
    top 10 as each of its own retrieval legs, and ranks them at least as well (nDCG@10;
    docs/quality.md has the table)."""
    from helix_ray.eval.runner import evaluate, format_table

    started = time.perf_counter()
    evalset = load_repo(QUESTIONS, workdir=tmp_path)
    report = evaluate(evalset, systems=["bm25", "dense", "rrf", "helix"], workdir=tmp_path, show_progress=False)
    print(format_table(report), f"\n{time.perf_counter() - started:.0f} s")
    for name, scores in report.systems.items():
        assert scores["n"] == len(evalset.queries)
        assert set(scores["per_category"]) == {"code", "history"}
        assert 0 <= scores["recall@5"] <= scores["recall@10"] <= 1
    for metric in ("recall@5", "recall@10", "ndcg@10"):
        helix = report.systems["helix"][metric]
        assert all(helix >= s[metric] for s in report.systems.values()), (metric, format_table(report))


def test_the_cli_refuses_repository_flags_where_they_mean_nothing(tmp_path: Path, capsys) -> None:
    from helix_ray.cli import main

    assert main(["eval", "beir", "--data", str(tmp_path), "--commit", "abc1234"]) == 2
    assert "only `helix eval repo`" in capsys.readouterr().err
    assert main(["eval", "repo", "--data", str(QUESTIONS), "--granularity", "turn",
                 "--workdir", str(tmp_path / "stores")]) == 2
    assert "Leave it out" in capsys.readouterr().err
    assert not (tmp_path / "stores").exists()  # refused before any copy or store is made


def test_snippets_read_as_code_keep_their_ids_and_gold(tmp_path: Path) -> None:
    """`helix eval beir --as-code`: each snippet becomes what --format code stores (a
    header naming the symbol, type code, the names it calls), under its own id."""
    from helix_ray.eval.datasets import EvalQuery, EvalSet
    from helix_ray.eval.repo import snippets_as_code

    docs = [EvalDoc("7", "def write_bool(stream, n):\n    stream.write(encode(n))\n"), EvalDoc("8", "not python {")]
    query = EvalQuery("q", "write a boolean", frozenset({"7"}), None, "cosqa")
    out = snippets_as_code(EvalSet("cosqa", {"cosqa": docs}, [query]), tmp_path)
    first, second = out.corpora["cosqa"]
    assert first.id == "7" and first.type == "code" and first.text.startswith("s7.py · s7.write_bool (function)\n")
    assert first.metadata["code"]["names"] == ["encode", "write"]
    assert second.id == "8" and second.type == "code"  # not Python: a block, still one memory
    assert out.queries == [query]
