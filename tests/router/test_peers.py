"""The router's peer channel without processes: what it applies from a peer's batch, what
it refuses, and a silent peer's load dropped after its timeout."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import orjson
import pytest

from kvserve.core.routing.announcements import Announcement, ChoiceNote, LoadNote, PeerView
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.router.app import Router
from kvserve.router.config import RouterConfig
from kvserve.router.peers import PeerLink

URLS = {"w0": "http://127.0.0.1:9000", "w1": "http://127.0.0.1:9001"}
IDS = {url: worker_id for worker_id, url in URLS.items()}


def link(**timing: float) -> tuple[PeerLink, list[ChoiceNote]]:
    recorded: list[ChoiceNote] = []

    def record(note: ChoiceNote, _now: float) -> None:
        recorded.append(note)

    made = PeerLink((), PeerView(record), {}, worker_url=URLS.get, worker_id=IDS.get, **timing)
    return made, recorded


def batch(*announcements: Announcement) -> bytes:
    return orjson.dumps([a.to_json() for a in announcements])


def test_a_batch_is_applied_with_workers_named_by_url() -> None:
    peer, recorded = link()
    sent = Announcement(
        "other",
        choices=(
            ChoiceNote(0, URLS["w1"], (7, 8), 40, 0),
            ChoiceNote(1, "http://gone:1", (), 1, 0),
        ),
        loads=(LoadNote(URLS["w1"], 2, 40),),
    )
    assert peer.receive(batch(sent)) == 1
    assert [(n.worker_id, n.block_hashes) for n in recorded] == [("w1", (7, 8))]
    assert peer.view.load("w1") == (2, 40) and peer.view.load("w0") == (0, 0)


@pytest.mark.parametrize(
    "body", [b"nope", b"{}", b'[{"origin": 1}]', b'[{"origin": "x", "undone": ["a"]}]']
)
def test_a_malformed_batch_is_refused_whole(body: bytes) -> None:
    peer, recorded = link()
    with pytest.raises(ValueError):
        peer.receive(body)
    assert recorded == [] and peer.received == 0


def test_its_own_announcements_are_refused() -> None:
    peer, _ = link()
    with pytest.raises(ValueError, match="itself"):
        peer.receive(batch(Announcement(peer.announcer.origin)))


def test_a_silent_peers_load_is_dropped() -> None:
    peer, _ = link(full_every_s=0.01, peer_timeout_s=0.2)
    peer.receive(batch(Announcement("other", loads=(LoadNote(URLS["w0"], 1, 5),))))
    assert peer.view.load("w0") == (1, 5)

    async def wait_for_expiry() -> None:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(peer.run_forever(session))
            deadline = time.monotonic() + 30
            while peer.view.load("w0") != (0, 0):
                assert time.monotonic() < deadline, "the silent peer's load stayed"
                await asyncio.sleep(0.02)
            task.cancel()

    asyncio.run(wait_for_expiry())
    assert peer.view.origins() == []


def test_a_kv_aware_router_with_peers_takes_its_rank_and_salt_by_its_address() -> None:
    settings = RouterConfig(worker_urls=tuple(URLS.values()), policy="kv_aware", port=8123)
    alone = Router(settings).policy
    assert isinstance(alone, KvAwarePolicy)
    assert alone.routing.salt is None and alone.routing.rank == 0
    peers = ("http://127.0.0.1:10000", "http://127.0.0.1:8122")  # ports compare as numbers
    replica = Router(dataclasses.replace(settings, peer_urls=peers)).policy
    assert isinstance(replica, KvAwarePolicy)
    assert replica.routing.rank == 1 and replica.routing.salt is None  # no salt by default
    salting = dataclasses.replace(
        settings, peer_urls=peers, kv_aware=KvAwareConfig(replica_spread_s=0.05)
    )
    salted = Router(salting).policy
    assert isinstance(salted, KvAwarePolicy) and salted.routing.salt is not None
    assert salted.routing.salt.replica == "127.0.0.1:8123/0"


def test_replicas_rank_themselves_by_host_then_port() -> None:
    ports = (8001, 8000, 8002)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    ranks = [
        RouterConfig(
            worker_urls=("http://127.0.0.1:9",),
            host="127.0.0.1",
            port=port,
            peer_urls=tuple(u for u in urls if not u.endswith(str(port))),
        ).replica_rank()
        for port in ports
    ]
    assert ranks == [1, 0, 2]
    other_host = RouterConfig(
        worker_urls=("http://127.0.0.1:9",),
        host="10.0.0.2",
        port=80,
        peer_urls=("http://10.0.0.1", "https://10.0.0.3"),
    )
    assert other_host.replica_rank() == 1
