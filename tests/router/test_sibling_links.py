"""Sibling links carry cache_aware's tree records between a router's processes."""

from __future__ import annotations

import asyncio
import socket

from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.types import RouteQuery, WorkerLoad
from kvserve.router.sibling_links import Record, SiblingLinks, TreeReplication

WORKERS = [WorkerLoad("w0"), WorkerLoad("w1"), WorkerLoad("w2")]


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2000):  # up to 10 s on a loaded box
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def test_records_arrive_whole_and_in_order_however_large() -> None:
    async def scenario() -> list[Record]:
        left, right = socket.socketpair()
        sender, receiver = SiblingLinks([left]), SiblingLinks([right])
        got: list[Record] = []
        await sender.start(lambda _record: None)
        await receiver.start(got.append)
        big = "x" * 3_000_000  # bigger than any socket buffer: split across reads
        for record in (["i", "regular", "m", "short", "w0", 1.5], ["i", "p", "m", big, "w1", 2.0]):
            sender.send(record)
        sender.send(["u", "regular", "m", "short", "w0", 3])
        await _until(lambda: len(got) == 3, "three records")
        sender.close()
        receiver.close()
        return got

    got = asyncio.run(scenario())
    assert got[0] == ["i", "regular", "m", "short", "w0", 1.5]
    assert got[1][3] == "x" * 3_000_000
    assert got[2] == ["u", "regular", "m", "short", "w0", 3]


async def _linked_pair() -> tuple[CacheAwarePolicy, CacheAwarePolicy, list[SiblingLinks]]:
    """Two processes' policies, as two objects on one loop joined by a socketpair."""
    left, right = socket.socketpair()
    a_policy = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    b_policy = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    links = [SiblingLinks([left]), SiblingLinks([right])]
    for policy, link in zip((a_policy, b_policy), links, strict=True):
        await link.start(TreeReplication(policy, link).apply)
    return a_policy, b_policy, links


PROMPT = RouteQuery("a long shared system prompt, then a question", prefill_tokens=10)


def test_a_prompt_routed_by_one_process_is_a_hit_in_the_other() -> None:
    async def scenario() -> None:
        a_policy, b_policy, links = await _linked_pair()
        decision = a_policy.select(PROMPT, WORKERS, 1.0)
        tree = b_policy.index.tree("regular", "")
        await _until(lambda: tree.match(PROMPT.text).get(decision.worker_id), "insert seen")
        again = b_policy.select(PROMPT, WORKERS, 2.0)  # process B routes the next turn
        assert again.worker_id == decision.worker_id and again.reason == "cache_hit"
        for link in links:
            link.close()

    asyncio.run(scenario())


def test_an_undone_decision_is_taken_back_in_every_process() -> None:
    async def scenario() -> None:
        a_policy, b_policy, links = await _linked_pair()
        decision = a_policy.select(PROMPT, WORKERS, 1.0)
        tree = b_policy.index.tree("regular", "")
        await _until(lambda: tree.match(PROMPT.text), "insert seen")
        a_policy.undo(decision, 2.0)  # the attempt failed before its first token
        assert not a_policy.index.tree("regular", "").match(PROMPT.text)
        await _until(lambda: not tree.match(PROMPT.text), "undo seen")
        for link in links:
            link.close()

    asyncio.run(scenario())
