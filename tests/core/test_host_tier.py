"""The host tier's index: capacity, LRU leaf eviction, prefix closure, events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.host_tier import HostTierIndex
from kvserve.core.kv_events import EventLog, apply_events


def test_insert_lookup_and_events() -> None:
    events = EventLog()
    index = HostTierIndex(4, events=events)
    assert index.insert([1, 2, 3], None) == (0, [0, 1, 2])
    assert index.prefix_len([1, 2, 3, 9]) == 3
    assert index.prefix_len([1, 2, 3, 9], start=1) == 2
    assert index.slots([2, 3]) == [1, 2]
    assert index.insert([1, 2, 3, 4], None) == (3, [3])
    [first, second] = events.since(0)
    assert (first.kind, first.tier, first.block_hashes, first.parent_hash) == (
        "stored", "host", (1, 2, 3), None,
    )  # fmt: skip
    assert (second.block_hashes, second.parent_hash) == ((4,), 3)
    index.check()


def test_eviction_takes_the_least_recently_used_leaf_never_a_prefix() -> None:
    index = HostTierIndex(4)
    index.insert([1, 2], None)
    index.insert([7, 8], None)
    index.touch([1, 2])  # chain 7-8 is now the older one
    first, slots = index.insert([1, 2, 3], None)
    assert (first, len(slots)) == (2, 1)
    assert 8 not in index and 7 in index  # the leaf went, its prefix stayed
    index.insert([5], None)
    assert 7 not in index  # now a leaf itself, and the oldest
    index.check()


def test_a_chain_never_evicts_its_own_prefix_and_stops_when_full() -> None:
    index = HostTierIndex(3)
    assert index.insert([1, 2, 3, 4, 5], None) == (0, [0, 1, 2])
    assert index.prefix_len([1, 2, 3]) == 3
    index.check()


def test_a_chain_under_a_missing_parent_is_not_added() -> None:
    index = HostTierIndex(3)
    assert index.insert([5, 6], 4) == (0, [])
    assert len(index) == 0
    with pytest.raises(ValueError):
        HostTierIndex(0)


def test_clear_empties_and_says_so() -> None:
    events = EventLog()
    index = HostTierIndex(2, events=events)
    index.clear()
    assert events.last_seq == 0
    index.insert([1], None)
    index.clear()
    assert events.since(1)[0].kind == "cleared" and len(index) == 0
    index.check()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=40
    ),
    st.integers(1, 8),
)
def test_random_use_keeps_every_invariant_and_the_events_describe_the_content(
    operations: list[tuple[int, int, bool]], capacity: int
) -> None:
    events = EventLog()
    index = HostTierIndex(capacity, events=events)
    view: dict[int, int | None] = {}
    for root, length, touch in operations:
        chain = [root * 100 + i for i in range(length)]  # chains share prefixes by root
        if touch and index.prefix_len(chain):
            index.touch(chain[: index.prefix_len(chain)])
        else:
            index.insert(chain, None)
        index.check()
    apply_events(view, events.since(0))
    assert set(view) == {
        h for root in range(6) for h in range(root * 100, root * 100 + 6) if h in index
    }
