#!/usr/bin/env bash
# Sets up .venv with the engine, dev and mooncake extras and .venv-vllm (vLLM's CPU build, cached
# under ~/.cache/kvserve between runs), checks style and types, and runs the tests. The tests over
# real vLLM servers (tests/foreign/) fail if .venv-vllm could not be made.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh engine,dev,mooncake
bash scripts/setup_vllm.sh || echo "warning: could not set up vLLM; the tests in tests/foreign/ will fail"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest -q --durations=15 "$@"
