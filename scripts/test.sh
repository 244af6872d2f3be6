#!/usr/bin/env bash
# Sets up .venv with the engine, dev and mooncake extras, checks style and types, and runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh engine,dev,mooncake
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
