"""``Memory.add`` killed (SIGKILL) at each step of a write and of the compaction that
folds it: nothing acknowledged is lost, no replaced text comes back, the store opens
without repair.

One round of ``scripts/drill_crash.py --scenario memory-add`` per kill point (a child
process each, so a few minutes in all): the child adds memories, a new text of the first
among them, and compacts after every second add; it kills itself at that step of its
fourth add (a write's step) or of the compaction after it; a fresh
:class:`helix_ray.Memory` then recalls every acknowledged memory by a word only its last
acknowledged text holds, finds no replaced text, and ``helix doctor``'s checks pass.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _drill():
    spec = importlib.util.spec_from_file_location("drill_crash", ROOT / "scripts" / "drill_crash.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["drill_crash"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_memory_add_killed_at_each_write_and_compaction_step_loses_nothing(tmp_path):
    drill = _drill()
    rows = drill.drill_memory_add(tmp_path, list(drill.STEPS), 1, random.Random(0), kill_on=4, show=False)
    table = "\n".join(" | ".join(row.cells()) + "".join(f"\n  ! {n}" for n in row.notes) for row in rows)
    assert [row.kills for row in rows] == [1] * len(drill.STEPS), f"a kill point was not reached:\n{table}"
    assert all(row.acknowledged >= 2 for row in rows), table
    assert sum(len(row.lost) for row in rows) == 0, table
    assert sum(len(row.resurrected) for row in rows) == 0, table
    assert all(row.opened for row in rows), table
