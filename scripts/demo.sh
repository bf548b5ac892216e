#!/usr/bin/env bash
# The main job: set up .venv, ingest the shipped sample memories with Ray Data, recall.
source "$(dirname "$0")/_env.sh" ""
helix demo "$@"
