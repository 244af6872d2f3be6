"""The two core hooks the KV tiers use: an unpinned prefix lookup and a connector's
admission gate."""

from __future__ import annotations

from kvserve.core.hashing import block_hashes
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from tests.core.test_kv_connector import RecordingConnector

NS = b"test"
BS = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id, tokens, SamplingParams(max_tokens=4), max_tokens=4, namespace=NS, block_size=BS
    )


def test_lookup_prefix_pins_nothing() -> None:
    cache = KVCacheManager(8, BS)
    hashes = block_hashes(list(range(12)), BS, NS)
    cache.allocate_slots("a", 12)
    cache.commit_blocks("a", hashes)
    table = cache.block_table("a")
    cache.free_request("a")
    assert cache.lookup_prefix(hashes) == table
    assert cache.lookup_prefix([hashes[0], 999, hashes[2]]) == table[:1]
    assert cache.lookup_prefix([hashes[1]]) == [table[1]]  # any cached path start
    assert cache.num_evictable_blocks == 3  # nothing pinned
    cache.check()


def test_a_gated_request_waits_while_later_ones_are_admitted() -> None:
    cache = KVCacheManager(16, BS)
    loading = {"first"}
    scheduler = Scheduler(cache, connector=RecordingConnector(refuse=loading))
    first, second = _request("first", [1] * 9), _request("second", [2] * 9)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["second"]
    assert first.status is RequestStatus.WAITING and scheduler.waiting == [first]
    loading.clear()
    plan = scheduler.schedule()
    assert "first" in [chunk.request.request_id for chunk in plan.chunks]
    assert first.status is RequestStatus.RUNNING
    cache.check()
