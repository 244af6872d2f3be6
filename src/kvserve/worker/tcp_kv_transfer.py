"""The default KV transfer, over TCP: a prefill worker's server and a decode worker's client.

The decode worker learns the prefill worker's transfer address from its ``/pd/info``,
connects, asks for a prompt's blocks (:mod:`pd_wire`), and installs each run as it
arrives; the prefill worker computes the prompt on its engine thread and writes each run
of blocks as soon as the engine hands it over, so the network works while later chunks
compute. The connection is the transfer's lifetime: when the decode
side hangs up (client gone, lease lapsed, decode worker dead) the prefill worker drops
the export at once, and when the prefill side dies the decode worker sees the
connection end and stops waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import torch

from kvserve.core.sampling_params import InvalidParameterError
from kvserve.engine.kv_block_io import KVBlockLayout, from_bytes, payload_view
from kvserve.engine.pd_export import start_export
from kvserve.worker.engine_bridge import EngineBridge
from kvserve.worker.kv_transfer import InstallRun, KVTransferError
from kvserve.worker.pd_wire import ProtocolError, frame_prefix, read_frame

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

_TRANSFER_ERRORS = (
    OSError,  # refused, reset, unreachable
    asyncio.IncompleteReadError,  # the peer hung up mid-frame
    TimeoutError,
    ProtocolError,
    ValueError,  # a layout mismatch, a run that does not fit the reservation
    RuntimeError,  # the prefill side's error frame, a lapsed lease
    aiohttp.ClientError,  # the prefill worker's /pd/info
    KeyError,  # a /pd/info without a transfer address
)


# The decode side's stream buffer. asyncio's default (64 KiB) pauses and resumes the
# socket every 128 KiB of a multi-MiB run: twice the loop wake-ups, half the throughput
# (benchmarks/kv_transfer_rate.py).
READ_LIMIT_BYTES = 8 << 20


class PrefillFailed(RuntimeError):
    """The prefill worker answered with an error frame."""


class _QueueSink:
    """An export's sink: engine-thread calls become items on an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        self._loop = loop
        self._queue = queue

    def blocks(self, first_block: int, blocks: torch.Tensor) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("blocks", first_block, blocks))

    def done(self, cached_tokens: int) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("done", cached_tokens))

    def failed(self, message: str) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("error", message))


class TCPKVSender:
    """Serves exports of the engine behind ``bridge`` (built with a ``PDExporter``) to
    decode workers, on a free port of ``host``."""

    def __init__(self, bridge: EngineBridge, layout: KVBlockLayout, host: str) -> None:
        self._bridge = bridge
        self._layout = layout
        self._host = host
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._export_ids = itertools.count()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def info(self) -> dict[str, Any]:
        return {"transfer_host": self._host, "transfer_port": self.port}

    async def close(self) -> None:
        """Stop listening and cancel every transfer (their exports are dropped)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        export_id = f"pd-export-{next(self._export_ids)}"
        exporting = False
        try:
            header, _ = await read_frame(reader)
            if header["type"] != "prefill":
                raise ProtocolError(f"expected a prefill frame, got {header['type']!r}")
            self._layout.require_same(KVBlockLayout.from_json(header.get("layout")))
            queue: asyncio.Queue[Any] = asyncio.Queue()
            sink = _QueueSink(asyncio.get_running_loop(), queue)
            token_ids, first, count = (
                header["token_ids"],
                header["first_block"],
                header["num_blocks"],
            )

            def start(engine: LLMEngine) -> None:
                start_export(
                    engine, export_id, token_ids, first, count, sink, header.get("cache_salt")
                )

            await self._bridge.call(start)
            exporting = True
            exporting = await self._relay(header, queue, reader, writer)
        except (InvalidParameterError, ProtocolError, ValueError, KeyError, TypeError) as exc:
            await _send_quietly(writer, frame_prefix({"type": "error", "message": str(exc)}))
        except (OSError, asyncio.IncompleteReadError):
            pass  # the decode side is gone: dropping the export below is all there is to do
        finally:
            if exporting:
                self._bridge.post(lambda engine: engine.abort_request(export_id))
            writer.close()
            self._connections.discard(task)

    async def _relay(
        self,
        request: dict[str, Any],
        queue: asyncio.Queue[Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Write the export's items until it ends; True if it is still running (the decode
        side hung up first)."""
        hangup = asyncio.ensure_future(reader.read(1))  # the decode side sends nothing more
        try:
            while True:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, hangup}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return True
                kind, *rest = item.result()
                if kind == "blocks":
                    await self._send_run(request, writer, *rest)
                    continue
                if kind == "done":
                    writer.write(frame_prefix({"type": "done", "cached_tokens": rest[0]}))
                else:
                    writer.write(frame_prefix({"type": "error", "message": rest[0]}))
                await writer.drain()
                return False
        finally:
            hangup.cancel()

    async def _send_run(
        self,
        request: dict[str, Any],
        writer: asyncio.StreamWriter,
        first_block: int,
        blocks: torch.Tensor,
    ) -> None:
        """One run of blocks to the decode side: here its bytes follow the frame."""
        header = {"type": "blocks", "first_block": first_block, "num_blocks": len(blocks)}
        payload = payload_view(blocks)
        writer.write(frame_prefix(header, len(payload)))
        writer.write(payload)
        await writer.drain()


async def _send_quietly(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
        await writer.drain()
    except OSError:
        pass


class TCPKVReceiver:
    """Fetches blocks from prefill workers, whose transfer addresses it learns from their
    ``/pd/info`` by URL (sending ``api_key``: workers of one fleet share one key; the
    transfer itself is raw TCP, no HTTP). ``frame_timeout_s`` bounds the wait for each
    frame (a stalled prefill worker fails the transfer, as a lapsed lease would)."""

    def __init__(
        self,
        layout: KVBlockLayout,
        frame_timeout_s: float,
        info_timeout_s: float = 5.0,
        api_key: str | None = None,
    ) -> None:
        self._layout = layout
        self._frame_timeout_s = frame_timeout_s
        self._info_timeout = aiohttp.ClientTimeout(total=info_timeout_s)
        self._info_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._addresses: dict[str, tuple[str, int]] = {}

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
            address = await self._address(prefill_url)
            with self._landing(first_block, num_blocks) as landing:
                return await self._fetch_blocks(
                    address, token_ids, first_block, num_blocks, install, landing, cache_salt
                )
        except _TRANSFER_ERRORS as exc:
            self._addresses.pop(prefill_url, None)  # it may have restarted on another port
            raise KVTransferError(f"KV transfer from {prefill_url} failed: {exc!r}") from exc

    async def _address(self, url: str) -> tuple[str, int]:
        known = self._addresses.get(url)
        if known is not None:
            return known
        async with (
            aiohttp.ClientSession(timeout=self._info_timeout) as session,
            session.get(url.rstrip("/") + "/pd/info", headers=self._info_headers) as response,
        ):
            response.raise_for_status()
            info = await response.json()
        address = self._addresses[url] = (str(info["transfer_host"]), int(info["transfer_port"]))
        return address

    async def _fetch_blocks(
        self,
        address: tuple[str, int],
        token_ids: list[int],
        first_block: int,
        num_blocks: int,
        install: InstallRun,
        landing: Landing,
        cache_salt: str | None,
    ) -> int:
        """Have the prefill worker at ``address`` compute blocks ``[0, num_blocks)`` of the
        prompt and install ``[first_block, num_blocks)`` as they come; returns the prompt
        tokens its cache served."""
        timeout_s = self._frame_timeout_s
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(*address, limit=READ_LIMIT_BYTES), timeout_s
        )
        try:
            request = {
                "type": "prefill",
                "token_ids": token_ids,
                "first_block": first_block,
                "num_blocks": num_blocks,
                "cache_salt": cache_salt,
                "layout": self._layout.to_json(),
                **landing.request_fields(),
            }
            writer.write(frame_prefix(request))
            await writer.drain()
            expected = first_block
            while True:
                header, payload = await asyncio.wait_for(read_frame(reader), timeout_s)
                kind = header["type"]
                if kind == "blocks":
                    blocks = landing.run_blocks(header, payload)
                    if header.get("first_block") != expected or header.get("num_blocks") != len(
                        blocks
                    ):
                        raise ProtocolError(f"unexpected run {header!r} after block {expected}")
                    await install(expected, blocks)
                    expected += len(blocks)
                elif kind == "done" and expected == num_blocks:
                    return int(header.get("cached_tokens", 0))
                elif kind == "error":
                    raise PrefillFailed(str(header.get("message")))
                else:
                    raise ProtocolError(f"unexpected frame {header!r} after block {expected}")
        finally:
            writer.close()

    def _landing(
        self, first_block: int, num_blocks: int
    ) -> contextlib.AbstractContextManager[Landing]:
        """Where one transfer's bytes arrive: here in the run frames' payloads."""
        return contextlib.nullcontext(PayloadLanding(self._layout))


class Landing(Protocol):
    """Where a transfer's runs arrive on the decode side."""

    def request_fields(self) -> dict[str, Any]:
        """What the prefill request adds, telling the prefill side where to put runs."""

    def run_blocks(self, header: dict[str, Any], payload: bytes) -> torch.Tensor:
        """A run frame's blocks, owned by the caller."""


class PayloadLanding:
    """Runs arrive as the frames' payloads, on the control connection itself."""

    def __init__(self, layout: KVBlockLayout) -> None:
        self._layout = layout

    def request_fields(self) -> dict[str, Any]:
        return {}

    def run_blocks(self, header: dict[str, Any], payload: bytes) -> torch.Tensor:
        return from_bytes(self._layout, payload)
