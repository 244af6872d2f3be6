"""The TCP transfer's two sides against a peer speaking (or breaking) the wire protocol on
a real loopback socket: every way a transfer ends early ends it at once, drops the
export on the prefill side and closes the connection.

The prefill side here serves ``HeldExports``: exports whose runs the test hands over
itself, so a hang-up can land while "the engine computes" at a moment the test chooses.
The engine-backed path is tested in test_kv_transfer.py and the PD end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from kvserve.engine.kv_block_io import KVBlockLayout, payload_view
from kvserve.engine.pd_export import ExportSink
from kvserve.worker.pd_wire import ProtocolError, frame_prefix, recv_frame_head, send_frame
from kvserve.worker.tcp_kv_transfer import PayloadLanding, PrefillFailed, TCPKVReceiver, TCPKVSender

LAYOUT = KVBlockLayout("wire-test", num_layers=2, block_size=4, num_kv_heads=1, head_dim=8,
                       dtype="float32")  # fmt: skip
TOKENS = list(range(8 * LAYOUT.block_size + 1))


def blocks(count: int, fill: float) -> torch.Tensor:
    return torch.full((count, *LAYOUT.block_shape), fill, dtype=torch.float32)


class HeldExports:
    """Exports that start at once and whose runs the test hands over."""

    def __init__(self) -> None:
        self.sinks: dict[str, ExportSink] = {}
        self.aborted: list[str] = []

    async def start(
        self, export_id: str, token_ids: list[int], first_block: int, num_blocks: int,
        sink: ExportSink, cache_salt: str | None,
    ) -> None:  # fmt: skip
        self.sinks[export_id] = sink

    def abort(self, export_id: str) -> None:
        self.aborted.append(export_id)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


@pytest.fixture
async def sender() -> AsyncIterator[tuple[TCPKVSender, HeldExports]]:
    exports = HeldExports()
    server = TCPKVSender(exports, LAYOUT, "127.0.0.1", request_timeout_s=0.5, merge_bytes=0)
    await server.start()
    try:
        yield server, exports
    finally:
        await server.close()


def request(first_block: int = 0, num_blocks: int = 8) -> dict[str, Any]:
    return {"type": "prefill", "token_ids": TOKENS, "first_block": first_block,
            "num_blocks": num_blocks, "layout": LAYOUT.to_json()}  # fmt: skip


async def connect(port: int) -> socket.socket:
    return await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)


async def sees_the_end(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (reading past anything it sent before)."""

    def drain() -> bool:
        sock.settimeout(10)
        while chunk := sock.recv(1 << 16):
            del chunk
        return True

    return await asyncio.to_thread(drain)


# --- the prefill side ----------------------------------------------------------------------


async def test_runs_follow_their_frames_and_done_ends_the_export(
    sender: tuple[TCPKVSender, HeldExports],
) -> None:
    server, exports = sender
    with await connect(server.port) as peer:
        await asyncio.to_thread(send_frame, peer, request())
        await until(lambda: len(exports.sinks) == 1, "the export started")
        (sink,) = exports.sinks.values()
        sink.blocks(0, blocks(3, 1.0))
        sink.blocks(3, blocks(5, 2.0))
        sink.done(16)
        frames = []
        for _ in range(3):
            header, payload_len = await asyncio.to_thread(recv_frame_head, peer)
            payload = await asyncio.to_thread(peer.recv, payload_len, socket.MSG_WAITALL)
            frames.append((header, len(payload)))
        assert frames == [
            ({"type": "blocks", "first_block": 0, "num_blocks": 3}, 3 * LAYOUT.block_nbytes),
            ({"type": "blocks", "first_block": 3, "num_blocks": 5}, 5 * LAYOUT.block_nbytes),
            ({"type": "done", "cached_tokens": 16}, 0),
        ]
        assert await sees_the_end(peer)
    assert exports.aborted == []  # it ended by itself


class ReadyExports:
    """Exports whose runs are all queued before the sending thread looks: a backlog."""

    def __init__(self, runs: list[torch.Tensor]) -> None:
        self.runs = runs

    async def start(
        self, export_id: str, token_ids: list[int], first_block: int, num_blocks: int,
        sink: ExportSink, cache_salt: str | None,
    ) -> None:  # fmt: skip
        for run in self.runs:
            sink.blocks(first_block, run)
            first_block += len(run)
        sink.done(0)

    def abort(self, export_id: str) -> None:
        raise AssertionError("a finished export is not aborted")


async def test_queued_runs_leave_as_frames_of_up_to_merge_bytes() -> None:
    runs = [blocks(2, 1.0), blocks(3, 2.0), blocks(3, 3.0)]
    server = TCPKVSender(
        ReadyExports(runs), LAYOUT, "127.0.0.1", merge_bytes=5 * LAYOUT.block_nbytes
    )
    await server.start()
    try:
        with await connect(server.port) as peer:
            await asyncio.to_thread(send_frame, peer, request())
            frames = []
            for _ in range(3):
                header, payload_len = await asyncio.to_thread(recv_frame_head, peer)
                payload = await asyncio.to_thread(peer.recv, payload_len, socket.MSG_WAITALL)
                frames.append((header, payload))
    finally:
        await server.close()
    assert [header for header, _ in frames] == [
        {"type": "blocks", "first_block": 0, "num_blocks": 5},  # 2 + 3 blocks: 5 at most
        {"type": "blocks", "first_block": 5, "num_blocks": 3},
        {"type": "done", "cached_tokens": 0},
    ]
    assert frames[0][1] + frames[1][1] == b"".join(bytes(payload_view(run)) for run in runs)


async def test_a_hang_up_while_the_engine_computes_aborts_the_export(
    sender: tuple[TCPKVSender, HeldExports],
) -> None:
    server, exports = sender
    with await connect(server.port) as peer:
        await asyncio.to_thread(send_frame, peer, request())
        await until(lambda: len(exports.sinks) == 1, "the export started")
    await until(lambda: exports.aborted == list(exports.sinks), "the export was aborted")


async def test_a_hang_up_mid_run_aborts_the_export(
    sender: tuple[TCPKVSender, HeldExports],
) -> None:
    server, exports = sender
    with await connect(server.port) as peer:
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await asyncio.to_thread(send_frame, peer, request(num_blocks=2048))
        await until(lambda: len(exports.sinks) == 1, "the export started")
        (sink,) = exports.sinks.values()
        sink.blocks(0, blocks(2048, 1.0))  # 4 MiB: the sending thread blocks on the peer
        await asyncio.to_thread(recv_frame_head, peer)
    await until(lambda: exports.aborted == list(exports.sinks), "the export was aborted")


async def test_closing_the_sender_aborts_exports_in_flight_and_ends_their_connections() -> None:
    exports = HeldExports()
    server = TCPKVSender(exports, LAYOUT, "127.0.0.1")
    await server.start()
    with await connect(server.port) as peer:
        await asyncio.to_thread(send_frame, peer, request())
        await until(lambda: len(exports.sinks) == 1, "the export started")
        await server.close()
        assert exports.aborted == list(exports.sinks)
        assert await sees_the_end(peer)


async def test_a_silent_connection_is_closed_and_starts_nothing(
    sender: tuple[TCPKVSender, HeldExports],
) -> None:
    server, exports = sender
    with await connect(server.port) as peer:
        assert await sees_the_end(peer)  # after request_timeout_s
    assert exports.sinks == {}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (frame_prefix({"type": "blocks"}), "expected a prefill frame"),
        (frame_prefix({**request(), "layout": {"model": "other"}}), "not a KV layout"),
        (b"HTTP/1.1 GET /\r\n\r\n", "bad frame prefix"),
    ],
)
async def test_a_bad_request_is_answered_with_an_error_frame(
    sender: tuple[TCPKVSender, HeldExports], frame: bytes, message: str
) -> None:
    server, exports = sender
    with await connect(server.port) as peer:
        await asyncio.to_thread(peer.sendall, frame)
        header, _ = await asyncio.to_thread(recv_frame_head, peer)
        assert header["type"] == "error" and message in header["message"]
        assert await sees_the_end(peer)
    assert exports.sinks == {}


# --- the decode side -----------------------------------------------------------------------


class PrefillPeer:
    """One connection's prefill side, scripted by the test: it reads the request, then
    ``answer(sock)`` writes whatever the test wants."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.server.getsockname()
        self.asked = False
        self.ended = False

    async def serve(self, answer: Callable[[socket.socket], None], hang_up: bool) -> None:
        """``hang_up``: the prefill side closes its end after answering (else it stalls)."""

        def run() -> None:
            conn, _ = self.server.accept()
            with conn:
                recv_frame_head(conn)
                self.asked = True
                with contextlib.suppress(OSError):  # the decode side may be gone already
                    answer(conn)
                    if hang_up:
                        conn.shutdown(socket.SHUT_WR)
                conn.settimeout(10)
                with contextlib.suppress(ConnectionResetError):  # closed with bytes unread
                    while conn.recv(1 << 16):
                        pass
                self.ended = True  # the decode side closed the connection

        await asyncio.to_thread(run)


async def fetch(
    peer: PrefillPeer,
    answer: Callable[[socket.socket], None],
    frame_timeout_s: float = 10.0,
    hang_up: bool = True,
) -> list[tuple[int, torch.Tensor]]:
    receiver = TCPKVReceiver(LAYOUT, frame_timeout_s=frame_timeout_s)
    installed: list[tuple[int, torch.Tensor]] = []

    async def install(first_block: int, run: torch.Tensor) -> None:
        installed.append((first_block, run.clone()))

    serving = asyncio.ensure_future(peer.serve(answer, hang_up))
    try:
        landing = PayloadLanding(LAYOUT, receiver.buffers)
        await receiver.fetch_from(peer.address, TOKENS, 2, 8, install, landing)
    finally:
        await serving
        peer.server.close()
    return installed


def send_run(sock: socket.socket, first: int, run: torch.Tensor) -> None:
    header = {"type": "blocks", "first_block": first, "num_blocks": len(run)}
    send_frame(sock, header, payload_view(run))


async def test_runs_are_installed_in_order_in_their_own_bytes() -> None:
    def answer(sock: socket.socket) -> None:
        send_run(sock, 2, blocks(1, 1.0))
        send_run(sock, 3, blocks(5, 2.0))
        send_frame(sock, {"type": "done", "cached_tokens": 8})

    peer = PrefillPeer()
    installed = await fetch(peer, answer)
    assert [(first, len(run)) for first, run in installed] == [(2, 1), (3, 5)]
    assert installed[0][1].eq(1.0).all() and installed[1][1].eq(2.0).all()
    assert peer.ended


async def test_a_stalled_prefill_side_fails_the_transfer_after_the_frame_timeout() -> None:
    peer = PrefillPeer()
    with pytest.raises(TimeoutError):
        run = blocks(1, 1.0)
        await fetch(peer, lambda sock: send_run(sock, 2, run), frame_timeout_s=0.3, hang_up=False)
    assert peer.ended


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (lambda sock: send_run(sock, 3, blocks(1, 1.0)), ProtocolError),  # skips block 2
        (lambda sock: send_run(sock, 2, blocks(7, 1.0)), ProtocolError),  # past the end
        (lambda sock: send_frame(sock, {"type": "done", "cached_tokens": 0}), ProtocolError),
        (lambda sock: send_frame(sock, {"type": "error", "message": "no"}), PrefillFailed),
        (lambda sock: sock.sendall(b"not a frame at all"), ProtocolError),
        (  # a payload of the wrong size for its blocks
            lambda sock: sock.sendall(
                frame_prefix({"type": "blocks", "first_block": 2, "num_blocks": 1}, 12) + bytes(12)
            ),
            ProtocolError,
        ),
        (  # the prefill worker dies mid-run
            lambda sock: sock.sendall(
                frame_prefix(
                    {"type": "blocks", "first_block": 2, "num_blocks": 1}, LAYOUT.block_nbytes
                )
            ),
            ConnectionError,
        ),
    ],
)
async def test_a_broken_answer_fails_the_transfer_at_once(
    answer: Callable[[socket.socket], None], error: type[Exception]
) -> None:
    peer = PrefillPeer()
    started = time.monotonic()
    with pytest.raises(error):
        await fetch(peer, answer)
    assert time.monotonic() - started < 5  # not the frame timeout (10 s)
    assert peer.ended


async def test_a_cancelled_fetch_closes_the_connection() -> None:
    peer = PrefillPeer()
    fetching = asyncio.ensure_future(fetch(peer, lambda sock: None, hang_up=False))
    await until(lambda: peer.asked, "the request reached the prefill side")
    fetching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fetching  # ``fetch`` waits for the peer to see the end before it re-raises
    assert peer.ended
