"""The router's foreign test server, run in-process, with misbehaviour scripted per request.

Real servers cannot be made to cut a stream or hang on cue; this one can. Requests the
script marks ``ok`` (and all after the script runs out) are served by
:class:`~tests.support.foreign_openai_server.ForeignServer` unchanged: streamed tokens,
usage, and cached tokens from its own prefix memory. Every response names the server in
``x-kvserve-worker``, as a kvserve router would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
from aiohttp import web

from kvserve.router.ports import free_port
from tests.support.foreign_openai_server import ForeignServer

BEHAVIOURS = ("ok", "http400", "cut", "hang")


class ScriptedServer(ForeignServer):
    def __init__(
        self, script: Sequence[str] = (), *, name: str = "scripted-0", token_delay_s: float = 0.002
    ) -> None:
        unknown = set(script) - set(BEHAVIOURS)
        if unknown:
            raise ValueError(f"unknown behaviours {unknown}")
        super().__init__(name, ttft_s=0.0, token_delay_s=token_delay_s)
        self.script = list(script)  # one per request, in arrival order; then "ok"
        self.received: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.max_in_flight = 0
        self.disconnects = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ScriptedServer:
        app = self.app()
        app.on_response_prepare.append(self._name_worker)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def wait_for_disconnects(self, count: int, timeout_s: float = 10.0) -> None:
        """Until ``count`` clients have gone away mid-stream (the server learns it late)."""
        async with asyncio.timeout(timeout_s):
            while self.disconnects < count:
                await asyncio.sleep(0.01)

    async def wait_until_no_stream_open(self, timeout_s: float = 10.0) -> None:
        """Until every scripted stream has ended on the server side (the client closed it)."""
        async with asyncio.timeout(timeout_s):
            while self.in_flight:
                await asyncio.sleep(0.01)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.received.append(orjson.loads(await request.read()))
        self.auth_headers.append(request.headers.get("Authorization"))
        behaviour = self.script.pop(0) if self.script else "ok"
        if behaviour == "http400":
            error = {"message": "max_tokens is too large", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        self.max_in_flight = max(self.max_in_flight, self.in_flight + 1)
        if behaviour == "ok":
            return await super().generate(request)
        self.in_flight += 1
        try:
            return await self._misbehave(request, behaviour)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away: aiohttp cancels the handler, or, if it was still
            # writing its first chunks, the write fails.
            self.disconnects += 1
            raise
        finally:
            self.in_flight -= 1

    async def _misbehave(self, request: web.Request, behaviour: str) -> web.StreamResponse:
        """Two chunks, then a dropped connection (``cut``) or silence (``hang``)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "text": " x", "delta": {"content": " x"}}]}
        for _ in range(2):
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if behaviour == "cut":
            request.transport.abort()
            return response
        await asyncio.sleep(3600)
        return response

    async def _name_worker(self, _request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-kvserve-worker"] = self.name
        response.headers["x-kvserve-decision"] = "policy=scripted; reason=script; matched=0.000"
