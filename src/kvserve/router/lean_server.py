"""The router's lean HTTP server (``kvserve router --http-server lean``): its hot routes,
``POST /v1/chat/completions`` and ``POST /v1/completions``, parsed by httptools and
proxied without aiohttp's request and response machinery; everything else still served
by the aiohttp app, listening on a private unix socket.

Which server answers is decided per connection, from its first bytes: a connection that
does not open with a hot route is spliced, byte for byte, to the aiohttp app (control
plane, dashboard, peers' websockets, ``/metrics``), with the client's address sent first
so the loopback rule of ``router/access.py`` still sees the real client. A later request
on a lean connection that is not a hot route is forwarded alone, rebuilt, on a fresh
private connection. The client limits of ``core/client_limits.py`` hold on both: the
connection cap and header deadline here, the header size (431), body deadline (408) and
body size (413) for hot requests here, the rest by aiohttp as before.

A client that leaves cancels its request's task, exactly as aiohttp's handler
cancellation does, so the proxy's ``finally`` releases every load guard.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict

from kvserve.core.client_limits import ClientLimits, raw_error_response
from kvserve.router.client_guard import GuardedRequestHandler, handler_settings
from kvserve.router.config import RouterConfig
from kvserve.router.errors import openai_error
from kvserve.router.lean_request import LeanRequest, RelayedAnswer
from kvserve.router.shared_loads import ConnectionTally

log = logging.getLogger(__name__)

HOT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_HOT_STARTS = (b"POST /v1/chat/completions", b"POST /v1/completions")
# Headers the lean server writes itself on a complete answer (lower case).
_FRAMING_AND_CONNECTION = frozenset({"content-length", "transfer-encoding", "connection"})
LeanHandler = Callable[[LeanRequest], Awaitable[web.StreamResponse | RelayedAnswer]]


class _Parsed:
    """One request as it arrives: head, then body, then complete. ``body_waiter`` exists
    only while the server waits for a body that did not come with the head (rare)."""

    __slots__ = (
        "body",
        "body_waiter",
        "complete",
        "header_bytes",
        "headers",
        "keep_alive",
        "method",
        "url",
    )

    def __init__(self) -> None:
        self.url = b""
        self.method = b""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.complete = False
        self.body_waiter: asyncio.Future[None] | None = None
        self.keep_alive = True


class LeanConnection(asyncio.Protocol):
    """One client connection: hot requests served here, in order; else spliced."""

    def __init__(self, server: LeanServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._limits = server.limits
        # Kept: asyncio.get_running_loop() is a getpid() system call per use on 3.11.
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._current: _Parsed | None = None
        # Requests whose headers are in, in order, and the serving task's wake-up while
        # it waits for the next (a queue without asyncio.Queue's per-call overhead).
        self._pending: deque[_Parsed] = deque()
        self._next_ready: asyncio.Future[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._first = b""  # bytes before the connection's kind is known
        self._splice: asyncio.Transport | None = None
        self._splicing = False
        # The header deadline runs from ``_idle_since`` (None: a request is being served).
        # One timer per deadline period, not per request: when it fires it checks when
        # the connection last became idle and sets itself again for that deadline.
        self._idle_since: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._remote: str | None = None

    # --- connection ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, (tuple, list)) else None
        server = self._server
        if len(server.connections) + server.tally.others() >= self._limits.max_connections:
            message = f"The router serves at most {self._limits.max_connections} connections."
            transport.write(raw_error_response(503, message, "too_many_connections"))
            transport.write_eof()
            self._loop.call_later(2.0, transport.close)
            self._transport = None
            return
        server.connections.add(self)
        server.tally.publish(len(server.connections))
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        connections = self._server.connections
        if self in connections:
            connections.discard(self)
            self._server.tally.publish(len(connections))
        self._stop_idle_timer()
        if self._worker is not None:
            self._worker.cancel()  # releases what the request holds (proxy's finally)
        if self._splice is not None:
            self._splice.close()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        if self._splice is not None:
            self._splice.write(data)
            return
        if self._splicing:
            self._first += data
            return
        if self._worker is None:  # the connection's kind is not known yet
            self._first += data
            kind = _kind(self._first)
            if kind is None:
                return  # too few bytes to tell
            if not kind:
                self._start_splice()
                return
            data, self._first = self._first, b""
            self._worker = self._loop.create_task(self._serve())
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are served on a fresh connection")
        except httptools.HttpParserError:
            self._fail(400, "malformed HTTP request")

    # --- parser callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._current = _Parsed()

    def on_url(self, url: bytes) -> None:
        assert self._current is not None
        self._current.url += url
        self._current.header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._current.header_bytes += len(name) + len(value) + 4
        if self._current.header_bytes <= self._limits.max_header_bytes:
            self._current.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        assert self._current is not None
        self._idle_since = None  # the header deadline is met: the body's starts
        self._current.method = self._parser.get_method()
        self._current.keep_alive = self._parser.should_keep_alive()
        self._pending.append(self._current)
        ready = self._next_ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self._current is not None
        self._current.body.append(body)

    def on_message_complete(self) -> None:
        current = self._current
        assert current is not None
        current.complete = True
        if current.body_waiter is not None and not current.body_waiter.done():
            current.body_waiter.set_result(None)
        self._current = None

    # --- requests ---------------------------------------------------------------
    async def _serve(self) -> None:
        """The connection's requests, one at a time, in the order they came."""
        while self._transport is not None:
            if not self._pending:
                self._next_ready = self._loop.create_future()
                try:
                    await self._next_ready
                finally:
                    self._next_ready = None
                continue
            keep = await self._answer(self._pending.popleft())
            if not keep or self._transport is None:
                if self._transport is not None:
                    self._transport.close()
                return
            if not self._pending:  # else the next request's headers are in already
                self._arm_idle_timer()

    async def _answer(self, parsed: _Parsed) -> bool:
        """Answer one request; whether the connection stays open."""
        assert self._transport is not None
        if parsed.header_bytes > self._limits.max_header_bytes:
            message = (
                f"Request line and headers exceed the limit of {self._limits.max_header_bytes}"
                " bytes."
            )
            self._transport.write(raw_error_response(431, message, "headers_too_large"))
            return False
        if not parsed.complete:  # most bodies come with their headers: no timer
            parsed.body_waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(self._limits.body_timeout_s):
                    await parsed.body_waiter
            except TimeoutError:
                message = f"Request body not received within {self._limits.body_timeout_s}s."
                self._transport.write(raw_error_response(408, message, "body_timeout"))
                return False
        body = b"".join(parsed.body)
        url = parsed.url.decode("latin-1")
        path = url.partition("?")[0]
        if parsed.method != b"POST" or path not in HOT_PATHS:
            try:
                await self._forward(parsed, body)
            except OSError:  # the private socket is gone (shutting down) or out of files
                unavailable = openai_error(
                    503,
                    "the router could not serve this request now",
                    error_type="service_unavailable",
                    code="router_unavailable",
                )
                self._write_response(unavailable, keep_alive=False)
            return False  # the private connection answered with Connection: close
        if len(body) > self._server.max_body_bytes:
            too_large = openai_error(
                413,
                "request body too large",
                error_type="invalid_request_error",
                code="request_too_large",
            )
            self._write_response(too_large, keep_alive=False)
            return False
        request = LeanRequest(path, parsed.headers, body, self._remote, self._transport)
        response: web.StreamResponse | RelayedAnswer
        try:
            response = await self._server.handle(request)
        except Exception:
            log.exception("the lean server's handler failed")
            response = openai_error(
                500, "internal router error", error_type="server_error", code="internal_error"
            )
        if isinstance(response, RelayedAnswer):
            self._write_relayed(response, keep_alive=parsed.keep_alive)
        elif isinstance(response, web.Response):
            self._write_response(response, keep_alive=parsed.keep_alive)
        return parsed.keep_alive and self._transport is not None

    def _write_relayed(self, answer: RelayedAnswer, *, keep_alive: bool) -> None:
        """A worker's answer in one write: its headers are the proxy's own (no framing)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(answer.encode(keep_alive=keep_alive))

    def _write_response(self, response: web.Response, *, keep_alive: bool) -> None:
        body = response.body if isinstance(response.body, bytes) else b""
        # Framing and Connection are the server's to write, as for a relayed answer.
        headers = {
            k: v for k, v in response.headers.items() if k.lower() not in _FRAMING_AND_CONNECTION
        }
        self._write_relayed(RelayedAnswer(response.status, headers, body), keep_alive=keep_alive)

    async def _forward(self, parsed: _Parsed, body: bytes) -> None:
        """A request the lean server does not serve, sent alone to the aiohttp app."""
        reader, writer = await asyncio.open_unix_connection(self._server.private_path)
        try:
            headers = CIMultiDict(parsed.headers)
            for name in ("Transfer-Encoding", "Content-Length", "Connection"):
                headers.popall(name, None)
            headers["Content-Length"] = str(len(body))
            headers["Connection"] = "close"
            head = [f"{parsed.method.decode()} {parsed.url.decode('latin-1')} HTTP/1.1"]
            head.extend(f"{k}: {v}" for k, v in headers.items())
            writer.write(_preamble(self._remote))
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            while chunk := await reader.read(65536):
                if self._transport is None:
                    return
                self._transport.write(chunk)
        finally:
            writer.close()

    # --- splicing ----------------------------------------------------------------
    def _start_splice(self) -> None:
        """Hand the whole connection to the aiohttp app."""
        self._splicing = True
        self._loop.create_task(self._connect_splice())

    async def _connect_splice(self) -> None:
        loop = self._loop
        client = self._transport
        if client is None:
            return
        try:
            splice, _ = await loop.create_unix_connection(
                lambda: _SpliceBack(client), self._server.private_path
            )
        except OSError:
            client.close()
            return
        if self._transport is None:  # the client left meanwhile
            splice.close()
            return
        self._stop_idle_timer()  # aiohttp keeps its own from here
        self._splice = splice
        splice.write(_preamble(self._remote) + self._first)
        self._first = b""

    # --- helpers ---------------------------------------------------------------
    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self, status: int, message: str) -> None:
        if self._transport is not None:
            body = openai_error(
                status, message, error_type="invalid_request_error", code="bad_request"
            )
            self._write_response(body, keep_alive=False)
            self._transport.close()

    def _arm_idle_timer(self) -> None:
        """The connection waits for a request's headers from now on."""
        self._idle_since = self._loop.time()
        if self._idle_timer is None:
            deadline = self._idle_since + self._limits.header_timeout_s
            self._idle_timer = self._loop.call_at(deadline, self._idle)

    def _stop_idle_timer(self) -> None:
        self._idle_since = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle(self) -> None:
        """No request's headers within the header deadline (from the connection's start or
        the last answer's end): closed silently, as aiohttp closes an idle keep-alive. The
        timer may be older than the deadline now running: then it waits for that one."""
        self._idle_timer = None
        if self._idle_since is None:  # serving: the timer is set again when idle
            return
        deadline = self._idle_since + self._limits.header_timeout_s
        if self._loop.time() < deadline:
            self._idle_timer = self._loop.call_at(deadline, self._idle)
        elif self._transport is not None:
            self._transport.close()


class _SpliceBack(asyncio.Protocol):
    """The aiohttp app's bytes, back to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


def _kind(first: bytes) -> bool | None:
    """Whether a connection opens with a hot route (None: too few bytes yet)."""
    for start in _HOT_STARTS:
        if first.startswith(start + b" ") or first.startswith(start + b"?"):
            return True
    if any((start + b" ").startswith(first) for start in _HOT_STARTS):
        return None
    return False


def _preamble(remote: str | None) -> bytes:
    """The client's address, one line, ahead of its bytes on the private socket."""
    return (remote or "-").encode() + b"\n"


class ForwardedPeerHandler(GuardedRequestHandler):
    """The aiohttp side of the private socket: reads the preamble's client address and
    answers as if that client were connected (``request.remote``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._preamble = b""
        self._forwarded_peer: str | None = None
        self._preamble_read = False

    @property
    def peername(self) -> Any:
        return self._forwarded_peer

    def data_received(self, data: bytes) -> None:
        if not self._preamble_read:
            self._preamble += data
            line, newline, rest = self._preamble.partition(b"\n")
            if not newline:
                return
            self._preamble_read = True
            peer = line.decode("latin-1")
            self._forwarded_peer = None if peer == "-" else peer
            self._preamble = b""
            data = rest
            if not data:
                return
        super().data_received(data)


class LeanServer:
    """What the lean connections share: the handler, the limits, the private socket."""

    def __init__(
        self,
        handle: LeanHandler,
        limits: ClientLimits,
        max_body_bytes: int,
        private_path: str,
        tally: ConnectionTally,
    ) -> None:
        self.handle = handle
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.private_path = private_path
        self.tally = tally  # the sibling processes' connections, for the cap
        self.connections: set[LeanConnection] = set()

    def connection(self) -> LeanConnection:
        return LeanConnection(self, asyncio.get_running_loop())


async def serve_lean(
    app: web.Application,
    handle: LeanHandler,
    config: RouterConfig,
    *,
    reuse_port: bool = False,
    tally: ConnectionTally | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM: the lean server on the port, ``app`` behind it on a
    private unix socket (in a directory only this process can enter). ``tally``: the
    sibling processes' connections (with ``--processes``), counted against the cap."""
    limits = config.client_limits
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None
    settings = handler_settings(limits)

    def private_connection() -> ForwardedPeerHandler:
        return ForwardedPeerHandler(server, loop=loop, limits=limits, access_log=None, **settings)

    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    with tempfile.TemporaryDirectory(prefix="kvserve-router-") as private_dir:
        private_path = os.path.join(private_dir, "app.sock")
        private = await loop.create_unix_server(private_connection, private_path)
        lean = LeanServer(
            handle, limits, config.max_request_bytes, private_path, tally or ConnectionTally()
        )
        listener = await loop.create_server(
            lean.connection,
            config.host,
            config.port,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        log.info(
            "kvserve router (lean) on http://%s:%d (pid %d)", config.host, config.port, os.getpid()
        )
        try:
            await stop.wait()
        finally:
            listener.close()
            for connection in list(lean.connections):
                connection.close()
            private.close()
            await runner.cleanup()
