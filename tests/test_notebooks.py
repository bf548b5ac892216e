"""Notebooks execute top to bottom against the installed package (docs that cannot rot)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: 02_evaluate reads this instead of LoCoMo (CC BY-NC, not in the repo): CI needs no external data.
EVAL_FIXTURE = REPO / "tests" / "fixtures" / "eval" / "mini_locomo.json"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("HELIX_NOTEBOOK_STORE", str(tmp_path))
    monkeypatch.setenv("HELIX_NOTEBOOK_RUNNER", "local")
    monkeypatch.setenv("HELIX_NOTEBOOK_EVAL_DATA", str(EVAL_FIXTURE))
    for name in ("HELIX_NOTEBOOK_EVAL_CONVERSATIONS", "HELIX_NOTEBOOK_BEIR"):
        monkeypatch.delenv(name, raising=False)
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    """Protects the repo's size and licence: an executed notebook would carry plots and benchmark output."""
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [i for i, c in enumerate(notebook.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before committing (Jupyter: Clear All Outputs)."
