"""The C++ kernels, built on first use: paged attention (``csrc/paged_attention.cpp``) and
the decoder layer's fused RMSNorm and Q/K norm + RoPE (``csrc/norm_rope.cpp``).

It is compiled with the machine's compiler through torch's extension mechanism, for the
machine's own CPU (``-march=native``), into a cache folder keyed by the source, the torch
version and the CPU, so a process after the first loads it in well under a second and a
folder copied to another CPU is never loaded there. Where no compiler is found the
engine keeps its pure-torch attention (gather + SDPA) and torch's norm and RoPE ops, which
also serve CUDA tensors: these kernels are CPU-only and are only chosen for CPU devices.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(_CSRC / name for name in ("paged_attention.cpp", "norm_rope.cpp"))
# Every file the build reads: the sources and the headers they include (``convert.h``), all
# hashed into the cache key below so a changed header makes a new build.
_HEADERS = (_CSRC / "convert.h",)
# The compiler flags are part of the cache key (through the hash below). ``-fopenmp`` makes
# ``at::parallel_for`` (header code, compiled here) run on torch's OpenMP threads: without
# it the kernel ran on one thread whatever ``--threads`` said (on 2 threads its share of a
# shared-prefix round took 617 ms against 612 ms on one, while the linears halved).
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# Set to 0 to force the pure-torch paths (e.g. to compare the two).
ENV_SWITCH = "KVSERVE_PAGED_KERNEL"


def _cpu_signature() -> str:
    """What ``-march=native`` compiled for: the CPU model and its instruction-set flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_directory() -> Path:
    key = hashlib.sha256(
        "\0".join(
            [
                *(source.read_text() for source in (*_SOURCES, *_HEADERS)),
                torch.__version__,
                " ".join(_CFLAGS),
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    root = os.environ.get("KVSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "kvserve"
    return Path(root) / f"paged_attention-{key}"


@functools.cache
def load() -> bool:
    """Whether ``torch.ops.kvserve_kernels.paged_attention`` is available (built now if
    needed). A failed build is logged once and the pure-torch path is used."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.info("no C++ compiler: paged attention uses the pure-torch path")
        return False
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name="kvserve_kernels",
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS,
            build_directory=str(directory),
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("paged attention kernel did not build (%s); using pure torch", err)
        return False
    return True


def usable(device: torch.device) -> bool:
    """The kernel serves CPU pools only; CUDA keeps torch's attention. Read when a runner
    is made, so tests and benchmarks can switch paths between runners."""
    return device.type == "cpu" and os.environ.get(ENV_SWITCH, "1") != "0" and load()
