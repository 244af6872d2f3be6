"""Sibling links carry cache_aware's tree records and kv_aware's predictions and load
changes between a router's processes."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.policies import make_policy
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad
from kvserve.router.sibling_links import KvReplication, Record, SiblingLinks, TreeReplication

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


BLOCK = 16
HASHES = [2**63 + i for i in range(1, 41)]  # unsigned 64-bit, as workers hash blocks


def _kv_query() -> RouteQuery:
    tokens = len(HASHES) * BLOCK + 5
    return RouteQuery("x", prefill_tokens=tokens, blocks=PromptBlocks(tokens, HASHES, BLOCK))


async def _linked_kv_pair(
    fleet_load: dict[str, WorkerLoad],
) -> tuple[KvAwarePolicy, KvAwarePolicy, list[SiblingLinks], list[KvReplication]]:
    left, right = socket.socketpair()
    policies = [make_policy("kv_aware", 0.0), make_policy("kv_aware", 0.0)]
    links = [SiblingLinks([left]), SiblingLinks([right])]
    replications = []
    for policy, link in zip(policies, links, strict=True):
        assert isinstance(policy, KvAwarePolicy)
        replication = KvReplication(policy.routing, link, fleet_load.__getitem__)
        replications.append(replication)
        await link.start(replication.apply)
    a, b = policies
    assert isinstance(a, KvAwarePolicy) and isinstance(b, KvAwarePolicy)
    return a, b, links, replications


def test_kv_aware_predictions_and_loads_reach_the_sibling_and_so_do_undos() -> None:
    async def scenario() -> None:
        fleet = {w.worker_id: w for w in WORKERS}
        a_policy, b_policy, links, (a_copy, _) = await _linked_kv_pair(fleet)
        decision = a_policy.select(_kv_query(), WORKERS, 1.0)
        worker = decision.worker_id
        b = b_policy.routing
        await _until(lambda: b.index.num_speculative(worker) == len(HASHES), "blocks")
        assert b.queue.queued_s(worker, 1.0) == pytest.approx(
            a_policy.routing.queue.queued_s(worker, 1.0)
        )
        again = b_policy.select(_kv_query(), WORKERS, 1.0)  # B expects them there too
        assert again.worker_id == worker and again.matched_fraction > 0.9
        b_policy.undo(again, 1.0)
        a_policy.undo(decision, 1.0)
        for routing in (a_policy.routing, b):
            await _until(lambda r=routing: r.index.num_speculative(worker) == 0, "withdrawn")
            await _until(lambda r=routing: r.queue.queued_s(worker, 1.0) < 1e-9, "unqueued")
        # A guard change in A: B's load order re-reads the fleet's total for that worker.
        fleet[worker] = WorkerLoad(worker, 7, 700)
        a_copy.load_changed(worker)
        await _until(lambda: b.loads._loads[worker].sort_key == (7, 700), "load re-read")
        for link in links:
            link.close()

    asyncio.run(scenario())
