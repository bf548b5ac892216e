"""scripts/weak_match.py: the AUC its table reports (the recall side is flags.match,
tested with the CLI and MCP)."""

from __future__ import annotations

import math

from tests.helpers import load_script


def test_auc_is_the_chance_an_answerable_question_is_closer():
    auc = load_script("weak_match").auc
    assert auc([0.9, 0.8], [0.5, 0.6]) == 1.0
    assert auc([0.5], [0.9]) == 0.0
    assert auc([0.7, 0.5], [0.6]) == 0.5
    assert auc([0.6], [0.6]) == 0.5  # a tie counts half
    assert math.isnan(auc([], [0.1]))
