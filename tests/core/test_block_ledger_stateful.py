"""Random interleavings of every ledger operation under memory pressure.

The model below is a deliberately naive restatement of the ledger's contract: plain
dicts, LRU eviction by scanning every leaf, reclaimable blocks by simulating eviction.
After every step the ledger must agree with it, pass ``check()``, and the KV events
replayed from the start must describe exactly what the ledger holds.
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.core.block_ledger import BlockLedger
from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.kv_cache_errors import (
    DoubleFreeError,
    NotCachedError,
    NotOwnedError,
    NotPinnedError,
    OutOfBlocksError,
)
from kvserve.core.kv_events import EventLog, apply_events

NS = make_namespace("ledger-test")
NUM_BLOCKS = 10
paths = st.lists(st.integers(0, 2), min_size=1, max_size=5)


def chain(path):
    return block_hashes(path, 1, NS)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.events = EventLog()
        self.ledger = BlockLedger(NUM_BLOCKS, 1, events=self.events)
        self.owned: set[int] = set()
        self.cached: dict[int, tuple[int, int | None]] = {}  # hash -> (block, parent hash)
        self.pins: Counter[int] = Counter()
        self.handles: list[list[int]] = []  # pins taken, each released as one unpin call
        self.released_at: dict[int, int] = {}  # block -> when its last pin went
        self.clock = 0  # counts releases of a last pin
        self.mirror: dict[int, int | None] = {}  # rebuilt from events only
        self.seen_seq = 0
        self.expected_evictions = 0

    # ------------------------------------------------------------ model helpers

    def free_blocks(self):
        held = self.owned | {block for block, _ in self.cached.values()}
        return sorted(set(range(NUM_BLOCKS)) - held)

    def lru_order(self, limit):
        """Hashes evicted by ``limit`` evictions: repeatedly the oldest unpinned leaf."""
        parents = {h: parent for h, (_, parent) in self.cached.items()}
        order = []
        while len(order) < limit:
            has_child = {parent for parent in parents.values() if parent is not None}
            leaves = [
                (self.released_at[self.cached[h][0]], h)
                for h in parents
                if h not in has_child and not self.pins[self.cached[h][0]]
            ]
            if not leaves:
                break
            _, oldest = min(leaves)
            order.append(oldest)
            del parents[oldest]
        return order

    def num_reclaimable(self):
        return len(self.lru_order(NUM_BLOCKS))

    def apply_evictions(self, hashes):
        for h in hashes:
            del self.cached[h]
        self.expected_evictions += len(hashes)

    def take_events(self):
        events = self.events.since(self.seen_seq)
        if events:
            self.seen_seq = events[-1].seq
        assert all(event.tier == "device" for event in events)
        apply_events(self.mirror, events)
        return events

    def assert_nothing_changed(self):
        assert not self.take_events()
        self.check_agrees()

    # ------------------------------------------------------------ rules

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free = len(self.free_blocks())
        if n > free + self.num_reclaimable():
            with pytest.raises(OutOfBlocksError, match=f"cannot allocate {n} blocks"):
                self.ledger.allocate(n)
            self.assert_nothing_changed()
            return
        expected_evicted = self.lru_order(max(0, n - free))
        blocks = self.ledger.allocate(n)
        assert len(blocks) == n == len(set(blocks))
        evicted_blocks = {self.cached[h][0] for h in expected_evicted}
        assert set(blocks) <= set(self.free_blocks()) | evicted_blocks
        events = self.take_events()
        if expected_evicted:
            assert [(e.kind, list(e.block_hashes)) for e in events] == [
                ("removed", expected_evicted)
            ]
        else:
            assert not events
        self.apply_evictions(expected_evicted)
        self.owned |= set(blocks)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.owned)), unique=True))
        self.ledger.free(blocks)
        self.owned -= set(blocks)

    def free_a_block_not_owned(self, data):
        choices = [*self.free_blocks(), *(b for b, _ in self.cached.values()), NUM_BLOCKS]
        block = data.draw(st.sampled_from(choices))
        owned_part = sorted(self.owned)[:2]  # freed first, so the call must roll them back
        expected = DoubleFreeError if block in self.free_blocks() else NotOwnedError
        with pytest.raises(expected, match=rf"block {block} (is|does not exist)"):
            self.ledger.free([*owned_part, block])

    @rule(path=paths, data=st.data())
    def insert(self, path, data):
        """Publish a chain under a cached parent (or the root), allocating if short."""
        hashes = chain(path)
        cached_len = 0
        while cached_len < len(hashes) and hashes[cached_len] in self.cached:
            cached_len += 1
        split = data.draw(st.integers(0, min(cached_len, len(hashes) - 1)))
        parent_hash = hashes[split - 1] if split else None
        hashes = hashes[split:]
        shortfall = len(hashes) - len(self.owned)
        if shortfall > 0:
            self.allocate(shortfall)  # may evict the parent: then this chain has none
            parent_gone = parent_hash is not None and parent_hash not in self.cached
            if parent_gone or len(self.owned) < len(hashes):
                return
        blocks = data.draw(st.permutations(sorted(self.owned)))[: len(hashes)]
        num_cached = 0
        while num_cached < len(hashes) and hashes[num_cached] in self.cached:
            num_cached += 1
        expected = [self.cached[h][0] for h in hashes[:num_cached]] + blocks[num_cached:]
        assert self.ledger.insert(hashes, blocks, parent_hash) == expected
        events = self.take_events()
        if num_cached < len(hashes):
            first_parent = hashes[num_cached - 1] if num_cached else parent_hash
            assert [(e.kind, list(e.block_hashes), e.parent_hash) for e in events] == [
                ("stored", hashes[num_cached:], first_parent)
            ]
        else:
            assert not events
        parent = first_parent if num_cached < len(hashes) else None
        for h, block in zip(hashes[num_cached:], blocks[num_cached:], strict=True):
            self.cached[h] = (block, parent)
            self.owned.discard(block)
            parent = h
        self.pins.update(expected)
        self.handles.append(expected)

    def insert_a_block_not_owned(self, data):
        if not self.owned:
            return
        choices = [*self.free_blocks(), *(b for b, _ in self.cached.values()), NUM_BLOCKS]
        block = data.draw(st.sampled_from(choices))
        owned_block = min(self.owned)
        hashes = chain([7, 7])  # never inserted by other rules
        with pytest.raises(NotOwnedError, match=rf"block {block} (is|does not exist)"):
            self.ledger.insert(hashes, [owned_block, block])

    def insert_under_an_unknown_parent(self, data):
        if not self.owned:
            return
        with pytest.raises(NotCachedError, match="parent hash"):
            self.ledger.insert(chain([7, 7])[1:], [min(self.owned)], chain([7])[0])

    @rule(path=paths)
    def match(self, path):
        self.pin_prefix(path)

    def pin_prefix(self, path):
        hashes = chain(path)
        expected = self.ledger_blocks_of(hashes)
        assert self.ledger.match(hashes) == expected
        self.pins.update(expected)
        if expected:
            self.handles.append(expected)
        return expected

    @rule(path=paths)
    def touch(self, path):
        """A request that reuses a prefix and goes: the prefix becomes the newest used."""
        if self.pin_prefix(path):
            self.release(self.handles.pop()[::-1])

    def ledger_blocks_of(self, hashes):
        blocks = []
        for h in hashes:
            if h not in self.cached:
                break
            blocks.append(self.cached[h][0])
        return blocks

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def pin(self, data):
        candidates = sorted(block for block, _ in self.cached.values())
        blocks = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3))
        self.ledger.pin(blocks)
        self.pins.update(blocks)
        self.handles.append(blocks)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unpin(self, data):
        handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.release(data.draw(st.permutations(handle)))

    def release(self, blocks):
        self.ledger.unpin(blocks)
        for block in blocks:
            self.pins[block] -= 1
            if not self.pins[block]:
                self.clock += 1
                self.released_at[block] = self.clock

    def unpin_a_block_not_pinned(self, data):
        unpinned_cached = [block for block, _ in self.cached.values() if not self.pins[block]]
        others = self.free_blocks() + sorted(self.owned)
        block = data.draw(st.sampled_from(unpinned_cached + others + [NUM_BLOCKS]))
        pinned_part = self.handles[-1] if self.handles else []  # unpinned, then restored
        expected = NotPinnedError if block in unpinned_cached else NotCachedError
        with pytest.raises(expected, match=f"block {block}"):
            self.ledger.unpin([*pinned_part, block])

    def pin_a_block_not_cached(self, data):
        block = data.draw(st.sampled_from([*self.free_blocks(), *sorted(self.owned), -1]))
        with pytest.raises(NotCachedError, match=f"block {block}"):
            self.ledger.pin([block])

    @rule(data=st.data())
    def misuse(self, data):
        """One of the calls the ledger must refuse, leaving everything as it was."""
        misuses = [
            self.free_a_block_not_owned,
            self.insert_a_block_not_owned,
            self.insert_under_an_unknown_parent,
            self.unpin_a_block_not_pinned,
            self.pin_a_block_not_cached,
        ]
        data.draw(st.sampled_from(misuses))(data)
        self.assert_nothing_changed()

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        expected = self.lru_order(n)
        assert self.ledger.evict(n) == len(expected)
        events = self.take_events()
        if expected:
            assert [(e.kind, list(e.block_hashes)) for e in events] == [("removed", expected)]
        else:
            assert not events
        self.apply_evictions(expected)

    @precondition(lambda self: len(self.cached) >= 3)
    @rule()
    def clear(self):
        expected = self.lru_order(NUM_BLOCKS)
        assert self.ledger.clear() == len(expected)
        events = self.take_events()
        self.apply_evictions(expected)
        if not expected:
            assert not events
        elif self.cached:
            assert [(e.kind, sorted(e.block_hashes)) for e in events] == [
                ("removed", sorted(expected))
            ]
        else:
            assert [(e.kind, e.block_hashes) for e in events] == [("cleared", ())]

    # ------------------------------------------------------------ invariants

    @invariant()
    def check_agrees(self):
        ledger = self.ledger
        ledger.check()
        assert {h: parent for h, (_, parent) in self.cached.items()} == dict(ledger.cached_hashes())
        self.take_events()
        assert self.mirror == dict(ledger.cached_hashes()), "events disagree with the ledger"
        assert ledger.pinned_counts() == +self.pins
        assert ledger.num_free_blocks == len(self.free_blocks())
        assert ledger.num_owned_blocks == len(self.owned)
        assert all(ledger.state_of(block) == "owned" for block in self.owned)
        assert ledger.num_evictable_blocks == self.num_reclaimable()
        assert ledger.stats.evictions == self.expected_evictions


LedgerMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase
