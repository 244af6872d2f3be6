"""Workers that load from one KV store: each member's match is continued by what any of
them announced in their storage tier, and the store's bookkeeping follows every event,
snapshot, eviction and membership change exactly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.kv_index import TIERS, KVBlockIndex, WorkerMatch

PROMPT = [11, 12, 13, 14, 15, 16]


def stored(hashes: list[int], tier: str = "storage") -> KVEvent:
    return KVEvent(1, "stored", tier, tuple(hashes), None)


def split(device: int = 0, host: int = 0, storage: int = 0) -> WorkerMatch:
    return WorkerMatch({"device": device, "host": host, "storage": storage})


def two_members() -> KVBlockIndex:
    """An index where workers ``a`` and ``b`` load from store ``s``."""
    index = KVBlockIndex()
    index.set_store("a", "s")
    index.set_store("b", "s")
    return index


def test_a_members_match_continues_through_what_another_member_stored() -> None:
    index = two_members()
    index.apply("a", stored(PROMPT[:2], "device"))
    index.apply("a", stored(PROMPT[:4]))  # a wrote 4 blocks to the store
    index.apply("b", stored(PROMPT[:1], "device"))
    index.apply("c", stored(PROMPT[:4]))  # c writes to a store of its own
    matches = index.match(PROMPT, ["a", "b", "c", "d"], now=0.0)
    assert matches["a"] == split(device=2, storage=2)
    assert matches["b"] == split(device=1, storage=3)  # a's writes, loaded where b's end
    assert matches["c"] == split(storage=4)
    assert matches["d"].num_blocks == 0
    index.set_store("d", "s")  # joins: everything already stored counts for it at once
    assert index.match(PROMPT, ["d"], now=0.0)["d"] == split(storage=4)
    assert index.match_holders(PROMPT, now=0.0) == {
        "a": split(device=2, storage=2),
        "b": split(device=1, storage=3),
        "c": split(storage=4),
        "d": split(storage=4),
    }
    index.check()


def test_an_eviction_one_member_reports_removes_the_block_for_every_member() -> None:
    index = KVBlockIndex()
    for worker in ("a", "b"):
        index.set_store(worker, "s")
        index.apply(worker, stored(PROMPT[:3]))  # both wrote them (the second: already there)
    index.apply("b", KVEvent(2, "removed", "storage", (PROMPT[1],)))
    assert index.match(PROMPT, ["a", "b"], now=0.0) == {
        "a": split(storage=1),
        "b": split(storage=1),
    }
    assert index.num_blocks("a", "storage") == 2  # its own record of the evicted one went too
    index.check()


def test_a_members_snapshot_replaces_only_what_it_vouched_for() -> None:
    index = two_members()
    index.apply("a", stored(PROMPT[:2]))
    index.apply("b", stored(PROMPT[:3]))
    index.replace("a", "storage", PROMPT[:1])
    assert index.match(PROMPT, ["a"], now=0.0)["a"] == split(storage=3)  # b still vouches
    index.remove_worker("b")
    assert index.match(PROMPT, ["a"], now=0.0)["a"] == split(storage=1)
    index.set_store("a", None)
    assert index.store_of("a") is None
    index.check()


def test_a_member_leaving_its_store_keeps_only_its_own_blocks() -> None:
    index = two_members()
    index.apply("a", stored(PROMPT[:3]))
    index.set_store("b", "t")  # moved to another store
    assert index.match(PROMPT, ["a", "b"], now=0.0) == {"a": split(storage=3), "b": split()}
    index.check()


operation = st.one_of(
    st.tuples(
        st.just("event"),
        st.integers(0, 4),
        st.sampled_from(["stored", "removed", "cleared"]),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(PROMPT), max_size=4),
    ),
    st.tuples(
        st.just("replace"),
        st.integers(0, 4),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(PROMPT), max_size=4),
    ),
    st.tuples(st.just("store"), st.integers(0, 4), st.sampled_from([None, "s", "t"])),
    st.tuples(st.just("leave"), st.integers(0, 4)),
    st.tuples(st.just("match"), st.integers(0, 6)),
)


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(operation, max_size=40), budget=st.sampled_from([None, 6, 30]))
def test_the_stores_bookkeeping_stays_exact_through_any_sequence(
    operations: list[tuple], budget: int | None
) -> None:
    """Events of every kind and tier, snapshots, workers joining, moving between and
    leaving stores, and the index's own budget forgetting blocks: after each, every
    store's record of who vouches for what is a recount of its members' storage tiers,
    and a member's match is its own walk continued by the store."""
    index = KVBlockIndex(max_entries=budget)
    for op in operations:
        worker = f"w{op[1]}" if op[0] != "match" else ""
        if op[0] == "event":
            _, _, kind, tier, hashes = op
            index.apply(worker, KVEvent(1, kind, tier, tuple(hashes), None))
        elif op[0] == "replace":
            index.replace(worker, op[2], op[3])
        elif op[0] == "store":
            index.set_store(worker, op[2])
        elif op[0] == "leave":
            index.remove_worker(worker)
        else:
            hashes = PROMPT[: op[1]]
            everyone = index.match(hashes, [f"w{i}" for i in range(5)], now=0.0)
            assert index.match_holders(hashes, now=0.0) == {
                w: m for w, m in everyone.items() if m.num_blocks
            }
        index.check()
