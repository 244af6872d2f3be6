"""The same-host shared-memory path of the TCP transfer, on real loopback sockets and real
``/dev/shm`` segments: the prefill side writes runs into a segment it can map and falls
back to payload frames when it cannot; the decode side unlinks its segment however the
transfer ends."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from aiohttp import web

from kvserve.router.ports import free_port
from kvserve.worker.kv_transfer import KVTransferError
from kvserve.worker.pd_wire import recv_frame_head, send_frame
from kvserve.worker.shm_landing import SHM_DIR, Segment, SegmentMaps, host_id
from kvserve.worker.tcp_kv_transfer import TCPKVReceiver, TCPKVSender
from tests.worker.test_tcp_kv_wire import (
    LAYOUT,
    TOKENS,
    HeldExports,
    blocks,
    connect,
    request,
    sees_the_end,
    until,
)


def own_segments() -> set[str]:
    """This process's segments in ``/dev/shm`` (the decode side names them by pid)."""
    return {name for name in os.listdir(SHM_DIR) if name.startswith(f"kvserve-pd-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    assert own_segments() == set()
    yield
    assert own_segments() == set()


async def serve_sender(same_host_shm: bool = True) -> tuple[TCPKVSender, HeldExports]:
    exports = HeldExports()
    sender = TCPKVSender(exports, LAYOUT, "127.0.0.1", request_timeout_s=2.0, merge_bytes=0,
                         same_host_shm=same_host_shm)  # fmt: skip
    await sender.start()
    return sender, exports


def read_frames(peer: socket.socket, count: int) -> list[tuple[dict[str, Any], bytes]]:
    frames = []
    for _ in range(count):
        header, payload_len = recv_frame_head(peer)
        frames.append((header, peer.recv(payload_len, socket.MSG_WAITALL) if payload_len else b""))
    return frames


# --- the prefill side ----------------------------------------------------------------------


async def test_runs_are_placed_in_the_offered_segment_and_announced_without_payload() -> None:
    sender, exports = await serve_sender()
    shared = Segment(6 * LAYOUT.block_nbytes)
    name, segment = shared.name, shared.memory
    try:
        offer = {"name": name, "bytes": segment.nbytes, "host_id": host_id()}
        with await connect(sender.port) as peer:
            await asyncio.to_thread(send_frame, peer, request(2, 8) | {"shm": offer})
            await until(lambda: len(exports.sinks) == 1, "the export started")
            (sink,) = exports.sinks.values()
            sink.blocks(2, blocks(1, 1.0))
            sink.blocks(3, blocks(5, 2.0))
            sink.done(8)
            frames = await asyncio.to_thread(read_frames, peer, 3)
            assert frames == [
                ({"type": "blocks", "first_block": 2, "num_blocks": 1, "placed": True}, b""),
                ({"type": "blocks", "first_block": 3, "num_blocks": 5, "placed": True}, b""),
                ({"type": "done", "cached_tokens": 8}, b""),
            ]
            placed = segment.view(torch.float32).reshape(6, *LAYOUT.block_shape)
            assert placed[0].eq(1.0).all() and placed[1:].eq(2.0).all()
            assert await sees_the_end(peer)
    finally:
        shared.close()
        await sender.close()


def offers() -> list[tuple[str, Any]]:
    return [
        ("another host", lambda name, size: {"name": name, "bytes": size, "host_id": "elsewhere"}),
        ("another size", lambda name, size: {"name": name, "bytes": size + 1,
                                             "host_id": host_id()}),
        ("a missing segment", lambda name, size: {"name": "kvserve-pd-1-0123456789abcdef",
                                                  "bytes": size, "host_id": host_id()}),
        ("a foreign file", lambda name, size: {"name": "../etc/passwd", "bytes": size,
                                               "host_id": host_id()}),
        ("no offer", lambda name, size: None),
    ]  # fmt: skip


@pytest.mark.parametrize(("what", "offer"), offers(), ids=[what for what, _ in offers()])
async def test_an_offer_this_host_cannot_serve_gets_payload_frames(what: str, offer: Any) -> None:
    sender, exports = await serve_sender()
    shared = Segment(LAYOUT.block_nbytes)
    name, segment = shared.name, shared.memory
    try:
        with await connect(sender.port) as peer:
            shm = offer(name, segment.nbytes)
            await asyncio.to_thread(send_frame, peer, request(0, 1) | {"shm": shm})
            await until(lambda: len(exports.sinks) == 1, "the export started")
            (sink,) = exports.sinks.values()
            sink.blocks(0, blocks(1, 3.0))
            sink.done(0)
            (run, _) = await asyncio.to_thread(read_frames, peer, 2)
            assert run[0] == {"type": "blocks", "first_block": 0, "num_blocks": 1}
            assert len(run[1]) == LAYOUT.block_nbytes
        assert segment.eq(0).all()  # nothing was written into it
        assert not os.path.exists(SHM_DIR / "kvserve-pd-1-0123456789abcdef")  # never created
    finally:
        shared.close()
        await sender.close()


async def test_a_sender_told_socket_ignores_offers() -> None:
    sender, exports = await serve_sender(same_host_shm=False)
    shared = Segment(LAYOUT.block_nbytes)
    name, segment = shared.name, shared.memory
    try:
        assert sender.info()["host_id"] == ""  # decode workers offer it no segment
        offer = {"name": name, "bytes": segment.nbytes, "host_id": host_id()}
        with await connect(sender.port) as peer:
            await asyncio.to_thread(send_frame, peer, request(0, 1) | {"shm": offer})
            await until(lambda: len(exports.sinks) == 1, "the export started")
            (sink,) = exports.sinks.values()
            sink.blocks(0, blocks(1, 3.0))
            (run,) = await asyncio.to_thread(read_frames, peer, 1)
            assert "placed" not in run[0] and len(run[1]) == LAYOUT.block_nbytes
    finally:
        shared.close()
        await sender.close()


# --- the decode side -----------------------------------------------------------------------


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[str, TCPKVSender, HeldExports]]:
    """A held-exports sender behind ``/pd/info``."""
    sender, exports = await serve_sender()

    async def info(_: web.Request) -> web.Response:
        return web.json_response(sender.info())

    app = web.Application()
    app.router.add_get("/pd/info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", sender, exports
    finally:
        await runner.cleanup()
        await sender.close()


class Installs:
    def __init__(self) -> None:
        self.runs: list[tuple[int, torch.Tensor]] = []

    async def __call__(self, first_block: int, run: torch.Tensor) -> None:
        self.runs.append((first_block, run.clone()))


async def test_a_same_host_fetch_lands_in_shared_memory_and_unlinks_it(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    installs = Installs()
    receiver = TCPKVReceiver(LAYOUT, 10.0)
    fetching = asyncio.ensure_future(receiver.fetch(url, TOKENS, 2, 8, installs))
    await until(lambda: len(exports.sinks) == 1, "the export started")
    assert len(own_segments()) == 1  # the decode side offered a segment
    (sink,) = exports.sinks.values()
    sink.blocks(2, blocks(2, 4.0))
    sink.blocks(4, blocks(4, 5.0))
    sink.done(8)
    assert await fetching == 8
    assert [(first, len(run)) for first, run in installs.runs] == [(2, 2), (4, 4)]
    assert installs.runs[0][1].eq(4.0).all() and installs.runs[1][1].eq(5.0).all()
    assert len(own_segments()) == 1
    assert receiver.segments.free_bytes > 0  # kept for the next transfer
    receiver.close()  # as the worker does when it stops


async def test_a_finished_transfers_segment_serves_the_next_one(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    receiver = TCPKVReceiver(LAYOUT, 10.0)
    offered: list[set[str]] = []
    for started, fill in ((1, 1.0), (2, 2.0)):
        installs = Installs()
        fetching = asyncio.ensure_future(receiver.fetch(url, TOKENS, 0, 4, installs))
        await until(lambda n=started: len(exports.sinks) == n, "the export started")
        offered.append(own_segments())
        sink = list(exports.sinks.values())[-1]
        sink.blocks(0, blocks(4, fill))
        sink.done(0)
        assert await fetching == 0
        assert installs.runs[0][1].eq(fill).all()
    assert offered[0] == offered[1] and len(offered[0]) == 1
    assert receiver.segments.free_bytes == 1 << 20  # one segment, the smallest size
    receiver.close()
    assert own_segments() == set()


async def test_a_started_receiver_makes_its_first_segment_before_any_transfer(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    receiver = TCPKVReceiver(LAYOUT, 10.0, max_transfer_blocks=3000)
    await receiver.start()
    try:
        made = own_segments()
        assert len(made) == 1
        # 3,000 blocks of 512 bytes, rounded up to a power of two: any transfer fits.
        assert receiver.segments.free_bytes == 2 << 20
        fetching = asyncio.ensure_future(receiver.fetch(url, TOKENS, 0, 4, Installs()))
        await until(lambda: len(exports.sinks) == 1, "the export started")
        assert own_segments() == made  # the first transfer offered it: nothing new made
        assert receiver.segments.free_bytes == 0
        (sink,) = exports.sinks.values()
        sink.blocks(0, blocks(4, 3.0))
        sink.done(0)
        assert await fetching == 0
        assert own_segments() == made
    finally:
        receiver.close()
    assert own_segments() == set()


async def test_a_receiver_told_socket_makes_no_segment_at_start() -> None:
    receiver = TCPKVReceiver(LAYOUT, 10.0, same_host_shm=False, max_transfer_blocks=3000)
    await receiver.start()
    assert own_segments() == set() and receiver.segments.free_bytes == 0
    receiver.close()


def test_a_prefill_side_drops_the_mapping_of_a_closed_segment() -> None:
    maps = SegmentMaps(host_id(), keep_bytes=8 << 20)
    first, second = Segment(1 << 20), Segment(2 << 20)
    try:
        offer = {"name": first.name, "bytes": first.nbytes, "host_id": host_id()}
        mapped = maps.open(offer, 1 << 20)
        assert mapped is not None and maps.kept_bytes == 1 << 20
        assert maps.open(offer, 1 << 20) is mapped  # kept: not mapped again
        offer = {"name": second.name, "bytes": second.nbytes, "host_id": host_id()}
        assert maps.open(offer, 2 << 20) is not None
        maps.drop_unlinked()
        assert maps.kept_bytes == 3 << 20  # both named still
        first.close()  # its decode worker is done with it
        maps.drop_unlinked()
        assert maps.kept_bytes == 2 << 20  # the closed segment's pages are not held here
    finally:
        first.close()
        second.close()


def test_a_prefill_side_maps_only_what_the_transfer_writes() -> None:
    maps = SegmentMaps(host_id(), keep_bytes=64 << 20)
    segment = Segment(32 << 20)  # a decode worker's segment, sized for its largest transfer
    offer = {"name": segment.name, "bytes": segment.nbytes, "host_id": host_id()}
    try:
        small = maps.open(offer, 100_000)
        assert small is not None and small.nbytes == 102_400  # whole pages
        assert maps.open(offer, 50_000) is small  # a shorter transfer reuses it
        larger = maps.open(offer, 3 << 20)
        assert larger is not None and larger.nbytes == 3 << 20
        assert maps.kept_bytes == 3 << 20  # in place of the shorter one
        assert maps.open(offer, (32 << 20) + 1) is None  # more than the segment holds
        assert maps.open(offer, 0) is None
    finally:
        segment.close()


async def test_segments_of_a_dead_worker_are_removed_by_the_next_receiver() -> None:
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    orphan = SHM_DIR / f"kvserve-pd-{dead.pid}-0123456789abcdef"
    orphan.write_bytes(b"left by a killed worker")
    alive = Segment(1 << 20)
    try:
        TCPKVReceiver(LAYOUT, 10.0).close()
        assert not orphan.exists()
        assert (SHM_DIR / alive.name).exists()  # this process's own stays
    finally:
        orphan.unlink(missing_ok=True)
        alive.close()


async def test_a_receiver_told_socket_offers_no_segment(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    fetching = asyncio.ensure_future(
        TCPKVReceiver(LAYOUT, 10.0, same_host_shm=False).fetch(url, TOKENS, 0, 1, Installs())
    )
    await until(lambda: len(exports.sinks) == 1, "the export started")
    assert own_segments() == set()
    (sink,) = exports.sinks.values()
    sink.blocks(0, blocks(1, 1.0))
    sink.done(0)
    assert await fetching == 0


async def test_a_cancelled_fetch_unlinks_its_segment_and_ends_the_export(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    receiver = TCPKVReceiver(LAYOUT, 10.0)
    fetching = asyncio.ensure_future(receiver.fetch(url, TOKENS, 0, 8, Installs()))
    await until(lambda: len(exports.sinks) == 1, "the export started")
    (sink,) = exports.sinks.values()
    sink.blocks(0, blocks(1, 1.0))
    await asyncio.sleep(0.05)
    assert len(own_segments()) == 1
    fetching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fetching
    assert own_segments() == set()
    assert receiver.segments.free_bytes == 0  # the prefill side may still write: not reused
    await until(lambda: len(exports.aborted) == 1, "the prefill side dropped the export")


async def test_a_prefill_side_gone_mid_transfer_unlinks_the_segment(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, sender, exports = prefill
    fetching = asyncio.ensure_future(
        TCPKVReceiver(LAYOUT, 10.0).fetch(url, TOKENS, 0, 8, Installs())
    )
    await until(lambda: len(exports.sinks) == 1, "the export started")
    (sink,) = exports.sinks.values()
    sink.blocks(0, blocks(3, 1.0))
    await sender.close()  # every connection ends, as when the prefill worker dies
    with pytest.raises(KVTransferError):
        await fetching


async def test_an_error_frame_unlinks_the_segment(
    prefill: tuple[str, TCPKVSender, HeldExports],
) -> None:
    url, _, exports = prefill
    fetching = asyncio.ensure_future(
        TCPKVReceiver(LAYOUT, 10.0).fetch(url, TOKENS, 0, 8, Installs())
    )
    await until(lambda: len(exports.sinks) == 1, "the export started")
    (sink,) = exports.sinks.values()
    sink.failed("the engine refused it")
    with pytest.raises(KVTransferError, match="refused"):
        await fetching
