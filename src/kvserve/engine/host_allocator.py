"""Keep the memory a CPU step frees inside the process, for the next step to reuse.

torch's CPU tensors come from glibc's ``malloc``. By default glibc serves a large block
(past a threshold that starts at 128 KiB) with its own ``mmap`` and unmaps it when freed,
and gives the free top of its heap back to the system past another threshold. A step's
activations are such blocks, made and freed a few hundred times a step, so every step
faulted its activations' pages in afresh and the kernel zeroed each one: on the 2-core
dev VM, a shared-prefix round of the 1024-wide model took 38–63k page faults and
0.03–0.15 s of system time out of ~4 s (docs/benchmarks.md, "Page faults of a step's
activations"). vLLM's CPU build asks its users to preload tcmalloc for the same reason;
kvserve tunes glibc in place, with nothing to install.

Blocks up to 32 MiB (glibc's largest allowed threshold on 64-bit: a step of 2,048 tokens
on that model has none larger) now come from the heap, and up to 1 GiB of free heap
stays mapped: the process keeps about its peak step's activations resident between
steps, next to a KV pool that is usually many times that. Larger blocks are still mapped
per use. A user who chose an allocator (``LD_PRELOAD``) or glibc's thresholds
(``MALLOC_*`` variables) keeps that choice; ``KVSERVE_KEEP_FREED_MEMORY=0`` keeps glibc's
defaults (e.g. to compare the two: ``benchmarks/host_allocator_ab.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
ENV_SWITCH = "KVSERVE_KEEP_FREED_MEMORY"


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds as the module docstring says, once per process; True if
    they are set (False: not glibc, or the user's own allocator or settings)."""
    if os.environ.get(ENV_SWITCH) == "0" or os.environ.get("LD_PRELOAD"):
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others lack it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mapped: int = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trimmed: int = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    done = mapped == 1 and trimmed == 1
    if not done:
        logger.info("glibc refused malloc thresholds: steps keep their page faults")
    return done
