#!/usr/bin/env bash
# Creates .venv and installs kvserve with the given extras (default: engine).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-engine}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned exactly (see pyproject.toml); install it first so nothing pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]"
# Build the CPU paged-attention kernel now (cached under ~/.cache/kvserve), not in the
# first engine that starts: without a compiler this prints False and the engine uses its
# pure-torch attention.
if [[ ",${extras}," == *",engine,"* ]]; then
    .venv/bin/python -c "from kvserve.engine import paged_kernel; print('paged kernel built:', paged_kernel.load())"
fi
