"""The speculative masks the index's walk reads, kept in shards: after any sequence of
speculations, expiries, take-backs, confirming events and departures, each hash's mask is
exactly the OR of the workers speculating it, in the hash's own shard, and nothing else
is kept (no empty mask, no batch left behind once every deadline passed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_index import TIERS, KVBlockIndex
from kvserve.core.routing.speculative_masks import SHARD_MASK, SHARDS, SpeculativeMasks

WORKERS = [f"w{i}" for i in range(5)]
# hashes landing in a few shards (multiples of SHARDS apart) and in many
HASHES = st.one_of(st.integers(0, 40), st.integers(0, 6).map(lambda i: i * SHARDS + 3))

step = st.one_of(
    st.tuples(st.just("speculate"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=12)),
    st.tuples(st.just("withdraw"), st.integers(0, 30)),  # the n-th speculation so far
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),
    st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS)),
    st.tuples(st.just("advance"), st.floats(0.0, 0.7)),
)


def expected_masks(index: KVBlockIndex) -> dict[int, int]:
    """Each speculated hash's mask, from the workers' own pending entries."""
    masks: dict[int, int] = {}
    for worker_id, pending in index._speculative.items():
        bit = 1 << index.slot(worker_id) * len(TIERS)
        for block_hash in pending:
            masks[block_hash] = masks.get(block_hash, 0) | bit
    return masks


def assert_consistent(index: KVBlockIndex) -> None:
    masks = index._speculative_holders
    for shard_number, shard in enumerate(masks.shards):
        assert all(block_hash & SHARD_MASK == shard_number for block_hash in shard)
        assert all(shard.values()), "no empty mask is kept"
    assert dict(masks.items()) == expected_masks(index)
    assert len(masks) == len(expected_masks(index))


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(step, max_size=40))
def test_the_sharded_masks_are_the_or_of_each_workers_speculation(steps: list[tuple]) -> None:
    index = KVBlockIndex()
    now, ttl = 0.0, 1.0
    made: list[tuple[str, list[int], float]] = []
    for kind, *args in steps:
        if kind == "speculate":
            worker_id, hashes = args
            index.speculate(worker_id, hashes, now + ttl)
            made.append((worker_id, hashes, now + ttl))
        elif kind == "withdraw" and made:
            index.withdraw(*made[args[0] % len(made)])
        elif kind == "store":
            worker_id, hashes = args
            index.apply(worker_id, KVEvent(1, "stored", "device", tuple(hashes), None))
        elif kind == "remove_worker":
            index.remove_worker(args[0])
        elif kind == "advance":
            now += args[0]
            index.expire(now)
        assert_consistent(index)
    index.expire(now + ttl)
    assert len(index._speculative_holders) == 0
    assert not index._batches and not index._deadlines


def test_a_hash_speculated_by_one_worker_shares_its_bit_and_a_second_widens_it() -> None:
    masks = SpeculativeMasks()
    first, second = 1 << 3000, 1 << 6
    masks.add([7, 7 + SHARDS], first)
    assert masks.get(7) is first  # no copy of a 1,000-worker fleet's wide bit
    masks.add([7], second)
    assert masks.get(7) == first | second and masks.get(7 + SHARDS) is first
    masks.drop_all([7], first)
    assert masks.get(7) == second
    masks.drop_all([7], second)
    masks.drop_all([7 + SHARDS], first)
    assert masks.get(7) == 0 and len(masks) == 0
