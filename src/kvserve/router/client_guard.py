"""The router's limits on its clients (see :mod:`kvserve.core.client_limits`), on aiohttp.

aiohttp already closes a connection whose request has not arrived within its keep-alive
timeout (the timer runs from the connection's start and from each response's end, and
only an idle handler is closed), so that timeout *is* the header deadline. The rest is
added here: the connection cap (a connection past it is answered 503 and closed before
aiohttp sees it), 431 for headers over the bound (aiohttp's parser answers 400 for an
over-long line; its per-line bound is set to the total bound, and the total is checked
once the headers are in), and the body deadline (408).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from kvserve.core.client_limits import ClientLimits, raw_error_response
from kvserve.router.errors import openai_error
from kvserve.router.shared_loads import ConnectionTally

log = logging.getLogger(__name__)

Handler = Any  # aiohttp's middleware handler type
_REFUSED_LINGER_S = 2.0


def handler_settings(limits: ClientLimits) -> dict[str, Any]:
    """aiohttp's own settings that carry ``limits``."""
    return {
        "keepalive_timeout": limits.header_timeout_s,
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
    }


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler, with the connection cap and 431 for big headers."""

    def __init__(
        self,
        manager: web.Server,
        *,
        limits: ClientLimits,
        tally: ConnectionTally | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._web_server = manager  # its connections are counted
        self._limits = limits
        # The sibling processes' connections, counted against the cap, and told this
        # process's count; None where another server counts the connections (lean's).
        self._tally = tally
        self._refused: asyncio.Transport | None = None  # answered 503, closing

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        others = 0 if self._tally is None else self._tally.others()
        if len(self._web_server.connections) + others >= self._limits.max_connections:
            self._refuse(cast(asyncio.Transport, transport))
            return
        super().connection_made(transport)
        if self._tally is not None:
            self._tally.publish(len(self._web_server.connections))

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 without reading a request. The connection closes once the client's
        request has been read (or after a moment): closing on unread bytes would reset it,
        and the client would see the reset instead of the answer."""
        self._refused = transport
        message = f"The router serves at most {self._limits.max_connections} connections."
        transport.write(raw_error_response(503, message, "too_many_connections"))
        transport.write_eof()
        asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.close)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is None:  # a refused connection was never registered or started
            super().connection_lost(exc)
            if self._tally is not None:
                self._tally.publish(len(self._web_server.connections))

    def data_received(self, data: bytes) -> None:
        if self._refused is None:
            super().data_received(data)
        else:
            self._refused.close()  # the request is read: closing now resets nothing

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)
        ):
            response = _headers_too_large(self._limits)
            response.force_close()
            return response
        return super().handle_error(request, status, exc, message)


def client_limits_middleware(limits: ClientLimits) -> Handler:
    """Total header size (431) and the body deadline (408), before any handler runs."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        size = len(request.raw_path) + sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
        if size > limits.max_header_bytes:
            return _headers_too_large(limits)
        if request.body_exists:
            try:
                async with asyncio.timeout(limits.body_timeout_s):
                    await request.read()  # kept by the request: handlers read it again free
            except TimeoutError:
                return openai_error(
                    408,
                    f"Request body not received within {limits.body_timeout_s}s.",
                    error_type="invalid_request_error",
                    code="body_timeout",
                )
            except web.HTTPRequestEntityTooLarge:
                return openai_error(
                    413,
                    "request body too large",
                    error_type="invalid_request_error",
                    code="request_too_large",
                )
        response: web.StreamResponse = await handler(request)
        return response

    return guard


def _headers_too_large(limits: ClientLimits) -> web.Response:
    return openai_error(
        431,
        f"Request line and headers exceed the limit of {limits.max_header_bytes} bytes.",
        error_type="invalid_request_error",
        code="headers_too_large",
    )


async def serve(
    app: web.Application,
    host: str,
    port: int,
    limits: ClientLimits,
    *,
    reuse_port: bool = False,
    tally: ConnectionTally | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (aiohttp's
    ``run_app``, with :class:`GuardedRequestHandler` for each connection). ``reuse_port``:
    several processes bind ``port`` and the kernel spreads connections over them;
    ``tally`` then counts their connections together against the cap."""
    settings = handler_settings(limits)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None

    def connection() -> GuardedRequestHandler:
        return GuardedRequestHandler(
            server,
            loop=loop,
            limits=limits,
            tally=tally or ConnectionTally(),
            access_log=None,
            **settings,
        )

    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    listener = await loop.create_server(
        connection, host, port, reuse_address=True, reuse_port=reuse_port or None
    )
    log.info("kvserve router on http://%s:%d (pid %d)", host, port, os.getpid())
    try:
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()
