"""The host tier's bookkeeping: which block hash sits in which host memory slot.

The host tier is a second, larger and slower pool of KV blocks in CPU memory, below the
device pool: a block that the device evicts may still be found here and copied back
instead of recomputed. The engine owns the memory (one CPU tensor of slots); this index
only decides which slot holds which hash, which hash goes when room is needed, and
reports every change as a KV event of tier ``"host"`` so the router knows what each
worker can load cheaply.

Two rules keep it usable as a prefix cache:

- a block enters only under a parent already held here (or at the root) and only leaves
  are evicted, so a suffix never outlives its prefix: whatever a longest-prefix lookup
  finds is a whole chain from the root;
- eviction takes the least recently used leaf; each use stamps the chain root first, so
  a parent is never used less recently than the children that were used through it.

Pure: no tensors, no threads, no clock (a logical counter orders uses).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.invariants import require
from kvserve.core.kv_events import EventLog

# The eviction heap is rebuilt from live entries once it holds this many stale ones
# beyond twice the index's size, so its memory stays proportional to the index.
_HEAP_SLACK = 64


@dataclass(slots=True)
class _Entry:
    slot: int
    parent: int | None
    children: int = 0
    stamp: int = 0


class HostTierIndex:
    """Hash → slot for up to ``capacity`` blocks, LRU leaf eviction, ``host`` events."""

    __slots__ = ("_clock", "_entries", "_free_slots", "_heap", "capacity", "events", "tier")

    def __init__(self, capacity: int, *, events: EventLog | None = None, tier: str = "host"):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.tier = tier
        self.events = events if events is not None else EventLog()
        self._entries: dict[int, _Entry] = {}
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._heap: list[tuple[int, int]] = []  # (stamp, hash) of leaves, maybe stale
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def snapshot(self) -> list[tuple[int, int | None]]:
        """``[(hash, parent_hash), ...]``, parents first: a block enters only under a held
        parent and leaves before it, so insertion order already puts every parent first."""
        return [(block_hash, entry.parent) for block_hash, entry in self._entries.items()]

    def prefix_len(self, hashes: Sequence[int], start: int = 0) -> int:
        """How many of ``hashes[start:]`` are held, counted from ``start`` until a miss."""
        entries = self._entries
        for i in range(start, len(hashes)):
            if hashes[i] not in entries:
                return i - start
        return len(hashes) - start

    def slots(self, hashes: Sequence[int]) -> list[int]:
        """The slots of held hashes (KeyError for one not held)."""
        entries = self._entries
        return [entries[block_hash].slot for block_hash in hashes]

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark held ``hashes`` (a chain, root first) as used now."""
        entries = self._entries
        for block_hash in hashes:
            entry = entries[block_hash]
            self._clock += 1
            entry.stamp = self._clock
            if not entry.children:
                self._push_leaf(block_hash, entry)

    def insert(self, hashes: Sequence[int], parent_hash: int | None) -> tuple[int, list[int]]:
        """Add the chain ``hashes`` under ``parent_hash``, evicting LRU leaves for room.

        Returns ``(first, slots)``: ``hashes[:first]`` were held already (now touched) and
        ``hashes[first:first + len(slots)]`` were added, one slot each, for the caller to
        fill before anything reads them. Adding stops early when no room can be made (every
        other leaf is an ancestor of this chain) or when the parent is not held.
        """
        entries = self._entries
        if parent_hash is not None and parent_hash not in entries:
            return 0, []
        first = self.prefix_len(hashes)
        self.touch(hashes[:first])
        parent = hashes[first - 1] if first else parent_hash
        # Protect the chain being extended: its deepest held block must not be evicted to
        # make room for its own children.
        protected = set(hashes[:first])
        if parent is not None:
            protected.add(parent)
        slots: list[int] = []
        evicted: list[int] = []
        for block_hash in hashes[first:]:
            if not self._free_slots and not self._evict_one(protected, evicted):
                break
            slot = self._free_slots.pop()
            self._clock += 1
            entry = _Entry(slot, parent, stamp=self._clock)
            entries[block_hash] = entry
            if parent is not None:
                entries[parent].children += 1
            protected.add(block_hash)
            slots.append(slot)
            parent = block_hash
        if evicted:
            self.events.append("removed", self.tier, evicted)
        if slots:
            added = hashes[first : first + len(slots)]
            self._push_leaf(added[-1], entries[added[-1]])
            self.events.append(
                "stored", self.tier, added, hashes[first - 1] if first else parent_hash
            )
        return first, slots

    def clear(self) -> None:
        """Drop everything (``cleared`` event if anything was held)."""
        if not self._entries:
            return
        self._entries.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self._heap.clear()
        self.events.append("cleared", self.tier, ())

    def _push_leaf(self, block_hash: int, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.stamp, block_hash))
        if len(self._heap) > 2 * len(self._entries) + _HEAP_SLACK:
            self._heap = [(e.stamp, h) for h, e in self._entries.items() if not e.children]
            heapq.heapify(self._heap)

    def _evict_one(self, protected: set[int], evicted: list[int]) -> bool:
        """Free the slot of the least recently used leaf not in ``protected``."""
        entries = self._entries
        heap = self._heap
        skipped: list[tuple[int, int]] = []
        found = False
        while heap:
            stamp, block_hash = heapq.heappop(heap)
            entry = entries.get(block_hash)
            if entry is None or entry.stamp != stamp or entry.children:
                continue  # stale: gone, used since, or a parent again
            if block_hash in protected:
                skipped.append((stamp, block_hash))
                continue
            del entries[block_hash]
            self._free_slots.append(entry.slot)
            evicted.append(block_hash)
            if entry.parent is not None:
                parent = entries[entry.parent]
                parent.children -= 1
                if not parent.children:
                    self._push_leaf(entry.parent, parent)
            found = True
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def check(self) -> None:
        """Raise InvariantError on any broken invariant."""
        entries = self._entries
        slots = [entry.slot for entry in entries.values()]
        require(len(set(slots)) == len(slots), "two hashes share a slot")
        require(not set(slots) & set(self._free_slots), "a held slot is also free")
        require(len(slots) + len(self._free_slots) == self.capacity, "a slot is lost")
        children: dict[int, int] = {}
        for entry in entries.values():
            if entry.parent is not None:
                require(entry.parent in entries, "a suffix outlived its prefix")
                children[entry.parent] = children.get(entry.parent, 0) + 1
        for block_hash, entry in entries.items():
            require(entry.children == children.get(block_hash, 0), "child count is wrong")
            if not entry.children:
                require((entry.stamp, block_hash) in self._heap, "a leaf cannot be evicted")
