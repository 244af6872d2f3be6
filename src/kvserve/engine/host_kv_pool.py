"""The host tier's memory: KV blocks in one CPU tensor, slots assigned by its index.

:class:`~kvserve.core.host_tier.HostTierIndex` decides which hash lives in which slot
(LRU leaves, prefix closure, ``host`` events); this class holds the bytes. Copies in and
out run on the engine thread between steps, so a slot is never read or reused while a
copy into it is under way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvserve.core.host_tier import HostTierIndex
from kvserve.core.kv_events import EventLog
from kvserve.engine.kv_block_io import KVBlockLayout


class HostKVPool:
    def __init__(self, layout: KVBlockLayout, capacity: int, events: EventLog) -> None:
        self.index = HostTierIndex(capacity, events=events)
        # Page-locked where a GPU is present: host-to-device copies of it can overlap.
        pinned = torch.cuda.is_available()
        self._data = torch.empty(
            (capacity, *layout.block_shape), dtype=layout.torch_dtype, pin_memory=pinned
        )

    @property
    def capacity(self) -> int:
        return self.index.capacity

    def prefix_len(self, hashes: Sequence[int], start: int = 0) -> int:
        return self.index.prefix_len(hashes, start)

    def store(
        self,
        hashes: Sequence[int],
        parent_hash: int | None,
        fetch: Callable[[int, int], torch.Tensor],
    ) -> int:
        """Add the chain ``hashes`` under ``parent_hash``; ``fetch(i, j)`` gives the blocks
        of ``hashes[i:j]`` and is called only for the blocks that get a slot. Returns how
        many were added."""
        first, slots = self.index.insert(hashes, parent_hash)
        if slots:
            self._data[slots] = fetch(first, first + len(slots))
        return len(slots)

    def read(self, hashes: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks of held ``hashes`` (a chain, root first); marks them used."""
        self.index.touch(hashes)
        return self._data[self.index.slots(hashes)]
