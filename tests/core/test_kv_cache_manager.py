"""The per-request façade: block tables, sharing, duplicates, errors, snapshot."""

import pytest

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.invariants import InvariantError
from kvserve.core.kv_cache_errors import RequestStateError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import EventLog, apply_events

NS = make_namespace("manager-test")
BS = 4


def hashes_of(tokens):
    return block_hashes(tokens, BS, NS)


def reusable(tokens):
    """Full blocks that do not hold the last token (it must be computed for logits)."""
    return hashes_of(tokens[:-1])


def run_prompt(kv, request_id, tokens):
    """Match, allocate and publish a whole prompt, as the scheduler would."""
    matched = kv.match_prefix(request_id, reusable(tokens))
    assert kv.allocate_slots(request_id, len(tokens))
    kv.commit_blocks(request_id, hashes_of(tokens))
    kv.check()
    return matched


def test_a_second_request_reuses_the_first_ones_prefix():
    kv = KVCacheManager(16, BS)
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    assert run_prompt(kv, "a", prompt) == 0
    table_a = kv.block_table("a")
    assert len(table_a) == 5 and kv.num_cached_blocks == 4
    kv.free_request("a")
    kv.check()
    assert kv.num_evictable_blocks == 4 and kv.num_free_blocks == 12
    assert run_prompt(kv, "b", [*prompt[:16], 99, 98, 97]) == 4
    assert kv.block_table("b")[:4] == table_a[:4]


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(4, BS)
    run_prompt(kv, "a", list(range(9)))  # 3 blocks, 2 of them cached and pinned
    before = (kv.block_table("b"), kv.num_free_blocks, kv.snapshot())
    assert not kv.allocate_slots("b", 2 * BS)
    assert (kv.block_table("b"), kv.num_free_blocks, kv.snapshot()) == before
    assert kv.allocate_slots("b", BS)
    kv.free_request("a")
    assert kv.allocate_slots("b", 4 * BS)  # evicts a's two cached blocks
    assert kv.num_cached_blocks == 0 and kv.stats.evictions == 2
    kv.check()


def test_allocate_only_grows_the_table():
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots("a", 5)
    table = kv.block_table("a")
    assert kv.allocate_slots("a", 3) and kv.allocate_slots("a", 0)
    assert kv.block_table("a") == table
    assert kv.allocate_slots("a", 9)
    assert kv.block_table("a")[:2] == table and len(kv.block_table("a")) == 3
    kv.check()


def test_duplicate_block_stays_owned_and_the_chain_continues_under_the_cached_one():
    kv = KVCacheManager(16, BS)
    prompt = list(range(12))
    for request_id in ("a", "b"):  # both computed before either published
        kv.match_prefix(request_id, reusable(prompt))
        assert kv.allocate_slots(request_id, len(prompt) + BS)
    kv.commit_blocks("a", hashes_of(prompt))
    kv.commit_blocks("b", hashes_of(prompt))
    kv.check()
    assert kv.num_cached_blocks == 3
    longer = [*prompt, 50, 51, 52, 53]
    kv.commit_blocks("b", hashes_of(longer))  # b's 4th block continues under a's blocks
    kv.check()
    kv.free_request("a")
    kv.check()
    assert kv.num_evictable_blocks == 0  # b pins the whole chain it extends
    kv.free_request("b")
    kv.check()
    assert kv.num_cached_blocks == 4 == kv.num_evictable_blocks
    assert kv.num_free_blocks == 12


def test_commit_is_idempotent_and_checks_its_hashes():
    kv = KVCacheManager(8, BS)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    seq = kv.events.last_seq
    kv.commit_blocks("a", hashes_of(prompt))
    kv.commit_blocks("a", hashes_of(prompt)[:1])
    assert kv.events.last_seq == seq
    with pytest.raises(RequestStateError, match="4 block hashes for a table of 3 blocks"):
        kv.commit_blocks("a", hashes_of([*prompt, *range(7)]))
    with pytest.raises(RequestStateError, match="hash of block 1 differs"):
        kv.commit_blocks("a", hashes_of([0, 1, 2, 3, 9, 9, 9, 9, 8, 8, 8, 8]))
    with pytest.raises(RequestStateError, match="'nobody' holds no blocks"):
        kv.commit_blocks("nobody", hashes_of(prompt))
    kv.check()


def test_matching_again_while_owning_blocks_is_refused():
    kv = KVCacheManager(8, BS)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    kv.free_request("a")
    assert kv.match_prefix("b", reusable(prompt)) == 2
    # Owning nothing yet, b may retry its match (the scheduler's admission retry).
    assert kv.match_prefix("b", reusable(prompt)) == 2
    kv.check()
    assert kv.allocate_slots("b", len(prompt))
    with pytest.raises(RequestStateError, match="'b' owns blocks"):
        kv.match_prefix("b", reusable(prompt))
    kv.check()


def test_free_request_is_idempotent_for_unknown_ids():
    kv = KVCacheManager(4, BS)
    kv.free_request("never-seen")
    run_prompt(kv, "a", list(range(5)))
    kv.free_request("a")
    kv.free_request("a")
    assert kv.block_table("a") == []
    assert kv.num_available_blocks == 4
    kv.check()


def test_snapshot_plus_later_events_rebuild_the_content():
    events = EventLog()
    kv = KVCacheManager(8, BS, tier="host", events=events)
    assert kv.events is events and kv.tier == "host"
    run_prompt(kv, "a", list(range(13)))
    kv.free_request("a")
    last_seq, blocks = kv.snapshot()
    view = dict(blocks)
    run_prompt(kv, "b", [7, 7, 7, 7, 7])
    kv.evict(2)
    later = events.since(last_seq)
    assert {event.tier for event in later} == {"host"}
    apply_events(view, later)
    assert view == dict(kv.snapshot()[1])
    kv.free_request("b")
    kv.clear()
    assert kv.snapshot() == (events.last_seq, [])
    assert events.since(events.last_seq - 1)[0].kind == "cleared"
    kv.check()


def test_check_notices_a_pin_no_request_holds():
    kv = KVCacheManager(8, BS)
    run_prompt(kv, "a", list(range(9)))
    kv._ledger.pin([kv.block_table("a")[0]])
    with pytest.raises(InvariantError, match="ref counts"):
        kv.check()
