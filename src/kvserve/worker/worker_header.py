"""Stamps every response with the worker's id (``x-kvserve-worker``).

The router forwards it so a client can tell which worker served a request. Written as
plain ASGI, not ``BaseHTTPMiddleware``, which would buffer streams and hide disconnects.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-kvserve-worker"


class WorkerHeaderMiddleware:
    def __init__(self, app: ASGIApp, worker_id: str) -> None:
        self.app = app
        self._header = (HEADER, worker_id.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self._header]
            await send(message)

        await self.app(scope, receive, send_with_header)
