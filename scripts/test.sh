#!/usr/bin/env bash
# Set up the environment (first run only) and run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# One pytest worker per core (pytest-xdist; SOFX_TEST_WORKERS overrides, 0 runs in this process): the suite's
# work is mostly single-threaded, so on 2 cores two workers take ~0.5-0.6 of the serial time. The 15 slowest
# tests' times close the report, so that a CI log shows where the suite's time (kept under 15 min) goes.
exec python -m pytest -q -n "${SOFX_TEST_WORKERS:-auto}" --durations=15 "$@"
