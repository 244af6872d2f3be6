"""The router's HTTP/1.1 client to its workers: pooled keep-alive connections, one write
per request, responses parsed by ``httptools`` (the C parser uvicorn uses).

Why not ``aiohttp.ClientSession``: on the proxied path it was a quarter of the router's
CPU per request (timeouts, tracing hooks, cookie and header merging, a connector that
scans its pool, the body written in pieces); this client does only what the proxy needs.
It speaks to the fleet's own workers, so it supports exactly what they send: a status
line, headers, and a body framed by Content-Length or chunked encoding (decoded by the
parser). Its errors are aiohttp's client errors (and ``TimeoutError``), so the proxy's
error handling is the same for either client.

One request holds one connection from ``post`` until its context exits. A connection goes
back to the pool only when its response was read to the end and the worker keeps it
alive; any other exit (an error, a timeout, a client gone mid-stream) closes it, since
its remaining bytes would otherwise be read as the next response.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict

# Past this many bytes buffered and not yet taken by the proxy, stop reading the socket:
# a slow client slows its worker's stream instead of growing the router's memory.
_PAUSE_READING_BYTES = 1 << 20


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker and the response being read on it.

    The request's deadline is checked by one timer per connection, not one per request:
    when it fires it compares the clock with the deadline of the request in flight now
    (None: none is) and sets itself again for that deadline if it is not due yet.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop  # kept: asyncio.get_running_loop() is a getpid() call on 3.11
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._error: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset_response()

    def _reset_response(self) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(aiohttp.ClientPayloadError(f"malformed response from worker: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if not self.complete:
            self._fail(aiohttp.ServerDisconnectedError(f"worker closed the connection: {exc}"))

    # -- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_READING_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # Asked here: once the parser moves past the message it no longer knows.
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # -- used by the response ------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _check_deadline(self) -> None:
        """The timer fired: time the request in flight out if its deadline passed."""
        self._timer = None
        if self._deadline is None:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
            return
        self._fail(TimeoutError())  # whatever waits on this connection raises
        self.close()

    def _stop_timer(self) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait(self) -> None:
        """Until the parser has something new (or the connection failed)."""
        if self._error is not None:
            raise self._error
        self._wakeup = self._loop.create_future()
        try:
            await self._wakeup
        finally:
            self._wakeup = None
        if self._error is not None:
            raise self._error

    def take_chunks(self) -> list[bytes]:
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunks

    def reusable(self) -> bool:
        return self.complete and not self.closed and self._error is None and self.keep_alive

    def start_request(self, request: bytes, timeout_s: float) -> None:
        assert self.transport is not None
        if self._paused:  # the last response completed while paused, and was not all read
            self.transport.resume_reading()
        self._reset_response()
        self._deadline = self._loop.time() + timeout_s
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
        self.transport.write(request)

    def end_request(self) -> None:
        """The request is over: no deadline runs until the next one."""
        self._deadline = None

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A worker's response: status and headers at once, the body read or streamed after."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers

    @property
    def content(self) -> UpstreamResponse:
        """aiohttp's spelling, ``response.content.iter_any()``: a property, not an
        attribute, since ``self.content = self`` would make every response a reference
        cycle, garbage that only the cyclic collector frees (tens of ms per collection)."""
        return self

    @property
    def content_type(self) -> str:
        """The media type without parameters, as aiohttp reports it."""
        value = self.headers.get("Content-Type", "application/octet-stream")
        return value.partition(";")[0].strip().lower()

    async def read(self) -> bytes:
        """The whole body (most often in already: then nothing is awaited)."""
        connection = self._connection
        parts: list[bytes] = []
        while True:
            parts += connection.take_chunks()  # taken as they come: a paused socket resumes
            if connection.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await connection.wait()

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, in the pieces they arrive in."""
        connection = self._connection
        while True:
            chunks = connection.take_chunks()
            if chunks:
                yield b"".join(chunks) if len(chunks) > 1 else chunks[0]
                continue
            if connection.complete:
                return
            await connection.wait()


class _Request:
    """``async with client.post(...) as response``: sends on entry, frees the connection
    (back to the pool or closed) on exit."""

    def __init__(
        self, client: UpstreamClient, url: str, body: bytes, headers: Mapping[str, str]
    ) -> None:
        self._client = client
        self._url = url
        self._body = body
        self._headers = headers
        self._connection: _Connection | None = None
        self._origin: tuple[str, str, int] | None = None

    async def __aenter__(self) -> UpstreamResponse:
        client = self._client
        scheme, host, port, path = client.target(self._url)
        request = client.encode(host, port, path, self._body, self._headers)
        self._origin = origin = (scheme, host, port)
        connection = client.idle_connection(origin) or await client.connect(origin)
        self._connection = connection
        try:
            connection.start_request(request, client.timeout_s)
            while not connection.headers_done:
                await connection.wait()
        except BaseException:  # an error, a timeout or a cancelled handler: free it now
            await self.__aexit__(None, None, None)
            raise
        return UpstreamResponse(connection)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._connection is not None and self._origin is not None:
            self._connection.end_request()
            self._client.release(self._origin, self._connection)


class UpstreamClient:
    """Pooled keep-alive connections to the workers, per (scheme, host, port)."""

    def __init__(self, default_headers: Mapping[str, str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._default_headers = dict(default_headers)
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[str, str, int, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    def post(self, url: str, *, data: bytes, headers: Mapping[str, str]) -> _Request:
        """POST ``data`` to ``url``; ``headers`` add to (and override) the default ones."""
        return _Request(self, url, data, headers)

    def target(self, url: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, path) of a URL; the proxy sends to a few URLs only."""
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise aiohttp.InvalidURL(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            found = (parts.scheme, parts.hostname, port, path)
            if len(self._targets) > 4096:  # workers come and go: keep the cache bounded
                self._targets.clear()
            self._targets[url] = found
        return found

    def encode(
        self, host: str, port: int, path: str, body: bytes, headers: Mapping[str, str]
    ) -> bytes:
        """The request's bytes: request line, headers, body, for one socket write."""
        merged = self._default_headers | dict(headers) if headers else self._default_headers
        every = "".join(merged) + "".join(merged.values())  # one search, not four per header
        if "\r" in every or "\n" in every:
            name = next(n for n, v in merged.items() if "\r" in n + v or "\n" in n + v)
            raise ValueError(f"header {name!r} holds a line break")
        fields = "".join([f"{name}: {value}\r\n" for name, value in merged.items()])
        head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"
        return (head + fields + "\r\n").encode("latin-1") + body

    def idle_connection(self, origin: tuple[str, str, int]) -> _Connection | None:
        """An idle pooled connection to ``origin``, if there is one (no await: the usual
        case costs no coroutine)."""
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def connect(self, origin: tuple[str, str, int]) -> _Connection:
        """A new connection to ``origin``."""
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop),
                    host,
                    port,
                    ssl=self._ssl_context() if scheme == "https" else None,
                ),
                self.timeout_s,
            )
        except OSError as error:
            raise aiohttp.ClientConnectionError(
                f"cannot connect to {host}:{port}: {error}"
            ) from error
        return connection

    def release(self, origin: tuple[str, str, int], connection: _Connection) -> None:
        if connection.reusable():
            self._idle.setdefault(origin, []).append(connection)
        else:
            connection.close()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def close(self) -> None:
        """Close every idle connection (requests in flight close theirs as they end)."""
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
