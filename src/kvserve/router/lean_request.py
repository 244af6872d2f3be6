"""A proxied request as the lean HTTP server (``router/lean_server.py``) parsed it, and the
streamed answer written straight to its connection.

:class:`kvserve.router.proxy.Proxy` reads a request's path, headers and body only, and
writes a stream through ``prepare``/``write``/``write_eof``: these two classes give it
that much without aiohttp's request machinery, so one proxy serves both HTTP servers.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy


class LeanRequest:
    """One complete request: the lean server reads the body before routing it."""

    __slots__ = ("_body", "_transport", "headers", "path", "remote")

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
        self._body = body
        self._transport = transport

    async def read(self) -> bytes:
        return self._body

    def stream_response(self, status: int, headers: dict[str, str]) -> LeanStreamResponse:
        return LeanStreamResponse(self._transport, status, headers)


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
