#!/usr/bin/env bash
# The router's end-to-end tests again in each other mode the router offers (the main run,
# scripts/test.sh, has the default: --http-server lean, one process). Every router a test
# starts through tests/support/processes.py gets the mode's options first, so a test's own
# choice of the same option still wins; a test whose options the mode refuses (--peers
# beside --processes) is skipped with that reason. Usage: test_router_modes.sh [MODE...],
# each MODE a quoted option string; default: the three below. Needs .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then
    set -- "--processes 2" "--http-server aiohttp" "--processes 2 --http-server aiohttp"
fi
mapfile -t files < <(grep -l "start_router" tests/router/test_*_e2e.py)
status=0
for mode in "$@"; do
    echo "== router tests with: $mode"
    KVSERVE_TEST_ROUTER_OPTIONS="$mode" .venv/bin/python -m pytest -q -rs "${files[@]}" || status=1
done
exit "$status"
