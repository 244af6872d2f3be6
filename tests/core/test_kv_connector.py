"""The scheduler's side of KV connectors: which hooks it calls when, and two connectors
combined."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.hashing import block_hashes
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_connector import SchedulerConnectors
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler, SchedulerConfig

NS = b"test"
BS = 4


@dataclass
class RecordingConnector:
    """A scheduler connector that refuses the ids in ``refuse`` and records every call
    (with the request's state at that moment)."""

    refuse: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    blocks_at_preempt: dict[str, int] = field(default_factory=dict)
    cache: KVCacheManager | None = None

    def request_added(self, request: Request) -> None:
        self.calls.append(("added", request.request_id))

    def may_admit(self, request: Request) -> bool:
        self.calls.append(("may_admit", request.request_id))
        return request.request_id not in self.refuse

    def before_preempt(self, request: Request) -> None:
        self.calls.append(("preempt", request.request_id))
        assert request.status is RequestStatus.RUNNING
        if self.cache is not None:  # its blocks are still its own
            self.blocks_at_preempt[request.request_id] = len(
                self.cache.block_table(request.request_id)
            )

    def request_finished(self, request: Request) -> None:
        self.calls.append(("finished", request.request_id))
        assert request.status is RequestStatus.FINISHED


def _request(request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        namespace=NS,
        block_size=BS,
    )


def test_every_event_of_a_request_reaches_the_connector() -> None:
    connector = RecordingConnector()
    scheduler = Scheduler(KVCacheManager(16, BS), connector=connector)
    request = _request("a", [1] * 9)
    scheduler.add(request)
    scheduler.schedule()
    scheduler.finish(request, "stop")
    scheduler.finish(request, "stop")  # already gone: not told twice
    assert connector.calls == [("added", "a"), ("may_admit", "a"), ("finished", "a")]


def test_aborted_and_rejected_requests_are_finished_for_the_connector() -> None:
    connector = RecordingConnector()
    scheduler = Scheduler(KVCacheManager(4, BS), connector=connector)
    scheduler.add(_request("aborted", [1] * 5))
    scheduler.add(_request("too_long", [2] * 20))  # more than the whole pool
    scheduler.abort("aborted")
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.finished_before_run] == ["too_long"]
    assert ("finished", "aborted") in connector.calls
    assert ("finished", "too_long") in connector.calls
    assert ("may_admit", "too_long") not in connector.calls


def test_the_victim_is_announced_while_it_still_holds_its_blocks() -> None:
    cache = KVCacheManager(6, BS)
    connector = RecordingConnector(cache=cache)
    scheduler = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=64), connector)
    old, new = _request("old", [1] * 11, max_tokens=8), _request("new", [2] * 11, max_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    preempted: list[Request] = []
    while not preempted:
        plan = scheduler.schedule()
        preempted = plan.preempted
        scheduler.advance(plan)
        for chunk in plan.chunks:
            if chunk.completes_sequence:
                chunk.request.token_ids.append(7)
    [victim] = preempted
    assert ("preempt", victim.request_id) in connector.calls
    assert connector.blocks_at_preempt[victim.request_id] >= 3
    assert not cache.block_table(victim.request_id)  # freed after the connector was told
    cache.check()


def test_combined_connectors_all_hear_and_must_all_consent() -> None:
    first, second = RecordingConnector(refuse={"x"}), RecordingConnector(refuse={"y"})
    combined = SchedulerConnectors([first, second])
    scheduler = Scheduler(KVCacheManager(16, BS), connector=combined)
    for request_id in ("x", "y", "z"):
        scheduler.add(_request(request_id, [ord(request_id)] * 5))
    plan = scheduler.schedule()
    assert [chunk.request.request_id for chunk in plan.chunks] == ["z"]
    # The first refusal ends the asking: "x" never reached the second connector.
    assert ("may_admit", "x") not in second.calls
    assert ("may_admit", "y") in first.calls and ("may_admit", "y") in second.calls
    for connector in (first, second):
        assert [c for c in connector.calls if c[0] == "added"] == [
            ("added", "x"), ("added", "y"), ("added", "z")
        ]  # fmt: skip
    scheduler.abort("x")
    assert ("finished", "x") in first.calls and ("finished", "x") in second.calls


def test_a_refused_request_keeps_its_place_and_its_hashes() -> None:
    cache = KVCacheManager(16, BS)
    connector = RecordingConnector(refuse={"a"})
    scheduler = Scheduler(cache, connector=connector)
    request = _request("a", [3] * 9)
    scheduler.add(request)
    for _ in range(3):
        assert not scheduler.schedule().chunks
    assert scheduler.waiting == [request] and cache.num_free_blocks == 16
    assert request.reusable_block_hashes() == block_hashes([3] * 8, BS, NS)
