#!/usr/bin/env bash
# Set up .venv with the test extras and run the test suite.
source "$(dirname "$0")/_env.sh" "[test]"
python -m pytest -q "$@"
