#!/usr/bin/env bash
# The engine's CUDA path, checked on a machine with an NVIDIA GPU and a CUDA build of torch
# (CI machines have none, so this is run by hand where a GPU is lent): the oracle tests on the GPU
# (greedy tokens equal transformers' in float32, logprobs, bf16 within transformers' own bf16
# error), then kvserve's throughput against transformers.generate there, float32 and bf16, on a
# model of realistic width. Logs go to the folder given as the first argument (default: here).
# Uses the interpreter in $PYTHON (default python3) with kvserve's source on PYTHONPATH; it needs
# torch, transformers, pytest and the engine's small dependencies installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${1:-.}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, transformers; print('torch', torch.__version__, '| transformers',
      transformers.__version__, '|', torch.cuda.get_device_name())" || exit 1

KVSERVE_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider \
    tests/engine/test_engine_oracle.py tests/engine/test_logprobs_oracle.py \
    "tests/engine/test_model_runner.py::test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16" \
    2>&1 | tee "$out/cuda_oracle.log" || status=1

# The width of benchmarks/engine_vs_vllm.py's model (Qwen3-shaped, 102M parameters).
for dtype in float32 bfloat16; do
    "$py" benchmarks/engine_throughput.py --device cuda --dtype "$dtype" --arch qwen3 \
        --hidden-size 1024 --intermediate-size 3072 --num-heads 16 --num-kv-heads 8 \
        --num-layers 8 --head-dim 64 "${@:2}" 2>&1 | tee "$out/cuda_throughput_$dtype.log" || status=1
done
exit "$status"
