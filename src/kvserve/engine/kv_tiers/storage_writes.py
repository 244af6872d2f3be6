"""The storage writes this worker queued, so that a block is not written twice.

Writes go to the background writer (:class:`~kvserve.engine.kv_offload.StorageWriter`),
which drops them rather than block when the store falls behind. The hashes queued or
written are remembered (bounded) and skipped by later writes; a failed write, an
eviction or any storage fault makes them forgotten, so they are written again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from kvserve.engine.kv_offload import StorageWriter, WriteJob

Fetch = Callable[[int, int], torch.Tensor]  # (i, j) -> CPU copy of blocks i..j of a chain
MAX_STORED_HASHES = 1 << 20  # hashes remembered as written by this worker


class StorageWrites:
    def __init__(self, writer: StorageWriter) -> None:
        self.writer = writer
        self._stored: set[int] = set()  # written (or queued) to storage by this worker

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._stored

    def write(self, hashes: Sequence[int], start: int, end: int, fetch: Fetch) -> None:
        """Queue ``hashes[start:end]`` (``fetch(i, j)`` copies out ``hashes[i:j]``) past
        the part this worker already stored; dropped, not waited for, if the writer is
        behind."""
        stored = self._stored
        while start < end and hashes[start] in stored:
            start += 1
        if start == end:
            return
        chain = tuple(hashes[start:end])
        job = WriteJob(chain, hashes[start - 1] if start else None, fetch(start, end))
        if self.writer.submit(job):
            if len(stored) >= MAX_STORED_HASHES:
                stored.clear()  # only costs a rewrite (a touch) of what was written before
            stored.update(chain)

    def forget(self, hashes: Iterable[int]) -> None:
        """These may be written again (their write failed, or the store evicted them)."""
        self._stored.difference_update(hashes)

    def forget_all(self) -> None:
        """A store that failed may have lost what it held (a restarted server): write
        blocks again rather than trust this worker's memory of them."""
        self._stored.clear()
