"""The worker's HTTP protocol: uvicorn's httptools protocol with a header deadline, a
header size bound and a connection cap (see :mod:`kvserve.core.client_limits`).

uvicorn bounds idle keep-alive connections, but a connection that sent part of a
request waits forever, httptools buffers headers of any size, and uvicorn's own
``limit_concurrency`` answers in plain text. This protocol arms a deadline at the connection's first
moment and at each request's first byte, disarmed when the headers are complete: a
client still sending headers then gets a 408 and is closed. Headers past the size bound
get a 431 (closed at once if they never end; answered by an ASGI app if they did); a
request on a connection past the cap (or past as many requests at once) gets a 503 with
OpenAI's body.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserve.core.client_limits import ClientLimits, raw_error_response
from kvserve.worker.errors import APIError

_HEADERS_TOO_LARGE = "Request headers exceed the limit of {} bytes."


def guarded_http_protocol(limits: ClientLimits) -> type[HttpToolsProtocol]:
    """A protocol class (uvicorn's ``http`` setting) enforcing ``limits``."""

    class Guarded(_GuardedHttpToolsProtocol):
        _limits = limits

    return Guarded


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    _limits: ClientLimits

    # uvicorn builds the protocol with keyword arguments of its own; none are changed here.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_bytes = 0
        self._reading_headers = True
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._reading_headers and self._header_bytes > self._limits.max_header_bytes:
            self._refuse(
                431, _HEADERS_TOO_LARGE.format(self._limits.max_header_bytes), "headers_too_large"
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._disarm_header_deadline()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        self._header_bytes = 0
        limits = self._limits
        if size > limits.max_header_bytes:
            refusal = APIError(
                431,
                _HEADERS_TOO_LARGE.format(limits.max_header_bytes),
                code="headers_too_large",
                error_type="invalid_request_error",
            )
        elif (  # this connection is counted already, this request's task not yet
            len(self.connections) > limits.max_connections
            or len(self.tasks) >= limits.max_connections
        ):
            refusal = APIError(
                503,
                f"The worker serves at most {limits.max_connections} connections.",
                code="too_many_connections",
                error_type="service_unavailable",
            )
        else:
            super().on_headers_complete()
            return
        served, self.app = self.app, _answer(refusal)
        try:  # uvicorn's own path, with the refusal as the app
            super().on_headers_complete()
        finally:
            self.app = served

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(
                self._limits.header_timeout_s, self._header_deadline_passed
            )

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self._reading_headers or self.transport.is_closing():
            return
        seconds = self._limits.header_timeout_s
        self._refuse(408, f"Request headers not received within {seconds}s.", "header_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(raw_error_response(status, message, code))
            self.transport.close()


def _answer(error: APIError) -> object:
    """An ASGI app that answers every request with ``error``."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await error.response()(scope, receive, send)

    return app
