"""The default KV transfer, over TCP: a prefill worker's server and a decode worker's client.

The decode worker learns the prefill worker's transfer address from its ``/pd/info``,
connects, asks for a prompt's blocks (:mod:`pd_wire`), and installs each run as it
arrives; the prefill worker computes the prompt on its engine thread and writes each run
of blocks as soon as the engine hands it over, so the network works while later chunks
compute. The connection is the transfer's lifetime: when the decode side hangs up
(client gone, lease lapsed, decode worker dead) the prefill worker drops the export at
once, and when the prefill side dies the decode worker sees the connection end and
stops waiting.

The bytes move on blocking sockets, each transfer's conversation on threads of its own
(:class:`~kvserve.worker.blocking_socket.BlockingSocket`): the prefill side writes a run
from the engine's copy of the blocks with one ``sendall`` (runs queued behind each other,
when the engine is ahead of the network, go as one frame); the decode side reads a
frame's run with one ``recv_into`` straight into the tensor that is installed. The event loop keeps
what it kept before: accepting, starting and aborting exports, noticing a hang-up while
the engine computes, per-frame timeouts and cancellation (which closes the socket).

Between workers of one host the runs' bytes skip the socket: the decode side offers a
shared-memory segment and the prefill side copies each run into it, sending only the
frames (:mod:`kvserve.worker.shm_landing`, ``--kv-transfer-same-host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import queue
import socket
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import torch

from kvserve.core.sampling_params import InvalidParameterError
from kvserve.engine.kv_block_io import KVBlockLayout, payload_view
from kvserve.worker.blocking_socket import BlockingSocket
from kvserve.worker.kv_transfer import ExportSource, InstallRun, KVTransferError
from kvserve.worker.pd_wire import ProtocolError, recv_frame_head, recv_into, send_frame
from kvserve.worker.run_buffers import RunBuffers
from kvserve.worker.shm_landing import (
    Segment,
    SegmentMaps,
    SegmentPool,
    ShmLanding,
    host_id,
    place_runs,
    remove_orphans,
)

logger = logging.getLogger(__name__)

_TRANSFER_ERRORS = (
    OSError,  # refused, reset, unreachable, the peer hung up mid-frame
    TimeoutError,
    ProtocolError,
    ValueError,  # a layout mismatch, a run that does not fit the reservation
    TypeError,  # a frame header whose fields have the wrong types
    RuntimeError,  # the prefill side's error frame, a lapsed lease
    aiohttp.ClientError,  # the prefill worker's /pd/info
    KeyError,  # a /pd/info without a transfer address
)

# What the receiving thread hands the event loop: a run (first block, blocks), the
# transfer's end (cached tokens) or what failed it.
_Arrival = tuple[int, torch.Tensor] | int | BaseException

# Memory of installed runs a decode worker keeps for the next ones (run_buffers.py).
RUN_BUFFER_KEEP_BYTES = 64 << 20

# Shared-memory segments a decode worker keeps for the next transfers, and decode
# workers' segments a prefill worker keeps mapped (shm_landing.py): a live segment's
# mapping costs only its page tables (the pages are the decode worker's), and one whose
# segment is gone is dropped, so the prefill side keeps those of 16 full decode pools.
SEGMENT_KEEP_BYTES = 256 << 20
SEGMENT_MAP_KEEP_BYTES = 4 << 30

# The most bytes of queued runs the sender joins into one run frame (TCPKVSender._gather):
# the decode side then reads them with one call (benchmarks/kv_transfer_rate.py).
MERGE_BYTES = 32 << 20

# After a failed accept (out of descriptors), the sender tries again this much later.
ACCEPT_RETRY_S = 0.1

# How long a prefill worker waits for a connection's request before hanging up.
REQUEST_TIMEOUT_S = 30.0

# What the prefill side's sending thread is told besides the export's items.
_HUNG_UP = ("hung_up",)
_CLOSED = ("closed",)


class PrefillFailed(RuntimeError):
    """The prefill worker answered with an error frame."""


class _QueueSink:
    """An export's sink: the engine thread's calls become items for the sending thread."""

    def __init__(self, items: queue.SimpleQueue[tuple[Any, ...]]) -> None:
        self._items = items

    def blocks(self, first_block: int, blocks: torch.Tensor) -> None:
        self._items.put(("blocks", first_block, blocks))

    def done(self, cached_tokens: int) -> None:
        self._items.put(("done", cached_tokens))

    def failed(self, message: str) -> None:
        self._items.put(("error", message))


class TCPKVSender:
    """Serves the exports of ``exports`` to decode workers, on a free port of ``host``; a
    connection that sends no request within ``request_timeout_s`` is closed. Runs queued
    behind each other leave as one frame of up to ``merge_bytes`` (0: one frame a run).
    With ``same_host_shm``, a decode worker's shared-memory segment (:mod:`shm_landing`)
    that this host can map receives the runs' bytes instead of the frames."""

    def __init__(
        self, exports: ExportSource, layout: KVBlockLayout, host: str,
        request_timeout_s: float = REQUEST_TIMEOUT_S, merge_bytes: int = MERGE_BYTES,
        same_host_shm: bool = True,
    ) -> None:  # fmt: skip
        self._merge_bytes = merge_bytes
        self._host_id = host_id() if same_host_shm else ""
        self._segments = SegmentMaps(self._host_id, SEGMENT_MAP_KEEP_BYTES)
        self._exports = exports
        self._layout = layout
        self._host = host
        self._request_timeout_s = request_timeout_s
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._export_ids = itertools.count()
        self.port = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        found = await loop.getaddrinfo(
            self._host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        listener = socket.create_server((self._host, 0), family=found[0][0])
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept(listener))

    def info(self) -> dict[str, Any]:
        return {"transfer_host": self._host, "transfer_port": self.port, "host_id": self._host_id}

    async def close(self) -> None:
        """Stop listening and cancel every transfer (their exports are dropped)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self, listener: socket.socket) -> None:
        """Serve each connection in a task of its own. A connection that fails before it
        is served (reset while queued, out of descriptors) is dropped; the loop goes on:
        were it to end, decode workers' connections would queue unserved until their
        frame timeout."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                logger.warning("KV transfer accept failed: %r", exc)
                await asyncio.sleep(ACCEPT_RETRY_S)  # EMFILE and the like persist a while
                continue
            try:
                conn = BlockingSocket(sock)
            except OSError:
                sock.close()  # reset before it was served: the peer is gone
                continue
            task = asyncio.ensure_future(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: BlockingSocket) -> None:
        loop = asyncio.get_running_loop()
        items: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        export_id = f"pd-export-{next(self._export_ids)}"
        exporting = watching = False

        def hung_up() -> None:  # the decode side sends nothing after its request
            loop.remove_reader(conn.fileno)
            items.put(_HUNG_UP)

        try:
            reading = conn.run(_read_request, "kv-send")
            request = await asyncio.wait_for(reading, self._request_timeout_s)
            self._layout.require_same(KVBlockLayout.from_json(request.get("layout")))
            token_ids, first, count = (
                request["token_ids"],
                request["first_block"],
                request["num_blocks"],
            )
            await self._exports.start(
                export_id, token_ids, first, count, _QueueSink(items), request.get("cache_salt")
            )
            exporting = True
            loop.add_reader(conn.fileno, hung_up)
            watching = True
            relay = functools.partial(self._relay, request, items)
            exporting = await conn.run(relay, "kv-send")
        except (InvalidParameterError, ProtocolError, ValueError, KeyError, TypeError) as exc:
            error = {"type": "error", "message": str(exc)}
            with contextlib.suppress(OSError):
                await conn.run(lambda sock: send_frame(sock, error), "kv-send")
        except (OSError, TimeoutError):
            pass  # the decode side is gone or silent: dropping the export is all there is
        finally:
            if watching:
                loop.remove_reader(conn.fileno)
            items.put(_CLOSED)  # a sending thread still waiting for the engine ends
            if exporting:
                self._exports.abort(export_id)
            conn.close()

    def _relay(
        self, request: dict[str, Any], items: queue.SimpleQueue[tuple[Any, ...]],
        sock: socket.socket,
    ) -> bool:  # fmt: skip
        """Sending thread: write the export's items until it ends; True if it is still
        running (the decode side hung up, or the sender is closing)."""
        try:
            return self._relay_items(request, items, sock)
        finally:  # the decode side is not waiting on this thread any more
            self._segments.drop_unlinked()

    def _relay_items(
        self, request: dict[str, Any], items: queue.SimpleQueue[tuple[Any, ...]],
        sock: socket.socket,
    ) -> bool:  # fmt: skip
        landed = int(request["num_blocks"]) - int(request["first_block"])
        segment = self._segments.open(request.get("shm"), landed * self._layout.block_nbytes)
        pending: tuple[Any, ...] | None = None
        while True:
            kind, *rest = pending or items.get()
            pending = None
            if kind == "blocks":
                runs = [rest[1]]
                pending = self._gather(items, rest[0], runs)
                if segment is None:
                    self._send_runs(sock, request, rest[0], runs)
                else:
                    self._place_runs(sock, request, segment, rest[0], runs)
            elif kind == "done":
                send_frame(sock, {"type": "done", "cached_tokens": rest[0]})
                return False
            elif kind == "error":
                send_frame(sock, {"type": "error", "message": rest[0]})
                return False
            else:
                return True

    def _gather(
        self, items: queue.SimpleQueue[tuple[Any, ...]], first_block: int,
        runs: list[torch.Tensor],
    ) -> tuple[Any, ...] | None:  # fmt: skip
        """Sending thread: add to ``runs`` (starting at ``first_block``) the runs already
        queued behind it that continue it, up to ``merge_bytes`` in all, so that a
        backlog (the engine ahead of the network) leaves in large frames; returns the
        first queued item it did not take, if any."""
        next_block = first_block + len(runs[0])
        nbytes = _nbytes(runs[0])
        while nbytes < self._merge_bytes:
            try:
                item = items.get_nowait()
            except queue.Empty:
                return None
            if item[0] != "blocks" or item[1] != next_block:
                return item
            if nbytes + _nbytes(item[2]) > self._merge_bytes:
                return item
            runs.append(item[2])
            next_block += len(item[2])
            nbytes += _nbytes(item[2])
        return None

    def _send_runs(
        self, sock: socket.socket, request: dict[str, Any], first_block: int,
        runs: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """Sending thread: consecutive runs of blocks from ``first_block`` on, as one run
        frame; here their bytes follow it, each written from its own memory."""
        count = sum(len(run) for run in runs)
        header = {"type": "blocks", "first_block": first_block, "num_blocks": count}
        send_frame(sock, header, *(payload_view(run) for run in runs))

    def _place_runs(
        self, sock: socket.socket, request: dict[str, Any], segment: torch.Tensor,
        first_block: int, runs: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """Sending thread: consecutive runs copied into their slots of the decode side's
        segment, then announced by one frame without a payload."""
        offset = (first_block - int(request["first_block"])) * self._layout.block_nbytes
        place_runs(segment, offset, runs)
        count = sum(len(run) for run in runs)
        header = {"type": "blocks", "first_block": first_block, "num_blocks": count}
        send_frame(sock, header | {"placed": True})


def _nbytes(blocks: torch.Tensor) -> int:
    return blocks.nelement() * blocks.element_size()


def _read_request(sock: socket.socket) -> dict[str, Any]:
    header, payload_len = recv_frame_head(sock)
    if header["type"] != "prefill" or payload_len:
        raise ProtocolError(f"expected a prefill frame, got {header['type']!r}")
    return header


class TCPKVReceiver:
    """Fetches blocks from prefill workers, whose transfer addresses it learns from their
    ``/pd/info`` by URL (sending ``api_key``: workers of one fleet share one key; the
    transfer itself is raw TCP, no HTTP). ``frame_timeout_s`` bounds the wait for each
    frame (a stalled prefill worker fails the transfer, as a lapsed lease would). With
    ``same_host_shm``, a prefill worker on this host (the same ``host_id`` in its
    ``/pd/info``) is offered a shared-memory segment to write the runs into; one for
    transfers of up to ``max_transfer_blocks`` is made at :meth:`start`."""

    def __init__(
        self,
        layout: KVBlockLayout,
        frame_timeout_s: float,
        info_timeout_s: float = 5.0,
        api_key: str | None = None,
        same_host_shm: bool = True,
        max_transfer_blocks: int = 0,
    ) -> None:
        self._layout = layout
        self._frame_timeout_s = frame_timeout_s
        self._info_timeout = aiohttp.ClientTimeout(total=info_timeout_s)
        self._info_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._addresses: dict[str, tuple[tuple[str, int], str]] = {}  # address, host id
        self._host_id = host_id() if same_host_shm else ""
        if same_host_shm:
            remove_orphans()
        self.segments = SegmentPool(SEGMENT_KEEP_BYTES)
        self.buffers = RunBuffers(RUN_BUFFER_KEEP_BYTES)
        self._max_transfer_blocks = max_transfer_blocks

    async def start(self) -> None:
        """Make the first shared segment now: its pages cost several times the copy
        into them, which the first transfer would otherwise pay (docs/benchmarks.md)."""
        if not self._host_id or self._max_transfer_blocks <= 0:
            return
        nbytes = self._max_transfer_blocks * self._layout.block_nbytes
        try:
            await asyncio.to_thread(self.segments.stock, nbytes)
        except OSError as exc:
            logger.warning("no shared segment made ahead of transfers: %r", exc)

    async def fetch(
        self,
        prefill_url: str,
        token_ids: list[int],
        first_block: int,
        num_blocks: int,
        install: InstallRun,
        cache_salt: str | None = None,
    ) -> int:
        try:
            address, peer_host_id = await self._address(prefill_url)
            same_host = bool(self._host_id) and peer_host_id == self._host_id
            segment = await self._segment(num_blocks - first_block) if same_host else None
            finished = False
            try:
                with self._landing(first_block, num_blocks, segment) as landing:
                    cached = await self.fetch_from(
                        address, token_ids, first_block, num_blocks, install, landing, cache_salt
                    )
                finished = True
                return cached
            finally:
                if segment is not None and finished:  # ``done`` came: no write is in flight
                    self.segments.give_back(segment)
                elif segment is not None:  # the prefill side may still write: never reused
                    segment.close()
        except _TRANSFER_ERRORS as exc:
            self._addresses.pop(prefill_url, None)  # it may have restarted on another port
            raise KVTransferError(f"KV transfer from {prefill_url} failed: {exc!r}") from exc

    def close(self) -> None:
        """Unlink the shared segments kept for later transfers."""
        self.segments.close()

    async def _segment(self, count: int) -> Segment | None:
        """A shared segment for ``count`` blocks, taken on a thread (a new one's pages
        are allocated); None if there is nothing to land or ``/dev/shm``
        cannot hold it."""
        if count <= 0:
            return None
        nbytes = count * self._layout.block_nbytes
        making = asyncio.ensure_future(asyncio.to_thread(self.segments.take, nbytes))
        try:
            return await asyncio.shield(making)
        except OSError as exc:
            logger.warning("no shared segment for a KV transfer, using the socket: %r", exc)
            return None
        except asyncio.CancelledError:
            making.add_done_callback(_close_made)  # cancelled while the thread made it
            raise

    async def _address(self, url: str) -> tuple[tuple[str, int], str]:
        known = self._addresses.get(url)
        if known is not None:
            return known
        async with (
            aiohttp.ClientSession(timeout=self._info_timeout) as session,
            session.get(url.rstrip("/") + "/pd/info", headers=self._info_headers) as response,
        ):
            response.raise_for_status()
            info = await response.json()
        address = (str(info["transfer_host"]), int(info["transfer_port"]))
        known = self._addresses[url] = (address, str(info.get("host_id", "")))
        return known

    async def fetch_from(
        self,
        address: tuple[str, int],
        token_ids: list[int],
        first_block: int,
        num_blocks: int,
        install: InstallRun,
        landing: Landing,
        cache_salt: str | None = None,
    ) -> int:
        """Have the prefill worker at ``address`` compute blocks ``[0, num_blocks)`` of the
        prompt and install ``[first_block, num_blocks)`` as they come; returns the prompt
        tokens its cache served. The receiving thread reads the next run while this one
        is installed."""
        loop = asyncio.get_running_loop()
        arrivals: asyncio.Queue[_Arrival] = asyncio.Queue()

        def deliver(item: _Arrival) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(arrivals.put_nowait, item)

        request = {
            "type": "prefill",
            "token_ids": token_ids,
            "first_block": first_block,
            "num_blocks": num_blocks,
            "layout": self._layout.to_json(),
            "cache_salt": cache_salt,
            **landing.request_fields(),
        }
        receive = functools.partial(_receive, request, landing, deliver)
        conn = await _connect(address, self._frame_timeout_s)
        try:
            conn.run(receive, "kv-receive")  # it reports through ``deliver``
            while True:
                item = await asyncio.wait_for(arrivals.get(), self._frame_timeout_s)
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, int):
                    return item
                await install(*item)
                landing.give_back(item[1])  # installed: its memory is free again
        finally:
            conn.close()

    def _landing(
        self, first_block: int, num_blocks: int, segment: Segment | None
    ) -> contextlib.AbstractContextManager[Landing]:
        """Where one transfer's bytes arrive: in ``segment`` if there is one (the
        caller gives it back), else in the run frames' payloads."""
        payloads = PayloadLanding(self._layout, self.buffers)
        if segment is None:
            return contextlib.nullcontext(payloads)
        shm = ShmLanding(
            self._layout, segment.name, segment.memory, first_block, payloads, self._host_id
        )
        return contextlib.nullcontext(shm)


def _close_made(making: asyncio.Future[Segment]) -> None:
    if not making.cancelled() and making.exception() is None:
        making.result().close()


async def _connect(address: tuple[str, int], timeout_s: float) -> BlockingSocket:
    loop = asyncio.get_running_loop()
    found = await loop.getaddrinfo(*address, type=socket.SOCK_STREAM)
    family, kind, proto, _, sockaddr = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, sockaddr), timeout_s)
    except BaseException:
        sock.close()
        raise
    return BlockingSocket(sock)


def _receive(
    request: dict[str, Any],
    landing: Landing,
    deliver: Callable[[_Arrival], None],
    sock: socket.socket,
) -> None:
    """Receiving thread: send the request, then deliver each run ``(first_block,
    blocks)`` in order, then the cached token count, or the exception that ended it."""
    try:
        send_frame(sock, request)
        expected, end = int(request["first_block"]), int(request["num_blocks"])
        while True:
            header, payload_len = recv_frame_head(sock)
            kind = header["type"]
            if kind == "blocks":
                first, count = header.get("first_block"), header.get("num_blocks")
                if first != expected or not isinstance(count, int) or not 0 < count <= end - first:
                    raise ProtocolError(f"unexpected run {header!r} after block {expected}")
                deliver((expected, landing.run_blocks(header, payload_len, sock)))
                expected += count
                continue
            if payload_len:
                raise ProtocolError(f"a {kind!r} frame with a payload")
            if kind == "done" and expected == end:
                deliver(int(header.get("cached_tokens", 0)))
                return
            if kind == "error":
                raise PrefillFailed(str(header.get("message")))
            raise ProtocolError(f"unexpected frame {header!r} after block {expected}")
    except BaseException as exc:  # the event loop raises it
        deliver(exc)


class Landing(Protocol):
    """Where a transfer's runs arrive on the decode side."""

    def request_fields(self) -> dict[str, Any]:
        """What the prefill request adds, telling the prefill side where to put runs."""

    def run_blocks(
        self, header: dict[str, Any], payload_len: int, sock: socket.socket
    ) -> torch.Tensor:
        """Receiving thread: the blocks of a run frame (its header checked, its payload
        next on ``sock``), in memory the receiver's ``RunBuffers`` lent."""

    def give_back(self, run: torch.Tensor) -> None:
        """``run``, one of ``run_blocks``'s, is installed: its memory may be reused."""


class PayloadLanding:
    """Runs arrive as the frames' payloads, read straight into the blocks' tensor."""

    def __init__(self, layout: KVBlockLayout, buffers: RunBuffers) -> None:
        self._layout = layout
        self._buffers = buffers

    def request_fields(self) -> dict[str, Any]:
        return {}

    def run_blocks(
        self, header: dict[str, Any], payload_len: int, sock: socket.socket
    ) -> torch.Tensor:
        count = header["num_blocks"]
        if payload_len != count * self._layout.block_nbytes:
            raise ProtocolError(f"a run of {count} blocks with {payload_len} payload bytes")
        memory = self._buffers.take(payload_len)
        recv_into(sock, payload_view(memory))
        return memory.view(self._layout.torch_dtype).reshape(count, *self._layout.block_shape)

    def give_back(self, run: torch.Tensor) -> None:
        self._buffers.give_back(run)
