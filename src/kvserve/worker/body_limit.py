"""Request body size and time limits, enforced before anything parses the body.

A declared ``Content-Length`` over the limit is refused at once; a chunked body is
counted as it arrives and refused as soon as it crosses the limit, so a 50 MB upload
never gets buffered, let alone handed to the JSON parser. The refusal drains what the
client is still sending (without keeping it) so that the client reads a clean 413
instead of a connection reset. A body must also arrive within ``body_timeout_s`` of the
headers (408 otherwise): a client dripping a byte at a time holds no request slot for long.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.worker.errors import APIError

# Beyond this many bytes a refused body is not drained: the connection is just closed.
_MAX_DRAIN_BYTES = 256 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(receive, send, already_read=0, declared=declared)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            seconds = self.body_timeout_s
            error = APIError(
                408, f"Request body not received within {seconds}s.", code="body_timeout"
            )
            await error.response()({"type": "http"}, receive, send)
            return
        if isinstance(body, int):
            await self._refuse(receive, send, already_read=body, declared=declared)
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; the bytes read when it went past the limit; None when the
        client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return size
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(
        self, receive: Receive, send: Send, *, already_read: int, declared: int | None
    ) -> None:
        if declared is None or declared <= _MAX_DRAIN_BYTES:
            await _drain(receive, _MAX_DRAIN_BYTES - already_read)
        error = APIError(
            413,
            f"Request body exceeds the limit of {self.max_body_bytes} bytes.",
            code="request_too_large",
        )
        await error.response()({"type": "http"}, receive, send)


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then defers to the server's."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
