"""The block ledger: where every KV block of one tier is, and who may touch it.

A block is in exactly one state: free (in the pool), owned (allocated to one request,
not shareable) or cached (in the prefix tree, shared, ref-counted by pins). Every move
between states goes through this object, which validates it, keeps exact counters,
emits the KV event describing the change, and can verify its own invariants with
:meth:`BlockLedger.check` (tests call it after every step).

Eviction is lazy: cached blocks stay until an allocation needs their memory (or a caller
asks), and then the least recently released unpinned leaves go, recycled to the pool in
one batch with one ``removed`` event per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.invariants import require
from kvserve.core.kv_cache_errors import (
    DoubleFreeError,
    KVCacheError,
    NotCachedError,
    NotOwnedError,
    OutOfBlocksError,
)
from kvserve.core.kv_events import EventLog
from kvserve.core.prefix_tree import PrefixTree

FREE = 0
OWNED = 1
CACHED = 2
_STATE_NAMES = ("free", "owned", "cached")


@dataclass(slots=True)
class CacheStats:
    """Exact, cumulative counters (no windows: a reader takes differences itself).

    ``evictions`` counts cached blocks removed for any reason: memory pressure, an
    explicit eviction or a clear. Hits are not counted here: a match only pins, and the
    same request may match several times (an admission retried, a preempted request
    resuming); the scheduler counts each request's cached tokens once.
    """

    evictions: int = 0


class BlockLedger:
    """Block states, free pool and prefix tree of one tier, with events and counters."""

    __slots__ = ("_events", "_pool", "_state", "_tree", "block_size", "num_blocks", "stats", "tier")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tier: str = "device",
        events: EventLog | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tier = tier
        self.stats = CacheStats()
        self._events = events if events is not None else EventLog()
        self._state = bytearray(num_blocks)  # every block starts FREE
        # A stack: the most recently freed block is reused first (its memory is warm).
        self._pool = list(range(num_blocks - 1, -1, -1))
        self._tree = PrefixTree(num_blocks)

    # ---------------------------------------------------------------- counts

    @property
    def events(self) -> EventLog:
        return self._events

    @property
    def num_free_blocks(self) -> int:
        return len(self._pool)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._tree)

    @property
    def num_owned_blocks(self) -> int:
        return self.num_blocks - len(self._pool) - len(self._tree)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that eviction can reclaim: unpinned, with no pinned descendant."""
        return self._tree.num_reclaimable

    @property
    def num_available_blocks(self) -> int:
        return len(self._pool) + self._tree.num_reclaimable

    def state_of(self, block: int) -> str:
        return _STATE_NAMES[self._state[block]]

    def ref_count(self, block: int) -> int:
        return self._tree.ref_count(block) if self._state[block] == CACHED else 0

    def hash_of(self, block: int) -> int:
        """The hash a cached block holds."""
        self._require_cached((block,))
        return self._tree.hash_of(block)

    def parent_hash_of(self, block: int) -> int | None:
        """The hash of a cached block's parent (``None`` at the root)."""
        self._require_cached((block,))
        return self._tree.parent_hash_of(block)

    def cached_hashes(self) -> list[tuple[int, int | None]]:
        """``(hash, parent_hash)`` of every cached block, parents first."""
        return list(self._tree.items())

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``: no pin, not counted as a
        query (for copying blocks out between steps, when nothing can evict them)."""
        return self._tree.lookup(hashes)

    def pinned_counts(self) -> dict[int, int]:
        """Ref count of every pinned block."""
        tree = self._tree
        return {block: tree.ref_count(block) for block in tree.blocks() if tree.ref_count(block)}

    # ---------------------------------------------------------------- owned blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks as owned, evicting cached ones if the pool is short.

        All or nothing: raises :class:`OutOfBlocksError`, changing nothing, if free plus
        reclaimable blocks cannot cover the request.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        pool = self._pool
        shortfall = num_blocks - len(pool)
        if shortfall > 0:
            if shortfall > self._tree.num_reclaimable:
                raise OutOfBlocksError(
                    f"cannot allocate {num_blocks} blocks: {len(pool)} free and "
                    f"{self._tree.num_reclaimable} reclaimable of {self.num_blocks} in tier "
                    f"{self.tier!r}"
                )
            self.evict(shortfall)
        cut = len(pool) - num_blocks
        blocks = pool[cut:]
        del pool[cut:]
        blocks.reverse()  # pop order: the most recently freed block first
        state = self._state
        for block in blocks:
            state[block] = OWNED
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return owned blocks to the pool; all or nothing."""
        self._move_owned(blocks, FREE, "freed")
        self._pool.extend(blocks)

    # ---------------------------------------------------------------- cached blocks

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Pin the longest cached prefix of ``hashes`` (nothing is counted)."""
        return self._tree.match(hashes)

    def insert(
        self,
        hashes: Sequence[int],
        blocks: Sequence[int],
        parent_hash: int | None = None,
        token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Commit owned blocks as the chain ``hashes`` (block i holds hash i), pinned.

        ``parent_hash`` is the cached block the chain continues (``None``: the root). A
        leading part of the chain that is already cached keeps its cached blocks (pinned
        for the caller) and the caller's blocks for it stay owned. Returns, per hash, the
        cached block now pinned for the caller. Emits one ``stored`` event, with the new
        blocks' tokens when ``token_ids`` (the chain's, ``block_size`` per hash) is given.
        """
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes for {len(blocks)} blocks")
        tree = self._tree
        num_cached = tree.cached_prefix_len(hashes)
        new_blocks = blocks[num_cached:]
        self._move_owned(new_blocks, CACHED, "committed")
        try:
            existing = tree.insert(hashes, blocks, num_cached, parent_hash)
        except Exception:
            state = self._state
            for block in new_blocks:
                state[block] = OWNED
            raise
        if new_blocks:
            first = num_cached
            chain_parent = hashes[first - 1] if first else parent_hash
            tokens = token_ids[first * self.block_size :]
            self._events.append("stored", self.tier, hashes[first:], chain_parent, tokens)
            existing.extend(new_blocks)
        return existing

    def pin(self, blocks: Sequence[int]) -> None:
        """Add one pin to each cached block; all or nothing."""
        self._require_cached(blocks)
        self._tree.pin(blocks)

    def unpin(self, blocks: Sequence[int]) -> None:
        """Remove one pin from each cached block, in order; all or nothing.

        A block losing its last pin counts as used now for LRU eviction (blocks released
        by one call age in the order given).
        """
        self._require_cached(blocks)
        self._tree.unpin(blocks)

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` LRU unpinned leaves into the pool; returns how many."""
        hashes, blocks = self._tree.evict(num_blocks)
        if blocks:
            self._recycle(blocks)
            self._events.append("removed", self.tier, hashes)
        return len(blocks)

    def clear(self) -> int:
        """Evict every reclaimable block; returns how many.

        Emits ``cleared`` if the tier ends up empty, else ``removed`` with what went
        (pinned blocks and their ancestors stay).
        """
        hashes, blocks = self._tree.evict(self._tree.num_reclaimable)
        if blocks:
            self._recycle(blocks)
            if len(self._tree):
                self._events.append("removed", self.tier, hashes)
            else:
                self._events.append("cleared", self.tier, ())
        return len(blocks)

    def _recycle(self, blocks: list[int]) -> None:
        state = self._state
        for block in blocks:
            state[block] = FREE
        self._pool.extend(blocks)
        self.stats.evictions += len(blocks)

    def _exists(self, block: int) -> bool:
        return 0 <= block < self.num_blocks

    def _describe(self, block: int) -> str:
        if not self._exists(block):
            return f"block {block} does not exist in tier {self.tier!r} of {self.num_blocks}"
        return f"block {block} is {_STATE_NAMES[self._state[block]]}"

    def _move_owned(self, blocks: Sequence[int], to_state: int, action: str) -> None:
        """Move owned blocks to ``to_state``; all or nothing, with the first misfit named."""
        state = self._state
        num_total = self.num_blocks
        for done, block in enumerate(blocks):
            if not (0 <= block < num_total and state[block] == OWNED):
                error = self._ownership_error(block, blocks[:done], action)
                for undone in blocks[:done]:
                    state[undone] = OWNED
                raise error
            state[block] = to_state

    def _ownership_error(self, block: int, earlier: Sequence[int], action: str) -> KVCacheError:
        """Why ``block`` cannot be freed or committed (``earlier`` went first in the call)."""
        if block in earlier:
            error = DoubleFreeError if action == "freed" else NotOwnedError
            return error(f"block {block} is {action} twice in one call")
        if action == "freed" and self._exists(block) and self._state[block] == FREE:
            return DoubleFreeError(f"block {block} is already free")
        return NotOwnedError(f"{self._describe(block)}: only owned blocks can be {action}")

    def _require_cached(self, blocks: Sequence[int]) -> None:
        state = self._state
        num_total = self.num_blocks
        for block in blocks:
            if not (0 <= block < num_total and state[block] == CACHED):
                raise NotCachedError(f"{self._describe(block)}, not cached")

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Raise InvariantError unless every block is in exactly one consistent state."""
        pool = self._pool
        require(len(set(pool)) == len(pool), "a block is in the free pool twice")
        state = self._state
        require(all(state[block] == FREE for block in pool), "a pooled block is not free")
        require(state.count(FREE) == len(pool), "a free block is missing from the pool")
        cached = set(self._tree.blocks())
        require(all(state[block] == CACHED for block in cached), "a tree block is not cached")
        require(state.count(CACHED) == len(cached), "a cached block is missing from the tree")
        self._tree.check()
        require(self.stats.evictions >= 0, "negative counter")
