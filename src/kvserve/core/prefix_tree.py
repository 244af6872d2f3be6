"""The prefix tree of cached blocks, with exact LRU eviction of unpinned leaves.

Block hashes are chained (each encodes its whole prefix, see :mod:`kvserve.core.hashing`),
so the radix tree needs no token comparisons: it is a dict ``hash -> block`` plus parent
links, and a match is one dict lookup per block. Per-block fields live in flat lists
indexed by block id, reused as blocks come and go (typed arrays measured slower in these
loops).

Eviction takes the least recently released unpinned leaf, and a parent becomes a leaf
candidate once its last child goes. Each block released gets the next value of a logical
clock as its stamp, so a parent that a request used after its children is ordered by its
own, newer, release. Candidates are plain ints ``(stamp << shift) | block`` (compared in
C) and are invalidated lazily: an entry counts only while its block still has that
stamp, no pins and no children. Released leaves arrive in stamp order, so they queue in
a deque (O(1) each); only parents exposed by eviction, whose stamps are older, need a
heap, and it stays as small as the number of branches being eaten.

A block is *held* while it is pinned or has a held child. Held blocks cannot be
reclaimed even by repeated eviction; every other cached block can. Keeping a count of
held children per block makes the number of reclaimable blocks exact in O(1), which is
what lets allocation promise all-or-nothing before it evicts anything.

This class trusts its caller (the block ledger) about block ids: it checks hashes, pins
and parents, while the ledger checks who owns which block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from heapq import heapify, heappop, heappush

from kvserve.core.invariants import require
from kvserve.core.kv_cache_errors import (
    InconsistentChainError,
    NotCachedError,
    NotPinnedError,
)

_NO_PARENT = -1
_NOT_RELEASED = -1
# Candidate queues this many entries beyond twice the tree's size are rebuilt from their
# live entries; each rebuild at least halves them, so the cost per entry stays O(1).
_QUEUE_SLACK = 64


class PrefixTree:
    """Cached blocks keyed by chained hash; ref counts; LRU order of unpinned leaves."""

    __slots__ = (
        "_block_of",
        "_children",
        "_clock",
        "_exposed",
        "_hash",
        "_held_children",
        "_mask",
        "_parent",
        "_ref",
        "_released",
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
        self._released: deque[int] = deque()  # released leaves, in stamp order
        self._exposed: list[int] = []  # heap: parents exposed by eviction
        self._shift = max(1, (capacity - 1).bit_length())
        self._mask = (1 << self._shift) - 1
        self._clock = 0
        self.num_held = 0

    # ---------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks that eviction could free, now or after their descendants."""
        return len(self._block_of) - self.num_held

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

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached path of ``hashes``, without pinning them."""
        block_of = self._block_of
        parent = self._parent
        found: list[int] = []
        previous = _NO_PARENT
        for block_hash in hashes:
            block = block_of.get(block_hash)
            if block is None or (found and parent[block] != previous):
                break
            found.append(block)
            previous = block
        return found

    # ---------------------------------------------------------------- pins

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Pin the longest cached path of ``hashes``; its blocks, root side first.

        Each block after the first must be the previous one's child, which chained hashes
        guarantee; checking it keeps a match a path in the tree whatever the hashes, and
        means a block that becomes held only has to tell its parent, held already.
        """
        block_of = self._block_of
        ref = self._ref
        parent = self._parent
        held_children = self._held_children
        matched: list[int] = []
        append = matched.append
        previous = _NO_PARENT
        newly_held = 0
        for block_hash in hashes:
            block = block_of.get(block_hash)
            if block is None:
                break
            if previous == _NO_PARENT:
                self.pin((block,))
            elif parent[block] != previous:
                break
            else:
                count = ref[block]
                ref[block] = count + 1
                if not count and not held_children[block]:
                    newly_held += 1
                    held_children[previous] += 1
            append(block)
            previous = block
        self.num_held += newly_held
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
        """Remove one pin from each of ``blocks``, in order; all or nothing.

        Each block whose last pin goes is stamped with the next clock value (so blocks
        released by one call age in the order given); leaves among them join the queue
        of eviction candidates.
        """
        ref = self._ref
        parent = self._parent
        children = self._children
        held_children = self._held_children
        stamp = self._stamp
        queue = self._released.append
        shift = self._shift
        clock = self._clock
        unheld = 0
        for done, block in enumerate(blocks):
            count = ref[block]
            if not count:
                # Re-pinning restores the pins; the stamps given meanwhile are never read
                # (a stamp counts only while unpinned) and the next release renews them.
                self._clock = clock
                self.num_held -= unheld
                self.pin(blocks[:done])
                raise NotPinnedError(f"block {block} is not pinned")
            ref[block] = count - 1
            if count == 1:
                clock += 1
                stamp[block] = clock
                if not held_children[block]:
                    # No longer held: tell the parent, which usually is still pinned.
                    unheld += 1
                    up = parent[block]
                    if up != _NO_PARENT:
                        left = held_children[up] - 1
                        held_children[up] = left
                        if not left and not ref[up]:
                            self._become_unheld(up)
                if not children[block]:
                    queue((clock << shift) | block)
        self._clock = clock
        self.num_held -= unheld
        if len(self._released) + len(self._exposed) > 2 * len(self._block_of) + _QUEUE_SLACK:
            self._compact_queues()

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
        """Pin ``hashes`` as a chain under ``parent_hash``, committing the uncached part.

        The first ``num_cached`` hashes are already cached (from :meth:`cached_prefix_len`)
        and are pinned as found; the rest are committed with ``blocks[i]`` holding
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
        existing = self.match(hashes[:num_cached]) if num_cached else []
        if len(existing) < num_cached:
            self._drop_pins(existing)
            raise InconsistentChainError(
                f"hash {hashes[len(existing)]:#x} (block {len(existing)} of the chain) is "
                "cached under another prefix"
            )
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
        up = parent_block
        for i in range(first, len(hashes)):
            block_hash = hashes[i]
            block = blocks[i]
            if block_of.setdefault(block_hash, block) != block:
                self._withdraw(blocks[first:i])
                self._drop_pins(existing)
                raise InconsistentChainError(
                    f"hash {block_hash:#x} (block {i} of the chain) is cached under another prefix"
                )
            hash_[block] = block_hash
            parent[block] = up
            ref[block] = 1
            up = block
        # Blocks out of the tree keep no children, held children or stamp, so only the
        # links inside the new chain need setting.
        for block in blocks[first:-1]:
            children[block] = 1
            held_children[block] = 1
        if parent_block != _NO_PARENT:
            children[parent_block] += 1
        # The new chain is pinned end to end: only its first block can change the held
        # state of the blocks above it.
        self.num_held += len(hashes) - first - 1
        self._become_held(blocks[first])
        return existing

    def _withdraw(self, chain: Sequence[int]) -> None:
        """Undo a partly committed chain: nothing else saw it, and its links to children
        and parent are set only once the whole chain is in."""
        block_of = self._block_of
        for block in chain:
            del block_of[self._hash[block]]
            self._ref[block] = 0

    def evict(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """Remove up to ``num_blocks`` least recently released unpinned leaves.

        Returns ``(hashes, blocks)`` of what was removed, in eviction order.
        """
        released = self._released
        take_released = released.popleft
        exposed = self._exposed
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
        while remaining > 0:
            if exposed and (not released or exposed[0] < released[0]):
                entry = heappop(exposed)
            elif released:
                entry = take_released()
            else:
                break
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
                    heappush(exposed, (stamp[up] << shift) | up)
        return evicted_hashes, evicted_blocks

    def _is_candidate(self, entry: int) -> bool:
        block = entry & self._mask
        return (
            self._stamp[block] == entry >> self._shift
            and not self._ref[block]
            and not self._children[block]
        )

    def _compact_queues(self) -> None:
        is_candidate = self._is_candidate
        self._released = deque(entry for entry in self._released if is_candidate(entry))
        exposed = [entry for entry in set(self._exposed) if is_candidate(entry)]
        heapify(exposed)
        self._exposed = exposed

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Raise InvariantError if links, counts, held state or eviction queues disagree."""
        order = {block: i for i, block in enumerate(self._block_of.values())}
        require(len(order) == len(self._block_of), "a block holds two hashes")
        children_count = dict.fromkeys(order, 0)
        for block_hash, block in self._block_of.items():
            require(self._hash[block] == block_hash, f"block {block}: hash link broken")
            require(self._ref[block] >= 0, f"block {block}: negative ref count")
            up = self._parent[block]
            if up != _NO_PARENT:
                require(up in order, f"block {block}: parent {up} is not cached")
                require(order[up] < order[block], f"block {block} listed before its parent")
                children_count[up] += 1
        held: dict[int, bool] = {}
        held_children_count = dict.fromkeys(order, 0)
        for block in reversed(list(order)):  # children before parents
            held[block] = self._ref[block] > 0 or held_children_count[block] > 0
            up = self._parent[block]
            if held[block] and up != _NO_PARENT:
                held_children_count[up] += 1
        for block in order:
            require(self._children[block] == children_count[block], f"block {block}: children")
            require(
                self._held_children[block] == held_children_count[block],
                f"block {block}: held children count",
            )
        require(self.num_held == sum(held.values()), "held count drifted")
        released = list(self._released)
        require(released == sorted(released), "released leaves out of stamp order")
        entries = released + self._exposed
        live = {entry & self._mask for entry in entries if self._is_candidate(entry)}
        for block in order:
            if not self._ref[block] and not self._children[block]:
                require(self._stamp[block] >= 0, f"unpinned leaf {block} was never released")
                require(block in live, f"unpinned leaf {block} is no eviction candidate")
        require(live <= order.keys(), "an eviction candidate is not cached")
        for block in range(len(self._ref)):
            if block not in order:  # insert relies on blocks arriving blank
                blank = (self._ref[block], self._children[block], self._held_children[block])
                require(blank == (0, 0, 0), f"block {block} left the tree with links")
                require(self._stamp[block] == _NOT_RELEASED, f"block {block} kept its stamp")
