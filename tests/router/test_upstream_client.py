"""The router's upstream client against real sockets: a scripted HTTP server on 127.0.0.1
that answers each request the way a test says, and counts the connections it accepts."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from kvserve.router.upstream_client import UpstreamClient

Reply = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """Reads one request at a time (headers and a Content-Length body) and lets ``reply``
    answer it; keeps the connection for the next request until the peer closes."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.reply(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _json_ok(_request: bytes, writer: asyncio.StreamWriter) -> None:
    body = b'{"ok": true}'
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstream = UpstreamClient({"Authorization": "Bearer fleet"}, timeout_s=2.0)
    yield upstream
    upstream.close()


async def test_sequential_requests_reuse_one_connection(client: UpstreamClient) -> None:
    async with ScriptedServer(_json_ok) as server:
        for _ in range(3):
            async with client.post(server.url + "/v1/completions", data=b"{}", headers={}) as r:
                assert (r.status, r.content_type, await r.read()) == (
                    200,
                    "application/json",
                    b'{"ok": true}',
                )
        assert server.connections == 1


async def test_a_read_response_is_freed_without_the_cyclic_collector(
    client: UpstreamClient,
) -> None:
    """A response in a reference cycle waits for the cyclic collector, whose pauses were
    the router's p99 under load (tens of ms to free tens of thousands of responses)."""
    async with ScriptedServer(_json_ok) as server:
        gc.disable()
        try:
            async with client.post(server.url + "/v1/completions", data=b"{}", headers={}) as r:
                assert r.content is r
                await r.content.read()
                freed = weakref.ref(r)
            del r
            assert freed() is None
        finally:
            gc.enable()


async def test_default_headers_are_sent_and_a_request_header_overrides_them(
    client: UpstreamClient,
) -> None:
    async with ScriptedServer(_json_ok) as server:
        url = server.url + "/v1/completions"
        async with client.post(url, data=b"{}", headers={"X-Request-Id": "r1"}) as r:
            await r.read()
        async with client.post(url, data=b"{}", headers={"Authorization": "Bearer user"}) as r:
            await r.read()
    first, second = server.requests
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer fleet\r\n" in first and b"X-Request-Id: r1\r\n" in first
    assert b"Authorization: Bearer user\r\n" in second and b"fleet" not in second


async def test_chunked_stream_arrives_decoded_and_in_order(client: UpstreamClient) -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    async def stream(_request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with ScriptedServer(stream) as server:
        async with client.post(server.url + "/s", data=b"{}", headers={}) as r:
            assert r.content_type == "text/event-stream"
            received = [chunk async for chunk in r.content.iter_any()]
        assert b"".join(received) == b"".join(events)
        async with client.post(server.url + "/s", data=b"{}", headers={}) as r:
            assert await r.read() == b"".join(events)
        assert server.connections == 1  # the finished stream left the connection reusable


async def test_a_response_left_unfinished_closes_its_connection(client: UpstreamClient) -> None:
    body_may_follow = asyncio.Event()

    async def slow_body(_request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        await writer.drain()
        await body_may_follow.wait()
        writer.write(b"{}")
        await writer.drain()

    async with ScriptedServer(slow_body) as server:
        async with client.post(server.url + "/v1/completions", data=b"{}", headers={}) as r:
            assert r.status == 200  # the body has not come: the connection is not reusable
        body_may_follow.set()
        async with client.post(server.url + "/v1/completions", data=b"{}", headers={}) as r:
            assert await r.read() == b"{}"
        assert server.connections == 2


async def test_a_worker_closing_mid_response_is_a_client_error(client: UpstreamClient) -> None:
    async def cut(_request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with (
        ScriptedServer(cut) as server,
        client.post(server.url + "/x", data=b"{}", headers={}) as r,
    ):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await r.read()


async def test_a_malformed_response_is_a_client_error(client: UpstreamClient) -> None:
    async def garbage(_request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with ScriptedServer(garbage) as server:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.post(server.url + "/x", data=b"{}", headers={}):
                pass


async def test_a_silent_worker_times_out() -> None:
    async def silent(_request: bytes, _writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    upstream = UpstreamClient({}, timeout_s=0.2)
    async with ScriptedServer(silent) as server:
        with pytest.raises(TimeoutError):
            async with upstream.post(server.url + "/x", data=b"{}", headers={}):
                pass
    upstream.close()


async def test_an_unreachable_worker_is_a_connection_error(client: UpstreamClient) -> None:
    async with ScriptedServer(_json_ok) as server:
        url = server.url
    with pytest.raises(aiohttp.ClientConnectionError, match="cannot connect"):
        async with client.post(url + "/x", data=b"{}", headers={}):
            pass


async def test_a_header_with_a_line_break_is_refused(client: UpstreamClient) -> None:
    async with ScriptedServer(_json_ok) as server:
        with pytest.raises(ValueError, match="line break"):
            async with client.post(server.url + "/x", data=b"{}", headers={"X-A": "a\r\nX-B: b"}):
                pass


async def test_a_large_body_arrives_whole_and_keeps_the_connection(client: UpstreamClient) -> None:
    """Many socket reads make one body, and the connection stays reusable after it."""
    big = bytes(range(256)) * (4 * 4096)  # 4 MiB

    async def large(_request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()

    async with ScriptedServer(large) as server:
        for _ in range(2):
            async with client.post(server.url + "/x", data=b"{}", headers={}) as r:
                received = bytearray()
                async for chunk in r.content.iter_any():
                    received += chunk
            assert bytes(received) == big
        assert server.connections == 1
