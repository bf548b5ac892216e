#!/usr/bin/env bash
# Set up .venv with the test extras, type-check Helix, then run the test suite.
# Any failure fails the script: a mypy error, a failing test, or no test collected (pytest's 5).
source "$(dirname "$0")/_env.sh" "[test]"
python -m mypy helix_ray pipelines
python -m pytest -q "$@"
