"""The prefix tree of cached blocks, with exact LRU eviction of unpinned leaves.

Block hashes are chained (each encodes its whole prefix, DESIGN.md §2), so the radix
tree needs no token comparisons: it is a dict ``hash -> block`` plus parent links, and a
match is one dict lookup per block. Per-block fields live in flat lists indexed by
block id rather than in node objects: the hot loops then touch a few lists of small
ints, which is what CPython does fastest.

Eviction takes the least recently released unpinned leaf, and a parent becomes a leaf
candidate once its last child goes. The candidates sit in a heap of plain ints
``(stamp << shift) | block`` (int comparisons run in C), invalidated lazily: an entry
counts only while its block still has that stamp, no pins and no children. ``stamp`` is
a logical clock value taken when the block was last released, so a parent that a
request used after its children is ordered by its own, newer, release.

A block is *held* while it is pinned or has a held child. Held blocks cannot be
reclaimed even by repeated eviction; every other cached block can. Keeping a count of
held children per block makes the number of reclaimable blocks exact in O(1), which is
what lets allocation promise all-or-nothing before it evicts anything.

This class trusts its caller (the block ledger) about block ids: it checks hashes, pins
and parents, while the ledger checks who owns which block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from heapq import heapify, heappop, heappush

from kvserve.core.kv_cache_errors import (
    InconsistentChainError,
    NotCachedError,
    NotPinnedError,
)

_NO_PARENT = -1
_NOT_RELEASED = -1
# A heap this many entries beyond twice the tree's size is rebuilt from its live entries;
# each rebuild at least halves it, so the cost per entry pushed stays O(1).
_HEAP_SLACK = 64


class PrefixTree:
    """Cached blocks keyed by chained hash; ref counts; LRU order of unpinned leaves."""

    __slots__ = (
        "_block_of",
        "_children",
        "_clock",
        "_hash",
        "_heap",
        "_held_children",
        "_mask",
        "_parent",
        "_ref",
        "_shift",
        "_stamp",
        "num_held",
    )

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._block_of: dict[int, int] = {}
        self._hash = [0] * capacity
        self._parent = [_NO_PARENT] * capacity
        self._children = [0] * capacity
        self._ref = [0] * capacity
        self._held_children = [0] * capacity
        self._stamp = [_NOT_RELEASED] * capacity
        self._heap: list[int] = []
        self._shift = max(1, (capacity - 1).bit_length())
        self._mask = (1 << self._shift) - 1
        self._clock = 0
        self.num_held = 0

    # ---------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._block_of

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks that eviction could free, now or after their descendants."""
        return len(self._block_of) - self.num_held

    def block_of(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> int:
        return self._hash[block]

    def parent_hash_of(self, block: int) -> int | None:
        parent = self._parent[block]
        return None if parent == _NO_PARENT else self._hash[parent]

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks(self) -> Iterable[int]:
        return self._block_of.values()

    def items(self) -> Iterator[tuple[int, int | None]]:
        """``(hash, parent_hash)`` of every cached block, each parent before its children.

        Dict order is insertion order, and a block is inserted only under a cached parent
        and evicted only after its children, so no sorting is needed.
        """
        parent_hash_of = self.parent_hash_of
        for block_hash, block in self._block_of.items():
            yield block_hash, parent_hash_of(block)

    def cached_prefix_len(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached, without pinning anything."""
        block_of = self._block_of
        for i, block_hash in enumerate(hashes):
            if block_hash not in block_of:
                return i
        return len(hashes)

    # ---------------------------------------------------------------- pins

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Pin the longest cached prefix of ``hashes``; its blocks, root side first."""
        block_of = self._block_of
        ref = self._ref
        held_children = self._held_children
        matched: list[int] = []
        append = matched.append
        for block_hash in hashes:
            block = block_of.get(block_hash)
            if block is None:
                break
            count = ref[block]
            ref[block] = count + 1
            if not count and not held_children[block]:
                self._become_held(block)
            append(block)
        return matched

    def pin(self, blocks: Iterable[int]) -> None:
        """Add one pin to each of ``blocks`` (all cached: the ledger checked)."""
        ref = self._ref
        held_children = self._held_children
        for block in blocks:
            count = ref[block]
            ref[block] = count + 1
            if not count and not held_children[block]:
                self._become_held(block)

    def unpin(self, blocks: Sequence[int]) -> None:
        """Remove one pin from each of ``blocks``; all or nothing.

        Blocks whose last pin goes are stamped with one new clock value for the whole
        call; those that are leaves become eviction candidates.
        """
        self._clock += 1
        stamp_now = self._clock
        ref = self._ref
        children = self._children
        held_children = self._held_children
        stamp = self._stamp
        heap = self._heap
        entry_base = stamp_now << self._shift
        for done, block in enumerate(blocks):
            count = ref[block]
            if not count:
                self.pin(blocks[:done])  # restores the pins; new stamps matter only once
                # a block is released again, which stamps it anew
                raise NotPinnedError(f"block {block} is not pinned")
            ref[block] = count - 1
            if count == 1:
                stamp[block] = stamp_now
                if not held_children[block]:
                    self._become_unheld(block)
                if not children[block]:
                    heappush(heap, entry_base | block)
        if len(heap) > 2 * len(self._block_of) + _HEAP_SLACK:
            self._rebuild_heap()

    def _drop_pins(self, blocks: Iterable[int]) -> None:
        """Take back pins that were never visible to anyone: no release, no new stamp."""
        ref = self._ref
        held_children = self._held_children
        for block in blocks:
            ref[block] -= 1
            if not ref[block] and not held_children[block]:
                self._become_unheld(block)

    def _become_held(self, block: int) -> None:
        parent = self._parent
        held_children = self._held_children
        ref = self._ref
        self.num_held += 1
        up = parent[block]
        while up != _NO_PARENT:
            count = held_children[up]
            held_children[up] = count + 1
            if count or ref[up]:
                return
            self.num_held += 1
            up = parent[up]

    def _become_unheld(self, block: int) -> None:
        parent = self._parent
        held_children = self._held_children
        ref = self._ref
        self.num_held -= 1
        up = parent[block]
        while up != _NO_PARENT:
            count = held_children[up] - 1
            held_children[up] = count
            if count or ref[up]:
                return
            self.num_held -= 1
            up = parent[up]

    # ---------------------------------------------------------------- insert / evict

    def insert(
        self,
        hashes: Sequence[int],
        blocks: Sequence[int],
        num_cached: int,
        parent_hash: int | None = None,
    ) -> list[int]:
        """Pin ``hashes`` as a chain under ``parent_hash``, publishing the uncached part.

        The first ``num_cached`` hashes are already cached (from :meth:`cached_prefix_len`)
        and are pinned as found; the rest are published with ``blocks[i]`` holding
        ``hashes[i]``, pinned once. Returns the cached blocks pinned for the leading part.
        """
        block_of = self._block_of
        if parent_hash is None:
            parent_block = _NO_PARENT
        else:
            found = block_of.get(parent_hash)
            if found is None:
                raise NotCachedError(f"parent hash {parent_hash:#x} is not cached")
            parent_block = found
        existing = self.match(hashes[:num_cached])
        if num_cached == len(hashes):
            return existing
        if existing:
            parent_block = existing[-1]
        first = num_cached
        hash_ = self._hash
        parent = self._parent
        children = self._children
        ref = self._ref
        held_children = self._held_children
        stamp = self._stamp
        up = parent_block
        for i in range(first, len(hashes)):
            block_hash = hashes[i]
            block = blocks[i]
            if block_of.setdefault(block_hash, block) != block:
                self._withdraw(blocks[first:i])
                self._drop_pins(existing)
                raise InconsistentChainError(
                    f"hash {block_hash:#x} (block {i} of the chain) is already cached "
                    "under another prefix"
                )
            hash_[block] = block_hash
            parent[block] = up
            children[block] = 0
            ref[block] = 1
            held_children[block] = 1  # its successor in the chain is pinned
            stamp[block] = _NOT_RELEASED
            if up != _NO_PARENT:
                children[up] += 1
            up = block
        held_children[up] = 0
        # The new chain is pinned end to end: only its first block can change the held
        # state of the blocks above it.
        self.num_held += len(hashes) - first - 1
        self._become_held(blocks[first])
        return existing

    def _withdraw(self, chain: Sequence[int]) -> None:
        """Undo a partly published chain (nothing else saw it): deepest block first."""
        block_of = self._block_of
        children = self._children
        for block in reversed(chain):
            del block_of[self._hash[block]]
            self._ref[block] = 0
            up = self._parent[block]
            if up != _NO_PARENT:
                children[up] -= 1

    def evict(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """Remove up to ``num_blocks`` least recently released unpinned leaves.

        Returns ``(hashes, blocks)`` of what was removed, in eviction order.
        """
        heap = self._heap
        block_of = self._block_of
        hash_ = self._hash
        parent = self._parent
        children = self._children
        ref = self._ref
        stamp = self._stamp
        shift = self._shift
        mask = self._mask
        evicted_hashes: list[int] = []
        evicted_blocks: list[int] = []
        remaining = num_blocks
        while remaining > 0 and heap:
            entry = heappop(heap)
            block = entry & mask
            if stamp[block] != entry >> shift or ref[block] or children[block]:
                continue
            block_hash = hash_[block]
            del block_of[block_hash]
            stamp[block] = _NOT_RELEASED
            evicted_hashes.append(block_hash)
            evicted_blocks.append(block)
            remaining -= 1
            up = parent[block]
            if up != _NO_PARENT:
                count = children[up] - 1
                children[up] = count
                if not count and not ref[up]:
                    heappush(heap, (stamp[up] << shift) | up)
        return evicted_hashes, evicted_blocks

    def _is_candidate(self, entry: int) -> bool:
        block = entry & self._mask
        return (
            self._stamp[block] == entry >> self._shift
            and not self._ref[block]
            and not self._children[block]
        )

    def _rebuild_heap(self) -> None:
        live = [entry for entry in set(self._heap) if self._is_candidate(entry)]
        heapify(live)
        self._heap = live

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Raise AssertionError if links, counts, held state or the LRU heap disagree."""
        order = {block: i for i, block in enumerate(self._block_of.values())}
        assert len(order) == len(self._block_of), "a block holds two hashes"
        children_count = dict.fromkeys(order, 0)
        for block_hash, block in self._block_of.items():
            assert self._hash[block] == block_hash, f"block {block}: hash link broken"
            assert self._ref[block] >= 0, f"block {block}: negative ref count"
            up = self._parent[block]
            if up != _NO_PARENT:
                assert up in order, f"block {block}: parent {up} is not cached"
                assert order[up] < order[block], f"block {block} listed before its parent"
                children_count[up] += 1
        held: dict[int, bool] = {}
        held_children_count = dict.fromkeys(order, 0)
        for block in reversed(list(order)):  # children before parents
            held[block] = self._ref[block] > 0 or held_children_count[block] > 0
            up = self._parent[block]
            if held[block] and up != _NO_PARENT:
                held_children_count[up] += 1
        for block in order:
            assert self._children[block] == children_count[block], f"block {block}: children"
            assert self._held_children[block] == held_children_count[block], (
                f"block {block}: held children count"
            )
        assert self.num_held == sum(held.values()), "held count drifted"
        live = {entry & self._mask for entry in self._heap if self._is_candidate(entry)}
        for block in order:
            if not self._ref[block] and not self._children[block]:
                assert self._stamp[block] >= 0, f"unpinned leaf {block} was never released"
                assert block in live, f"unpinned leaf {block} missing from the LRU heap"
        assert live <= order.keys(), "the LRU heap names a block that is not cached"
