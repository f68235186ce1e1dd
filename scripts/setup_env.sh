#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the
# pinned versions of everything sofx, its tests, benchmarks and notebooks need.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run repeatedly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.sofx-installed"
WANT="$(cat "$ROOT/requirements/pinned.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    # torch first, pinned: the CPU build from this machine's disk.
    "$VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        -c "$ROOT/requirements/pinned.txt" -r "$ROOT/requirements/pinned.txt"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
