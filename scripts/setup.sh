#!/usr/bin/env bash
# Creates .venv and installs kvserve with the given extras (default: engine).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-engine}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned exactly (see pyproject.toml) and installed first, so that no looser
# requirement of another package picks a different build. Which build 2.13.0 is depends on
# the package index: the CPU build where a local index provides it, else PyPI's build for
# this platform (CUDA on Linux x86_64). The line printed below says which one came.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]"
# Build the CPU paged-attention kernel now (cached under ~/.cache/kvserve), not in the
# first engine that starts: without a compiler this prints False and the engine uses its
# pure-torch attention.
if [[ ",${extras}," == *",engine,"* ]]; then
    .venv/bin/python -c "from kvserve.engine import paged_kernel; print('paged kernel built:', paged_kernel.load())"
fi
.venv/bin/python -c "import torch; print(f'torch {torch.__version__}:', \
f'CUDA {torch.version.cuda} build' if torch.version.cuda else 'CPU build', \
f'(GPU visible: {torch.cuda.is_available()})')"
