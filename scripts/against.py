"""``--against REF`` for the benchmark scripts: the same measurement with the code of a
git ref, in the same run, so a change is judged against its base on one host state.

The ref's tree is exported with ``git archive`` (no worktree: the repository is not
changed) and its own copy of the script runs in a fresh process; that copy puts its
tree first on ``sys.path``, so it imports the ref's ``helix_ray``, not this one."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def export_ref(ref: str, work: Path) -> tuple[Path, str]:
    """The tree of git ref ``ref`` of this repository, exported once into ``work``:
    (its folder, its commit)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    dest = work / f"against-{sha[:12]}"
    if not dest.is_dir():  # extracted beside it, then renamed: an export cut short is never taken for whole
        partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=work))
        tree = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=tree, check=True)
        partial.rename(dest)
    found = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(dest)!r}); import helix_ray; "
                            "print(helix_ray.__file__)"], capture_output=True, text=True, check=True).stdout.strip()
    if not found.startswith(str(dest)):
        raise RuntimeError(f"the copy of {ref} would import helix_ray from {found}, not from {dest}")
    return dest, sha


def ref_argv(argv: list[str]) -> list[str]:
    """``argv`` without ``--against REF`` and ``--json PATH`` (either spelling)."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--against", "--json"):
            skip = True
        elif not arg.startswith(("--against=", "--json=")):
            rest.append(arg)
    return rest


def run_ref(script: str, ref: str, argv: list[str]) -> dict[str, Any]:
    """``scripts/<script>`` as it is at ``ref``, run with ``argv`` (without ``--against``;
    its own ``--json``) in a fresh process: {"ref", "commit", "results": what it wrote}."""
    with tempfile.TemporaryDirectory(prefix="helix-against-") as tmp:
        tree, sha = export_ref(ref, Path(tmp))
        out = Path(tmp) / "ref.json"
        print(f"--against {ref}: scripts/{script} at {sha[:12]}, the same arguments", flush=True)
        done = subprocess.run([sys.executable, str(tree / "scripts" / script), *ref_argv(argv), "--json", str(out)])
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"scripts/{script} at {ref} ({sha[:12]}) failed with exit code {done.returncode}")
        return {"ref": ref, "commit": sha, "results": json.loads(out.read_text())}
