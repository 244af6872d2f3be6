"""Sibling links carry a router's processes' announcements (the same as router replicas'):
cache_aware's tree records, kv_aware's predictions, prefill/decode pairs, their undos, and
kv_aware's notices to re-read a worker's load."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvserve.core.routing.announcements import PeerView
from kvserve.core.routing.announcing_policy import AnnouncingPolicy
from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies import make_policy
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, WorkerLoad
from kvserve.router.sibling_links import SiblingAnnouncements, SiblingLinks

WORKERS = [WorkerLoad("w0"), WorkerLoad("w1"), WorkerLoad("w2")]


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2000):  # up to 10 s on a loaded box
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def test_messages_arrive_whole_and_in_order_however_large() -> None:
    async def scenario() -> list[object]:
        left, right = socket.socketpair()
        sender, receiver = SiblingLinks([left]), SiblingLinks([right])
        got: list[object] = []
        await sender.start(lambda _record, _link: None)
        await receiver.start(lambda record, _link: got.append(record))
        big = "x" * 3_000_000  # bigger than any socket buffer: split across reads
        for record in (["i", "regular", "m", "short", "w0", 1.5], ["i", "p", "m", big, "w1", 2.0]):
            sender.send(record)
        sender.send(["u", "regular", "m", "short", "w0", 3])
        await _until(lambda: len(got) == 3, "three messages")
        sender.close()
        receiver.close()
        return got

    got = asyncio.run(scenario())
    assert got[0] == ["i", "regular", "m", "short", "w0", 1.5]
    assert got[1][3] == "x" * 3_000_000
    assert got[2] == ["u", "regular", "m", "short", "w0", 3]


async def _link(
    policies: list[Policy], on_load: list[list[str]] | None = None
) -> tuple[list[AnnouncingPolicy], list[SiblingLinks]]:
    """Two processes' policies, as two objects on one loop joined by a socketpair, each
    announcing to the other as the router's processes do (``on_load[i]`` collects the
    workers whose load process ``i`` was told to re-read)."""
    left, right = socket.socketpair()
    links = [SiblingLinks([left]), SiblingLinks([right])]
    routing = []
    for index, (policy, link) in enumerate(zip(policies, links, strict=True)):
        heard = on_load[index].append if on_load is not None else None
        view = PeerView(policy.observe_peer_choice, heard)
        # The tests' clock stands still at 1.0, like the times they route at.
        channel = SiblingAnnouncements(link, index, view, clock=lambda: 1.0)
        await channel.start()
        routing.append(AnnouncingPolicy(policy, channel.announcer))
    return routing, links


async def _linked_pair() -> tuple[AnnouncingPolicy, CacheAwarePolicy, list[SiblingLinks]]:
    """Process A's routing policy and process B's cache_aware policy, linked."""
    b_policy = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    (a_routing, _), links = await _link([CacheAwarePolicy(CacheAwareConfig(), 0.0), b_policy])
    return a_routing, b_policy, links


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
        assert isinstance(a_policy.inner, CacheAwarePolicy)
        assert not a_policy.inner.index.tree("regular", "").match(PROMPT.text)
        await _until(lambda: not tree.match(PROMPT.text), "undo seen")
        for link in links:
            link.close()

    asyncio.run(scenario())


BLOCK = 16
HASHES = [2**63 + i for i in range(1, 41)]  # unsigned 64-bit, as workers hash blocks


def _kv_query() -> RouteQuery:
    tokens = len(HASHES) * BLOCK + 5
    return RouteQuery("x", prefill_tokens=tokens, blocks=PromptBlocks(tokens, HASHES, BLOCK))


def test_kv_aware_predictions_and_loads_reach_the_sibling_and_so_do_undos() -> None:
    async def scenario() -> None:
        a_policy, b_policy = _kv_policies()
        heard: list[list[str]] = [[], []]
        (a_routing, b_routing), links = await _link([a_policy, b_policy], heard)
        decision = a_routing.select(_kv_query(), WORKERS, 1.0)
        worker = decision.worker_id
        b = b_policy.routing
        await _until(lambda: b.index.num_speculative(worker) == len(HASHES), "blocks")
        assert b.queue.queued_s(worker, 1.0) == pytest.approx(
            a_policy.routing.queue.queued_s(worker, 1.0)
        )
        again = b_routing.select(_kv_query(), WORKERS, 1.0)  # B expects them there too
        assert again.worker_id == worker and again.matched_fraction > 0.9
        b_routing.undo(again, 1.0)
        a_routing.undo(decision, 1.0)
        for routing in (a_policy.routing, b):
            await _until(lambda r=routing: r.index.num_speculative(worker) == 0, "withdrawn")
            await _until(lambda r=routing: r.queue.queued_s(worker, 1.0) < 1e-9, "unqueued")
        # A guard change in A: B is told to re-read that worker's total (from the table).
        a_routing.announcer.load(worker, 7, 700)
        await _until(lambda: heard[1] == [worker], "load notice")
        for link in links:
            link.close()

    asyncio.run(scenario())


def _kv_policies() -> tuple[KvAwarePolicy, KvAwarePolicy]:
    a, b = make_policy("kv_aware", 0.0), make_policy("kv_aware", 0.0)
    assert isinstance(a, KvAwarePolicy) and isinstance(b, KvAwarePolicy)
    return a, b


def test_a_kv_aware_pair_choice_reaches_the_sibling_and_so_does_its_undo() -> None:
    """Prefill/decode mode: the prefill queued on the prefill worker and the blocks
    expected on both; the decode worker computes nothing, so nothing is queued there."""

    async def scenario() -> None:
        a_policy, b_policy = _kv_policies()
        (a_routing, _), links = await _link([a_policy, b_policy])
        decodes = [WorkerLoad("d0"), WorkerLoad("d1")]
        prefills = [WorkerLoad("p0"), WorkerLoad("p1")]
        pair = a_routing.select_pair(_kv_query(), decodes, prefills, 1.0, PDConfig())
        assert pair.prefill_worker_id is not None
        b = b_policy.routing
        for worker in (pair.worker_id, pair.prefill_worker_id):
            await _until(lambda w=worker: b.index.num_speculative(w) == len(HASHES), "blocks")
        assert b.queue.queued_s(pair.prefill_worker_id, 1.0) == pytest.approx(
            a_policy.routing.queue.queued_s(pair.prefill_worker_id, 1.0)
        )
        assert b.queue.queued_s(pair.worker_id, 1.0) == 0.0
        a_routing.undo(pair, 1.0)
        for worker in (pair.worker_id, pair.prefill_worker_id):
            await _until(lambda w=worker: b.index.num_speculative(w) == 0, "withdrawn")
        await _until(lambda: b.queue.queued_s(pair.prefill_worker_id, 1.0) < 1e-9, "unqueued")
        for link in links:
            link.close()

    asyncio.run(scenario())


def test_a_cache_aware_pair_choice_is_recorded_in_both_pools_of_the_sibling() -> None:
    async def scenario() -> None:
        b_policy = CacheAwarePolicy(CacheAwareConfig(), 0.0)
        (a_routing, _), links = await _link([CacheAwarePolicy(CacheAwareConfig(), 0.0), b_policy])
        long_prompt = RouteQuery("a system prompt " * 40, prefill_tokens=4000)
        decodes, prefills = [WorkerLoad("d0"), WorkerLoad("d1")], [WorkerLoad("p0")]
        pair = a_routing.select_pair(long_prompt, decodes, prefills, 1.0, PDConfig())
        assert pair.prefill_worker_id == "p0"
        decode_tree = b_policy.index.tree("decode", "")
        prefill_tree = b_policy.index.tree("prefill", "")
        await _until(lambda: decode_tree.match(long_prompt.text).get(pair.worker_id), "decode")
        assert prefill_tree.match(long_prompt.text).get("p0")
        a_routing.undo(pair, 2.0)
        await _until(lambda: not decode_tree.match(long_prompt.text), "decode undone")
        assert not prefill_tree.match(long_prompt.text)
        for link in links:
            link.close()

    asyncio.run(scenario())
