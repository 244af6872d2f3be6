"""Where the model runs, in which dtype and on how many threads, when the caller does not say.

CUDA runs the checkpoint's own dtype (as its authors intended). A CPU runs a bf16
checkpoint in bf16 only where it has native bf16 arithmetic (AVX512-BF16 or AMX): there
bf16 GEMMs are several times faster than float32 ones, while elsewhere bf16 is emulated,
slower than float32 and less accurate; everything else runs in float32 on CPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from kvserve.model_folder.config import ModelConfig
from kvserve.model_folder.errors import ModelLoadError

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_CHOICES = ("auto", *_DTYPES)
# omp_pause_resource_all's kind that releases threads but keeps data on devices
OMP_PAUSE_SOFT = 1
# CPU feature flags (as /proc/cpuinfo names them) that make bf16 GEMMs native.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def pick_device(requested: str | None) -> torch.device:
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"auto"`` (or None) → None, which :func:`pick_dtype` resolves; else the dtype."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    try:
        return _DTYPES[name]
    except KeyError:
        choices = ", ".join(DTYPE_CHOICES)
        raise ValueError(f"unknown dtype {name!r}; choose one of {choices}") from None


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, and float32 is always right
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return not _NATIVE_BF16_FLAGS.isdisjoint(flags.split(":", 1)[-1].split())


def pick_dtype(
    config: ModelConfig, device: torch.device, requested: torch.dtype | None
) -> torch.dtype:
    if requested is not None:
        return requested
    if device.type == "cpu":
        native = config.dtype == "bfloat16" and cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    try:
        return _DTYPES[config.dtype]
    except KeyError:
        raise ModelLoadError(f"unsupported checkpoint dtype {config.dtype!r}") from None


def use_threads(count: int | None) -> int:
    """Run torch's intra-op work on ``count`` threads (None: one per CPU this process may
    use, which torch's own default undercounts under an affinity mask or in a container).
    Returns the count."""
    if count is None:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        count = count or os.cpu_count() or 1
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    torch.set_num_threads(count)
    return count


def loaded_libgomp() -> ctypes.CDLL | None:
    """torch's libgomp, as loaded in this process; None if there is not exactly one (not
    Linux, torch on another OpenMP runtime, or two libgomps: not ours to call)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    return ctypes.CDLL(paths.pop()) if len(paths) == 1 else None


def release_openmp_threads() -> bool:
    """Release the OpenMP threads the calling thread started (its libgomp thread pool);
    True if released. Call it on a thread that is done with torch's parallel work.

    Each OS thread that starts parallel work keeps a pool of threads of its own, and
    libgomp cuts every thread's spin to 100 (its "throttled" wait) while it manages more
    threads than the process has CPUs. A worker that loads its model on one thread and
    steps it on another so ran every step with sleeping siblings: on the 2-core dev VM
    3,900 wakes a round of the shared-prefix benchmark and 112-114 tok/s, against 26-39
    wakes and 135-138 once the loading thread's pool was released (docs/benchmarks.md,
    "Spinning through a step, short waits on shared cores").
    """
    libgomp = loaded_libgomp()
    if libgomp is None:
        return False
    status: int = libgomp.omp_pause_resource_all(OMP_PAUSE_SOFT)
    return status == 0
