"""Imports flow one way: the index layer (helix_ray/index) imports nothing above it; the
store imports the index layer but never ingest, recall, the live store or serve; ingest
and recall never import the live store or serve; and the live store (helix_ray/live),
with the in-process front doors over it (memory.py, shared_store.py), imports neither
the Serve layer, nor Ray, nor an HTTP framework; no other front door imports the Serve
layer but the command that runs it (cli_serve.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "helix_ray"


def imports(path: Path) -> set[str]:
    """Every absolute module ``path`` imports, at any depth (inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def helix_imports(path: Path) -> set[str]:
    """The helix_ray and pipelines modules ``path`` imports, at any depth."""
    return {n for n in imports(path) if n.split(".")[0] in ("helix_ray", "pipelines")}


FRONT_DOORS = ("helix_ray.serve", "helix_ray.eval", "helix_ray.memory", "helix_ray.shared_store", "helix_ray.cli",
               "helix_ray.mcp_server", "pipelines")
ABOVE_STORE = ("helix_ray.ingest", "helix_ray.recall", "helix_ray.live", *FRONT_DOORS)


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("index", ("helix_ray.store", *ABOVE_STORE)),
    ("store", ABOVE_STORE),
    ("ingest", ("helix_ray.live", *FRONT_DOORS[:-1])),  # ingest runs on Ray Data through pipelines/
    ("recall", ("helix_ray.ingest", "helix_ray.live", *FRONT_DOORS)),
    ("live", FRONT_DOORS),
])
def test_a_layer_imports_nothing_above_it(layer: str, forbidden: tuple[str, ...]):
    found = {f"{path.name}: {name}" for path in sorted((PACKAGE / layer).glob("*.py"))
             for name in helix_imports(path) if name.startswith(forbidden)}
    assert not found, f"helix_ray/{layer} imports from a layer above it: {sorted(found)}"


#: What the live store must run without: the Serve layer, Ray and the HTTP stack.
SERVING = ("helix_ray.serve", "ray", "fastapi", "starlette", "uvicorn")
LIVE = [*sorted((PACKAGE / "live").glob("*.py")), PACKAGE / "memory.py", PACKAGE / "shared_store.py"]


def serving_imports(path: Path) -> list[str]:
    return sorted(n for n in imports(path) if any(n == s or n.startswith(s + ".") for s in SERVING))


@pytest.mark.parametrize("path", LIVE, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_the_live_store_imports_no_serve_ray_or_http(path: Path):
    """Protects: Memory, helix mcp and the Writer needing Ray or the HTTP layer to write
    and recall; the live store is what serve/ wraps, never the other way round."""
    assert (PACKAGE / "live" / "writer.py") in LIVE  # the glob found the package
    found = serving_imports(path)
    assert not found, f"{path.relative_to(PACKAGE.parent)} imports {found}; move what it needs into helix_ray/live"


def test_the_import_scan_sees_imports_inside_functions(tmp_path: Path):
    """The scan would pass a module that imports Serve lazily, inside a function, if it
    read only the top level."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from helix_ray.serve.shells import PipelineShell\n    import ray.serve\n")
    assert serving_imports(module) == ["helix_ray.serve.shells", "ray.serve"]


def test_no_front_door_imports_the_serve_package_but_the_serve_command():
    """Protects: one front door built on another (``helix mcp`` on the Serve shells): the
    front doors share the write and recall path through helix_ray.live and
    helix_ray.Memory. ``helix serve`` (cli_serve.py) imports the Serve package to run it."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py"))
               if p.relative_to(PACKAGE).parts[0] != "serve" and p.name != "cli_serve.py"]
    assert PACKAGE / "mcp_server.py" in outside
    found = {f"{p.relative_to(PACKAGE.parent)}: {name}" for p in outside for name in helix_imports(p)
             if name == "helix_ray.serve" or name.startswith("helix_ray.serve.")}
    assert not found, f"modules outside helix_ray/serve import it: {sorted(found)}; share helix_ray.live instead"
