"""Block hash → the workers speculating it, for :class:`~kvserve.core.routing.kv_index.
KVBlockIndex`'s walk: one dict per shard of the hashes, never one large table.

Speculative entries churn with every decision: a request routed away from its prefix's
holder speculates its whole prompt (128 hashes for a 2k-token prompt), and a few seconds
later they expire. A CPython dict never reuses a deleted entry's slot in its entries
array: once a table has taken in as many insertions as it has room for, the next one
rebuilds it whole, at a cost proportional to its size. One dict of the ~19,000 hashes a
1,000-worker fleet speculates in 2 s was rebuilt every ~200 decisions, 200–900 µs inside
one decision (docs/benchmarks.md, "Routing at fleet scale"). Split by the hash's low bits
into :data:`SHARDS` dicts, a rebuild moves 1/256th of that: a few µs, and the shards fill
at different decisions.

A mask holds each speculating worker's first bit (its device bit); a hash speculated by
one worker shares that worker's bit object rather than a copy (a 1,000-worker fleet's
bits are 375-byte ints).
"""

from __future__ import annotations

from collections.abc import Iterable

SHARDS = 256  # a power of two: a hash's shard is its low bits
SHARD_MASK = SHARDS - 1


class SpeculativeMasks:
    """Hash → first bits of the workers speculating it (no entry: none). ``shards`` is
    read directly by the walk (``shards[h & SHARD_MASK].get(h, 0)``), the hot loop that
    a method call per block would slow."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: tuple[dict[int, int], ...] = tuple({} for _ in range(SHARDS))

    def get(self, block_hash: int) -> int:
        return self.shards[block_hash & SHARD_MASK].get(block_hash, 0)

    def add(self, block_hashes: Iterable[int], bit: int) -> None:
        """``bit``'s worker speculates each of ``block_hashes`` (set even if it was)."""
        shards = self.shards
        for block_hash in block_hashes:
            shard = shards[block_hash & SHARD_MASK]
            mask = shard.get(block_hash)
            shard[block_hash] = bit if mask is None else mask | bit

    def drop_all(self, block_hashes: Iterable[int], bit: int) -> None:
        """``bit``'s worker no longer speculates any of ``block_hashes`` (it did each):
        one call for a batch, not one per hash (expiry drops a prompt's worth at once)."""
        shards, others = self.shards, ~bit
        for block_hash in block_hashes:
            shard = shards[block_hash & SHARD_MASK]
            mask = shard[block_hash]
            if mask == bit:
                del shard[block_hash]
            else:
                shard[block_hash] = mask & others

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def items(self) -> Iterable[tuple[int, int]]:
        """Every (hash, mask), for checks: no order."""
        for shard in self.shards:
            yield from shard.items()
