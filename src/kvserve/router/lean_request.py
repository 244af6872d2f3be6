"""A proxied request as the lean HTTP server (``router/lean_server.py``) parsed it, and the
streamed answer written straight to its connection.

:class:`kvserve.router.proxy.Proxy` reads a request's path, headers and body only, and
writes a stream through ``prepare``/``write``/``write_eof`` or returns a worker's whole
answer (:class:`RelayedAnswer`): these classes give it that much without aiohttp's
request and response machinery, so one proxy serves both HTTP servers.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

_REASONS = {status.value: status.phrase for status in HTTPStatus}  # as aiohttp's


class LeanRequest:
    """One complete request: the lean server reads the body before routing it."""

    __slots__ = ("_transport", "body", "headers", "path", "remote")

    def __init__(
        self,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        remote: str | None,
        transport: asyncio.Transport,
    ) -> None:
        self.path = path
        self.headers = CIMultiDictProxy(headers)
        self.remote = remote
        self.body = body
        self._transport = transport

    def stream_response(self, status: int, headers: dict[str, str]) -> LeanStreamResponse:
        return LeanStreamResponse(self._transport, status, headers)


class RelayedAnswer:
    """A worker's complete answer as the proxy relays it: status, the proxy's headers (no
    framing: the server adds it) and the body. The lean server writes it with one
    ``transport.write`` of bytes built in one pass; aiohttp's ``web.Response`` cost more
    to build than the rest of the answer's writing, and only the aiohttp server needs one
    (:meth:`web_response`)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def encode(self, *, keep_alive: bool) -> bytes:
        """The whole HTTP/1.1 answer: status line, headers, framing, body."""
        lines = "".join([f"{name}: {value}\r\n" for name, value in self.headers.items()])
        close = "" if keep_alive else "Connection: close\r\n"
        head = (
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, '')}\r\n{lines}"
            f"Content-Length: {len(self.body)}\r\n{close}\r\n"
        )
        return head.encode("latin-1") + self.body

    def web_response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, headers=self.headers)


def encode_head(status: int, reason: str, headers: dict[str, str] | CIMultiDict[str]) -> bytes:
    """The status line and headers of an HTTP/1.1 answer."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class LeanStreamResponse(web.StreamResponse):
    """A chunked answer written to the client's transport as each chunk comes. A client
    gone raises ``ConnectionResetError`` on write, as aiohttp's own stream does, so the
    proxy's accounting for a vanished client is the same under both servers."""

    def __init__(self, transport: asyncio.Transport, status: int, headers: dict[str, str]) -> None:
        super().__init__(status=status, headers=headers)
        self._lean_transport = transport

    async def prepare(self, request: object) -> None:
        head = dict(self.headers)
        head["Transfer-Encoding"] = "chunked"
        self._write_raw(encode_head(self.status, self.reason, head))

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._write_raw(b"%x\r\n%b\r\n" % (len(data), bytes(data)))
            await asyncio.sleep(0)  # let the loop flush and notice a closed client

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        self._write_raw(b"0\r\n\r\n")

    def _write_raw(self, data: bytes) -> None:
        if self._lean_transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._lean_transport.write(data)
