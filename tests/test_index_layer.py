"""Imports flow one way: the index layer (helix_ray/index) imports nothing above it, and
the store imports the index layer but never ingest, recall or serve."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "helix_ray"


def helix_imports(path: Path) -> set[str]:
    """The helix_ray and pipelines modules ``path`` imports, at any depth (inside
    functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("helix_ray", "pipelines")}


ABOVE_STORE = ("helix_ray.ingest", "helix_ray.recall", "helix_ray.serve", "helix_ray.eval", "helix_ray.memory",
               "helix_ray.cli", "pipelines")


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("index", ("helix_ray.store", *ABOVE_STORE)),
    ("store", ABOVE_STORE),
])
def test_a_layer_imports_nothing_above_it(layer: str, forbidden: tuple[str, ...]):
    found = {f"{path.name}: {name}" for path in sorted((PACKAGE / layer).glob("*.py"))
             for name in helix_imports(path) if name.startswith(forbidden)}
    assert not found, f"helix_ray/{layer} imports from a layer above it: {sorted(found)}"
