"""Memory that received KV runs land in, reused from one run (and transfer) to the next.

A run read into freshly allocated memory pays a page fault for every 4 KiB the kernel
first writes, which on a virtual machine can cost about as much as the copy itself
(``benchmarks/kv_transfer_rate.py --fresh-memory``: 0.56 GB/s into reused memory, 0.47
into fresh, medians of 7 alternating rounds on a loaded 2-core box). So the decode side
takes run memory from :class:`RunBuffers` and gives it back once the run is installed
(the install copied it into the KV pool); memory nobody gave back (a failed install, a
cancelled transfer) is simply left to the garbage collector.
"""

from __future__ import annotations

import bisect
import threading

import torch

_MIN_BUFFER_BYTES = 1 << 20


class RunBuffers:
    """Byte buffers for runs; up to ``keep_bytes`` of the ones given back are kept."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()  # taken on receiving threads, given back on the loop
        self._free: list[tuple[int, int, torch.Tensor]] = []  # (capacity, address, buffer)
        self._free_bytes = 0
        self._kept: set[int] = set()  # the free buffers' addresses

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of memory (a ``uint8`` tensor) to land a run in: the smallest kept
        buffer that holds it, else a new one (a power of two, so it fits later runs)."""
        with self._lock:
            found = bisect.bisect_left(self._free, (nbytes,))
            if found < len(self._free):
                capacity, address, buffer = self._free.pop(found)
                self._kept.discard(address)
                self._free_bytes -= capacity
                return buffer[:nbytes]
        capacity = max(_MIN_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())
        return torch.empty(capacity, dtype=torch.uint8)[:nbytes]

    def give_back(self, run: torch.Tensor) -> None:
        """The memory under ``run`` (any view of it) is no longer used by anyone: keep it
        for a later run, unless enough is kept already."""
        storage = run.untyped_storage()
        capacity, address = storage.nbytes(), storage.data_ptr()
        with self._lock:
            if address in self._kept or self._free_bytes + capacity > self._keep_bytes:
                return
            buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
            bisect.insort(self._free, (capacity, address, buffer))
            self._kept.add(address)
            self._free_bytes += capacity

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes
