# Sourced by scripts/*.sh: create .venv with Python 3.11 and install Helix into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY="$candidate"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "Helix needs Python 3.11 (none found on PATH); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
EXTRAS="${1:-}"
STAMP=".venv/.helix-installed${EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "Installing Helix and its pinned dependencies into .venv (a minute or two the first time)..." >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e ".${EXTRAS}" 2>&1 | grep -v -E "^(WARNING: Location|  |$)" || true
  .venv/bin/python -c "import helix_ray, ray, fastembed, usearch, bm25s, duckdb" \
    || { echo "Installing Helix's dependencies failed (see pip's output above)." >&2; exit 2; }
  touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export RAY_USAGE_STATS_ENABLED=0
