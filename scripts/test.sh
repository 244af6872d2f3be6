#!/usr/bin/env bash
# Sets up .venv with the engine, dev and mooncake extras and .venv-vllm (vLLM's CPU build, cached
# under ~/.cache/kvserve between runs), checks style and types, and runs the tests (with no
# arguments: all of them, then the router's end-to-end tests with --processes 2). The tests over
# real vLLM servers (tests/foreign/) fail if .venv-vllm could not be made.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh engine,dev,mooncake
bash scripts/setup_vllm.sh || echo "warning: could not set up vLLM; the tests in tests/foreign/ will fail"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -q --durations=15 "$@"
status=$?
set -e
# The router's end-to-end tests once more with several router processes (the mode where
# they found bugs the one-process run cannot; scripts/test_router_modes.sh runs the others).
if [ "$status" -eq 0 ] && [ "$#" -eq 0 ]; then
    bash scripts/test_router_modes.sh "--processes 2" || status=$?
fi
exit "$status"
