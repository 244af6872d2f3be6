"""The global block index follows the workers' KV events exactly."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_index import KVBlockIndex

NAMESPACE = make_namespace("m")


def stored(seq: int, hashes: list[int], parent: int | None = None, tier: str = "device"):
    return KVEvent(seq, "stored", tier, tuple(hashes), parent)


def test_stored_removed_cleared_per_tier() -> None:
    index = KVBlockIndex()
    index.apply("w0", stored(1, [1, 2, 3]))
    index.apply("w0", stored(2, [1, 2], tier="host"))
    index.apply("w1", stored(1, [1]))
    match = index.match([1, 2, 3, 4], ["w0", "w1", "w2"], now=0.0)
    assert match["w0"].blocks_by_tier["device"] == 3
    assert match["w1"].num_blocks == 1
    assert match["w2"].num_blocks == 0

    index.apply("w0", KVEvent(3, "removed", "device", (2, 3)))
    match = index.match([1, 2, 3], ["w0"], now=0.0)["w0"]
    assert match.blocks_by_tier == {"device": 1, "host": 1, "storage": 0}  # 2 lives on in host

    index.apply("w0", KVEvent(4, "cleared", "host", ()))
    assert index.match([1, 2, 3], ["w0"], now=0.0)["w0"].num_blocks == 1
    assert index.num_blocks("w0", "host") == 0


def test_unknown_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV tier"):
        KVBlockIndex().apply("w0", stored(1, [1], tier="gpu9"))


def test_worker_removal_forgets_everything() -> None:
    index = KVBlockIndex()
    index.apply("w0", stored(1, [1, 2]))
    index.apply("w0", stored(2, [1], tier="host"))
    index.speculate("w0", [1, 2, 3], deadline=10.0)
    index.apply("w1", stored(1, [1, 2]))
    index.remove_worker("w0")
    assert index.match([1, 2, 3], ["w0"], now=0.0)["w0"].num_blocks == 0
    assert index.num_speculative("w0") == 0
    assert index.match([1, 2], ["w1"], now=0.0)["w1"].num_blocks == 2


def test_a_removed_workers_slot_is_reused_clean() -> None:
    """A worker joining after another left holds nothing until its own events say so,
    and the workers that stayed keep their blocks."""
    index = KVBlockIndex()
    index.apply("w0", stored(1, [1, 2]))
    index.apply("w0", stored(2, [2], tier="host"))
    index.apply("w1", stored(1, [1, 2]))
    index.remove_worker("w0")
    index.apply("w2", stored(1, [5]))  # takes w0's place in the masks
    assert not index.holds("w2", 1) and not index.holds("w2", 2, "host")
    assert index.match([1, 2], ["w2"], now=0.0)["w2"].num_blocks == 0
    assert index.match([5], ["w2"], now=0.0)["w2"].blocks_by_tier["device"] == 1
    assert index.match([1, 2], ["w1"], now=0.0)["w1"].num_blocks == 2
    index.apply("w1", KVEvent(2, "removed", "device", (2, 99)))  # 99: never stored
    assert index.match([1, 2], ["w1"], now=0.0)["w1"].num_blocks == 1


def test_held_blocks_add_nothing_for_the_garbage_collector_to_walk() -> None:
    """The router's event loop pauses for each full collection, in proportion to the
    tracked objects: a fleet's worth of blocks must not add one per block."""
    index = KVBlockIndex()
    gc.collect()
    walked = _entries_walked()
    before = len(gc.get_objects())
    for worker in range(4):
        for seq in range(1, 51):
            hashes = [worker * 10**6 + seq * 100 + i for i in range(100)]
            index.apply(f"w{worker}", stored(seq, hashes))
            index.speculate(f"w{worker}", [h + 50 for h in hashes], deadline=10.0)
    gc.collect()
    assert index.num_blocks("w3") == 5000
    assert len(gc.get_objects()) - before < 100  # 40,000 blocks and guesses
    # nor one entry of a tracked container per block: a full collection walks each
    # (a worker's held blocks as a set were one: seconds at 10^5 blocks x 1,000 workers)
    assert _entries_walked() - walked < 1000


def _entries_walked() -> int:
    """Entries of the containers the cyclic collector tracks (it visits each). Built-in
    types only: a subclass's own ``__len__`` may load something (a lazy mapping)."""
    return sum(len(o) for o in gc.get_objects() if type(o) in _CONTAINERS)


_CONTAINERS = (dict, set, frozenset, list, tuple)


def test_snapshot_replaces_a_workers_view() -> None:
    index = KVBlockIndex()
    index.apply("w0", stored(1, [1, 2, 3]))
    index.replace("w0", "device", [7, 8])
    assert not index.holds("w0", 1)
    assert index.match([7, 8, 9], ["w0"], now=0.0)["w0"].num_blocks == 2


def test_speculative_insert_expires_unless_confirmed() -> None:
    index = KVBlockIndex()
    index.speculate("w0", [1, 2, 3], deadline=2.0)
    assert index.match([1, 2, 3], ["w0"], now=1.0)["w0"].blocks_by_tier["device"] == 3
    assert index.num_speculative("w0") == 3
    index.apply("w0", stored(1, [1]))  # the worker confirms the first block only
    assert index.match([1, 2, 3], ["w0"], now=1.5)["w0"].blocks_by_tier["device"] == 3
    assert index.num_speculative("w0") == 2
    assert index.match([1, 2, 3], ["w0"], now=2.0)["w0"].blocks_by_tier["device"] == 1
    assert index.num_speculative("w0") == 0


def test_index_equals_a_real_cache_through_events_and_a_gap() -> None:
    """Random traffic on a real KVCacheManager: replaying its events (and, after a gap,
    its snapshot) gives exactly the blocks it holds."""
    rng = random.Random(7)
    cache = KVCacheManager(num_blocks=24, block_size=4)
    index = KVBlockIndex()
    applied = 0
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(4)]
    for step in range(200):
        tokens = rng.choice(prefixes)[: rng.randrange(4, 13)] + [rng.randrange(100)] * 4
        hashes = block_hashes(tokens, 4, NAMESPACE)
        rid = f"r{step}"
        cache.match_prefix(rid, hashes)
        if cache.allocate_slots(rid, len(tokens)):
            cache.commit_blocks(rid, hashes)
        cache.free_request(rid)
        if step % 50 == 49:
            cache.clear()
        if step == 120:  # the subscriber missed events: resync from the snapshot
            last_seq, blocks = cache.snapshot()
            index.replace("w0", "device", [h for h, _ in blocks])
            applied = last_seq
        elif step % 3 == 0:
            for event in cache.events.since(applied):
                index.apply("w0", event)
            applied = cache.events.last_seq
    for event in cache.events.since(applied):
        index.apply("w0", event)
    held = {h for h, _ in cache.snapshot()[1]}
    assert index.num_blocks("w0") == len(held)
    assert all(index.holds("w0", h) for h in held)


def test_a_budget_forgets_the_least_recently_used_blocks_and_counts_them() -> None:
    index = KVBlockIndex(max_entries=6)
    index.apply("w0", stored(1, [1, 2, 3]))
    index.apply("w1", stored(1, [1, 2]))
    assert (index.num_entries, index.evicted_entries) == (5, 0)
    index.match_holders([1, 2], now=0.0)  # 1 and 2 are used: 3 is the coldest now
    index.apply("w1", stored(2, [7, 8]))
    assert index.num_entries <= 6
    assert index.evicted_entries == 1
    assert index.match([1, 2, 3], ["w0"], now=0.0)["w0"].num_blocks == 2
    index.apply("w0", KVEvent(2, "removed", "device", (3,), None))  # already forgotten
    index.apply("w1", KVEvent(3, "cleared", "device", (), None))
    assert index.num_entries == 2
    assert index.num_blocks("w0") == 2


def test_one_holder_is_stored_compactly_many_as_a_mask() -> None:
    index = KVBlockIndex()
    for w in range(300):
        index.apply(f"w{w}", stored(1, [w]))  # block w on worker w alone
    index.apply("w5", stored(2, [299]))
    assert [index.holds("w299", 299), index.holds("w5", 299), index.holds("w5", 5)] == [
        True,
        True,
        True,
    ]
    index.apply("w299", KVEvent(2, "removed", "device", (299,), None))
    assert index.match_holders([299], now=0.0).keys() == {"w5"}
    assert index.num_entries == 300


def test_blocks_held_alone_cost_under_140_bytes_an_entry_at_1000_workers() -> None:
    """What a (block, holder) entry costs, all of it (two dict entries and the hash's
    int): a block one worker holds alone shares its ``~bit`` with that worker's other
    such blocks (an int made per block made it 164 bytes)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KVBlockIndex()
        for w in range(1000):
            first = w * 200
            index.apply(f"w{w}", stored(1, list(range(first, first + 200))))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.num_entries == 200_000
    assert used / index.num_entries < 140
