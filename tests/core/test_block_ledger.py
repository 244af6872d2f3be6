"""Targeted tests of the ledger: each error path, eviction order, events and counters."""

import pytest

from kvserve.core.block_ledger import BlockLedger
from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.invariants import InvariantError
from kvserve.core.kv_cache_errors import (
    DoubleFreeError,
    InconsistentChainError,
    NotCachedError,
    NotOwnedError,
    NotPinnedError,
    OutOfBlocksError,
)

NS = make_namespace("ledger-test")


def chain(path):
    return block_hashes(path, 1, NS)


def state(ledger):
    """Everything observable, to show that a failed call changed nothing."""
    return (
        ledger.num_free_blocks,
        ledger.num_owned_blocks,
        ledger.cached_hashes(),
        ledger.pinned_counts(),
        ledger.num_evictable_blocks,
        ledger.events.last_seq,
        [ledger.state_of(block) for block in range(ledger.num_blocks)],
    )


def commit(ledger, path, parent_hash=None):
    """Allocate, insert and release a chain: cached, unpinned."""
    hashes = chain(path)
    if parent_hash is not None:
        hashes = hashes[-1:]
    blocks = ledger.allocate(len(hashes))
    ledger.insert(hashes, blocks, parent_hash)
    ledger.unpin(blocks)
    return hashes, blocks


def test_allocating_more_than_exists_raises_and_changes_nothing():
    ledger = BlockLedger(4, 16)
    ledger.allocate(1)
    before = state(ledger)
    with pytest.raises(OutOfBlocksError, match="allocate 5 blocks: 3 free and 0 reclaimable"):
        ledger.allocate(5)
    assert state(ledger) == before
    with pytest.raises(ValueError, match="cannot allocate -1"):
        ledger.allocate(-1)
    ledger.check()


def test_allocation_counts_reclaimable_but_not_pinned_blocks():
    ledger = BlockLedger(4, 1)
    commit(ledger, [1, 2])
    pinned = ledger.match(chain([1]))
    # 2 free + the leaf [1, 2]; [1] is pinned.
    with pytest.raises(OutOfBlocksError, match="2 free and 1 reclaimable"):
        ledger.allocate(4)
    assert len(ledger.allocate(3)) == 3
    assert ledger.cached_hashes() == [(chain([1])[0], None)]
    ledger.unpin(pinned)
    ledger.check()


def test_freeing_twice_raises_double_free_and_rolls_back_the_call():
    ledger = BlockLedger(4, 16)
    a, b, c = ledger.allocate(3)
    ledger.free([a])
    before = state(ledger)
    with pytest.raises(DoubleFreeError, match=f"block {a} is already free"):
        ledger.free([b, c, a])
    assert state(ledger) == before
    with pytest.raises(DoubleFreeError, match=f"block {b} is freed twice in one call"):
        ledger.free([b, b])
    assert state(ledger) == before
    ledger.check()


def test_freeing_a_cached_or_unknown_block_is_refused():
    ledger = BlockLedger(4, 1)
    _, (block,) = commit(ledger, [1])
    with pytest.raises(
        NotOwnedError, match=f"block {block} is cached: only owned blocks can be freed"
    ):
        ledger.free([block])
    for missing in (-1, 4):
        with pytest.raises(NotOwnedError, match=f"block {missing} does not exist"):
            ledger.free([missing])
    ledger.check()


def test_unpinning_a_block_not_pinned_raises_and_restores_the_other_pins():
    ledger = BlockLedger(4, 1)
    hashes, blocks = commit(ledger, [1, 2])
    pinned = ledger.match(hashes[:1])
    before = state(ledger)
    with pytest.raises(NotPinnedError, match=f"block {blocks[1]} is not pinned"):
        ledger.unpin([*pinned, blocks[1]])
    assert state(ledger) == before
    (owned,) = ledger.allocate(1)
    with pytest.raises(NotCachedError, match=f"block {owned} is owned, not cached"):
        ledger.unpin([owned])
    with pytest.raises(NotCachedError, match="block 9 does not exist"):
        ledger.pin([9])
    ledger.check()


def test_insert_refuses_blocks_it_does_not_own_and_unknown_parents():
    ledger = BlockLedger(6, 1)
    _, (cached,) = commit(ledger, [1])
    owned = ledger.allocate(2)
    before = state(ledger)
    with pytest.raises(NotOwnedError, match=f"block {cached} is cached"):
        ledger.insert(chain([5, 6]), [owned[0], cached])
    with pytest.raises(NotOwnedError, match=f"block {owned[0]} is committed twice"):
        ledger.insert(chain([5, 6]), [owned[0], owned[0]])
    with pytest.raises(NotCachedError, match="parent hash"):
        ledger.insert(chain([5, 6])[1:], owned[:1], chain([5])[0])
    with pytest.raises(ValueError, match="2 hashes for 1 blocks"):
        ledger.insert(chain([5, 6]), owned[:1])
    assert state(ledger) == before
    ledger.check()


def test_a_chain_contradicting_the_tree_is_refused_whole():
    ledger = BlockLedger(6, 1)
    (h1,), _ = commit(ledger, [1])
    (h2,), _ = commit(ledger, [2])
    owned = ledger.allocate(2)
    before = state(ledger)
    # h1 is cached at the root, so it cannot also follow a new block under h2.
    new_hash = chain([2, 3])[1]
    with pytest.raises(InconsistentChainError, match="block 1 of the chain"):
        ledger.insert([new_hash, h1], owned, h2)
    assert state(ledger) == before
    ledger.check()


def test_insert_pins_an_already_cached_lead_and_leaves_the_callers_copy_owned():
    ledger = BlockLedger(6, 1)
    hashes = chain([1, 2, 3])
    _, (first,) = commit(ledger, [1])
    mine = ledger.allocate(3)
    assert ledger.insert(hashes, mine) == [first, mine[1], mine[2]]
    assert ledger.state_of(mine[0]) == "owned"
    assert ledger.pinned_counts() == {first: 1, mine[1]: 1, mine[2]: 1}
    (last,) = ledger.events.since(ledger.events.last_seq - 1)
    assert (last.kind, last.parent_hash) == ("stored", hashes[0])
    assert list(last.block_hashes) == hashes[1:]
    ledger.check()


def test_eviction_takes_least_recently_released_leaves_and_then_their_parents():
    ledger = BlockLedger(8, 1)
    a = commit(ledger, [1, 2])[0]  # released first
    b = commit(ledger, [3])[0]
    ledger.unpin(ledger.match(a[:1]))  # [1] used again: newer than [3] and [1, 2]
    seq = ledger.events.last_seq
    assert ledger.evict(2) == 2
    (event,) = ledger.events.since(seq)
    assert (event.kind, list(event.block_hashes)) == ("removed", [a[1], b[0]])
    assert ledger.evict(5) == 1
    assert ledger.num_cached_blocks == 0
    assert ledger.stats.evictions == 3
    ledger.check()


def test_allocation_under_pressure_evicts_in_one_batch_with_one_event():
    ledger = BlockLedger(4, 1)
    commit(ledger, [1, 2, 3])
    seq = ledger.events.last_seq
    assert len(ledger.allocate(3)) == 3
    (event,) = ledger.events.since(seq)
    assert event.kind == "removed" and len(event.block_hashes) == 2
    assert ledger.num_free_blocks == 0 and ledger.num_cached_blocks == 1
    ledger.check()


def test_clear_keeps_pinned_blocks_and_says_cleared_only_when_empty():
    ledger = BlockLedger(6, 1)
    kept = commit(ledger, [1, 2])[0]
    commit(ledger, [3])
    pinned = ledger.match(kept)
    assert ledger.clear() == 1
    assert ledger.events.since(ledger.events.last_seq - 1)[0].kind == "removed"
    assert [h for h, _ in ledger.cached_hashes()] == kept
    seq = ledger.events.last_seq
    assert ledger.clear() == 0
    assert ledger.events.last_seq == seq  # nothing changed, nothing said
    ledger.unpin(pinned)
    assert ledger.clear() == 2
    (event,) = ledger.events.since(seq)
    assert (event.kind, event.block_hashes) == ("cleared", ())
    ledger.check()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda ledger: ledger._pool.append(ledger._pool[0]),
        lambda ledger: ledger._pool.pop(),
        lambda ledger: ledger._state.__setitem__(ledger._pool[0], 2),
        lambda ledger: ledger._tree._ref.__setitem__(next(iter(ledger._tree.blocks())), 1),
        lambda ledger: ledger._tree._released.clear(),
    ],
)
def test_check_detects_broken_invariants(corrupt):
    ledger = BlockLedger(6, 1)
    commit(ledger, [1, 2])
    ledger.check()
    corrupt(ledger)
    with pytest.raises(InvariantError):
        ledger.check()
