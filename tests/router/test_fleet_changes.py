"""Run-time fleet changes over the sibling links: process 0 orders them, every process
applies them in that order, and the asking process has applied one when it answers."""

from __future__ import annotations

import asyncio
import socket

from kvserve.router.fleet_changes import Change, FleetChanges
from kvserve.router.sibling_links import SiblingLinks


class _Registry:
    """What a process's apply does, in miniature: ids in registration order."""

    def __init__(self) -> None:
        self.applied: list[Change] = []
        self.urls: list[str] = []

    def apply(self, change: Change) -> Change:
        self.applied.append(change)
        if change["url"] in self.urls:
            return {"status": 409, "code": "bad_worker", "error": "already registered"}
        self.urls.append(change["url"])
        return {"worker_id": f"w{len(self.urls) - 1}"}


def _group(count: int) -> tuple[list[SiblingLinks], list[_Registry], list[FleetChanges]]:
    pairs = {(a, b): socket.socketpair() for a in range(count) for b in range(a + 1, count)}
    links = []
    for index in range(count):
        mine = [
            ends[0] if index == a else ends[1] for (a, b), ends in pairs.items() if index in (a, b)
        ]
        links.append(SiblingLinks(mine, index))
    registries = [_Registry() for _ in range(count)]
    fleets = [
        FleetChanges(registry.apply, link, index, timeout_s=2.0)
        for index, (registry, link) in enumerate(zip(registries, links, strict=True))
    ]
    return links, registries, fleets


def test_changes_asked_of_any_process_apply_everywhere_in_one_order() -> None:
    async def scenario() -> tuple[list[Change], list[_Registry]]:
        links, registries, fleets = _group(3)
        for link, fleet in zip(links, fleets, strict=True):
            await link.start(fleet.on_message)
        asks = [
            fleets[2].change({"url": "http://a"}),
            fleets[1].change({"url": "http://b"}),
            fleets[0].change({"url": "http://c"}),
            fleets[2].change({"url": "http://b"}),  # a duplicate: one of the two is refused
        ]
        results = list(await asyncio.gather(*asks))
        for _ in range(50):  # the last broadcasts reach the process that did not ask
            if all(len(r.urls) == 3 for r in registries):
                break
            await asyncio.sleep(0.01)
        for link in links:
            link.close()
        return results, registries

    results, registries = asyncio.run(scenario())
    added = sorted(r["worker_id"] for r in results if "worker_id" in r)
    assert added == ["w0", "w1", "w2"]  # distinct ids, whichever process asked
    assert [r.get("status") for r in results].count(409) == 1  # one of the two "b"s
    assert registries[0].urls == registries[1].urls == registries[2].urls
    assert sorted(registries[0].urls) == ["http://a", "http://b", "http://c"]


def test_the_asking_process_has_applied_the_change_when_it_answers() -> None:
    async def scenario() -> tuple[Change, list[str]]:
        links, registries, fleets = _group(2)
        for link, fleet in zip(links, fleets, strict=True):
            await link.start(fleet.on_message)
        result = await fleets[1].change({"url": "http://a"})
        seen = list(registries[1].urls)
        for link in links:
            link.close()
        return result, seen

    result, seen = asyncio.run(scenario())
    assert result == {"worker_id": "w0"} and seen == ["http://a"]


def test_a_silent_ordering_process_gives_503_not_a_hang() -> None:
    async def scenario() -> Change:
        links, registries, _ = _group(2)
        asking = FleetChanges(registries[1].apply, links[1], 1, timeout_s=0.2)
        await links[1].start(asking.on_message)  # process 0 never reads its link
        result = await asking.change({"url": "http://a"})
        for link in links:
            link.close()
        return result

    result = asyncio.run(scenario())
    assert result["status"] == 503 and result["code"] == "fleet_change_timeout"


def test_one_process_applies_at_once() -> None:
    registry = _Registry()
    fleet = FleetChanges(registry.apply)
    assert asyncio.run(fleet.change({"url": "http://a"})) == {"worker_id": "w0"}
    assert registry.urls == ["http://a"]
