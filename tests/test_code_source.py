"""helix_ray/ingest/code.py: a source tree read into ``code`` memories, on small
hand-made trees (one git work tree, one plain folder). No Ray."""

from __future__ import annotations

import ast
import datetime as dt
import os
import re
import subprocess
from pathlib import Path

import pytest

from helix_ray.errors import InvalidArgument
from helix_ray.ingest.code import (
    RepoInfo,
    gitignore_rules,
    is_ignored,
    read_code_file,
    repo_identity,
    tree_files,
)
from helix_ray.schema import code_containers, is_test_code, is_test_path
from tests.helpers import REPO

COMMIT_TIME = "2025-03-01T10:00:00+00:00"
RECORD_KEYS = {"id", "text", "type", "user", "source", "created_at", "metadata", "_source", "_position"}


@pytest.fixture(autouse=True)
def _hermetic_git(monkeypatch, tmp_path):
    """git here sees neither the host's global config (a global excludes file would
    change what is ignored) nor a repository above the test folder."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(name, raising=False)


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": COMMIT_TIME, "GIT_COMMITTER_DATE": COMMIT_TIME}
    done = subprocess.run(["git", "-c", "user.email=test@example.com", "-c", "user.name=Test",
                           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return done.stdout


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def read(root: Path, rel: str, info: RepoInfo | None = None) -> dict[str, dict]:
    """id → record of one file."""
    info = info or repo_identity(root)
    return {r["id"]: r for r in read_code_file(root / rel, rel=rel, info=info, user="ann")}


def symbols(records: dict[str, dict]) -> list[str]:
    return [r["metadata"]["code"]["symbol"] for r in records.values()]


# --------------------------------------------------------------------------- repo_identity


def test_repo_identity_in_git_from_the_top_a_subfolder_and_a_file(tmp_path):
    repo = write(tmp_path / "myrepo", {"pkg/mod.py": "X = 1\n"})
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "HEAD").strip()
    for root in (repo, repo / "pkg", repo / "pkg" / "mod.py"):
        info = repo_identity(root)
        assert info == RepoInfo(name="myrepo", toplevel=repo.resolve(), commit=head, committed_at=COMMIT_TIME)


def test_repo_identity_takes_a_name_or_makes_one_from_the_folder(tmp_path):
    """A folder's name becomes a repository name with what a name may not hold as '_'."""
    odd = write(tmp_path / "my project:2", {"a.py": "X = 1\n"})
    assert repo_identity(odd).name == "my_project_2"
    assert repo_identity(odd, "billing.v2").name == "billing.v2"
    with pytest.raises(InvalidArgument, match="each a letter, digit, '.', '_' or '-'"):
        repo_identity(odd, "my project")


def test_repo_identity_outside_git_before_a_commit_and_without_git(tmp_path, monkeypatch):
    plain = write(tmp_path / "plain", {"a.py": "X = 1\n"})
    assert repo_identity(plain) == RepoInfo(name="plain", toplevel=plain.resolve())
    assert repo_identity(plain / "a.py").toplevel == plain.resolve()

    fresh = write(tmp_path / "fresh", {"a.py": "X = 1\n"})
    git(fresh, "init", "-q")
    assert repo_identity(fresh) == RepoInfo(name="fresh", toplevel=fresh.resolve())

    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # git missing: not a repository
    assert repo_identity(fresh / "a.py") == RepoInfo(name="fresh", toplevel=fresh.resolve())
    with pytest.raises(InvalidArgument, match="existing file or folder"):
        repo_identity(tmp_path / "nowhere")


# --------------------------------------------------------------------------- .gitignore

GITIGNORED_TREE: dict[str, str | bytes] = {
    ".gitignore": "# generated\n\ngen_*.py\n!gen_keep.py\n/top_only.py\ncache/\ndocs/**/draft.py\nwild?.py\n",
    "pkg/.gitignore": "local.py\n/anchored.py\n",
    "app.py": "A = 1\n",
    "gen_a.py": "A = 1\n",
    "gen_keep.py": "A = 1\n",
    "top_only.py": "A = 1\n",
    "pkg/top_only.py": "A = 1\n",
    "cache/x.py": "A = 1\n",
    "pkg/cache/y.py": "A = 1\n",
    "docs/draft.py": "A = 1\n",
    "docs/a/b/draft.py": "A = 1\n",
    "other/draft.py": "A = 1\n",
    "wild1.py": "A = 1\n",
    "wild10.py": "A = 1\n",
    "local.py": "A = 1\n",
    "pkg/local.py": "A = 1\n",
    "pkg/anchored.py": "A = 1\n",
    "pkg/sub/anchored.py": "A = 1\n",
}
NOT_IGNORED = ["app.py", "gen_keep.py", "local.py", "other/draft.py", "pkg/sub/anchored.py", "pkg/top_only.py",
               "wild10.py"]


@pytest.mark.parametrize("kind", ["git", "plain", "git-missing"])
def test_tree_files_respects_gitignore(tmp_path, monkeypatch, kind):
    """The same tree lists the same files through git and through the plain matcher."""
    root = write(tmp_path / "proj", GITIGNORED_TREE)
    if kind != "plain":
        git(root, "init", "-q")
        git(root, "add", ".gitignore", "app.py")  # tracked and untracked files are both listed
        git(root, "commit", "-qm", "first")
    if kind == "git-missing":
        monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    info = repo_identity(root)
    assert (info.commit is not None) == (kind == "git")
    files, skipped = tree_files(root, info)
    assert files == NOT_IGNORED
    assert skipped == [(".gitignore", "not code (no suffix)"), ("pkg/.gitignore", "not code (no suffix)")]
    # A subfolder or one file: paths stay relative to the top, the top's .gitignore still holds.
    assert tree_files(root / "pkg", info)[0] == ["pkg/sub/anchored.py", "pkg/top_only.py"]
    assert tree_files(root / "pkg" / "top_only.py", info)[0] == ["pkg/top_only.py"]
    assert tree_files(root / "gen_a.py", info) == ([], [])


def test_gitignore_matcher_patterns():
    rules = gitignore_rules("# comment\n\n*.log\n!keep.log\nbuild/\n/top.txt\na/**/z\n**/deep\nx/**\n\\#hash\n"
                            "file?.txt\n[ab]c.txt\n")
    cases = [
        ("x.log", False, True), ("d/e/x.log", False, True), ("keep.log", False, False),
        ("build", True, True), ("d/build", True, True), ("build", False, False),  # a trailing / means folders
        ("top.txt", False, True), ("d/top.txt", False, False),  # a leading / anchors
        ("a/z", False, True), ("a/b/c/z", False, True), ("q/a/z", False, False),  # an inner / anchors too
        ("deep", True, True), ("m/n/deep", False, True),
        ("x/y", False, True), ("x/y/z", False, True), ("x", True, False),
        ("#hash", False, True), ("# comment", False, False),
        ("file1.txt", False, True), ("file12.txt", False, False), ("d/file/1.txt", False, False),
        ("ac.txt", False, True), ("cc.txt", False, False),
    ]
    assert [(rel, is_ignored(rel, is_dir, rules)) for rel, is_dir, _ in cases] == [(r, e) for r, _, e in cases]
    # A nested .gitignore: relative to its folder, and later (deeper) rules win.
    nested = gitignore_rules("*.py\n") + gitignore_rules("!keep.py\n/only.py\n", base="sub")
    assert is_ignored("keep.py", False, nested) and not is_ignored("sub/keep.py", False, nested)
    assert is_ignored("sub/only.py", False, nested) and is_ignored("sub/q/only.py", False, nested)
    assert not is_ignored("sub/q/only.py", False, gitignore_rules("/only.py\n", base="sub"))


# --------------------------------------------------------------------------- skips


def test_tree_files_skips_with_a_reason(tmp_path):
    root = write(tmp_path / "proj", {
        "main.py": "A = 1\n",
        "small.json": '{"a": 1}\n',
        "script": "#!/usr/bin/env bash\necho hi\n",
        "notes": "just words\n",
        "node_modules/lib/index.js": "module.exports = 1;\n",
        "node_modules/other/x.js": "module.exports = 2;\n",
        "pkg/vendor/dep.go": "package dep\n",
        "mylib.egg-info/top.py": "A = 1\n",
        "package-lock.json": "{}\n",
        "go.sum": "x v1 h1:abc\n",
        "README.md": "# Read me\n",
        "app.min.js": "var a=1;\n",
        "bundle.js": "var a = '" + "x" * 1200 + "';\n",
        "big.py": "x = 1\n" * 200_000,
        "data.json": '{"rows": [' + ",".join(["1"] * 40_000) + "]}\n",
        "logo.png": b"\x89PNG\r\n\x1a\n\0\0",
        "blob.py": b"A = 1\n\0\0\0",
        "latin.py": "CAF\xc9 = 1\n".encode("latin-1"),
    })
    os.symlink(root / "main.py", root / "link.py")
    files, skipped = tree_files(root, repo_identity(root))
    assert files == ["main.py", "script", "small.json"]
    assert dict(skipped) == {
        "node_modules/": "vendored or generated folder",
        "pkg/vendor/": "vendored or generated folder",
        "mylib.egg-info/": "vendored or generated folder",
        "package-lock.json": "lock file",
        "go.sum": "lock file",
        "README.md": "markdown: ingest it with --format markdown",
        "app.min.js": "minified",
        "bundle.js": "minified (a line over 1,000 characters)",
        "big.py": "over 1 MiB",
        "data.json": "json data over 64 KiB",
        "logo.png": "not code (.png)",
        "notes": "not code (no suffix)",
        "blob.py": "binary (NUL byte)",
        "latin.py": "binary (not UTF-8)",
        "link.py": "symbolic link",
    }
    # A vendored folder asked for by name is read.
    assert tree_files(root / "node_modules" / "lib", repo_identity(root))[0] == ["node_modules/lib/index.js"]


# --------------------------------------------------------------------------- Python

SHAPES = '''"""Shapes and their areas."""

import math

SCALE = 2  # a constant


def area(r: float) -> float:
    """Area of a circle."""
    def square(x):
        return x * x
    return math.pi * square(r) * SCALE


# Cached, because drawing is slow.
@functools.lru_cache(maxsize=None)
def draw(shape):
    return render_shape(shape)


@dataclass
class Circle(Shape):
    """A circle."""

    radius: float = 1.0

    def area(self) -> float:
        return compute_area(self.radius)

    @property
    def diameter(self) -> float:
        return 2 * self.radius

    @diameter.setter
    def diameter(self, value: float) -> None:
        self.radius = value / 2

    class Meta:
        ordering = "radius"

        def label(self):
            return "m"
'''


def test_python_symbols_kinds_and_ids(tmp_path):
    root = write(tmp_path / "proj", {"pkg/shapes.py": SHAPES})
    stamp = dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc).timestamp()
    os.utime(root / "pkg/shapes.py", (stamp, stamp))
    records = read(root, "pkg/shapes.py")
    prefix = "code:ann/proj:pkg/shapes.py::"
    assert list(records) == [prefix + s for s in (
        "<module>", "area", "draw", "Circle", "Circle.area", "Circle.diameter", "Circle.diameter~2",
        "Circle.Meta", "Circle.Meta.label")]
    kinds = [r["metadata"]["code"]["kind"] for r in records.values()]
    assert kinds == ["module", "function", "function", "class", "method", "method", "method", "class", "method"]
    for record in records.values():
        assert set(record) == RECORD_KEYS and record["user"] == "ann"  # whom the id names
        assert record["type"] == "code" and record["source"] == "code:proj"
        assert record["created_at"] == "2024-05-06T07:08:09+00:00"  # no git: the file's mtime
        meta = record["metadata"]["code"]
        assert meta["repo"] == "proj" and meta["path"] == "pkg/shapes.py" and meta["language"] == "python"
        assert meta["module"] == "pkg.shapes" and meta["commit"] is None
        assert not re.search(r"\b(?:line|lines) \d", record["text"])

    module = records[prefix + "<module>"]
    assert module["text"].startswith("pkg/shapes.py · pkg.shapes (module)\n")
    assert '"""Shapes and their areas."""' in module["text"] and "SCALE = 2" in module["text"]
    assert "def " not in module["text"]

    area = records[prefix + "area"]
    assert area["text"].split("\n")[0] == "pkg/shapes.py · pkg.shapes.area (function)"
    assert "def square(x):" in area["text"] and "return x * x" in area["text"]  # nested: inside its parent
    assert area["metadata"]["code"]["lines"] == [8, 12]
    assert area["_position"] == "pkg/shapes.py, lines 8-12"

    draw = records[prefix + "draw"]["text"].split("\n")
    assert draw[1:4] == ["# Cached, because drawing is slow.", "@functools.lru_cache(maxsize=None)", "def draw(shape):"]

    circle = records[prefix + "Circle"]["text"]
    assert circle.split("\n") == [
        "pkg/shapes.py · pkg.shapes.Circle (class)",
        "@dataclass",
        "class Circle(Shape):",
        '    """A circle."""',
        "    radius: float = 1.0",
        "    def area(self) -> float:",
        "    @property",
        "    def diameter(self) -> float:",
        "    @diameter.setter",
        "    def diameter(self, value: float) -> None:",
        "    class Meta: ...",
    ]
    method = records[prefix + "Circle.area"]
    assert method["text"] == ("pkg/shapes.py · pkg.shapes.Circle.area (method)\n"
                              "def area(self) -> float:\n    return compute_area(self.radius)")
    assert method["metadata"]["code"]["names"] == ["compute_area", "radius"]
    assert "return 2 * self.radius" in records[prefix + "Circle.diameter"]["text"]
    assert "self.radius = value / 2" in records[prefix + "Circle.diameter~2"]["text"]
    assert records[prefix + "Circle.Meta.label"]["text"].startswith(
        "pkg/shapes.py · pkg.shapes.Circle.Meta.label (method)\ndef label(self):")


def test_python_module_memory_only_with_content(tmp_path):
    root = write(tmp_path / "proj", {
        "pkg/__init__.py": "from pkg.shapes import area\n\n__all__ = ['area']\n",
        "pkg/imports_only.py": "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import re\n\n\n"
                               "def f():\n    return os.getcwd()\n",
        "src/lib/core.py": "def g():\n    return 1\n",
    })
    init = read(root, "pkg/__init__.py")
    assert list(init) == ["code:ann/proj:pkg/__init__.py::<module>"]
    assert init["code:ann/proj:pkg/__init__.py::<module>"]["metadata"]["code"]["module"] == "pkg"
    assert symbols(read(root, "pkg/imports_only.py")) == ["f"]
    core = read(root, "src/lib/core.py")["code:ann/proj:src/lib/core.py::g"]
    assert core["metadata"]["code"]["module"] == "lib.core"  # the src layout
    assert core["text"].startswith("src/lib/core.py · lib.core.g (function)\n")


def test_python_names(tmp_path):
    root = write(tmp_path / "proj", {"walker.py": (
        "def walk(node):\n"
        "    items = len(node.children)\n"
        "    for child in node.children:\n"
        "        walk(child)\n"
        "        visit_node(child)\n"
        "    ab(1)\n"
        "    super().__init__()\n"
        "    return helpers.Collector(items).finish()\n"
    )})
    record = read(root, "walker.py")["code:ann/proj:walker.py::walk"]
    # Called and attribute names in source order; not itself, builtins, dunders or short names.
    assert record["metadata"]["code"]["names"] == ["children", "visit_node", "Collector", "finish"]
    many = "def big():\n" + "".join(f"    call_{i}()\n" for i in range(80))
    write(root, {"big.py": many})
    assert len(read(root, "big.py")["code:ann/proj:big.py::big"]["metadata"]["code"]["names"]) == 50


def test_python_syntax_error_falls_back_to_blocks(tmp_path):
    root = write(tmp_path / "proj", {"broken.py": (
        "import os\n\n\ndef ok():\n    return os.sep\n\n\n# Half written.\ndef broken(:\n    pass\n\n\n"
        "class Thing:\n    pass\n"
    )})
    records = read(root, "broken.py")
    assert symbols(records) == ["ok", "broken", "Thing"]
    assert {r["metadata"]["code"]["kind"] for r in records.values()} == {"block"}
    broken = records["code:ann/proj:broken.py::broken"]
    assert broken["text"] == "broken.py · broken (python)\n# Half written.\ndef broken(:\n    pass"
    assert broken["metadata"]["code"]["module"] == "broken"
    assert "import os" in records["code:ann/proj:broken.py::ok"]["text"]  # a file's opening goes with the first


# --------------------------------------------------------------------------- other languages

JS = """import fs from "fs";
const DEBUG = false;

// Parse reads the config.
// It never throws.
export function parse(text) {
  return JSON.parse(text);
}

/**
 * A store of things.
 */
export class Store {
  get(key) { return load(key); }
}

const helper = (x) => x + 1;

export default function () {
  return helper(2);
}
"""

GO = """package main

import "fmt"

// Server serves.
type Server struct {
\tport int
}

// Start starts the server.
func (s *Server) Start() error {
\treturn listen(s.port)
}

func init() {}

func main() {
\tfmt.Println("hi")
}

func init() { setup() }
"""


def test_javascript_split_at_definitions_with_comments_attached(tmp_path):
    root = write(tmp_path / "proj", {"web/app.js": JS})
    records = read(root, "web/app.js")
    assert symbols(records) == ["parse", "Store", "helper", "block4"]
    parse = records["code:ann/proj:web/app.js::parse"]
    assert parse["text"].split("\n")[:3] == ["web/app.js · parse (javascript)", 'import fs from "fs";',
                                             "const DEBUG = false;"]
    assert "// Parse reads the config.\n// It never throws.\nexport function parse(text) {" in parse["text"]
    assert "/**" not in parse["text"]
    store = records["code:ann/proj:web/app.js::Store"]
    assert store["text"].split("\n")[1] == "/**" and store["metadata"]["code"]["lines"] == [10, 15]
    assert store["metadata"]["code"]["names"] == ["get", "load"]
    assert store["metadata"]["code"]["kind"] == "block" and store["metadata"]["code"]["language"] == "javascript"
    assert "module" not in store["metadata"]["code"]
    assert records["code:ann/proj:web/app.js::block4"]["text"].endswith("return helper(2);\n}")


def test_go_split_at_definitions_with_receivers_and_repeats(tmp_path):
    root = write(tmp_path / "proj", {"cmd/main.go": GO})
    records = read(root, "cmd/main.go")
    assert symbols(records) == ["Server", "Server.Start", "init", "main", "init~2"]
    server = records["code:ann/proj:cmd/main.go::Server"]["text"]
    assert server.startswith("cmd/main.go · Server (go)\npackage main\n") and "// Server serves.\ntype" in server
    start = records["code:ann/proj:cmd/main.go::Server.Start"]
    assert start["text"].split("\n")[1] == "// Start starts the server."
    assert start["metadata"]["code"]["names"] == ["listen"]
    assert records["code:ann/proj:cmd/main.go::main"]["metadata"]["code"]["names"] == ["Println"]
    assert records["code:ann/proj:cmd/main.go::init~2"]["metadata"]["code"]["names"] == ["setup"]


# --------------------------------------------------------------------------- stability and bad files


@pytest.mark.parametrize("rel, content, moved", [
    ("pkg/shapes.py", SHAPES, "code:ann/proj:pkg/shapes.py::draw"),
    ("cmd/main.go", GO, "code:ann/proj:cmd/main.go::main"),
])
def test_ids_and_texts_stable_when_a_blank_line_is_added(tmp_path, rel, content, moved):
    """A re-ingest after an edit that moves code without changing it keeps ids and texts
    (so the embedding is reused); only metadata lines change."""
    root = write(tmp_path / "proj", {rel: content})
    info = RepoInfo(name="proj", toplevel=root, commit="a" * 40, committed_at=COMMIT_TIME)
    before = read(root, rel, info)
    marker = "\n# Cached" if rel.endswith(".py") else "\nfunc main"
    write(root, {rel: content.replace(marker, "\n" + marker, 1)})
    after = read(root, rel, info)
    assert list(after) == list(before)
    assert {k: r["text"] for k, r in after.items()} == {k: r["text"] for k, r in before.items()}
    first, last = before[moved]["metadata"]["code"]["lines"]
    assert after[moved]["metadata"]["code"]["lines"] == [first + 1, last + 1]
    assert after[moved]["metadata"]["code"]["commit"] == "a" * 40 and after[moved]["created_at"] == COMMIT_TIME


def test_invalid_utf8_is_one_bad_record(tmp_path):
    root = write(tmp_path / "proj", {"bad.py": b"A = '\xff\xfe'\ndef f():\n    pass\n"})
    records = list(read_code_file(root / "bad.py", rel="bad.py", info=repo_identity(root), user="ann"))
    assert len(records) == 1
    bad = records[0]
    assert set(bad) == {"_source", "_position", "_code", "_reject", "_raw"}
    assert bad["_code"] == "invalid_utf8" and bad["_position"] == "bad.py, whole file" and bad["_raw"] == ""
    assert bad["_source"] == str(root / "bad.py") and "not UTF-8" in bad["_reject"]


# --------------------------------------------------------------------------- this repository


def test_reads_this_repositorys_keys_module():
    rel = "helix_ray/store/keys.py"
    info = repo_identity(REPO)
    records = read(REPO, rel, info)
    tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
    top = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert top and all(f"code:ann/{info.name}:{rel}::{name}" in records for name in top)
    key_store = records[f"code:ann/{info.name}:{rel}::KeyStore"]
    assert key_store["text"].startswith(f"{rel} · helix_ray.store.keys.KeyStore (class)\n")
    assert key_store["metadata"]["code"]["module"] == "helix_ray.store.keys"
    assert f"code:ann/{info.name}:{rel}::KeyStore.create" in records


def test_a_folder_the_enclosing_repository_ignores_is_read_as_its_own_tree(tmp_path):
    """A virtualenv's package inside a project: asked for by name, it is read (with its
    own name), not found empty because the project's .gitignore hides it."""
    project = tmp_path / "project"
    pkg = project / ".venv" / "lib" / "somepkg"
    pkg.mkdir(parents=True)
    (project / ".gitignore").write_text(".venv/\n")
    (pkg / "core.py").write_text("def run():\n    return 1\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    info = repo_identity(pkg)
    assert info.name == "somepkg" and info.toplevel == pkg.resolve() and info.commit is None
    files, _ = tree_files(pkg, info)
    assert files == ["core.py"]
    records = read_code_file(pkg / "core.py", rel="core.py", info=info, user="ann")
    assert [r["id"] for r in records] == ["code:ann/somepkg:core.py::run"]


@pytest.mark.parametrize("rel, test", [
    ("tests/test_keys.py", True), ("pkg/test_keys.py", True), ("keys_test.go", True), ("src/app.spec.ts", True),
    ("web/__tests__/a.js", True), ("src/FooTest.java", True), ("conftest.py", True),
    ("helix_ray/store/keys.py", False), ("contest.py", False), ("latest/app.py", False), ("testdata.py", False),
])
def test_test_files_are_told_apart(rel, test):
    """Test code is marked (metadata.code.test) and so less salient than the code it tests;
    recall tells it apart by the id the code reader gives it (or its chunk's)."""
    assert is_test_path(rel) is test
    assert is_test_code(f"code:ann/shop:{rel}::run") is test
    assert is_test_code(f"code:ann/shop:{rel}::Keys.check#chunk2") is test
    assert is_test_code(f"code:shop:{rel}::run") is test  # the id form of an older store


def test_only_code_ids_name_test_files():
    assert not is_test_code("md:ann/docs/tests/plan.md#testing")
    assert not is_test_code("tests/test_keys.py")
    assert not is_test_code("git:ann/shop:0123456789ab")


def test_a_code_memory_names_what_encloses_it_nearest_first():
    assert code_containers("code:ann/shop:app/keys.py::Store.Keys.get") == [
        "code:ann/shop:app/keys.py::Store.Keys", "code:ann/shop:app/keys.py::Store",
        "code:ann/shop:app/keys.py::<module>"]
    assert code_containers("code:ann/shop:app/keys.py::check~2") == ["code:ann/shop:app/keys.py::<module>"]
    assert code_containers("code:ann/shop:app/keys.py::<module>") == []
    assert code_containers("git:ann/shop:0123456789ab") == []

